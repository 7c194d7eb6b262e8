"""Do running streams stall while a long prompt prefills? Inter-token gaps of a server's streams around one.

Issue #45's "long prompt" bar: while a 6,000-token prompt prefills, running streams never wait
more than 1.0 s between tokens (goal 0.25 s). Through ``vlmspec serve`` (HTTP, streaming), and
with ``--engines`` the same run against ``llama-server`` (``-np`` streams + 1) and ``vllm serve``
(``benchmarks/prefix_peers.py`` starts them; reference target only), one engine after another:

1. ``--streams`` clients (4) each stream short held-out questions back to back (greedy,
   ``--max-tokens`` each; a client whose answer ends sends its next question), so that
   streams are running throughout;
2. ``--lead-s`` seconds after every stream has had its first token, one prompt of about
   ``--long-tokens`` tokens (held-out text repeated) arrives, streamed, asking for
   ``--long-max-tokens`` tokens;
3. ``--tail-s`` seconds after its first token, the clients stop (each after the answer it is
   streaming).

Every gap between two consecutive content chunks of one running stream is put in a phase:
``before`` (it ended before the long prompt was sent), ``while`` (it overlaps the time from
sending the long prompt to its first token: the prefill) or ``after``. Reported per phase:
the number of gaps, their median, p99 and max, and the long prompt's time to first token and
prompt tokens. A first chunk's wait (a stream's own TTFT) is not a gap. With speculation a
chunk may carry several tokens: a gap is the wait a user sees between two pieces of text.

Writes ``long_prompt_stall.json`` and ``long_prompt_stall.md`` into ``--out``; the servers' logs
go to ``runs/peer-logs/``.

```bash
python -m benchmarks.long_prompt_stall --out runs/long-prompt-stall
python -m benchmarks.long_prompt_stall --engines vlmspec-serve,llama-cpp,vllm --out runs/long-prompt-stall-peers
python -m benchmarks.long_prompt_stall --target tiny:qwen2_vl --drafter prompt-lookup --long-tokens 300 \\
    --lead-s 1 --tail-s 1 --max-tokens 16 --out runs/stall-smoke
```
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

from benchmarks import prefix_peers
from benchmarks.common import (
    MT_BENCH,
    add_server_arguments,
    add_target_arguments,
    held_out_prompts_of_length,
    log,
    markdown_table,
    peer_logs_dir,
    percentile,
    prepare_out_dir,
    server_drafter,
    write_json,
    write_text,
)
from benchmarks.peer_process import PeerNotReady, Timing, openai_client, stream_chat

PHASES = ("before", "while", "after")
BAR_S, GOAL_S = 1.0, 0.25  # issue #45: the most a running stream may wait while a long prompt prefills


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_arguments(parser, out="runs/long-prompt-stall")
    add_server_arguments(parser)
    engines = prefix_peers.ENGINES
    parser.add_argument("--engines", default="vlmspec-serve", help=f"comma-separated, any of {', '.join(engines)}")
    parser.add_argument(
        "--llama-cpp", default=None, help="llama.cpp folder (default: $LLAMA_CPP_DIR, else runs/llamacpp)"
    )
    parser.add_argument("--streams", type=int, default=4, help="running streams (short prompts)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each short request")
    parser.add_argument("--long-tokens", type=int, default=6000, help="the long prompt's length, about, in tokens")
    parser.add_argument("--long-max-tokens", type=int, default=8, help="max_tokens of the long request")
    parser.add_argument(
        "--lead-s",
        type=float,
        default=5.0,
        help="seconds the streams run (after each one's first token) before the long prompt",
    )
    parser.add_argument("--tail-s", type=float, default=5.0, help="seconds they run after its first token")
    args = parser.parse_args(argv)
    args.drafter = server_drafter(args)
    args.engine_list = [e for e in args.engines.split(",") if e]
    if not args.engine_list or set(args.engine_list) - set(engines):
        parser.error(f"--engines takes any of {', '.join(engines)}, got {args.engines!r}")
    return args


# ---------------------------------------------------------------------------------- the maths
def phase_gaps(chunks: Sequence[float], long_sent: float, long_first: float) -> dict[str, list[float]]:
    """The gaps between consecutive ``chunks`` (arrival times of one stream), by phase around the prefill window
    ``[long_sent, long_first]``: ``before`` ends by ``long_sent``, ``after`` starts at ``long_first`` or later,
    ``while`` is every gap that overlaps the window."""
    gaps: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for start, end in zip(chunks, chunks[1:]):
        phase = "before" if end <= long_sent else "after" if start >= long_first else "while"
        gaps[phase].append(end - start)
    return gaps


def summarize_gaps(gaps: Sequence[float]) -> dict[str, float | int | None]:
    """Count, median, p99 and max of some gaps (seconds; None when there are none)."""
    return {
        "gaps": len(gaps),
        "median_s": percentile(gaps, 50),
        "p99_s": percentile(gaps, 99),
        "max_s": max(gaps, default=None),
    }


def merge_phases(streams: Sequence[dict[str, list[float]]]) -> dict[str, list[float]]:
    return {phase: [gap for stream in streams for gap in stream[phase]] for phase in PHASES}


# ---------------------------------------------------------------------------------- the run
async def run_window(url: str, questions: list[str], long_prompt: str, args: argparse.Namespace, fields: dict) -> dict:
    """The streams, the long prompt among them, and the times that place every gap (see the module docstring).

    ``fields`` are the engine's own request fields (llama.cpp's ``cache_prompt``)."""
    client = openai_client(url)
    stop = asyncio.Event()
    streams: list[list[Timing]] = [[] for _ in range(args.streams)]

    async def runner(index: int) -> None:  # after the stop, the answer in flight finishes: its chunks count
        asked = 0
        while not stop.is_set():
            question = questions[(index + asked * args.streams) % len(questions)]
            body = {"messages": [user(question)], "max_tokens": args.max_tokens, "temperature": 0, **fields}
            streams[index].append(Timing(time.perf_counter()))  # watched below while it streams
            await stream_chat(client, body, streams[index][-1])
            asked += 1

    tasks = [asyncio.ensure_future(runner(i)) for i in range(args.streams)]
    await every_stream_running(streams, args.startup_timeout)
    await asyncio.sleep(args.lead_s)
    long_body = {"messages": [user(long_prompt)], "max_tokens": args.long_max_tokens, "temperature": 0, **fields}
    long = await stream_chat(client, long_body)
    await asyncio.sleep(args.tail_s)
    stop.set()
    await asyncio.gather(*tasks)
    await client.close()
    return {"long": long, "streams": streams}


async def every_stream_running(streams: list[list[Timing]], timeout: float) -> None:
    """Return once every stream has had its first token (its prefill is behind it), or ``timeout`` seconds passed."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if all(any(t.first_s is not None for t in requests) for requests in streams):
            return
        if any(t.error for requests in streams for t in requests):
            return  # the report counts the error; the window still runs
        await asyncio.sleep(0.05)


def user(text: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def main(argv: Sequence[str] | None = None) -> int:
    from vlmspec.data.heldout import held_out_prompts
    from vlmspec.loading import load_target

    args = parse_args(argv)
    out = prepare_out_dir(args.out)
    tokenizer = load_target(args.target, dtype=args.dtype).tokenizer
    long_prompt = held_out_prompts_of_length(tokenizer, 1, args.long_tokens)[0]
    questions = held_out_prompts(MT_BENCH)[: 4 * args.streams]
    args.server_args = ["--max-batch-size", str(args.streams + 1), *args.server_args]  # a later one of the user's wins
    context = args.long_tokens + 2048  # the long prompt, the chat template and the answer
    results, skipped = {}, {}
    for name in args.engine_list:
        try:
            engine = prefix_peers.make_engine(
                name, args, peer_logs_dir(out, name), context=context, slots=args.streams + 1
            )
            server = prefix_peers.ready(engine.start(True), args.startup_timeout)  # its warm-up is off the clock
            try:
                log(f"[stall] {name}: streams running; the long prompt follows ...")
                found = asyncio.run(run_window(server.url, questions, long_prompt, args, engine.fields(True)))
            finally:
                server.stop()
            results[name] = {**summarize_run(found["long"], found["streams"]), "server": server.command}
        except (PeerNotReady, RuntimeError, ValueError, OSError) as err:
            if name == "vlmspec-serve":
                raise
            skipped[name] = " ".join(str(err).split())[:600]
            log(f"[stall] {name} left out: {skipped[name]}")
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_json(out / "long_prompt_stall.json", {"settings": settings, "skipped": skipped, "engines": results})
    text = report(results, skipped, args)
    write_text(out / "long_prompt_stall.md", text)
    print(text)
    return 0


def summarize_run(long: Timing, streams: list[list[Timing]]) -> dict:
    """Per phase (all streams together and each stream) the gaps' summary, the long request's TTFT and errors."""
    window = (long.sent_s, long.first_s if long.first_s is not None else long.done_s)
    per_stream = [
        merge_phases([phase_gaps(t.chunk_s, *window) for t in requests if t.error is None]) for requests in streams
    ]
    every = merge_phases(per_stream)
    errors = [t.error for requests in streams for t in requests if t.error] + ([long.error] if long.error else [])
    return {
        "long": {
            "ttft_s": long.ttft_s,
            "prompt_tokens": long.prompt_tokens,
            "completion_tokens": long.completion_tokens,
            "error": long.error,
        },
        "phases": {phase: summarize_gaps(every[phase]) for phase in PHASES},
        "streams": [{phase: summarize_gaps(gaps[phase]) for phase in PHASES} for gaps in per_stream],
        "requests": sum(len(r) for r in streams),
        "errors": errors[:10],
        "gaps_while_s": every["while"],
    }


def verdict(result: dict) -> str:
    """The longest wait of a running stream while the long prompt prefilled, against #45's bar."""
    worst = result["phases"]["while"]["max_s"]
    if worst is None:
        return "no gap fell in the prefill window (no stream was running: lengthen --lead-s or --max-tokens)"
    return f"longest wait while it prefilled {worst:.3f} s: {'within' if worst <= BAR_S else 'over'} the {BAR_S} s bar"


def report(results: dict[str, dict], skipped: dict[str, str], args: argparse.Namespace) -> str:
    lines = [
        f"{args.target}, {args.dtype}; vlmspec serve: --drafter {args.drafter or '(its default)'}"
        + "".join(f" {a}" for a in args.server_args)
        + f"; {args.streams} streams of short held-out questions (max_tokens {args.max_tokens}, greedy), then one "
        f"prompt of about {args.long_tokens} tokens; #45's bar: no gap over {BAR_S} s while it prefills "
        f"(goal {GOAL_S} s)",
        "",
    ]
    for name, result in results.items():
        long = result["long"]
        ttft = "none (failed)" if long["ttft_s"] is None else f"{long['ttft_s']:.2f} s"
        lines.append(
            f"- {name}: the long prompt's {long['prompt_tokens']} tokens, TTFT {ttft}; {verdict(result)}; "
            f"{result['requests']} short requests answered, {len(result['errors'])} errors"
            + (f" (first: {result['errors'][0][:200]})" if result["errors"] else "")
        )
    lines += [f"- {name}: not run: {why}" for name, why in skipped.items()]
    rows = [
        [name, phase, s["gaps"], s["median_s"], s["p99_s"], s["max_s"]]
        for name, result in results.items()
        for phase, s in result["phases"].items()
    ]
    per_stream = [
        [name, i + 1, *(s[p]["max_s"] for p in PHASES)]
        for name, result in results.items()
        for i, s in enumerate(result["streams"])
    ]
    lines += [
        "",
        markdown_table(["engine", "phase", "gaps", "median s", "p99 s", "max s"], rows, digits=3),
        "",
        "Per stream, its longest gap (s) before / while / after the prefill:",
        "",
        markdown_table(["engine", "stream", *PHASES], per_stream, digits=3),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
