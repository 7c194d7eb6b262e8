"""Hostile and careless clients (issue #44): every case of ``benchmarks/hostile_clients.py``, in CI.

A server in this process, on the tiny target, with small limits so each case is cheap. Each
case must get its expected answer (a 4xx naming the limit or the field, or the honoured
answer), no error body may carry a path or a traceback, no answer is a 5xx, and a normal
request right after must still get the same answer as before. The memory each case costs
is measured against a real ``vlmspec serve`` by the benchmark (``docs/serving.md``, "Limits").
"""

from __future__ import annotations

import base64
import json

import openai
import pytest
from PIL import EpsImagePlugin
from server_helpers import MODEL, http, metric

from benchmarks.hostile_clients import (
    API_KEY,
    CASES,
    CI_SCALE,
    EPS,
    LEAKS,
    NORMAL,
    Client,
    Limits,
    abandoned_stream,
    run_cases,
)
from vlmspec.server import BackgroundServer, RequestLimits, ServerConfig
from vlmspec.server.protocol import REFUSED, choice_seed
from vlmspec.serving import BatchEngine
from vlmspec.targets.inputs import ImageLimits

LIMITS = RequestLimits(
    max_body_bytes=2 * 1024 * 1024, max_images=4, max_total_pixels=120_000, max_prompt_tokens=200, max_choices=4
)
IMAGE_LIMITS = ImageLimits(max_bytes=512 * 1024, max_pixels=50_000)
MAX_BATCH, MAX_QUEUED = 2, 1


@pytest.fixture(scope="module")
def hostile(server_target):
    config = ServerConfig(
        MODEL, max_queued=MAX_QUEUED, image_limits=IMAGE_LIMITS, limits=LIMITS, api_key=API_KEY, default_max_tokens=8
    )
    server = BackgroundServer(BatchEngine(server_target, max_batch_size=MAX_BATCH), config).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(hostile):
    return Client(hostile.url)


@pytest.fixture(scope="module")
def limits(server_target):
    return Limits(
        request=LIMITS,
        image=IMAGE_LIMITS,
        max_places=MAX_BATCH + MAX_QUEUED,
        prompt_cap=LIMITS.prompt_tokens(server_target.max_context),
        longest_token=max(map(len, server_target.tokenizer.get_vocab())),
    )


def test_every_hostile_case_gets_its_answer_and_the_server_serves_on(client, limits, monkeypatch):
    eps_opened = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda self: eps_opened.append(1))
    rows = run_cases(client, CI_SCALE, limits)
    assert [row["case"] for row in rows] == [case.name for case in CASES]
    for row in rows:
        assert row["passed"], row
        assert row["normal_request_after"], row
        assert not row["leaks"] and not row["server_errors"], row
    assert not eps_opened  # refused from its first bytes: Pillow's EPS plugin (and Ghostscript) never ran


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_refused_field_is_a_400_naming_it_and_its_neutral_value_is_served(client, name):
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False}
    used = {"logprobs": True, "top_logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    answer = client.chat({**NORMAL, name: used.get(name, {"not": "neutral"})})
    if name != "parallel_tool_calls":  # meaningless without tools, so any value is taken
        assert answer.status == 400 and answer.json()["error"]["param"] == name, answer.body
    if name in neutral:
        assert client.chat({**NORMAL, name: neutral[name]}).status == 200


def test_n_choices_are_independent_requests_with_derived_seeds(client):
    """Choice i is what a request with seed + i gets alone; streamed, the choices' chunks say their index."""
    sampled = {**NORMAL, "temperature": 0.9, "seed": 41}
    together = client.chat({**sampled, "n": 3}).json()
    alone = [client.chat({**sampled, "seed": choice_seed(41, i)}).json() for i in range(3)]
    assert [c["message"]["content"] for c in together["choices"]] == [
        a["choices"][0]["message"]["content"] for a in alone
    ]
    assert together["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    assert together["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    openai_client = openai.OpenAI(base_url=f"{client.url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=NORMAL["messages"], max_tokens=8, temperature=0.9, seed=41, n=3, stream=True
    )
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [a["choices"][0]["message"]["content"] for a in alone]


def test_a_low_detail_image_is_scaled_to_fit_512(client, astronaut):
    """OpenAI's detail "low": the image is scaled to fit 512 x 512 first, so it takes fewer vision tokens."""
    import io

    def prompt_tokens(detail: str | None) -> int:
        buffer = io.BytesIO()
        astronaut.resize((600, 80)).save(buffer, "PNG")  # under the per-image limit, wider than 512
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        part = {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
        body = {**NORMAL, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}]}
        return client.chat(body).json()["usage"]["prompt_tokens"]

    assert prompt_tokens("low") < prompt_tokens(None) == prompt_tokens("high")


def test_the_api_key_guards_every_endpoint_but_health(hostile):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=hostile.base_url, api_key="wrong", max_retries=0).models.list()
    served = openai.OpenAI(base_url=hostile.base_url, api_key=API_KEY, max_retries=0, timeout=600)
    assert served.models.list().data[0].id == MODEL
    assert http(f"{hostile.url}/health")[0] == 200
    status, body = http(f"{hostile.url}/metrics")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_a_body_over_the_cap_is_refused_before_it_is_read(client):
    """Content-Length over the cap: 413 at once; the bytes the client would send are never awaited."""
    answer = client.exchange("POST", "/v1/chat/completions", iter(()), length=LIMITS.max_body_bytes + 1)
    assert answer.status == 413 and "--max-request-bytes" in answer.body


def test_an_abandoned_stream_is_freed_and_metrics_show_it(hostile, client):
    before = metric(client.get("/metrics").body, "vlmspec_requests_total", finish_reason="abort")
    row = abandoned_stream(client, CI_SCALE, Limits(max_places=MAX_BATCH + MAX_QUEUED))
    assert row.passed, row.observed
    text = client.get("/metrics").body
    assert metric(text, "vlmspec_requests_total", finish_reason="abort") == before + 1
    assert metric(text, "vlmspec_num_requests_running") == 0 and not hostile.engine.has_unfinished


def test_no_error_body_names_a_path(client, tmp_path):
    """Local paths are refused without echoing them (the server's folders are nobody's business)."""
    for url in (str(tmp_path / "secret.png"), f"file://{tmp_path}/secret.png", "/etc/passwd"):
        message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
        answer = client.chat({**NORMAL, "messages": [message]})
        assert answer.status == 400 and str(tmp_path) not in answer.body and not LEAKS.search(answer.body)
    assert json.loads(client.chat({**NORMAL, "messages": [{"role": "user", "content": "x"}]}).body)["choices"]
    assert EPS.startswith(b"%!PS")  # the case list sends a real EPS header
