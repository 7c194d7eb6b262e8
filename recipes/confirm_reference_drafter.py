"""Measure a reference drafter trained elsewhere against the shipped one on this CPU, and calibrate it here.

A drafter trained on a lent GPU (recipes/gpu_train_reference.py) comes back with tau measured
against the bfloat16 target on that machine. Before it replaces the shipped one, this decodes
the recipe's 16 held-out prompts here, with the shipped drafter ("untrained": the starting
point) and the new one ("trained"), in one run on the same prompts, greedy, every output
compared with the target alone; fits the new drafter's calibration on its rounds; and writes
``OUT/drafter`` and ``OUT/report.json`` as a training chunk leaves them, so that the chunks'
check and shipping apply unchanged (recipes/continue_10x.sh):

    python recipes/confirm_reference_drafter.py --drafter GPU_RUN/drafter --prompts RUN/prompts/prompts.jsonl \\
        --report GPU_RUN/report.json --out CONFIRM
    python recipes/ship_reference_drafter.py --run CONFIRM --name dspark    # only if tau went up
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository and the recipes importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from train_qwen3vl import measure_heldout  # noqa: E402 - the recipe's own held-out measurement

from vlmspec.drafters.dspark import DSparkDrafter, DSparkProposer  # noqa: E402
from vlmspec.engine import SpecEngine  # noqa: E402
from vlmspec.loading import load_target  # noqa: E402
from vlmspec.reference import reference_drafter_dir  # noqa: E402
from vlmspec.training import calibrate, load_prompt_sources, split_prompts  # noqa: E402
from vlmspec.training.calibrate import write_report  # noqa: E402

WEIGHT_FILES = ("config.json", "model.safetensors")  # the drafter itself; its calibration is fitted here


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", type=Path, required=True, help="the new drafter's directory")
    parser.add_argument("--prompts", action="append", required=True, help="the mix (the held-out split is seeded)")
    parser.add_argument("--out", type=Path, required=True, help="OUT/drafter and OUT/report.json are written")
    parser.add_argument("--shipped", type=Path, default=None, help="the drafter to beat (default: the shipped one)")
    parser.add_argument("--report", type=Path, default=None, help="the training run's report.json, kept beside")
    parser.add_argument("--target", default="reference")
    parser.add_argument("--dtype", default="float32", help="the target's dtype here (the chunks measured float32)")
    parser.add_argument("--heldout-prompts", type=int, default=16)
    parser.add_argument("--eval-max-new-tokens", type=int, default=64)
    parser.add_argument("--eval-temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, target=None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The recipe's split: the first --heldout-prompts of the seeded order, whatever trains after them.
    _, heldout = split_prompts(load_prompt_sources(args.prompts), None, args.heldout_prompts, args.seed)
    target = target or load_target(args.target, dtype=args.dtype)
    shipped_dir = args.shipped or reference_drafter_dir("reference-dspark")
    drafter_dir = args.out / "drafter"
    drafter_dir.mkdir(parents=True, exist_ok=True)
    for name in WEIGHT_FILES:
        shutil.copy2(args.drafter / name, drafter_dir / name)
    report: dict[str, Any] = {"target": args.target, "dtype": args.dtype, "shipped": str(shipped_dir)}
    shipped = DSparkDrafter.from_pretrained(shipped_dir, target=target)
    report["untrained"] = measure_heldout(
        SpecEngine(target, DSparkProposer(shipped)), heldout, args, "shipped drafter"
    ).as_dict()
    new = DSparkDrafter.from_pretrained(drafter_dir, target=target)
    run = measure_heldout(SpecEngine(target, DSparkProposer(new)), heldout, args, "new drafter")
    report["trained"] = run.as_dict()
    if new.config.confidence_head:
        report["calibration"] = list(calibrate(run, drafter_dir).temperatures)
    if args.report is not None and args.report.is_file():
        report["training_run"] = json.loads(args.report.read_text())
    path = write_report(args.out / "report.json", report)
    before, after = report["untrained"], report["trained"]
    print(f"held-out free-running tau: {before['tau']:.3f} -> {after['tau']:.3f}; report: {path}", flush=True)
    return report


if __name__ == "__main__":
    main()
