"""Server processes the benchmarks run beside vlmspec: launched, waited for and stopped by one class.

Every server a benchmark starts is a :class:`PeerProcess`: ``llama-server``
(``benchmarks/llama_cpp_peer.py``'s ``LlamaServer`` adds llama.cpp's ``/completion`` client to it),
``vllm serve`` and ``vlmspec serve`` (``benchmarks/serving.py``). Each is a child process on a free
loopback port (:func:`free_port`), its output in a log file, ready once ``GET /health`` answers 200
(llama-server answers 503 while it loads the model), stopped with SIGTERM, then SIGKILL. A server
that exits or does not get ready in time raises :class:`PeerNotReady` with its log's last lines.

``launch`` and ``wait_ready`` are separate so that a benchmark can start several servers and let
them load side by side; ``start`` (and ``with``) does both.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from http.client import HTTPException
from pathlib import Path

START_TIMEOUT_S = 300.0


class PeerNotReady(RuntimeError):
    """A server process that exited, or did not answer ``/health`` in time; the message ends with its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS has free on ``host`` now (another process could take it before the server binds it)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class PeerProcess:
    """One server child process on ``http://127.0.0.1:port`` (a context manager: started on entry, stopped on exit).

    ``command`` must make the server listen on ``port``; its stdout and stderr go to ``log_path``;
    ``env`` replaces the environment when given.
    """

    def __init__(
        self, name: str, command: Sequence[str], *, port: int, log_path: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.command = [str(part) for part in command]
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> PeerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def launch(self) -> PeerProcess:
        """Start the process and return at once (see :meth:`wait_ready`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:  # the child holds its own descriptor of the log
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Return once ``/health`` answers 200; raise :class:`PeerNotReady` if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise PeerNotReady(f"the {self.name} server exited with {code}: {self.log_tail()}")
            if _healthy(f"{self.url}/health"):
                return
            time.sleep(0.5)
        raise PeerNotReady(f"the {self.name} server did not answer /health within {timeout:.0f} s: {self.log_tail()}")

    def start(self, timeout: float = START_TIMEOUT_S) -> PeerProcess:
        """:meth:`launch`, then :meth:`wait_ready`; a server that does not get ready is stopped before the error."""
        self.launch()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 8) -> str:
        """The log's last ``lines`` lines on one line, and where the log is."""
        text = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.is_file() else []
        return " | ".join(text[-lines:]) + f" (log: {self.log_path})"


def _healthy(url: str) -> bool:
    """``GET url`` answered 200 (and, where the body is JSON with a ``status``, that status is ``ok``)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            if response.status != 200:
                return False
            body = response.read()
    except (OSError, HTTPException):  # not listening yet, 503 while loading, a dropped connection
        return False
    try:
        found = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True  # vLLM's /health: 200 with an empty body
    return not isinstance(found, dict) or found.get("status", "ok") == "ok"
