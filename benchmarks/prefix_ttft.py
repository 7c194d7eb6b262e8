"""Time to first token when a request repeats what an earlier one sent: a multi-turn image chat, a shared system prompt.

Issue #45's reuse workloads, through ``vlmspec.serving.BatchEngine`` in this process
(one request at a time, so a TTFT is the request's own prefill and first token):

* ``chat``: a ``--turns``-turn chat about one picture (the first held-out MT-Bench prompts as
  the user's turns, each answer appended to the history). Each turn is sent twice, in
  alternating order: ``warm`` to the engine that served the earlier turns, and ``cold`` to
  an engine over the same target with its reuse state emptied first (a fresh vision cache),
  as a freshly started server would see it. Reported per turn: both TTFTs and their ratio.
* ``system``: ``--requests`` requests behind one system prompt of about ``--system-tokens``
  tokens (held-out text repeated), each with a different question. Reported: each request's
  TTFT and its ratio to the first's.

What reuses work today: the vision tower's output cache (a later turn about the same picture
skips the encoder). The target's KV of a repeated prefix is recomputed (prefix caching is
not built yet), so ratios near 1 are expected for the system prompt, and for the chat the
share of the first turn's TTFT the encoder was. Greedy outputs of warm and cold must agree.

```bash
python -m benchmarks.prefix_ttft --out runs/prefix-ttft
python -m benchmarks.prefix_ttft --target tiny:qwen2_vl --turns 3 --requests 3 --system-tokens 200 --out runs/pt-smoke
```
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import markdown_table, prepare_out_dir, write_json, write_text

PROMPT_SET = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "mt-bench.jsonl"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="reference", help="'reference', a Qwen-VL directory, or tiny:FAMILY")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--picture", default="astronaut", help="a scikit-image picture (held out)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/prefix-ttft"))
    return parser.parse_args(argv)


def ttft(engine, images, messages, max_new_tokens: int) -> tuple[float, list[int]]:
    """One request alone: seconds from add_request to its first token (processing included), its greedy output."""
    tick = time.perf_counter()
    request_id = engine.add_request(images, messages=messages, max_new_tokens=max_new_tokens)
    engine.admit()  # nothing else runs: this prefills the request and draws its first token
    seconds = time.perf_counter() - tick
    while engine.has_unfinished:
        engine.step()
    return seconds, engine.result(request_id, pop=True).token_ids


def chat(engine_of, target, picture, questions: list[str], max_new_tokens: int) -> list[dict]:
    from vlmspec.targets.families import VisionCache

    warm, history, rows = engine_of(), [], []
    for turn, question in enumerate(questions, start=1):
        content = ([{"type": "image"}] if turn == 1 else []) + [{"type": "text", "text": question}]
        messages = [*history, {"role": "user", "content": content}]
        times, outputs = {}, {}
        for kind in ("warm", "cold") if turn % 2 else ("cold", "warm"):  # alternate which runs first
            if kind == "cold":
                target.vision_cache = VisionCache()  # what a freshly started server holds
            engine = warm if kind == "warm" else engine_of()
            times[kind], outputs[kind] = ttft(engine, [picture], messages, max_new_tokens)
        answer = target.tokenizer.decode(outputs["warm"], skip_special_tokens=True)
        history = [*messages, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        rows.append(
            {"turn": turn, **times, "ratio": times["warm"] / times["cold"], "same": outputs["warm"] == outputs["cold"]}
        )
    return rows


def shared_system(engine_of, target, questions: list[str], system_tokens: int, max_new_tokens: int) -> list[dict]:
    base = " ".join(questions)
    repeats = max(1, system_tokens // max(1, len(target.tokenizer(base).input_ids)))
    system = {"role": "system", "content": [{"type": "text", "text": " ".join([base] * repeats)}]}
    engine, rows = engine_of(), []
    for i, question in enumerate(questions):
        messages = [system, {"role": "user", "content": [{"type": "text", "text": question}]}]
        seconds, _ = ttft(engine, None, messages, max_new_tokens)
        rows.append({"request": i + 1, "ttft": seconds})
    for row in rows:
        row["ratio_to_first"] = row["ttft"] / rows[0]["ttft"]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from vlmspec.data.heldout import held_out_prompts
    from vlmspec.data.pictures import skimage_image
    from vlmspec.loading import load_target
    from vlmspec.serving import BatchEngine

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = prepare_out_dir(args.out)
    target = load_target(args.target, dtype=args.dtype)
    prompts = held_out_prompts(PROMPT_SET)
    picture = skimage_image(args.picture)

    def engine_of() -> BatchEngine:
        return BatchEngine(target, max_batch_size=1)

    chat_rows = chat(engine_of, target, picture, prompts[: args.turns], args.max_new_tokens)
    system_rows = shared_system(
        engine_of, target, prompts[args.turns : args.turns + args.requests], args.system_tokens, args.max_new_tokens
    )
    write_json(out / "prefix_ttft.json", {"args": vars(args), "chat": chat_rows, "system": system_rows})
    table = markdown_table(
        ["turn", "TTFT warm s", "TTFT cold s", "warm / cold", "same output"],
        [[r["turn"], r["warm"], r["cold"], r["ratio"], "yes" if r["same"] else "NO"] for r in chat_rows],
    )
    table += "\n\n" + markdown_table(
        ["request", "TTFT s", "/ first"], [[r["request"], r["ttft"], r["ratio_to_first"]] for r in system_rows]
    )
    later = [r["ratio_to_first"] for r in system_rows[1:]]
    if later:
        table += f"\n\nMedian TTFT ratio of requests 2..{len(system_rows)} to the first: {statistics.median(later):.2f}"
    write_text(out / "prefix_ttft.md", table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
