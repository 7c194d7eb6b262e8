"""Time to first token when a request repeats what an earlier one sent: a multi-turn image chat, a shared system prompt.

Issue #45's reuse workloads, side by side on several engines (``--engines``). ``vlmspec`` runs
them through ``vlmspec.serving.BatchEngine`` in this process (one request at a time, so a TTFT is
the request's own prefill and first token), as described below; ``vlmspec-serve``,
``llama-cpp`` (``llama-server``, ``cache_prompt``) and ``vllm`` (``vllm serve``, prefix caching
on) run the same workloads through HTTP servers, each with its own meaning of cold
(``benchmarks/prefix_peers.py``), and add the same chat without its picture (``text chat``),
the scenario llama.cpp can run. A peer that cannot start is left out with the reason.

* ``chat``: a ``--turns``-turn chat about one picture (the first held-out MT-Bench prompts as
  the user's turns, each answer appended to the history). Each turn is sent twice, in
  alternating order: ``warm`` to the engine that served the earlier turns, and ``cold`` to
  an engine over the same target with its reuse state emptied first (a fresh vision cache),
  as a freshly started server would see it. Reported per turn: both TTFTs and their ratio.
* ``system``: ``--requests`` requests behind one system prompt of about ``--system-tokens``
  tokens (held-out text repeated), each with a different question. Reported: each request's
  TTFT and its ratio to the first's.

What reuses work: the prefix cache (a warm request takes the full KV blocks an earlier one
computed, keyed by tokens, positions and image content, and computes only the rest:
docs/design.md §21.4) and the vision tower's output cache (a later turn about the same picture
skips the encoder). Issue #45's bars: turns 3-5 of the chat at most 0.5x cold (goal 0.2x),
requests behind the system prompt at most 0.4x the first. Greedy outputs of warm and cold
must agree.

Every scenario runs ``--repeats`` times, each time on fresh engines and servers (one run's
cells move by tens of milliseconds on a 2-core machine); the tables give the medians.

Writes ``prefix_ttft.json`` and ``prefix_ttft.md`` (a table per scenario: per turn or request,
each engine's TTFT and warm / cold or the ratio to the first request) into ``--out``.

```bash
python -m benchmarks.prefix_ttft --out runs/prefix-ttft
python -m benchmarks.prefix_ttft --target tiny:qwen2_vl --engines vlmspec,vlmspec-serve --turns 3 --requests 3 \
    --system-tokens 200 --max-new-tokens 8 --out runs/pt-smoke
```
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from benchmarks import prefix_peers
from benchmarks.common import (
    MT_BENCH,
    add_server_arguments,
    add_target_arguments,
    log,
    markdown_table,
    peer_logs_dir,
    prepare_out_dir,
    server_drafter,
    write_json,
    write_text,
)
from benchmarks.peer_process import PeerNotReady

IN_PROCESS = "vlmspec"  # BatchEngine in this process


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_arguments(parser, out="runs/prefix-ttft")
    engines = (IN_PROCESS, *prefix_peers.ENGINES)
    parser.add_argument("--engines", default=",".join(engines), help=f"comma-separated, any of {', '.join(engines)}")
    add_server_arguments(parser)  # vlmspec-serve's
    parser.add_argument("--llama-slots", type=int, default=4, help="llama-server -np (slots that keep a prompt)")
    parser.add_argument(
        "--llama-cpp", default=None, help="llama.cpp folder (default: $LLAMA_CPP_DIR, else runs/llamacpp)"
    )
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--picture", default="astronaut", help="a scikit-image picture (held out)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="independent runs of every scenario, each on fresh engines and servers; the tables give medians",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    args.engine_list = [e for e in args.engines.split(",") if e]
    if not args.engine_list or set(args.engine_list) - set(engines):
        parser.error(f"--engines takes any of {', '.join(engines)}, got {args.engines!r}")
    args.drafter = server_drafter(args)
    return args


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


def system_text(tokenizer, questions: list[str], system_tokens: int) -> str:
    """The shared system prompt: the questions' text repeated to about ``system_tokens`` tokens."""
    base = " ".join(questions)
    repeats = max(1, system_tokens // max(1, len(tokenizer(base).input_ids)))
    return " ".join([base] * repeats)


def shared_system(engine_of, target, questions: list[str], system_tokens: int, max_new_tokens: int) -> list[dict]:
    system = {
        "role": "system",
        "content": [{"type": "text", "text": system_text(target.tokenizer, questions, system_tokens)}],
    }
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
    from vlmspec.targets.families import VisionCache

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = prepare_out_dir(args.out)
    target = load_target(args.target, dtype=args.dtype)
    prompts = held_out_prompts(MT_BENCH)
    picture = skimage_image(args.picture)
    chat_questions = prompts[: args.turns]
    system_questions = prompts[args.turns : args.turns + args.requests]
    scenarios: dict[str, dict[str, list[dict]]] = {"image chat": {}, "text chat": {}, "system prompt": {}}
    skipped: dict[str, str] = {}

    if IN_PROCESS in args.engine_list:

        def engine_of() -> BatchEngine:
            return BatchEngine(target, max_batch_size=1)

        chats, systems = [], []
        for _ in range(args.repeats):
            target.vision_cache = VisionCache()  # each repeat starts as a fresh process would
            chats.append(chat(engine_of, target, picture, chat_questions, args.max_new_tokens))
            systems.append(shared_system(engine_of, target, system_questions, args.system_tokens, args.max_new_tokens))
        scenarios["image chat"][IN_PROCESS] = prefix_peers.median_of_repeats(chats)
        scenarios["system prompt"][IN_PROCESS] = prefix_peers.median_of_repeats(systems)
    system = system_text(target.tokenizer, system_questions, args.system_tokens)
    cold = {}
    if IN_PROCESS in args.engine_list:
        cold[IN_PROCESS] = "new BatchEngine over the same target, vision cache emptied"
    for name in (e for e in args.engine_list if e != IN_PROCESS):
        try:
            engine = prefix_peers.make_engine(name, args, peer_logs_dir(out, name))
            cold[name] = engine.cold
            runs = []
            for repeat in range(args.repeats):
                log(f"[prefix-ttft] {name}: starting its servers (repeat {repeat + 1}/{args.repeats}) ...")
                runs.append(prefix_peers.run_engine(engine, picture, chat_questions, system, system_questions, args))
            for scenario in runs[0]:
                scenarios[scenario][name] = prefix_peers.median_of_repeats([found[scenario] for found in runs])
        except (PeerNotReady, RuntimeError, ValueError, OSError) as err:
            skipped[name] = " ".join(str(err).split())[:600]
            log(f"[prefix-ttft] {name} left out: {skipped[name]}")
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_json(
        out / "prefix_ttft.json", {"settings": settings, "cold": cold, "skipped": skipped, "scenarios": scenarios}
    )
    text = report(scenarios, cold, skipped, args)
    write_text(out / "prefix_ttft.md", text)
    print(text)
    return 0


def report(scenarios: dict[str, dict[str, list[dict]]], cold: dict[str, str], skipped: dict[str, str], args) -> str:
    """The markdown: what ran, what cold means per engine, then one table per scenario that has rows."""
    lines = [
        f"target {args.target}, {args.dtype}, greedy, {args.max_new_tokens} new tokens; chat: {args.turns} turns "
        f"(picture {args.picture} in the first), system prompt: about {args.system_tokens} tokens, "
        f"{args.requests} requests; TTFT from the request to the first token (HTTP engines: the first content chunk); "
        f"each cell the median of {args.repeats} independent runs (a ratio: of each run's own ratio)",
        "",
        *(f"- {engine}: cold = {how}" for engine, how in cold.items()),
        *(f"- {engine}: not run: {why}" for engine, why in skipped.items()),
    ]
    for scenario, results in scenarios.items():
        results = {engine: rows for engine, rows in results.items() if rows}
        if not results:
            continue
        table = prefix_peers.system_table if scenario == "system prompt" else prefix_peers.chat_table
        headers, rows = table(results)
        lines += ["", f"### {scenario}", "", markdown_table(headers, rows)]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
