"""Helpers of the server tests: images as data URLs, plain HTTP, Prometheus samples, waiting.

The servers under test run in this process (``vlmspec.server.BackgroundServer``). The
target is tiny and random-init, the drafter a tiny random DSpark drafter, so outputs are
gibberish but exact: every greedy answer is compared with ``SpecEngine.generate``.
"""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.request

MODEL = "tiny-qwen2-vl"


def data_url(image, size=(64, 64)) -> str:
    """A PIL image as a base64 PNG data: URL."""
    buffer = io.BytesIO()
    image.resize(size).save(buffer, "PNG")
    return png_data_url(buffer.getvalue())


def png_data_url(data: bytes) -> str:
    """Encoded PNG bytes as a base64 data: URL."""
    return "data:image/png;base64," + base64.b64encode(data).decode()


def http(url: str, body: object | None = None, raw: bytes | None = None) -> tuple[int, object]:
    """Plain HTTP (GET, or POST of ``body`` as JSON / ``raw`` bytes): (status, parsed JSON or text)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            status, payload = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, payload = err.code, err.read().decode()
    try:
        return status, json.loads(payload)
    except json.JSONDecodeError:
        return status, payload


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0 if absent)."""
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def wait_until(condition, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds (the server settles on its own threads)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        time.sleep(0.02)
