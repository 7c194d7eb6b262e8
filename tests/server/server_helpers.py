"""Helpers of the server tests: a live vlmspec server on a free loopback port, in this process.

The server runs uvicorn on a thread; the engine runs on its own worker thread. The
target is tiny and random-init, the drafter a tiny random DSpark drafter, so outputs are
gibberish but exact: every greedy answer is compared with ``SpecEngine.generate``.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import uvicorn

from vlmspec.server import ServerConfig, create_app
from vlmspec.serving import BatchEngine

MODEL = "tiny-qwen2-vl"


@dataclass
class LiveServer:
    """A running server: its engine, its app (``app.state.worker`` / ``.metrics``) and its address."""

    engine: BatchEngine
    app: object
    url: str  # http://127.0.0.1:PORT
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(engine: BatchEngine, config: ServerConfig) -> LiveServer:
    app = create_app(engine, config)
    with socket.socket() as probe:  # a free port, chosen by the OS
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(engine, app, f"http://127.0.0.1:{port}", server, thread)


def data_url(image, size=(64, 64)) -> str:
    """A PIL image as a base64 PNG data: URL."""
    buffer = io.BytesIO()
    image.resize(size).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def http(url: str, body: object | None = None, raw: bytes | None = None) -> tuple[int, object]:
    """Plain HTTP (GET, or POST of ``body`` as JSON / ``raw`` bytes): (status, parsed JSON or text)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
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
