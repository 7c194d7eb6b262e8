"""The prefix/TTFT workloads (``benchmarks/prefix_ttft.py``) through HTTP servers: vlmspec serve, llama-server, vLLM.

Each engine is a server process from ``benchmarks/peer_process.py``, asked through its OpenAI
chat endpoint (streamed; the time to first token is the client's, from sending the request to
the first content chunk). Greedy (temperature 0), the same messages for every engine; every
server answers one short unrelated warm-up request before it is timed (first-call costs).

Warm and cold, per engine (its :class:`Engine`'s ``cold`` field says which):

* ``vlmspec-serve``: warm is one server that served the earlier turns; cold is a freshly
  started server for every cold request (``vlmspec serve`` has no flag that empties its caches).
* ``llama-cpp``: ``llama-server -np SLOTS`` on the reference target's GGUF (its language model,
  the same token ids), warm requests with ``cache_prompt: true`` (the slot keeps the prompt's KV
  and reuses the common prefix); cold requests go to a second server with ``cache_prompt:
  false`` (the prompt is computed whole). Text only: its vision path does not compute this
  tower's image features (docs/benchmarks.md, the ``--images`` smoke run of #32).
* ``vllm``: ``vllm serve`` of vLLM's CPU build (its own venv) with automatic prefix caching on
  for warm; cold is a second server started with ``--no-enable-prefix-caching``.

The chat with an image runs on the engines whose vision path serves this tower (an
:class:`Engine`'s ``images``); the same chat without the image runs on every engine, so that
llama.cpp has a row. One warm server per engine (and one cold, where it turns its cache off)
serves all three scenarios (:func:`run_engine`): vLLM takes minutes to start on 2 cores.
``benchmarks/long_prompt_stall.py`` starts its peers through :func:`make_engine` too.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peer_process import PeerProcess, Timing, image_data_url, openai_client, stream_chat

WARM_UP = [{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}]


@dataclass(frozen=True)
class Engine:
    """How to start one engine's servers and what its warm and cold requests carry."""

    name: str
    start: Callable[[bool], PeerProcess]  # cache on (warm) or off (cold): a launched, not yet ready, server
    cold: str  # "fresh process" (a new server for every cold request) or "cache off" (one server, caching off)
    images: bool  # its vision path computes this tower's image features
    fields: Callable[[bool], dict]  # request fields beyond OpenAI's for warm (True) or cold (False)


ENGINES = ("vlmspec-serve", "llama-cpp", "vllm")


def make_engine(name: str, args: Any, log_dir: Path, *, context: int = 4096, slots: int | None = None) -> Engine:
    """The :class:`Engine` called ``name`` (one of :data:`ENGINES`) for the run's target, dtype and threads.

    ``context`` is the longest prompt and answer one request may hold (each llama.cpp slot's context,
    vLLM's ``--max-model-len``); ``slots`` is llama-server's ``-np`` (default ``args.llama_slots``).

    Raises ``ValueError`` (with how to fix it) when a peer cannot serve this target, and whatever
    locating llama.cpp or its GGUF raises when it is missing.
    """
    from benchmarks.peer_process import vllm_serve, vlmspec_serve

    if name == "vlmspec-serve":
        extra = list(args.server_args)

        def start_vlmspec(cache: bool) -> PeerProcess:
            server = f"vlmspec-{'warm' if cache else 'cold'}"
            return vlmspec_serve(
                server, target=args.target, dtype=args.dtype, drafter=args.drafter, extra=extra, log_dir=log_dir
            ).launch()

        return Engine(name, start_vlmspec, "fresh process", True, lambda cache: {})
    if args.target != "reference":
        raise ValueError(f"{name} serves the reference target's own weights only: pass --target reference")
    if name == "vllm":
        from vlmspec.reference import reference_target_dir

        def start_vllm(cache: bool) -> PeerProcess:
            extra = [] if cache else ["--no-enable-prefix-caching"]
            return vllm_serve(
                f"vllm-{'warm' if cache else 'cold'}",
                model=reference_target_dir(),
                dtype=args.dtype,
                threads=args.threads,
                log_dir=log_dir,
                extra=["--enable-prefix-caching", *extra] if cache else extra,
                max_model_len=context,
                images=True,
            ).launch()

        return Engine(name, start_vllm, "cache off", True, lambda cache: {})
    if name == "llama-cpp":
        from benchmarks import llama_cpp_peer
        from vlmspec.loading import load_target

        llama_cpp = llama_cpp_peer.locate_llama_cpp(args.llama_cpp)
        target = load_target("reference", dtype=args.dtype)
        gguf = llama_cpp_peer.reference_ggufs(target, args.dtype, llama_cpp, quantized=False)[llama_cpp_peer.EXACT]
        del target
        slots = slots or args.llama_slots
        server_args = llama_cpp_peer.server_args(gguf, args.threads, context=context * slots)

        def start_llama(cache: bool) -> PeerProcess:
            return llama_cpp_peer.LlamaServer(
                llama_cpp.binary("llama-server"),
                server_args,
                work_dir=log_dir,
                name=f"llama-{'warm' if cache else 'cold'}",
                parallel=slots,
            ).launch()

        return Engine(name, start_llama, "cache off", False, lambda cache: {"extra_body": {"cache_prompt": cache}})
    raise ValueError(f"unknown engine {name!r}: pick from {', '.join(ENGINES)}")


def ready(server: PeerProcess, timeout: float) -> PeerProcess:
    """Wait for ``server`` and send it the warm-up request; a server that fails is stopped and raises."""
    try:
        server.wait_ready(timeout)
        warm_up = ask(server, WARM_UP, 4, {})
        if warm_up.error is not None:
            raise RuntimeError(f"the warm-up request failed: {warm_up.error}")
    except BaseException:
        server.stop()
        raise
    return server


def ask(server: PeerProcess, messages: list[dict], max_tokens: int, fields: dict) -> Timing:
    """One greedy streamed request to ``server``, timed by the client."""

    async def one() -> Timing:
        client = openai_client(server.url)
        try:
            return await stream_chat(
                client, {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}
            )
        finally:
            await client.close()

    return asyncio.run(one())


def run_engine(engine: Engine, picture, chat_questions: Sequence[str], system: str, system_questions, args: Any):
    """Every scenario on ``engine``, one scenario after another on the same servers: ``{scenario: rows}``.

    The warm server (and the cold one, where the engine turns its cache off) stays up through all of
    them: their prompts share no more than the chat template's first tokens, so nothing one
    scenario leaves in a cache serves the next.
    """
    warm = ready(engine.start(True), args.startup_timeout)
    cold = None
    try:
        cold = None if engine.cold == "fresh process" else ready(engine.start(False), args.startup_timeout)
        found = {}
        if engine.images:
            found["image chat"] = http_chat(engine, warm, cold, picture, chat_questions, args)
        found["text chat"] = http_chat(engine, warm, cold, None, chat_questions, args)
        found["system prompt"] = http_system(engine, warm, system, system_questions, args)
        return found
    finally:
        for server in (warm, cold):
            if server is not None:
                server.stop()


def http_chat(engine: Engine, warm: PeerProcess, cold, picture, questions: Sequence[str], args: Any) -> list[dict]:
    """A multi-turn chat (about ``picture`` when given): each turn to ``warm`` and cold, alternating which first.

    Cold is ``cold`` (a server with its cache off) or, where it is None, a freshly started server
    for each cold request. The answer appended to the history is the warm server's. Returns per
    turn: ``warm`` and ``cold`` TTFT seconds, their ``ratio`` and whether the answers are the ``same``.
    """
    history, rows = [], []
    for turn, question in enumerate(questions, start=1):
        content = [{"type": "text", "text": question}]
        if turn == 1 and picture is not None:
            content.insert(0, {"type": "image_url", "image_url": {"url": image_data_url(picture)}})
        messages = [*history, {"role": "user", "content": content}]
        answers = {}
        for kind in ("warm", "cold") if turn % 2 else ("cold", "warm"):
            server = warm if kind == "warm" else cold or ready(engine.start(False), args.startup_timeout)
            try:
                answers[kind] = ask(server, messages, args.max_new_tokens, engine.fields(kind == "warm"))
            finally:
                if server is not warm and server is not cold:
                    server.stop()
        history = [*messages, {"role": "assistant", "content": answers["warm"].text}]
        rows.append(turn_row(turn, answers["warm"], answers["cold"]))
    return rows


def http_system(engine: Engine, server: PeerProcess, system: str, questions: Sequence[str], args: Any) -> list[dict]:
    """``questions`` one after another behind one ``system`` prompt on ``server``: each TTFT and its ratio to the
    first's."""
    timings = []
    for question in questions:
        messages = [
            {"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "text", "text": question}]},
        ]
        timings.append(ask(server, messages, args.max_new_tokens, engine.fields(True)))
    return system_rows([t.ttft_s for t in timings], [t.error for t in timings])


# ---------------------------------------------------------------------------------- the table maths
def turn_row(turn: int, warm: Timing, cold: Timing) -> dict:
    """One chat turn's row: both TTFTs, warm / cold, whether the answers agree, and any error."""
    error = warm.error or cold.error
    return {
        "turn": turn,
        "warm": warm.ttft_s,
        "cold": cold.ttft_s,
        "ratio": ratio(warm.ttft_s, cold.ttft_s),
        "same": error is None and warm.text == cold.text,
        **({"error": error[:300]} if error else {}),
    }


def system_rows(ttfts: Sequence[float | None], errors: Sequence[str | None] = ()) -> list[dict]:
    """Each request's TTFT and its ratio to the first request's (None where either is missing)."""
    rows = []
    for i, seconds in enumerate(ttfts):
        row = {"request": i + 1, "ttft": seconds, "ratio_to_first": ratio(seconds, ttfts[0])}
        if i < len(errors) and errors[i]:
            row["error"] = errors[i][:300]
        rows.append(row)
    return rows


def median_of_repeats(runs: Sequence[Sequence[dict]]) -> list[dict]:
    """Several repeats of one scenario's rows merged row by row: each number the median over the repeats.

    A ratio is each repeat's own (its warm and cold ran side by side) and then the median of those;
    ``same`` holds only where every repeat's answers agreed; the first error is kept.
    """
    merged = []
    for rows in zip(*runs, strict=True):
        row = {"repeats": len(rows)}
        for field, value in rows[0].items():
            if field in ("turn", "request"):
                row[field] = value
            elif field == "same":
                row[field] = all(r[field] for r in rows)
            elif field != "error":
                found = [r[field] for r in rows if r.get(field) is not None]
                row[field] = statistics.median(found) if found else None
        errors = [r["error"] for r in rows if r.get("error")]
        if errors:
            row["error"] = errors[0]
        merged.append(row)
    return merged


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def median_later_ratio(rows: Sequence[dict]) -> float | None:
    """The median of requests 2..N's ratios to the first (issue #45's bar: at most 0.4)."""
    later = [r["ratio_to_first"] for r in rows[1:] if r["ratio_to_first"] is not None]
    return statistics.median(later) if later else None


def chat_table(results: dict[str, list[dict]]) -> tuple[list[str], list[list]]:
    """Headers and rows of a chat scenario side by side: per turn, each engine's warm and cold TTFT and warm / cold."""
    engines = list(results)
    headers = ["turn"] + [f"{e} {column}" for e in engines for column in ("warm s", "cold s", "warm/cold")]
    turns = sorted({r["turn"] for rows in results.values() for r in rows})
    table = []
    for turn in turns:
        row: list = [turn]
        for engine in engines:
            found = next((r for r in results[engine] if r["turn"] == turn), {})
            ratio_cell = found.get("ratio")
            if found and not found.get("same", True):
                ratio_cell = f"{ratio_cell:.2f} (answers differ)" if ratio_cell is not None else "answers differ"
            row += [found.get("warm"), found.get("cold"), ratio_cell]
        table.append(row)
    return headers, table


def system_table(results: dict[str, list[dict]]) -> tuple[list[str], list[list]]:
    """Headers and rows of the shared-system-prompt scenario: per request, each engine's TTFT and its ratio to the
    first, and a last row with each engine's median ratio of requests 2..N."""
    engines = list(results)
    headers = ["request"] + [f"{e} {column}" for e in engines for column in ("TTFT s", "/ first")]
    count = max((len(rows) for rows in results.values()), default=0)
    table = []
    for i in range(count):
        row: list = [i + 1]
        for engine in engines:
            found = results[engine][i] if i < len(results[engine]) else {}
            row += [found.get("ttft"), found.get("ratio_to_first")]
        table.append(row)
    if count > 1:
        table.append([f"median 2..{count}"] + [v for e in engines for v in (None, median_later_ratio(results[e]))])
    return headers, table
