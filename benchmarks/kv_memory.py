"""KV memory table: peak RSS of BatchEngine against concurrency and prompt length, with the budget set and unset.

Each cell runs in a fresh Python process (peak RSS only ever rises in a process): it loads
the target, notes its RSS, submits C requests of about L prompt tokens each (held-out
text repeated to length, each request a different one) with ``max_new_tokens`` new tokens,
runs them to the end through ``vlmspec.serving.BatchEngine(kv_cache_memory=...)`` and
reports the peak RSS rise over the loaded target, the KV pool's peak blocks and bytes, the
most requests that ran at once, the wall time, and (greedy) whether the first
``--check-alone`` requests' outputs equal what each gets alone. A request the budget can
never hold counts as ``refused`` (``add_request``'s ValueError, the server's HTTP 400).

Expected (issue #45): unset, the rise grows with C x L (every request's blocks at once);
with a budget, it stays within the budget plus the activations, requests wait for blocks
(``most running`` drops), and outputs equal the requests' own.

``--through-server`` runs each cell through ``vlmspec serve --kv-cache-memory`` instead (the
reference pair's drafter for the reference target, the server's other defaults): C clients
send their requests at once over HTTP, and the server's RSS is sampled every 50 ms from
before the burst to its end. Each request ends as ``done`` (its answer; the first
``--check-alone`` are compared with the same request sent alone afterwards), ``429`` (and
whether it carried ``Retry-After``), ``400`` (refused: can never fit), another error, or
``hung`` (no answer within ``--request-timeout``).

```bash
python -m benchmarks.kv_memory --out runs/kv-memory                      # reference target
python -m benchmarks.kv_memory --through-server --concurrency 32 --prompt-tokens 2000 --budgets 256MB \
    --out runs/kv-memory-serve
python -m benchmarks.kv_memory --target tiny:qwen2_vl --concurrency 4 --prompt-tokens 200 --out runs/kv-smoke
```
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks.common import (
    add_server_arguments,
    add_target_arguments,
    held_out_prompts_of_length,
    markdown_table,
    peer_logs_dir,
    prepare_out_dir,
    server_drafter,
    write_json,
    write_text,
)
from benchmarks.peer_process import PeakRSS


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_arguments(parser, out="runs/kv-memory")
    parser.add_argument("--concurrency", default="8,32", help="comma-separated numbers of concurrent requests")
    parser.add_argument("--prompt-tokens", default="500,2000", help="comma-separated prompt lengths (tokens)")
    parser.add_argument("--budgets", default="unset,256MB", help="comma-separated --kv-cache-memory values or 'unset'")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--check-alone", type=int, default=2, help="requests whose output is compared with alone")
    parser.add_argument("--through-server", action="store_true", help="each cell through vlmspec serve (HTTP)")
    parser.add_argument("--request-timeout", type=float, default=1800.0, help="seconds before a request counts as hung")
    add_server_arguments(parser)
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # internal: run one cell, print JSON
    return parser.parse_args(argv)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def run_cell(args: argparse.Namespace) -> dict:
    import torch

    from vlmspec.loading import load_target
    from vlmspec.serving import BatchEngine
    from vlmspec.serving.memory import parse_kv_cache_memory

    torch.set_num_threads(args.threads)
    concurrency, prompt_tokens, budget = args.cell.split(":", 2)
    memory = None if budget == "unset" else parse_kv_cache_memory(budget)
    target = load_target(args.target, dtype=args.dtype)
    texts = held_out_prompts_of_length(target.tokenizer, int(concurrency), int(prompt_tokens))
    options = {"max_new_tokens": args.max_new_tokens}
    alone = [
        BatchEngine(target).generate_many([{"prompt": t, **options}])[0].token_ids for t in texts[: args.check_alone]
    ]
    engine = BatchEngine(target, max_batch_size=int(concurrency), kv_cache_memory=memory)
    base = rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids, refused = [], 0
    for text in texts:
        try:
            ids.append(engine.add_request(None, text, **options))
        except ValueError:
            refused += 1
    tick, most_running, peak_blocks = time.perf_counter(), 0, 0
    while engine.has_unfinished:
        engine.step()
        most_running = max(most_running, engine.num_running)
        peak_blocks = max(peak_blocks, engine.kv_cache["blocks_used"])
    wall = time.perf_counter() - tick
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kv = engine.kv_cache
    outputs = [engine.result(i).token_ids for i in ids]
    return {
        "concurrency": int(concurrency),
        "prompt_tokens": int(prompt_tokens),
        "budget": budget,
        "budget_blocks": kv["blocks_limit"],
        "refused": refused,
        "most_running": most_running,
        "peak_kv_blocks": peak_blocks,
        "peak_kv_mib": peak_blocks * kv["bytes_per_block"] / 2**20,
        "peak_rss_rise_mib": (max(peak, peak_before) - base) / 2**20,
        "wall_s": wall,
        "same_as_alone": outputs[: len(alone)] == alone[: len(outputs)],
    }


async def send(client, text: str, max_tokens: int, timeout: float) -> dict:
    """One greedy chat completion: how it ended (done, 429, 400, error, hung), its text, a 429's Retry-After."""
    import openai

    from benchmarks.peer_process import SERVED_MODEL_NAME

    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0.0}
    try:
        reply = await asyncio.wait_for(client.chat.completions.create(model=SERVED_MODEL_NAME, **body), timeout)
    except asyncio.TimeoutError:
        return {"end": "hung"}
    except openai.APIStatusError as err:
        end = str(err.status_code) if err.status_code in (400, 429) else f"error {err.status_code}"
        return {"end": end, "retry_after": err.response.headers.get("retry-after")}
    except Exception as err:  # noqa: BLE001 - counted: the other clients go on
        return {"end": f"error {type(err).__name__}"}
    return {"end": "done", "text": reply.choices[0].message.content}


def run_server_cell(args: argparse.Namespace, concurrency: int, prompt_tokens: int, budget: str) -> dict:
    """C requests at once against ``vlmspec serve`` with ``--kv-cache-memory budget``: their ends and the peak RSS."""
    from benchmarks.peer_process import openai_client, vlmspec_serve
    from vlmspec.loading import load_target

    texts = held_out_prompts_of_length(load_target(args.target, dtype=args.dtype).tokenizer, concurrency, prompt_tokens)
    extra = [] if budget == "unset" else ["--kv-cache-memory", budget]
    server = vlmspec_serve(
        f"kv-memory-{concurrency}-{prompt_tokens}-{budget}", target=args.target, dtype=args.dtype,
        drafter=server_drafter(args), extra=[*extra, *args.server_args], log_dir=peer_logs_dir(args.out, "vlmspec"),
    )  # fmt: skip
    server.start(timeout=args.startup_timeout)
    try:
        meter = PeakRSS(server.process.pid)
        replies, alone, wall = asyncio.run(burst_then_alone(openai_client(server.url), texts, meter, args))
    finally:
        server.stop()
    return {
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "budget": budget,
        **summarize_ends(replies, alone),
        "peak_rss_rise_mib": meter.growth_mib,
        "wall_s": wall,
    }


def summarize_ends(replies: Sequence[dict], alone: Sequence[dict]) -> dict:
    """How the burst's requests ended (counts), whether every 429 said when to retry, and whether the answers
    of the first ones equal the same requests' answers alone (``alone[i]`` is request i's)."""
    ends = [r["end"] for r in replies]
    checked = [(r, a) for r, a in zip(replies, alone) if r["end"] == "done" and a["end"] == "done"]
    return {
        "ends": {end: ends.count(end) for end in sorted(set(ends))},
        "retry_after_on_every_429": all(r.get("retry_after") for r in replies if r["end"] == "429"),
        "same_as_alone": all(r["text"] == a["text"] for r, a in checked),
        "compared_with_alone": len(checked),
    }


async def burst_then_alone(
    client, texts: Sequence[str], meter: PeakRSS, args: argparse.Namespace
) -> tuple[list[dict], list[dict], float]:
    """A warm-up request, then every text at once (metered), then the first ``--check-alone`` each alone."""
    await send(client, "Hello.", 4, args.request_timeout)  # the first request's one-time costs, before the meter
    with meter:
        tick = time.perf_counter()
        replies = await asyncio.gather(*(send(client, t, args.max_new_tokens, args.request_timeout) for t in texts))
        wall = time.perf_counter() - tick
    alone = [await send(client, t, args.max_new_tokens, args.request_timeout) for t in texts[: args.check_alone]]
    return list(replies), alone, wall


def server_table(cells: list[dict]) -> str:
    headers = ["C", "prompt tokens", "budget", "ends", "429s with Retry-After", "peak RSS rise MiB", "wall s"]
    headers.append("same as alone (compared)")
    rows = [
        [
            c["concurrency"], c["prompt_tokens"], c["budget"], ", ".join(f"{k} {v}" for k, v in c["ends"].items()),
            "yes" if c["retry_after_on_every_429"] else "NO", c["peak_rss_rise_mib"], c["wall_s"],
            f"{'yes' if c['same_as_alone'] else 'NO'} ({c['compared_with_alone']})",
        ]
        for c in cells
    ]  # fmt: skip
    return markdown_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cell is not None:
        print(json.dumps(run_cell(args)))
        return 0
    out = prepare_out_dir(args.out)
    if args.through_server:
        cells = []
        for concurrency in args.concurrency.split(","):
            for tokens in args.prompt_tokens.split(","):
                for budget in args.budgets.split(","):
                    cells.append(run_server_cell(args, int(concurrency), int(tokens), budget))
                    print(f"[kv-memory] {cells[-1]}", file=sys.stderr)
        write_json(out / "kv_memory.json", {"args": vars(args), "cells": cells})
        write_text(out / "kv_memory.md", server_table(cells))
        print(server_table(cells))
        return 0
    cells = []
    for concurrency in args.concurrency.split(","):
        for tokens in args.prompt_tokens.split(","):
            for budget in args.budgets.split(","):
                command = [sys.executable, "-m", "benchmarks.kv_memory", *(argv or sys.argv[1:]), "--cell"]
                command.append(f"{concurrency}:{tokens}:{budget}")
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                cells.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"[kv-memory] {cells[-1]}", file=sys.stderr)
    write_json(out / "kv_memory.json", {"args": vars(args), "cells": cells})
    headers = ["C", "prompt tokens", "budget", "refused", "most running", "peak KV MiB", "peak RSS rise MiB", "wall s"]
    rows = [
        [
            c["concurrency"], c["prompt_tokens"], c["budget"], c["refused"], c["most_running"],
            c["peak_kv_mib"], c["peak_rss_rise_mib"], c["wall_s"],
        ]
        for c in cells
    ]  # fmt: skip
    headers.append("same as alone")
    for row, cell in zip(rows, cells, strict=True):
        row.append("yes" if cell["same_as_alone"] else "NO")
    write_text(out / "kv_memory.md", markdown_table(headers, rows))
    print(markdown_table(headers, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
