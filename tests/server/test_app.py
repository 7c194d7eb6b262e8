"""The HTTP server through the official ``openai`` client: answers equal SpecEngine's, streamed or not.

Malformed requests go through plain HTTP, since the client refuses to send most of them.
"""

from __future__ import annotations

import io
import json
import urllib.request

import openai
import pytest
import torch
from image_helpers import bomb_png
from server_helpers import MODEL, data_url, http, metric, png_data_url, wait_until

from vlmspec.drafters import PerRequestProposer
from vlmspec.engine import SpecEngine
from vlmspec.server import BackgroundServer, ServerConfig
from vlmspec.serving import BatchEngine
from vlmspec.targets.inputs import ImageLimits
from vlmspec.types import DraftBlock


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def reference(server_target, drafter):
    """SpecEngine over the same target and drafter: the answer each request must get."""
    engine = SpecEngine(server_target, drafter)

    def generate(messages, images=None, **options):
        return engine.generate(images, messages=messages, **options)

    return generate


def user(text: str, image_url: str | None = None) -> list[dict]:
    """One OpenAI user message, and the same message as SpecEngine takes it."""
    parts = ([{"type": "image_url", "image_url": {"url": image_url}}] if image_url else []) + [
        {"type": "text", "text": text}
    ]
    return [{"role": "user", "content": parts}]


def engine_messages(text: str, with_image: bool) -> list[dict]:
    return [{"role": "user", "content": ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": text}]}]


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_a_greedy_answer_equals_spec_engine_generate(client, reference, astronaut, with_image):
    url = data_url(astronaut) if with_image else None
    response = client.chat.completions.create(
        model=MODEL, messages=user("Describe what you see.", url), max_tokens=14, temperature=0
    )
    images = [astronaut.resize((64, 64))] if with_image else None
    expected = reference(engine_messages("Describe what you see.", with_image), images=images, max_new_tokens=14)

    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == expected.prompt_tokens > 0
    assert response.usage.completion_tokens == len(expected.token_ids) == 14
    assert response.usage.total_tokens == response.usage.prompt_tokens + 14
    spec = response.model_extra["vlmspec"]
    assert spec["rounds"] == expected.stats.rounds and spec["tau"] == pytest.approx(expected.stats.tau, abs=1e-4)
    assert spec["accepted"] == expected.stats.accepted
    assert len(spec["acceptance_by_position"]) == len(expected.stats.acceptance_by_position)


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_a_streamed_greedy_answer_equals_spec_engine_generate(client, reference, astronaut, with_image):
    url = data_url(astronaut) if with_image else None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=user("Tell me a story.", url),
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    images = [astronaut.resize((64, 64))] if with_image else None
    expected = reference(engine_messages("Tell me a story.", with_image), images=images, max_new_tokens=16)

    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-2].model_extra["vlmspec"]["rounds"] == expected.stats.rounds


def test_a_conversation_with_system_and_assistant_turns_equals_spec_engine(client, reference):
    conversation = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "text", "text": "Another one?"}]},
    ]
    response = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=8, temperature=0)
    as_parts = [
        {
            "role": m["role"],
            "content": [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"],
        }
        for m in conversation
    ]
    assert response.choices[0].message.content == reference(as_parts, max_new_tokens=8).text


def test_the_event_stream_ends_with_done(live):
    body = {"messages": user("Hi"), "max_tokens": 4, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        f"{live.base_url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_ends_the_answer_and_is_left_out(client, reference):
    full = reference(engine_messages("Count to ten.", False), max_new_tokens=12).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "the tiny target's answer should have text to stop at"
    expected = full[: full.index(stop)]
    response = client.chat.completions.create(
        model=MODEL, messages=user("Count to ten."), max_tokens=12, temperature=0, stop=[stop]
    )
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=user("Count to ten."), max_tokens=12, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_sampling_with_a_seed_repeats_and_follows_the_parameters(client, reference):
    options = dict(model=MODEL, messages=user("Write a poem."), max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
    first = client.chat.completions.create(**options, extra_body={"top_k": 50})
    again = client.chat.completions.create(**options, extra_body={"top_k": 50})
    expected = reference(
        engine_messages("Write a poem.", False), max_new_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=7
    )
    assert first.choices[0].message.content == again.choices[0].message.content == expected.text


def test_models_health_and_metrics(live, client):
    assert [model.id for model in client.models.list()] == [MODEL]
    assert http(f"{live.url}/health") == (200, {"status": "ok", "active_requests": 0})
    status, text = http(f"{live.url}/metrics")
    assert status == 200
    for name in (
        "vlmspec_requests_total",
        "vlmspec_generation_tokens_total",
        "vlmspec_spec_tau",
        "vlmspec_num_requests_waiting",
        "vlmspec_kv_cache_blocks_used",
        "vlmspec_kv_cache_usage_ratio",
        "vlmspec_prefix_cache_hit_rate",
        "vlmspec_time_to_first_token_seconds_count",
    ):
        assert name in text


def test_a_repeated_conversation_reports_its_cached_prompt_tokens_and_the_hit_rate(live, client, astronaut):
    history = user("What is in this picture? Answer in one long sentence, please.", data_url(astronaut))
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0)
    follow = [*history, {"role": "assistant", "content": first.choices[0].message.content}, *user("And then?")]
    second = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens  # whole blocks of the first turn, never the last token
    text = http(f"{live.url}/metrics")[1]
    assert metric(text, "vlmspec_prefix_cache_hit_tokens") >= cached
    assert 0 < metric(text, "vlmspec_prefix_cache_hit_rate") <= 1


BAD_REQUESTS = {
    "not json": (None, b"{not json"),
    "not an object": ([1, 2], None),
    "no messages": ({"messages": []}, None),
    "a message without content": ({"messages": [{"role": "user"}]}, None),
    "an unknown role": ({"messages": [{"role": "robot", "content": "hi"}]}, None),
    "max_tokens as a string": ({"messages": user("hi"), "max_tokens": "5"}, None),
    "max_tokens zero": ({"messages": user("hi"), "max_tokens": 0}, None),
    "max_tokens over the context": ({"messages": user("hi"), "max_tokens": 10**6}, None),
    "temperature out of range": ({"messages": user("hi"), "temperature": 3.5}, None),
    "top_p zero": ({"messages": user("hi"), "top_p": 0}, None),
    "stream as a string": ({"messages": user("hi"), "stream": "yes"}, None),
    "five stop strings": ({"messages": user("hi"), "stop": ["a", "b", "c", "d", "e"]}, None),
    "an empty stop string": ({"messages": user("hi"), "stop": ["a", ""]}, None),
    "n zero": ({"messages": user("hi"), "n": 0}, None),
    "a participant's name": ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, None),
    "an unknown field": ({"messages": user("hi"), "frobnicate": 1}, None),
    "an unknown field in a message": ({"messages": [{"role": "user", "content": "hi", "refusal": None}]}, None),
    "logprobs": ({"messages": user("hi"), "logprobs": True}, None),
    "NaN": (None, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    "a logit_bias id outside the vocabulary": ({"messages": user("hi"), "logit_bias": {"99999999": 1}}, None),
    "a logit_bias over 100": ({"messages": user("hi"), "logit_bias": {"11": 101}}, None),
    "n over the limit": ({"messages": user("hi"), "n": 9}, None),
    "no user content": ({"messages": [{"role": "system", "content": "be brief"}]}, None),
    "a remote image": ({"messages": user("hi", "https://example.com/cat.png")}, None),
    "an unreadable image": ({"messages": user("hi", "data:image/png;base64,aGVsbG8=")}, None),
    "bad base64": ({"messages": user("hi", "data:image/png;base64,***")}, None),
    "a decompression bomb": ({"messages": user("hi", png_data_url(bomb_png(20_000, 20_000)))}, None),
    "an image over the pixel limit": ({"messages": user("hi", png_data_url(bomb_png(8000, 6000)))}, None),
    "a local path": ({"messages": user("hi", "/etc/hostname")}, None),
    "a prompt over the context": ({"messages": user("hello " * 3000)}, None),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_malformed_request_gets_a_400_with_an_openai_error_body(live, case):
    body, raw = BAD_REQUESTS[case]
    status, answer = http(f"{live.base_url}/chat/completions", body, raw)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and isinstance(error["message"], str) and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_the_server_keeps_serving_after_bad_requests_and_counts_them(live, client):
    before = metric(http(f"{live.url}/metrics")[1], "vlmspec_rejected_requests_total", status="400")
    http(f"{live.base_url}/chat/completions", raw=b"][")
    response = client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=3, temperature=0)
    assert response.usage.completion_tokens == 3
    after = metric(http(f"{live.url}/metrics")[1], "vlmspec_rejected_requests_total", status="400")
    assert after == before + 1


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=user("Hi"), max_tokens=3)


def test_the_openai_client_sees_bad_parameters_as_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="remote image URLs are not fetched"):
        client.chat.completions.create(model=MODEL, messages=user("Hi", "http://example.com/a.png"), max_tokens=3)


def test_local_images_only_from_the_allowed_folder(server_target, drafter, astronaut, tmp_path, reference):
    allowed = tmp_path / "media"
    allowed.mkdir()
    astronaut.resize((64, 64)).save(allowed / "astronaut.png")
    astronaut.resize((64, 64)).save(tmp_path / "outside.png")
    server = BackgroundServer(BatchEngine(server_target, drafter), ServerConfig(MODEL, allowed_media=allowed)).start()
    try:
        url = f"{server.base_url}/chat/completions"
        for path in (str(allowed / "astronaut.png"), (allowed / "astronaut.png").as_uri()):
            status, answer = http(url, {"messages": user("Describe it.", path), "max_tokens": 6, "temperature": 0})
            assert status == 200, answer
        expected = reference(
            engine_messages("Describe it.", True), images=[astronaut.resize((64, 64))], max_new_tokens=6
        )
        assert answer["choices"][0]["message"]["content"] == expected.text
        for path in (str(tmp_path / "outside.png"), str(allowed / ".." / "outside.png"), str(allowed / "missing.png")):
            status, answer = http(url, {"messages": user("Describe it.", path), "max_tokens": 6})
            assert status == 400 and answer["error"]["param"] == "messages[0].content[0].image_url.url", answer
    finally:
        server.stop()


def test_a_full_server_answers_429_and_never_hangs(server_target, drafter):
    server = BackgroundServer(
        BatchEngine(server_target, drafter, max_batch_size=1), ServerConfig(MODEL, max_queued=1)
    ).start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
        streams = [
            client.chat.completions.create(model=MODEL, messages=user("Go on."), max_tokens=400, stream=True)
            for _ in range(2)
        ]
        with pytest.raises(openai.RateLimitError, match="at capacity"):
            client.chat.completions.create(model=MODEL, messages=user("One more."), max_tokens=3)
        for stream in streams:
            stream.close()
        assert metric(http(f"{server.url}/metrics")[1], "vlmspec_rejected_requests_total", status="429") == 1
        wait_until(lambda: server.app.state.worker.active == 0)
        response = client.chat.completions.create(model=MODEL, messages=user("Now?"), max_tokens=3)
        assert response.usage.completion_tokens == 3
    finally:
        server.stop()


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(live, client):
    before = metric(http(f"{live.url}/metrics")[1], "vlmspec_requests_total", finish_reason="abort")
    stream = client.chat.completions.create(model=MODEL, messages=user("Go on and on."), max_tokens=1500, stream=True)
    for _, _ in zip(stream, range(3)):  # read a few chunks, then hang up
        pass
    stream.close()
    wait_until(lambda: not live.engine.has_unfinished and live.app.state.worker.active == 0)
    text = http(f"{live.url}/metrics")[1]
    assert metric(text, "vlmspec_requests_total", finish_reason="abort") == before + 1
    assert metric(text, "vlmspec_num_requests_running") == 0


class ExplodingDrafter(PerRequestProposer):
    """Drafts the anchor again, except for prompts that mention KABOOM: those make it raise."""

    max_draft_tokens = 1

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def new_state(self) -> dict:
        return {"prompt": None}

    def propose_one(self, state, update, params, generator) -> DraftBlock:
        state["prompt"] = state["prompt"] or self.tokenizer.decode(update.token_ids)
        if "KABOOM" in state["prompt"]:
            raise RuntimeError("the drafter exploded")
        return DraftBlock(update.token_ids[-1:].reshape(1, 1).to(torch.long), torch.tensor([1]))


def test_a_request_that_fails_gets_a_500_and_the_others_are_served(server_target, caplog):
    """The 500 names the request id, never the exception; the server's log has the exception under that id."""
    engine = BatchEngine(server_target, ExplodingDrafter(server_target.tokenizer), max_batch_size=4)
    with BackgroundServer(engine, ServerConfig(MODEL)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
        with pytest.raises(openai.InternalServerError, match="generation failed inside the server") as failed:
            client.chat.completions.create(model=MODEL, messages=user("KABOOM"), max_tokens=5)
        request_id = failed.value.response.headers["x-request-id"]
        assert f"request id {request_id}" in failed.value.message and "exploded" not in failed.value.message
        assert any(request_id in r.getMessage() and "exploded" in str(r.exc_info) for r in caplog.records)
        with pytest.raises(openai.APIError, match="generation failed inside the server"):
            list(client.chat.completions.create(model=MODEL, messages=user("KABOOM!"), max_tokens=5, stream=True))
        response = client.chat.completions.create(model=MODEL, messages=user("Fine?"), max_tokens=5, temperature=0)
        assert response.usage.completion_tokens == 5
        assert metric(http(f"{server.url}/metrics")[1], "vlmspec_requests_total", finish_reason="error") == 2
        assert http(f"{server.url}/health")[0] == 200


class Fatal(BaseException):
    """Not an Exception: nothing in the engine may swallow it, so it stops the engine thread."""


class FatalDrafter(ExplodingDrafter):
    def propose_one(self, state, update, params, generator) -> DraftBlock:
        raise Fatal("the machine caught fire")


def test_a_dead_engine_thread_answers_503_and_says_why(server_target):
    engine = BatchEngine(server_target, FatalDrafter(server_target.tokenizer))
    with BackgroundServer(engine, ServerConfig(MODEL)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
        with pytest.raises(openai.APIStatusError, match="the engine thread died of Fatal") as failed:
            client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=5)
        assert failed.value.status_code == 503 and "caught fire" not in failed.value.message  # its text: in the log
        status, health = http(f"{server.url}/health")
        assert status == 503 and health["status"] == "dead" and "died of Fatal" in health["error"]
        with pytest.raises(openai.APIStatusError, match="the engine is not running") as refused:
            client.chat.completions.create(model=MODEL, messages=user("Hi again"), max_tokens=5)
        assert refused.value.status_code == 503


def test_an_unreadable_image_gets_a_fix_an_http_client_can_apply(live):
    body = {"messages": user("hi", "data:image/png;base64,aGVsbG8=")}  # "hello": valid base64, not an image
    status, answer = http(f"{live.base_url}/chat/completions", body)
    message = answer["error"]["message"]
    assert status == 400 and "base64 data: URL" in message
    assert "BytesIO" not in message and "PIL" not in message


def test_a_decompression_bomb_gets_a_400_naming_the_limit_and_the_server_keeps_serving(live, client):
    body = {"messages": user("hi", png_data_url(bomb_png(20_000, 20_000)))}  # 400 megapixels in 50 kB
    status, answer = http(f"{live.base_url}/chat/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert error["code"] == "image_too_large" and error["param"] == "messages[0].content[0].image_url.url"
    assert "over the server's limit of 40,000,000" in error["message"] and "--max-image-pixels" in error["message"]
    response = client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=3, temperature=0)
    assert response.usage.completion_tokens == 3


def test_images_over_the_configured_limits_get_a_400_before_decoding(server_target, drafter, astronaut, tmp_path):
    photo = io.BytesIO()
    astronaut.resize((64, 64)).save(photo, "PNG")
    (tmp_path / "photo.png").write_bytes(photo.getvalue())
    (tmp_path / "black.png").write_bytes(bomb_png(64, 64))
    limits = ImageLimits(max_bytes=len(bomb_png(64, 64)) + 100, max_pixels=64 * 64)
    assert len(photo.getvalue()) > limits.max_bytes
    config = ServerConfig(MODEL, allowed_media=tmp_path, image_limits=limits)
    with BackgroundServer(BatchEngine(server_target, drafter), config) as server:
        url = f"{server.base_url}/chat/completions"
        refused = {
            "--max-image-bytes": [png_data_url(photo.getvalue()), str(tmp_path / "photo.png")],
            "--max-image-pixels": [png_data_url(bomb_png(65, 64))],
        }
        for flag, images in refused.items():
            for image in images:
                status, answer = http(url, {"messages": user("Describe it.", image), "max_tokens": 2})
                assert status == 400 and answer["error"]["code"] == "image_too_large", answer
                assert flag in answer["error"]["message"], answer
        for image in (png_data_url(bomb_png(64, 64)), str(tmp_path / "black.png")):  # at the limits: served
            status, answer = http(url, {"messages": user("Describe it.", image), "max_tokens": 2})
            assert status == 200, answer


def test_an_answer_the_context_cuts_short_says_so(live, server_target, client):
    """OpenAI's "length", plus ``vlmspec.finish_reason == "context"`` and a message naming the fix."""
    phrase = "one two three four five six seven eight nine ten "
    length = lambda text: server_target.build_inputs(None, messages=engine_messages(text, False)).length  # noqa: E731
    per_phrase = length(phrase * 2) - length(phrase)
    words = phrase * ((server_target.max_context - 20 - (length(phrase) - per_phrase)) // per_phrase)
    room = server_target.max_context - length(words) + 1
    assert 0 < room < 64, "the prompt should leave a few tokens of context"
    response = client.chat.completions.create(model=MODEL, messages=user(words), max_tokens=64, temperature=0)
    spec = response.model_extra["vlmspec"]
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens <= room
    assert (
        spec["finish_reason"] == "context" and "context window" in spec["message"] and "max_tokens" in spec["message"]
    )
    short = client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.model_extra["vlmspec"]["finish_reason"] == "length"
    assert "message" not in short.model_extra["vlmspec"]
