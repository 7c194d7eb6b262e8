"""Server processes the benchmarks run beside vlmspec, and the one streaming client that times them.

Every server a benchmark starts is a :class:`PeerProcess`, made by one of three functions that
write its command line as a user would: :func:`vlmspec_serve`, :func:`vllm_serve` (vLLM's CPU
build in its own venv, ``benchmarks/vllm_peer.py``) and :func:`llama_server_command`
(``benchmarks/llama_cpp_peer.py``'s ``LlamaServer`` adds llama.cpp's ``/completion`` client to
it). Each is a child process on a free loopback port (:func:`free_port`), its output in a log
file, ready once ``GET /health`` answers 200 (llama-server answers 503 while it loads the model),
stopped with SIGTERM, then SIGKILL. A server that exits or does not get ready in time raises
:class:`PeerNotReady` with its log's last lines.

``launch`` and ``wait_ready`` are separate so that a benchmark can start several servers and let
them load side by side; ``start`` (and ``with``) does both.

Every benchmark talks to every server's OpenAI endpoint through :func:`stream_chat`: one
streamed ``/v1/chat/completions`` request, timed by the client (:class:`Timing`: when it was
sent, when each content chunk arrived, when it ended).
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path

START_TIMEOUT_S = 300.0
SERVED_MODEL_NAME = "bench"  # the model id every server is started with and every client asks for


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


# ---------------------------------------------------------------------------------- the three servers
def vlmspec_serve(
    name: str,
    *,
    target: str,
    dtype: str,
    log_dir: Path,
    drafter: str | None = None,
    extra: Sequence[str] = (),
    port: int | None = None,
    env: Mapping[str, str] | None = None,
) -> PeerProcess:
    """``vlmspec serve`` of ``target`` (and ``drafter``, else the server's default) in this Python, not started.

    ``extra`` are further ``vlmspec serve`` flags (a scheduler, ``--max-batch-size``, ...); the log is
    ``log_dir/<name>.log``.
    """
    port = port or free_port()
    command = [sys.executable, "-m", "vlmspec.cli", "serve", "--target", target, "--dtype", dtype]
    command += ["--drafter", drafter] if drafter is not None else []
    command += [*extra, "--port", str(port), "--served-model-name", SERVED_MODEL_NAME]
    return PeerProcess(name, command, port=port, log_path=Path(log_dir) / f"{name}.log", env=env)


def vllm_serve(
    name: str,
    *,
    model: str | os.PathLike,
    dtype: str,
    threads: int,
    log_dir: Path,
    extra: Sequence[str] = (),
    max_model_len: int = 2048,
    images: bool = False,
    port: int | None = None,
) -> PeerProcess:
    """``vllm serve`` of the model folder from vLLM's venv (made on first use), with its CPU guide's settings.

    Not started. Prompts carry no videos, and no images unless ``images`` (then one each): vLLM
    profiles the memory of those only; ``extra`` are further flags (``--max-num-seqs``,
    ``--no-enable-prefix-caching``, ...).
    """
    from benchmarks.vllm_peer import DEFAULT_VENV, ensure_vllm_venv, vllm_environment

    port = port or free_port()
    python = ensure_vllm_venv(DEFAULT_VENV)
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--served-model-name", SERVED_MODEL_NAME, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--max-model-len", str(max_model_len), "--seed", "0"]
    command += ["--gpu-memory-utilization", "0.3"]  # on a CPU: the share of RAM to reserve
    # no videos ever, and no images unless asked: vLLM then profiles the memory of what can come only
    command += ["--limit-mm-per-prompt", json.dumps({"image": int(images), "video": 0})]
    command += list(extra)
    env = vllm_environment(threads)
    return PeerProcess(name, command, port=port, log_path=Path(log_dir) / f"{name}.log", env=env)


def llama_server_command(server: str | os.PathLike, args: Sequence[str], *, port: int, parallel: int) -> list[str]:
    """``llama-server ARGS`` on ``port`` with ``parallel`` slots (``-np``), its counters on, the model id ``bench``."""
    command = [str(server), *args, "--port", str(port), "--host", "127.0.0.1", "-np", str(parallel), "--metrics"]
    return [*command, "--alias", SERVED_MODEL_NAME]


# ---------------------------------------------------------------------------------- the client
@dataclass
class Timing:
    """One streamed request as its client saw it (``time.perf_counter`` seconds)."""

    sent_s: float
    first_s: float | None = None  # the first content chunk
    done_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # every content chunk's arrival
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    speculation: dict = field(default_factory=dict)  # vlmspec's own field: rounds, accepted
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s


async def stream_chat(client, body: dict, timing: Timing | None = None) -> Timing:
    """One streamed chat completion through ``client`` (``openai.AsyncOpenAI``), timed; a failure is kept, not raised.

    ``body`` holds the request's fields (``messages``, ``max_tokens``, ...; ``extra_body`` for a
    server's own fields such as llama.cpp's ``cache_prompt``). ``timing``, when given, is filled
    as the chunks arrive (another task may watch it) and returned.
    """
    timing = timing or Timing(time.perf_counter())
    try:
        stream = await client.chat.completions.create(
            model=SERVED_MODEL_NAME, stream=True, stream_options={"include_usage": True}, **body
        )
        async for chunk in stream:
            if chunk.usage is not None:
                timing.prompt_tokens = chunk.usage.prompt_tokens
                timing.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    now = time.perf_counter()
                    timing.first_s = timing.first_s or now
                    timing.chunk_s.append(now)
                    timing.text += choice.delta.content
                if choice.finish_reason is not None:
                    timing.speculation = (chunk.model_extra or {}).get("vlmspec", {})
    except Exception as err:  # noqa: BLE001 - counted and reported, the other clients go on
        timing.error = repr(err)
    timing.done_s = time.perf_counter()
    return timing


def image_data_url(image) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL, the way an OpenAI client sends a picture."""
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def openai_client(url: str):
    """An ``openai.AsyncOpenAI`` on ``url`` (a server's base URL): no retries, no key, an hour's timeout."""
    import openai

    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)


class PeakRSS:
    """The peak resident memory of a process (and its children) while the block runs, sampled every 20 ms."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.before = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _rss(self) -> int:
        return self.process.memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRSS:
        self.before = self.peak = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.before) / 2**20
