"""Serving benchmark: ``vlmspec serve`` under N concurrent OpenAI clients, speculative against the target alone.

One ``vlmspec serve`` process is started per variant (they stay up side by side, so the
variants run interleaved at every level and their ratios compare numbers measured in one
run):

* ``alone``: the target alone (``--drafter none``): one token per request per step;
* ``default``: the drafter with what ``vlmspec serve`` picks without scheduler flags;
* ``threshold``: the drafter, drafts verified up to the first confidence below ``--threshold``;
* ``fixed``: the drafter, every draft verified (``--scheduler none``);
* ``prefix``: Algorithm 1, with a batch SPS table (``--sps``, or measured here first);
* ``threshold-capped``: ``threshold``, drafting only while at most ``--speculate-up-to``
  requests run (``vlmspec serve --speculate-up-to``);
* ``vllm`` (opt-in): ``vllm serve`` of vLLM's CPU build on the reference target, from its
  own venv (``benchmarks/vllm_peer.py``), with its CPU guide's settings; text only
  (``--workload text``);
* ``llama-cpp`` (opt-in): ``llama-server -np N`` (N = ``--max-batch-size`` or the top level,
  2048 tokens of context per slot) on the reference target's own language model as GGUF of
  the run's dtype (``benchmarks/llama_cpp_peer.py``), its OpenAI endpoint with the chat
  template the GGUF carries (the target's own); text only (``--workload text``).

A peer that cannot start (llama.cpp not built, vLLM not installable) is skipped, with the reason
in ``serving.md``.

At each concurrency level N, N clients (``openai.AsyncOpenAI``, streaming) send
``--requests`` chat completions back to back: with ``--workload mixed`` (the default) half
with an image (a base64 data URL) and half text, with ``--workload text`` text only; every
text request a different held-out prompt (``benchmarks/concurrency.py``'s workload).
Reported per cell: requests/s and output tokens/s (completion tokens over the wall time
of the whole cell), time to first token and time per output token
after the first (p50 / p90 / p99 over the requests), end-to-end latency, tau (from the
responses' ``vlmspec`` field), errors, and for greedy runs whether every answer equals
the target alone's. Writes ``serving.json``, ``serving.md``, ``serving_throughput.png``
and ``serving_latency.png`` into ``--out``; the servers' logs go to ``runs/peer-logs/``.

The reference pair on a CPU (the default)::

    python -m benchmarks.serving --out runs/serving

A smoke run on a tiny random target::

    python -m benchmarks.serving --target tiny:qwen2_vl --drafter prompt-lookup --variants alone,fixed --concurrency 1,2 \\
        --requests 4 --max-tokens 8 --out runs/serving-smoke

The clients run in this process and the servers in theirs; on a small machine they share
the cores, which slows both variants alike.

A ratio near 1.0 needs more than rounds: each server process has a speed of its own (where
its memory landed), and rounds on one pair of processes all share it. ``--restarts K``
starts every server K times, runs every round on each start, and reports each variant's
ratio to the target alone as the mean over starts with its standard error::

    python -m benchmarks.serving --dtype bfloat16 --variants alone,default --concurrency 16 --requests 16 \
        --rounds 4 --restarts 8 --max-tokens 32 --workload text --out runs/serving-starts
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    environment_info,
    format_number,
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
from benchmarks.concurrency import add_workload_arguments, describe_workload, workload
from benchmarks.peer_process import (
    PeerNotReady,
    PeerProcess,
    Timing,
    image_data_url,
    openai_client,
    stream_chat,
    vllm_serve,
    vlmspec_serve,
)

VARIANTS = ("alone", "default", "threshold", "fixed", "prefix", "threshold-capped", "vllm", "llama-cpp")
PEERS = ("vllm", "llama-cpp")  # other engines: text prompts of the reference target
SCHEDULER_FLAGS = {
    "default": [],  # what vlmspec serve picks by itself
    "alone": ["--drafter", "none"],
    "threshold": ["--scheduler", "threshold"],
    "fixed": ["--scheduler", "none"],
    "prefix": ["--scheduler", "prefix"],
    "threshold-capped": ["--scheduler", "threshold"],  # and --speculate-up-to
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="reference", help="'reference', a Qwen-VL directory, or tiny:FAMILY")
    parser.add_argument("--drafter", default="reference", help="a drafter `vlmspec serve --drafter` takes")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--variants", default="alone,threshold", help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--requests", type=int, default=32, help="requests per cell (per level and variant)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of each level, the variants alternating in order; each round sends other questions, and a "
        "cell pools its variant's rounds (this machine's speed drifts by a fifth between minutes)",
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=1,
        help="start every server this many times, fresh processes each time, and run all rounds on each: a "
        "process carries a speed of its own (two identical vlmspec servers ran 2-5%% apart over 16 rounds on "
        "the 2-core EPYC), so the ratios' standard errors are taken across starts",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (answers are compared)")
    parser.add_argument("--threshold", type=float, default=0.5, help="confidence threshold of the threshold variant")
    parser.add_argument("--sps", default=None, help="a batch SPS table for 'prefix' (measured here if omitted)")
    parser.add_argument(
        "--speculate-up-to", type=int, default=1, help="'threshold-capped' drafts only while this many requests run"
    )
    parser.add_argument("--max-batch-size", type=int, default=None, help="the servers' (default: the top level)")
    parser.add_argument(
        "--server-args",
        type=shlex.split,
        default=[],
        help="more vlmspec serve flags for every vlmspec variant, one string (shell quoting), as other benchmarks",
    )
    add_workload_arguments(parser)
    parser.add_argument("--threads", type=int, default=2, help="vLLM's and llama.cpp's threads (their variants)")
    parser.add_argument(
        "--llama-cpp", default=None, help="llama.cpp folder (default: $LLAMA_CPP_DIR, else runs/llamacpp)"
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for a server")
    parser.add_argument("--out", type=Path, default=Path("runs/serving"))
    args = parser.parse_args(argv)
    args.levels = [int(v) for v in args.concurrency.split(",") if v.strip()]
    args.variant_list = [v for v in args.variants.split(",") if v]
    if args.rounds < 1:
        parser.error(f"--rounds takes a positive integer, got {args.rounds}")
    if args.restarts < 1:
        parser.error(f"--restarts takes a positive integer, got {args.restarts}")
    if not args.levels or min(args.levels) < 1:
        parser.error(f"--concurrency takes positive integers separated by commas, got {args.concurrency!r}")
    if not args.variant_list or set(args.variant_list) - set(VARIANTS):
        parser.error(f"--variants takes any of {', '.join(VARIANTS)}, got {args.variants!r}")
    if set(PEERS) & set(args.variant_list) and (args.workload != "text" or args.target != "reference"):
        parser.error("the vllm and llama-cpp variants serve text prompts of the reference target: pass --workload text")
    return args


# ---------------------------------------------------------------------------------- servers
def start_server(variant: str, args: argparse.Namespace, sps: str | None, out: Path) -> PeerProcess:
    """The ``variant``'s server process, launched (not yet ready: see ``PeerProcess.wait_ready``)."""
    log_dir = peer_logs_dir(out, "servers")
    slots = args.max_batch_size or max(args.levels)
    if variant == "vllm":  # the reference target, text prompts only
        from vlmspec.reference import reference_target_dir

        extra = ["--max-num-seqs", str(slots)]
        return vllm_serve(
            "server-vllm",
            model=reference_target_dir(),
            dtype=args.dtype,
            threads=args.threads,
            log_dir=log_dir,
            extra=extra,
        ).launch()
    if variant == "llama-cpp":
        return start_llama_server(args, log_dir, slots)
    extra = ["--threshold", str(args.threshold), *SCHEDULER_FLAGS[variant]]
    extra += ["--sps", sps] if variant == "prefix" else []
    extra += ["--speculate-up-to", str(args.speculate_up_to)] if variant == "threshold-capped" else []
    extra += ["--max-batch-size", str(slots), "--max-queued", str(args.requests), *args.server_args]
    return vlmspec_serve(  # alone: SCHEDULER_FLAGS' later --drafter none wins
        f"server-{variant}", target=args.target, dtype=args.dtype, drafter=args.drafter, extra=extra, log_dir=log_dir
    ).launch()


def start_llama_server(args: argparse.Namespace, log_dir: Path, slots: int) -> PeerProcess:
    """``llama-server -np N`` on the reference target's GGUF of this dtype (converted once, cached), text prompts."""
    from benchmarks import llama_cpp_peer
    from vlmspec.loading import load_target

    llama_cpp = llama_cpp_peer.locate_llama_cpp(args.llama_cpp)
    target = load_target("reference", dtype=args.dtype)  # its own weights and vocabulary, written for the converter
    gguf = llama_cpp_peer.reference_ggufs(target, args.dtype, llama_cpp, quantized=False)[llama_cpp_peer.EXACT]
    del target
    server_args = llama_cpp_peer.server_args(gguf, args.threads, context=2048 * slots)
    binary = llama_cpp.binary("llama-server")
    return llama_cpp_peer.LlamaServer(
        binary, server_args, work_dir=log_dir, name="server-llama-cpp", parallel=slots
    ).launch()


def measured_sps(args: argparse.Namespace, out: Path) -> str:
    """A batch SPS table for Algorithm 1: ``--sps``, or measured now (vlmspec profile --requests ...)."""
    if args.sps:
        return args.sps
    from benchmarks.concurrency import load_pair, sps_table

    profile_args = argparse.Namespace(**{**vars(args), "profile_context": 160, "profile_repeats": 5, "sps": None})
    target, proposer = load_pair(profile_args)
    sps_table(profile_args, target, proposer.max_draft_tokens, out)
    return str(out / "sps.json")


# ---------------------------------------------------------------------------------- clients
def chat_requests(args: argparse.Namespace) -> list[dict]:
    """Every round's request bodies (``--requests`` a round): prompt-set questions, every other one an image
    question (data URL) when mixed."""
    bodies = []
    for task in workload(args, args.requests * args.rounds):
        parts = [{"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in task.images]
        parts.append({"type": "text", "text": task.prompt})
        bodies.append(
            dict(
                messages=[{"role": "user", "content": parts}],
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=len(bodies),
            )
        )
    return bodies


async def run_cell(url: str, bodies: list[dict], clients: int) -> tuple[float, list[Timing]]:
    """``clients`` closed-loop clients share the bodies; returns the wall time and each request's timing, in order."""
    client = openai_client(url)
    timings: list[Timing | None] = [None] * len(bodies)
    queue = list(range(len(bodies)))[::-1]

    async def worker() -> None:
        while queue:
            index = queue.pop()
            timings[index] = await stream_chat(client, bodies[index])

    tick = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall_s = time.perf_counter() - tick
    await client.close()
    return wall_s, timings


def cell_metrics(wall_s: float, timings: list[Timing]) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None]
    tokens = sum(t.completion_tokens for t in ok)
    ttft = [t.first_s - t.sent_s for t in ok if t.first_s is not None]
    tpot = [(t.done_s - t.first_s) / (t.completion_tokens - 1) for t in ok if t.first_s and t.completion_tokens > 1]
    e2e = [t.done_s - t.sent_s for t in ok]
    rounds = sum(t.speculation.get("rounds", 0) for t in ok)
    accepted = sum(t.speculation.get("accepted", 0) for t in ok)
    cell = {
        "wall_s": wall_s,
        "requests": len(ok),
        "errors": len(timings) - len(ok),
        "requests_per_s": len(ok) / wall_s,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall_s,
        "tau": (accepted + rounds) / rounds if rounds else None,
        "first_error": next((t.error for t in timings if t.error is not None), None),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            cell[f"{name}_p{q}_s"] = percentile(values, q)
    return cell


# ------------------------------------------------------------------------------------- main
@dataclass
class Run:
    """One variant's requests of one round at one level, on one start of its server."""

    start: int  # which start of the servers (0 .. --restarts - 1)
    round: int
    wall_s: float
    timings: list[Timing]

    @property
    def tokens_per_s(self) -> float:
        return sum(t.completion_tokens for t in self.timings if t.error is None) / self.wall_s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.skipped = {}
    out = prepare_out_dir(args.out)
    bodies = chat_requests(args)  # before measuring anything: too few held-out prompts stops here
    sps = measured_sps(args, out) if "prefix" in args.variant_list else None
    runs: dict[tuple[int, str], list[Run]] = {}  # (level, variant) -> its runs, every start and round
    for start in range(args.restarts):
        if args.restarts > 1:
            log(f"start {start + 1}/{args.restarts} of the servers")
        servers = start_servers(args, sps, out, warm_up=bodies[:2], start=start)
        try:
            for level in args.levels:
                for variant, run in run_rounds(servers, bodies, args, level, start):
                    runs.setdefault((level, variant), []).append(run)
        finally:
            for server in servers.values():
                server.stop()
    cells = []
    for level in args.levels:
        cells += level_cells(runs, level, args)
    write_outputs(out, args, cells)
    return 0


def start_servers(
    args: argparse.Namespace, sps: str | None, out: Path, warm_up: list[dict], start: int = 0
) -> dict[str, PeerProcess]:
    """Every variant's server, ready and warmed up on ``warm_up``; a peer that cannot start is skipped (for the
    rest of the run: ``args.variant_list`` drops it).

    The servers launch in the order :func:`run_order` gives start number ``start``: over the starts each
    variant's process comes first as often as last, so none always finds the machine's memory as the
    others left it (a process keeps the speed it starts with).
    """
    servers = {}
    try:
        for variant in run_order(args.variant_list, start):
            try:
                servers[variant] = start_server(variant, args, sps, out)
            except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as err:
                if variant not in PEERS:
                    raise
                args.skipped[variant] = " ".join(str(err).split())[:300]
                log(f"{variant} skipped: {args.skipped[variant]}")
        for variant, server in list(servers.items()):
            log(f"waiting for the {variant} server ...")
            try:
                server.wait_ready(args.startup_timeout)
            except PeerNotReady as err:  # a peer that does not come up is skipped; vlmspec's own must
                if variant not in PEERS:
                    raise SystemExit(str(err)) from err
                args.skipped[variant] = str(err)
                log(f"{variant} skipped: {err}")
                servers.pop(variant).stop()
                continue
            asyncio.run(run_cell(server.url, warm_up, 2))  # first-call costs, both paths
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    args.variant_list = [v for v in args.variant_list if v in servers]
    return servers


def run_rounds(
    servers: dict[str, PeerProcess], bodies: list[dict], args: argparse.Namespace, level: int, start: int
) -> list[tuple[str, Run]]:
    """``--rounds`` rounds of ``level`` clients on every server, the variants alternating (run_order)."""
    done = []
    for round_index in range(args.rounds):
        # Each round its own questions: a prefix cache holds the last round's prompts.
        sent = bodies[round_index * args.requests : (round_index + 1) * args.requests]
        step = (start * len(args.levels) + args.levels.index(level)) * args.rounds + round_index
        for variant in run_order(args.variant_list, step):
            wall_s, timings = asyncio.run(run_cell(servers[variant].url, sent, level))
            run = Run(start, round_index, wall_s, timings)
            done.append((variant, run))
            this_round = cell_metrics(wall_s, timings)
            where = f"start {start + 1} " if args.restarts > 1 else ""
            log(
                f"N={level:3d} {where}round {round_index + 1}/{args.rounds} {variant:10s} "
                f"{this_round['requests_per_s']:6.2f} req/s {this_round['tokens_per_s']:7.1f} tok/s "
                f"TTFT p50 {format_number(this_round['ttft_p50_s'])} s, "
                f"TPOT p50 {format_number(this_round['tpot_p50_s'], 3)} s, errors {this_round['errors']}"
            )
    return done


def level_cells(runs: dict[tuple[int, str], list[Run]], level: int, args: argparse.Namespace) -> list[dict]:
    """One cell per variant at ``level``: its runs pooled (their tokens over their summed wall time)."""
    cells = []
    measured = [v for v in VARIANTS if (level, v) in runs]  # a peer skipped at a later start keeps its runs
    for variant in measured:
        mine = runs[(level, variant)]
        timings = [t for run in mine for t in run.timings]
        cell = {"concurrency": level, "variant": variant, **cell_metrics(sum(r.wall_s for r in mine), timings)}
        cell["round_tokens_per_s"] = [run.tokens_per_s for run in mine]
        cell["texts"] = [t.text for t in timings]  # what "identical" compared
        cells.append(cell)
    compare(cells, {v: [t for run in runs[(level, v)] for t in run.timings] for v in measured}, level, args)
    if "alone" in measured:
        for cell in cells:
            cell.update(ratio_by_start(runs[(level, cell["variant"])], runs[(level, "alone")]))
    return cells


def ratio_by_start(runs: list[Run], alone: list[Run]) -> dict[str, Any]:
    """The variant's throughput over the target alone's on each start of the servers (each start's rounds
    pooled), their mean, and its standard error across starts (None with one start).

    A start is the unit of replication: rounds on one pair of processes share what each process got at
    start (where its memory landed, its threads), which moved identical servers 2-5% apart here.
    """
    starts = sorted({run.start for run in alone})
    ratios = []
    for start in starts:
        own = [r for r in runs if r.start == start]
        base = [r for r in alone if r.start == start]
        ratios.append(safe_ratio(pooled_tokens_per_s(own), pooled_tokens_per_s(base)))
    ratios = [r for r in ratios if r is not None]
    mean = statistics.fmean(ratios) if ratios else None
    error = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else None
    return {"start_vs_alone": ratios, "vs_alone_mean_of_starts": mean, "vs_alone_standard_error": error}


def pooled_tokens_per_s(runs: list[Run]) -> float | None:
    wall_s = sum(r.wall_s for r in runs)
    return sum(r.tokens_per_s * r.wall_s for r in runs) / wall_s if wall_s > 0 else None


def compare(cells: list[dict], results: dict[str, list[Timing]], level: int, args: argparse.Namespace) -> None:
    """Each cell of this level against the target alone: the throughput ratio, and identity when greedy."""
    if "alone" not in results:
        return
    alone = next(c for c in cells if c["concurrency"] == level and c["variant"] == "alone")
    for cell in (c for c in cells if c["concurrency"] == level):
        cell["vs_alone"] = safe_ratio(cell["tokens_per_s"], alone["tokens_per_s"])
        if args.temperature == 0:
            pairs = zip(results[cell["variant"]], results["alone"])
            cell["identical"] = all(t.text == a.text and t.error is None for t, a in pairs)


def format_by_start(cell: dict[str, Any]) -> str:
    """``0.98 +- 0.012 (8 starts)``: the cell's ratio to the target alone over the servers' starts."""
    mean, error = cell.get("vs_alone_mean_of_starts"), cell.get("vs_alone_standard_error")
    if mean is None:
        return ""
    spread = "" if error is None else f" +- {error:.3f}"
    starts = len(cell["start_vs_alone"])
    return f"{mean:.3f}{spread} ({starts} start{'' if starts == 1 else 's'})"


def write_outputs(out: Path, args: argparse.Namespace, cells: list[dict[str, Any]]) -> None:
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_json(out / "serving.json", {"environment": environment_info(), "settings": settings, "cells": cells})
    headers = ["clients", "variant", "req/s", "tok/s", "vs alone", "tau", "TTFT p50 s", "TTFT p90 s"]
    headers += ["TPOT p50 ms", "TPOT p90 ms", "TPOT p99 ms", "errors", "identical"]
    by_start = args.restarts > 1
    if by_start:
        headers.insert(5, "vs alone by start")
    rows = []
    for c in cells:
        row = [c["concurrency"], c["variant"], c["requests_per_s"], c["tokens_per_s"], c.get("vs_alone"), c["tau"]]
        row += [c["ttft_p50_s"], c["ttft_p90_s"]]
        row += [None if c[f"tpot_p{q}_s"] is None else 1000 * c[f"tpot_p{q}_s"] for q in (50, 90, 99)]
        row += [c["errors"], c.get("identical")]
        if by_start:
            row.insert(5, format_by_start(c))
        rows.append(row)
    note = (
        f"target {args.target}, drafter {args.drafter}, {args.dtype}; {args.requests} requests per cell"
        + (f" and round ({args.rounds} rounds pooled, the variants alternating)" if args.rounds > 1 else "")
        + (
            f"; every server started {args.restarts} times (fresh processes), all rounds on each start; "
            "'vs alone by start': the mean over starts of each start's pooled ratio, +- its standard error"
            if by_start
            else ""
        )
        + ", "
        f"{describe_workload(args)}; max_tokens {args.max_tokens}, temperature {args.temperature}; clients stream"
        + "".join(f"\n- {variant} skipped: {why}" for variant, why in args.skipped.items())
    )
    write_text(out / "serving.md", f"{note}\n\n{markdown_table(headers, rows)}")
    by_variant = {v: [c for c in cells if c["variant"] == v] for v in args.variant_list}
    plot_lines(
        out / "serving_throughput.png",
        {v: ([c["concurrency"] for c in mine], [c["tokens_per_s"] for c in mine]) for v, mine in by_variant.items()},
        title="vlmspec serve: output tokens per second",
        xlabel="concurrent clients",
        ylabel="output tokens / s",
    )
    plot_lines(
        out / "serving_latency.png",
        {
            f"{v} {name}": ([c["concurrency"] for c in mine], [c[f"{name}_p50_s"] for c in mine])
            for v, mine in by_variant.items()
            for name in ("ttft", "e2e")
        },
        title="vlmspec serve: median latency",
        xlabel="concurrent clients",
        ylabel="seconds",
    )
    log(f"wrote {out / 'serving.json'}, {out / 'serving.md'} and two plots")
    print(json.dumps({c["variant"] + f"@{c['concurrency']}": round(c["tokens_per_s"], 2) for c in cells}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
