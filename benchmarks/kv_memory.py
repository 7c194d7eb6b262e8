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

```bash
python -m benchmarks.kv_memory --out runs/kv-memory                      # reference target
python -m benchmarks.kv_memory --target tiny:qwen2_vl --concurrency 4 --prompt-tokens 200 --out runs/kv-smoke
```
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks.common import (
    add_target_arguments,
    held_out_prompts_of_length,
    markdown_table,
    prepare_out_dir,
    write_json,
    write_text,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_arguments(parser, out="runs/kv-memory")
    parser.add_argument("--concurrency", default="8,32", help="comma-separated numbers of concurrent requests")
    parser.add_argument("--prompt-tokens", default="500,2000", help="comma-separated prompt lengths (tokens)")
    parser.add_argument("--budgets", default="unset,256MB", help="comma-separated --kv-cache-memory values or 'unset'")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--check-alone", type=int, default=2, help="requests whose output is compared with alone")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cell is not None:
        print(json.dumps(run_cell(args)))
        return 0
    out = prepare_out_dir(args.out)
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
