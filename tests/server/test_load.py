"""A bounded load test: 32 concurrent clients against one live server on the tiny target.

The mix: plain and streamed requests (with and without an image), streams whose client
hangs up after two chunks, and malformed requests. Every well-formed answer must equal
SpecEngine's, no request may be lost or answered twice, the /metrics counters must add
up, and the process's memory after a round must be back within a margin of before it
(measured after two warm-up rounds of the same load, since the batch keeps its KV buffer
at its high-water size), and neither the engine nor the worker may hold anything of them.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc

import openai
import psutil
from server_helpers import MODEL, data_url, http, metric, wait_until

from vlmspec.engine import SpecEngine

PROMPTS = ["Describe the picture.", "Write a haiku about rain.", "List three colours.", "Hi", "Explain gravity."]
PLAIN, STREAMED, HANG_UPS, BAD = 12, 10, 5, 5  # 32 clients
MEMORY_MARGIN = 64 * 2**20  # bytes: allocator noise in a long test session; a coarse guard beside the exact checks
BAD_BODIES = [
    {"messages": []},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"},
    {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
        ]
    },
]


def well_formed(astronaut) -> list[dict]:
    """The 22 requests that must complete, each with its expected SpecEngine call."""
    requests = []
    for i in range(PLAIN + STREAMED):
        prompt, with_image = PROMPTS[i % len(PROMPTS)], i % 3 == 0
        parts = [{"type": "text", "text": prompt}]
        engine_parts = [{"type": "text", "text": prompt}]
        if with_image:
            parts.insert(0, {"type": "image_url", "image_url": {"url": data_url(astronaut, (64 + 16 * (i % 2), 64))}})
            engine_parts.insert(0, {"type": "image"})
        requests.append(
            dict(
                stream=i >= PLAIN,
                body=dict(messages=[{"role": "user", "content": parts}], max_tokens=6 + i % 7, temperature=0),
                engine=dict(
                    images=[astronaut.resize((64 + 16 * (i % 2), 64))] if with_image else None,
                    messages=[{"role": "user", "content": engine_parts}],
                    max_new_tokens=6 + i % 7,
                ),
            )
        )
    return requests


async def plain(client, body) -> dict:
    response = await client.chat.completions.create(model=MODEL, **body)
    return dict(
        id=response.id,
        text=response.choices[0].message.content,
        finish=response.choices[0].finish_reason,
        usage=response.usage,
    )


async def streamed(client, body) -> dict:
    stream = await client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **body
    )
    chunks = [chunk async for chunk in stream]
    return dict(
        id=chunks[0].id,
        text="".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        finish=[c.choices[0].finish_reason for c in chunks if c.choices][-1],
        usage=chunks[-1].usage,
        ids={c.id for c in chunks},
    )


async def hang_up(client, prompt: str) -> str:
    messages = [{"role": "user", "content": prompt}]
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1000, stream=True)
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 2:
            break
    await stream.close()
    return "hung up"


async def one_round(base_url: str, requests: list[dict]) -> tuple[list, list]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    answers = [streamed(client, r["body"]) if r["stream"] else plain(client, r["body"]) for r in requests]
    hang_ups = [hang_up(client, f"Go on forever, number {i}.") for i in range(HANG_UPS)]
    bad = [asyncio.to_thread(http, f"{base_url}/chat/completions", body) for body in BAD_BODIES]
    results = await asyncio.gather(*answers, *hang_ups, *bad)
    await client.close()
    return results[: len(requests)], results[len(requests) + HANG_UPS :]


def counters(live) -> dict[str, float]:
    text = http(f"{live.url}/metrics")[1]
    reasons = ("eos", "stop", "length", "abort", "error")
    values = {reason: metric(text, "vlmspec_requests_total", finish_reason=reason) for reason in reasons}
    values["finished"] = sum(values[reason] for reason in reasons)
    for name in ("vlmspec_prompt_tokens_total", "vlmspec_generation_tokens_total", "vlmspec_spec_rounds_total"):
        values[name] = metric(text, name)
    values["ttft"] = metric(text, "vlmspec_time_to_first_token_seconds_count")
    values["400"] = metric(text, "vlmspec_rejected_requests_total", status="400")
    values["running"] = metric(text, "vlmspec_num_requests_running")
    values["waiting"] = metric(text, "vlmspec_num_requests_waiting")
    return values


def resident_memory(process: psutil.Process) -> int:
    """RSS in bytes after collecting garbage and handing freed heap back to the OS (glibc), so only live memory counts."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then includes freed but cached heap
        pass
    return process.memory_info().rss


def settled(live) -> bool:
    return not live.engine.has_unfinished and live.app.state.worker.active == 0


def test_32_concurrent_clients_get_exact_answers_and_the_server_returns_to_rest(
    live, server_target, drafter, astronaut
):
    requests = well_formed(astronaut)
    reference = SpecEngine(server_target, drafter)
    expected = [reference.generate(**r["engine"]) for r in requests]  # while the server is idle
    hang_up_prompt_tokens = sum(
        server_target.build_inputs(None, f"Go on forever, number {i}.").length for i in range(HANG_UPS)
    )
    process = psutil.Process()

    for _ in range(3):  # two rounds warm up (buffers reach their high-water size); memory is compared around the third
        memory_before, before = resident_memory(process), counters(live)
        answers, bad = asyncio.run(one_round(live.base_url, requests))
        wait_until(lambda: settled(live))
        memory_after, after = resident_memory(process), counters(live)
        assert live.engine.num_results == 0 and live.app.state.worker.num_tracked == 0  # nothing left behind

        for request, answer, want in zip(requests, answers, expected):
            assert answer["text"] == want.text, request["body"]
            assert answer["finish"] == {"eos": "stop", "length": "length"}[want.finish_reason]
            assert answer["usage"].completion_tokens == len(want.token_ids)
            assert answer["usage"].prompt_tokens == want.prompt_tokens
            assert answer.get("ids", {answer["id"]}) == {answer["id"]}  # one id per streamed answer
        assert len({answer["id"] for answer in answers}) == len(answers)  # nobody got someone else's answer
        assert all(status == 400 and "error" in body for status, body in bad)

        delta = {name: after[name] - before[name] for name in after}
        assert delta["finished"] == len(requests) + HANG_UPS  # every admitted request finished exactly once
        assert delta["abort"] == HANG_UPS and delta["error"] == 0
        assert delta["400"] == BAD
        assert delta["ttft"] == len(requests) + HANG_UPS
        assert delta["vlmspec_prompt_tokens_total"] == sum(w.prompt_tokens for w in expected) + hang_up_prompt_tokens
        completed_tokens = sum(len(w.token_ids) for w in expected)
        assert completed_tokens + 2 * HANG_UPS <= delta["vlmspec_generation_tokens_total"] < completed_tokens + 1000
        assert after["running"] == after["waiting"] == 0
    growth = memory_after - memory_before
    assert growth < MEMORY_MARGIN, f"memory grew by {growth / 2**20:.1f} MiB over a round of the same load"
