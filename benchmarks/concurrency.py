"""Concurrency benchmark: BatchEngine's output tokens per second against the number of concurrent requests.

For each number of concurrent requests C (1, 4, 16, 32 by default) and each decoding mode
(greedy, sampled), C requests, half with an image and half text only (``--workload text``:
all text), run to the end through ``vlmspec.serving.BatchEngine`` with ``max_batch_size = C``,
once per variant. Each text request asks a different held-out prompt (MT-Bench's, then
GSM8K's: the entries no drafter trains on, ``vlmspec.data.heldout``):

* ``alone``: the target alone, batched (no drafter: one token per request per step);
* ``fixed``: the drafter, every draft verified (fixed gamma);
* ``threshold``: drafts up to the first confidence below ``--threshold``;
* ``prefix``: Algorithm 1 over the whole batch, with an SPS table measured here for the
  batched forward (``vlmspec profile --requests ...``; pass ``--sps`` to reuse one);
* ``lagged-topk`` (opt-in with ``--variants``): Algorithm 1's production form;
* ``vllm``, ``vllm-ngram`` (opt-in): vLLM's CPU build on the same prompt tokens, all C
  submitted in one ``generate`` call (its own continuous batching), plain or with its
  n-gram speculation, in its own venv (``benchmarks/vllm_peer.py``); greedy, text only
  (``--workload text``), the reference target only;
* ``llama-cpp`` (opt-in): ``llama-server -np C`` on the reference target's own weights as GGUF
  of the run's dtype (``benchmarks/llama_cpp_peer.py``), the same prompt tokens sent to
  ``/completion`` by C client threads at once, streamed; the same restrictions as ``vllm``.
  A peer that is missing (llama.cpp not built, vLLM not installable) is skipped, with the reason.

Variants run interleaved (run_order) at every level, in one process, so ratios compare
numbers measured side by side. Reported per run: output tokens per second (all new
tokens / wall time, prefills included), the ratio to ``alone`` at the same level and mode,
tau, verified drafts per request per step, time to first token (from the cell's start: all C
requests arrive together; median and 90th percentile; not for vLLM, whose one ``generate``
call returns only at the end), per-request latency (add_request to finish:
mean and 90th percentile), and for greedy runs whether every request's output equals its
``alone`` output token for token. Writes ``concurrency.json``, ``concurrency.md`` and one
``throughput_<mode>.png`` per mode into ``--out``.

The reference pair (the default) on a CPU::

    python -m benchmarks.concurrency --out runs/concurrency

A smoke run on a tiny random target (``--drafter untrained`` builds a random DSpark
drafter with a confidence head: lossless, never fast)::

    python -m benchmarks.concurrency --target tiny:qwen2_vl --drafter untrained --concurrency 1,2 \\
        --max-new-tokens 6 --profile-repeats 1 --out runs/concurrency-smoke
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    environment_info,
    log,
    markdown_table,
    peer_logs_dir,
    percentile,
    plot_lines,
    prepare_out_dir,
    run_order,
    safe_ratio,
    write_json,
    write_text,
)
from benchmarks.spec.workloads import Task, easy_vqa_tasks, prompt_set_tasks, skimage_open_tasks
from vlmspec.data.prompt_sets import prompt_set_name
from vlmspec.scheduling import build_scheduler
from vlmspec.serving import BatchEngine
from vlmspec.types import GenerationResult, SpecStats

VARIANTS = ("alone", "fixed", "threshold", "prefix", "lagged-topk", "vllm", "vllm-ngram", "llama-cpp")
VLLM_VARIANTS = {"vllm": False, "vllm-ngram": True}  # name -> n-gram speculation
PEERS = (*VLLM_VARIANTS, "llama-cpp")  # other engines, in their own processes
DEFAULT_VARIANTS = ("alone", "fixed", "threshold", "prefix")
# Text prompts: MT-Bench's held-out first turns, then GSM8K's when a run needs more than MT-Bench holds out.
DEFAULT_PROMPT_SETS = tuple(
    str(Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / name)
    for name in ("mt-bench.jsonl", "gsm8k.jsonl")
)
IMAGE_PROMPT = "Describe the image in detail."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="reference", help="'reference', a Qwen-VL directory, or tiny:FAMILY")
    parser.add_argument(
        "--drafter",
        default="reference",
        help="'reference', 'reference-dflash', a DSpark drafter directory, or 'untrained' (random, for smoke runs)",
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--concurrency", default="1,4,16,32", help="comma-separated numbers of concurrent requests")
    parser.add_argument("--modes", default="greedy,sampled", help="greedy and/or sampled")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7, help="for the sampled mode")
    parser.add_argument("--top-p", type=float, default=None, help="for the sampled mode")
    parser.add_argument("--threshold", type=float, default=0.5, help="confidence threshold of the threshold variant")
    parser.add_argument(
        "--sps", default=None, help="a batch SPS table (vlmspec profile --requests ...); measured here if omitted"
    )
    parser.add_argument("--profile-context", type=int, default=160, help="cached tokens per request while profiling")
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of every cell (the fastest counts)")
    add_workload_arguments(parser)
    parser.add_argument("--threads", type=int, default=2, help="torch threads here, vLLM's and llama.cpp's threads")
    parser.add_argument(
        "--llama-cpp", default=None, help="llama.cpp folder (default: $LLAMA_CPP_DIR, else runs/llamacpp)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/concurrency"))
    args = parser.parse_args(argv)
    args.levels = _int_list(args.concurrency, "--concurrency")
    args.mode_list = [m for m in args.modes.split(",") if m]
    args.variant_list = [v for v in args.variants.split(",") if v]
    if not args.mode_list or set(args.mode_list) - {"greedy", "sampled"}:
        parser.error(f"--modes takes greedy and/or sampled, got {args.modes!r}")
    if not args.variant_list or set(args.variant_list) - set(VARIANTS):
        parser.error(f"--variants takes any of {', '.join(VARIANTS)}, got {args.variants!r}")
    if set(args.variant_list) & set(PEERS):
        if args.workload != "text" or args.mode_list != ["greedy"] or args.target != "reference":
            parser.error(
                "the vllm and llama-cpp variants run greedy text prompts on the reference target: pass --workload text "
                "--modes greedy (and the default --target reference)"
            )
    return args


def _int_list(text: str, flag: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} takes positive integers separated by commas, got {text!r}")
    return values


# ------------------------------------------------------------------------------------ setup
def load_pair(args: argparse.Namespace):
    """The target and the drafter's proposer."""
    from vlmspec.loading import load_proposer, load_target

    target = load_target(args.target, dtype=args.dtype)
    if args.drafter == "untrained":
        from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkProposer

        torch.manual_seed(0)
        return target, DSparkProposer(DSparkDrafter.from_target(target, DSparkConfig.for_target(target, block_size=4)))
    return target, load_proposer(args.drafter, target)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """``--prompt-set`` and ``--workload``: what the requests ask (shared with benchmarks/serving.py)."""
    parser.add_argument(
        "--prompt-set",
        action="append",
        help="text prompts (JSONL with turns; repeatable): their held-out entries in order, "
        "each set continuing where the one before ends (default: MT-Bench, then GSM8K)",
    )
    parser.add_argument(
        "--workload", default="mixed", choices=("mixed", "text"), help="mixed: half the requests with an image"
    )


def describe_workload(args: argparse.Namespace) -> str:
    """The workload in words, for the notes above the results tables."""
    sets = " then ".join(prompt_set_name(path) for path in args.prompt_set or DEFAULT_PROMPT_SETS)
    if args.workload == "text":
        return f"text prompts only ({sets}, held-out entries)"
    return f"half the requests with an image, half text prompts ({sets}, held-out entries)"


def text_tasks(paths: Sequence[str], count: int) -> list[Task]:
    """``count`` distinct held-out prompts: the held-out entries of each set in turn.

    Distinct, so that no engine's prefix cache serves a repeated prompt; a run that needs more
    than the sets hold out stops with a ValueError rather than reach into what the drafter trained on.
    """
    pool = [task for path in paths for task in prompt_set_tasks(path, None)]
    if count > len(pool):
        raise ValueError(
            f"{count} text requests need {count} distinct held-out prompts, but {', '.join(map(str, paths))} "
            f"hold out {len(pool)}; add a --prompt-set or run fewer requests"
        )
    return pool[:count]


def workload(args: argparse.Namespace, count: int) -> list[Task]:
    """``count`` tasks alternating image and text: easy-vqa shapes (scikit-image photos without easy-vqa), prompt-set questions.

    ``--workload text``: prompt-set questions only. Every text task is a different held-out prompt.
    """
    paths = args.prompt_set or DEFAULT_PROMPT_SETS
    if args.workload == "text":
        return text_tasks(paths, count)
    texts = text_tasks(paths, count // 2)
    images = max((count + 1) // 2, 1)
    try:
        image_tasks = easy_vqa_tasks(images)
    except ImportError:
        image_tasks = skimage_open_tasks(images, max_side=224)
    tasks = []
    for i in range(count):
        if i % 2 == 0:
            tasks.append(
                Task(
                    workload="image",
                    qid=f"image-{i}",
                    group="image",
                    prompt=IMAGE_PROMPT,
                    images=image_tasks[(i // 2) % len(image_tasks)].images,
                )
            )
        else:
            tasks.append(texts[i // 2])
    return tasks


def requests_for(tasks: list[Task], mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    sampling = dict(temperature=args.temperature, top_p=args.top_p) if mode == "sampled" else {}
    return [
        dict(images=task.image_arg, prompt=task.prompt, max_new_tokens=args.max_new_tokens, seed=i, **sampling)
        for i, task in enumerate(tasks)
    ]


def sps_table(args: argparse.Namespace, target, gamma: int, out: Path):
    """The batch SPS table Algorithm 1 uses: ``--sps``, or measured now for every concurrency level."""
    from vlmspec.scheduling import load_sps_table
    from vlmspec.targets.profile import profile_target_batched

    if args.sps:
        return load_sps_table(args.sps)
    log(f"profiling the batched verification forward for {args.levels} requests (gamma {gamma}) ...")
    table = profile_target_batched(
        target,
        requests=args.levels,
        gamma=gamma,
        context_length=args.profile_context,
        warmup=1,
        repeats=args.profile_repeats,
    )
    table.save(out / "sps.json")
    return table


def make_engine(variant: str, target, proposer, table, args: argparse.Namespace, concurrency: int) -> BatchEngine:
    if variant == "alone":
        return BatchEngine(target, max_batch_size=concurrency)
    scheduler = {
        "fixed": None,
        "threshold": lambda: build_scheduler("threshold", threshold=args.threshold),
        "prefix": lambda: build_scheduler("prefix", sps=table),
        "lagged-topk": lambda: build_scheduler("lagged-topk", sps=table),
    }[variant]
    return BatchEngine(target, proposer, scheduler() if scheduler else None, max_batch_size=concurrency)


# ------------------------------------------------------------------------------------ runs
def run_cell(engine: BatchEngine, requests: list[dict[str, Any]]) -> tuple[float, list, list[float]]:
    """Run every request to the end (all added at once); the wall time, the results in order, and each
    request's time to its first token from the start."""
    tick = time.perf_counter()
    ids = [engine.add_request(**r) for r in requests]
    first: dict[str, float] = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.tokens and output.request_id not in first:
                first[output.request_id] = time.perf_counter()
    wall_s = time.perf_counter() - tick
    return wall_s, [engine.result(i, pop=True) for i in ids], [first.get(i, tick + wall_s) - tick for i in ids]


def run_vllm_cell(variant: str, target, requests: list[dict[str, Any]], args, out: Path) -> tuple[float, list, None]:
    """vLLM on the same prompt tokens, all requests in one call; results as GenerationResults (no tau)."""
    from benchmarks.vllm_peer import run_vllm
    from vlmspec.reference import reference_target_dir

    prompts = [target.build_inputs(None, r["prompt"]).input_ids[0].tolist() for r in requests]
    found = run_vllm(
        reference_target_dir(),
        prompts,
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        ngram=VLLM_VARIANTS[variant],
        threads=args.threads,
        work_dir=peer_logs_dir(out, "vllm"),
        name=f"{variant}-{len(prompts)}",
        concurrent=True,
    )
    wall_s = found["seconds"][0]
    results = []
    for tokens in found["tokens"]:
        stats = SpecStats(new_tokens=len(tokens), total_s=wall_s)
        results.append(GenerationResult(target.tokenizer.decode(tokens), tokens, stats, "length"))
    return wall_s, results, None


def run_llama_cell(target, requests: list[dict[str, Any]], args, out: Path) -> tuple[float, list, list[float]]:
    """``llama-server -np C`` on the same prompt tokens, all C at once; results as GenerationResults (no tau)."""
    from benchmarks import llama_cpp_peer

    llama_cpp = llama_cpp_peer.locate_llama_cpp(args.llama_cpp)
    gguf = llama_cpp_peer.reference_ggufs(target, args.dtype, llama_cpp, quantized=False)[llama_cpp_peer.EXACT]
    prompts = [target.build_inputs(None, r["prompt"]).input_ids[0].tolist() for r in requests]
    server_args = llama_cpp_peer.server_args(gguf, args.threads, context=2048 * len(prompts))  # 2048 per slot
    wall_s, answers = llama_cpp_peer.run_concurrent(
        llama_cpp.binary("llama-server"),
        server_args,
        prompts,
        max_new_tokens=args.max_new_tokens,
        work_dir=peer_logs_dir(out, "llama-cpp"),
        name=f"np{len(prompts)}",
    )
    results = []
    for answer in answers:
        tokens = list(answer["tokens"])
        stats = SpecStats(new_tokens=len(tokens), total_s=answer["wall_s"])
        results.append(GenerationResult(target.tokenizer.decode(tokens), tokens, stats, "length"))
    return wall_s, results, [a["ttft_s"] for a in answers]


def engine_cell_metrics(wall_s: float, results: list, ttft: list[float] | None = None) -> dict[str, Any]:
    """One cell from the engine's side: its GenerationResults' stats (tau, verified drafts, per-request latency).

    ``benchmarks/serving.py``'s ``cell_metrics`` is the clients' side of an HTTP server (their timings);
    the two write different fields to their JSON.
    """
    stats = SpecStats.merge(r.stats for r in results)
    latencies = sorted(r.stats.total_s for r in results)
    return {
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p90_s": percentile(ttft, 90) if ttft else None,
        "ttft_per_request_s": ttft,
        "wall_s": wall_s,
        "new_tokens": stats.new_tokens,
        "tokens_per_s": stats.new_tokens / wall_s if wall_s > 0 else None,
        "tau": stats.tau,
        "mean_verified": stats.mean_verified_length,
        "latency_mean_s": statistics.fmean(latencies),
        "latency_p90_s": percentile(latencies, 90),
        "tau_per_request": [r.stats.tau for r in results],
        "latency_per_request_s": [r.stats.total_s for r in results],
        "errors": sum(r.finish_reason == "error" for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = prepare_out_dir(args.out)
    tasks = workload(args, max(args.levels))  # before loading anything: too few held-out prompts stops here
    target, proposer = load_pair(args)
    needs_table = {"prefix", "lagged-topk"} & set(args.variant_list)
    table = sps_table(args, target, proposer.max_draft_tokens, out) if needs_table else None
    log("warming up ...")
    ours = [variant for variant in args.variant_list if variant not in PEERS]
    for variant in ours:
        make_engine(variant, target, proposer, table, args, 2).generate_many(
            requests_for(tasks[:2], "greedy", args)[:2]
        )

    cells, skipped = [], {}
    for mode in args.mode_list:
        for level in args.levels:
            requests = requests_for(tasks[:level], mode, args)
            best: dict[str, tuple] = {}
            for repeat in range(args.repeats):
                for variant in run_order([v for v in args.variant_list if v not in skipped], repeat + level):
                    try:
                        measured = run_variant(variant, target, proposer, table, requests, args, out, level)
                    except PEER_ERRORS as err:
                        if variant not in PEERS:
                            raise
                        skipped[variant] = " ".join(str(err).split())[:300]
                        log(f"{variant} skipped: {skipped[variant]}")
                        continue
                    if variant not in best or measured[0] < best[variant][0]:
                        best[variant] = measured
            alone = best.get("alone")
            for variant in [v for v in args.variant_list if v in best]:
                cell = {"mode": mode, "concurrency": level, "variant": variant, **engine_cell_metrics(*best[variant])}
                results = best[variant][1]
                if alone is not None:
                    cell["vs_alone"] = safe_ratio(cell["tokens_per_s"], engine_cell_metrics(*alone)["tokens_per_s"])
                    if mode == "greedy":
                        cell["identical"] = all(r.token_ids == a.token_ids for r, a in zip(results, alone[1]))
                cells.append(cell)
                tau = "" if variant in PEERS else f"  tau {cell['tau']:.2f}"
                log(f"{mode:8s} C={level:3d} {variant:12s} {cell['tokens_per_s']:8.1f} tok/s{tau}")
    args.skipped = skipped
    write_outputs(out, args, cells, table)
    return 0


PEER_ERRORS = (RuntimeError, ValueError, OSError, subprocess.SubprocessError)  # a peer missing or failing


def run_variant(variant: str, target, proposer, table, requests, args, out: Path, level: int) -> tuple:
    """One timed cell: (wall seconds, results in order, each request's time to first token or None)."""
    if variant in VLLM_VARIANTS:
        return run_vllm_cell(variant, target, requests, args, out)
    if variant == "llama-cpp":
        return run_llama_cell(target, requests, args, out)
    engine = make_engine(variant, target, proposer, table, args, level)
    measured = run_cell(engine, requests)
    del engine
    gc.collect()
    return measured


# ------------------------------------------------------------------------------------ outputs
def write_outputs(out: Path, args: argparse.Namespace, cells: list[dict[str, Any]], table) -> None:
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    write_json(
        out / "concurrency.json",
        {
            "environment": environment_info(),
            "settings": settings,
            "cells": cells,
            "sps_table": None if table is None else table.to_dict(),
        },
    )
    headers = [
        "mode",
        "concurrent",
        "variant",
        "tokens/s",
        "vs alone",
        "tau",
        "verified/step",
        "TTFT p50 s",
        "TTFT p90 s",
        "latency mean s",
        "latency p90 s",
        "identical",
    ]
    rows = [
        [
            c["mode"],
            c["concurrency"],
            c["variant"],
            c["tokens_per_s"],
            c.get("vs_alone"),
            c["tau"],
            c["mean_verified"],
            c["ttft_p50_s"],
            c["ttft_p90_s"],
            c["latency_mean_s"],
            c["latency_p90_s"],
            c.get("identical"),
        ]
        for c in cells
    ]
    note = (
        f"target {args.target}, drafter {args.drafter}, {args.dtype}, {args.max_new_tokens} new tokens per request, "
        + describe_workload(args)
        + f"; sampled: temperature {args.temperature}; vllm rows: vLLM's own batching, no tau, no TTFT; "
        "llama-cpp rows: llama-server -np C, no tau"
        + "".join(f"\n- {variant} skipped: {why}" for variant, why in getattr(args, "skipped", {}).items())
    )
    write_text(out / "concurrency.md", f"{note}\n\n{markdown_table(headers, rows)}")
    for mode in args.mode_list:
        series = {}
        for variant in args.variant_list:
            mine = [c for c in cells if c["mode"] == mode and c["variant"] == variant]
            if mine:
                series[variant] = ([c["concurrency"] for c in mine], [c["tokens_per_s"] for c in mine])
        plot_lines(
            out / f"throughput_{mode}.png",
            series,
            title=f"BatchEngine throughput ({mode})",
            xlabel="concurrent requests",
            ylabel="output tokens / s",
        )
    log(f"wrote {out / 'concurrency.json'}, {out / 'concurrency.md'} and the throughput plots")


if __name__ == "__main__":
    raise SystemExit(main())
