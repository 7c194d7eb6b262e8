"""A server on a thread of this process: for tests, benchmarks and notebooks.

>>> with BackgroundServer(engine, ServerConfig("my-model")) as server:
...     client = openai.OpenAI(base_url=server.base_url, api_key="unused")

The port is a free one the OS picks (unless given); ``app.state.worker`` and
``app.state.metrics`` are the engine's worker and the server's metrics.
"""

from __future__ import annotations

import socket
import threading
import time

from vlmspec.server.app import ServerConfig, create_app
from vlmspec.serving.engine import BatchEngine


class BackgroundServer:
    """uvicorn serving ``create_app(engine, config)`` on a daemon thread, on the loopback interface by default."""

    def __init__(
        self, engine: BatchEngine, config: ServerConfig | None = None, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        import uvicorn

        self.engine = engine
        self.app = create_app(engine, config)
        self.port = port or _free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="vlmspec-http", daemon=True)

    @property
    def base_url(self) -> str:
        """Where OpenAI clients point: ``http://HOST:PORT/v1``."""
        return f"{self.url}/v1"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url} (is the port taken?)")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting connections, abort what is unfinished, end both threads."""
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
