"""Learning curve of one or more drafter training runs: held-out tau and top-1 by position against training tokens.

Reads the evaluation records that ``recipes/train_qwen3vl.py`` appends to
``OUT/metrics.jsonl`` every ``--eval-every`` steps (teacher-forced on cached sequences
that training never sees) and, when present, the free-running held-out tau of
``OUT/report.json``. Writes ``learning_curve.json``, ``learning_curve_tau.png`` (greedy
and expected tau per run) and ``learning_curve_top1.png`` (top-1 agreement with the
target by block position, per run).

*Training tokens* are supervised block positions: blocks seen x gamma. The greedy tau of a
block is 1 + the number of leading positions whose argmax equals the target's, which is
what a greedy round with the full block verified would accept, given the true context.

    python recipes/learning_curve.py --run runs/ref2/dspark --run runs/ref2/dflash --out runs/ref2/curve

A warm-started run (a chunk of the 10x run, ``--init-from``) continues its starting drafter's
curve: ``--start-tokens`` gives the block positions that drafter had already seen, and
``--previous`` draws the curves of an earlier ``learning_curve.json`` beside it (their run
directories need not exist any more):

    python recipes/learning_curve.py --previous recipes/results/learning_curve.json \
        --run RUN/chunk-1 --name "DSpark chunk 1" --start-tokens 1805321 --out recipes/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, plot_lines, write_json, write_text


def block_size(run: Path) -> int:
    """gamma of the run's drafter (final or latest checkpoint)."""
    for config in [run / "drafter" / "config.json", *sorted(run.glob("checkpoints/*/drafter/config.json"))[::-1]]:
        if config.is_file():
            return int(json.loads(config.read_text())["block_size"])
    raise FileNotFoundError(f"{run} holds no drafter config.json: is it an OUT directory of train_qwen3vl.py?")


def read_curve(run: Path, start_tokens: int = 0) -> dict[str, Any]:
    """The run's evaluation records as curves over training tokens (plus ``start_tokens`` of a warm start)."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("split") == "eval" and "train_blocks" in r]
    by_step = {r["step"]: r for r in evals}  # a resumed run may repeat an evaluation: keep the last
    gamma = block_size(run)
    points = [by_step[step] for step in sorted(by_step)]
    report = run / "report.json"
    heldout = json.loads(report.read_text()).get("trained") if report.is_file() else None
    return {
        "run": str(run),
        "gamma": gamma,
        "steps": [p["step"] for p in points],
        "start_tokens": start_tokens,
        "train_tokens": [start_tokens + p["train_blocks"] * gamma for p in points],
        "greedy_tau": [p.get("greedy_tau") for p in points],
        "expected_tau": [p["expected_tau"] for p in points],
        "top1_by_position": [p["top1_by_position"] for p in points],
        "heldout_free_running": heldout and {k: heldout.get(k) for k in ("tau", "rounds", "acceptance_by_position")},
    }


def previous_curves(path: Path) -> dict[str, Any]:
    """The curves of an earlier ``learning_curve.json`` (its provenance record left out)."""
    return {name: c for name, c in json.loads(path.read_text()).items() if isinstance(c, dict) and "train_tokens" in c}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", type=Path, required=True, help="OUT directory of a training run")
    parser.add_argument("--name", action="append", default=None, help="label per --run (default: directory name)")
    parser.add_argument(
        "--start-tokens",
        action="append",
        type=int,
        default=None,
        help="per --run: block positions its starting drafter had already seen (a warm start; default 0)",
    )
    parser.add_argument("--previous", type=Path, default=None, help="an earlier learning_curve.json to draw as well")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    names = args.name or [run.name for run in args.run]
    starts = args.start_tokens or [0] * len(args.run)
    if len(names) != len(args.run) or len(starts) != len(args.run):
        raise SystemExit("give one --name (and one --start-tokens) per --run, or none")
    curves = previous_curves(args.previous) if args.previous else {}
    curves.update({name: read_curve(run, start) for name, run, start in zip(names, args.run, starts)})
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "learning_curve.json", curves)
    series = {}
    for name, c in curves.items():
        series[f"{name} greedy"] = (c["train_tokens"], c["greedy_tau"])
        series[f"{name} expected (T=1)"] = (c["train_tokens"], c["expected_tau"])
    plot_lines(
        args.out / "learning_curve_tau.png",
        series,
        title="Held-out tau (teacher-forced) vs training tokens",
        xlabel="training tokens (block positions)",
        ylabel="tau",
    )
    top1 = {}
    for name, c in curves.items():
        for k in range(c["gamma"]):
            top1[f"{name} pos {k + 1}"] = (c["train_tokens"], [row[k] for row in c["top1_by_position"]])
    plot_lines(
        args.out / "learning_curve_top1.png",
        top1,
        title="Held-out top-1 by block position",
        xlabel="training tokens (block positions)",
        ylabel="top-1 agreement",
        ylim=(0, 1),
    )
    rows = []
    for name, c in curves.items():
        for i in range(len(c["steps"])):
            top = c["top1_by_position"][i]
            rows.append(
                [
                    name,
                    c["steps"][i],
                    c["train_tokens"][i],
                    c["greedy_tau"][i],
                    c["expected_tau"][i],
                    " ".join(f"{x:.2f}" for x in top),
                ]
            )
    table = markdown_table(["run", "step", "training tokens", "greedy tau", "expected tau", "top-1 by position"], rows)
    write_text(args.out / "learning_curve.md", table + "\n")
    print(table)
    return curves


if __name__ == "__main__":
    main()
