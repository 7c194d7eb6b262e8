"""llama.cpp's ``llama-server`` as a peer: start it on GGUF files, answer token prompts, read its counters.

``run_llama_server`` starts one server (``-np 1``, ``--metrics``), sends each prompt as a list of
token ids to ``/completion`` (greedy: ``temperature`` 0, ``top_k`` 1, no prompt cache), and
returns the generated tokens, per-request timings (``prompt_ms``, ``predicted_ms``, ``draft_n``,
``draft_n_accepted``) and, from ``/metrics``, the speculative counters:
``spec_decode_num_drafts_total`` (verification steps) and
``spec_decode_num_accepted_tokens_per_pos_total{position="k"}`` (steps whose draft k+1 was
accepted). The server log goes to ``work_dir/<name>.log``.

Where llama.cpp lives: ``--llama-cpp DIR`` / ``$LLAMA_CPP_DIR`` (``vlmspec.llama_cpp.LlamaCpp``),
``runs/llamacpp`` by default (``runs/llamacpp/build.sh`` builds it there).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_LLAMA_CPP = Path(__file__).resolve().parents[1] / "runs" / "llamacpp"
START_TIMEOUT_S = 300.0
_PER_POS = re.compile(r'^llamacpp:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)$', re.M)


def run_llama_server(
    server: Path,
    args: Sequence[str],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    work_dir: Path,
    name: str,
) -> dict[str, Any]:
    """Greedy answers of one ``llama-server`` (started with ``args``) to token-id ``prompts``, then its counters."""
    work_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log_path = work_dir / f"{name}.log"
    command = [str(server), *args, "--port", str(port), "--host", "127.0.0.1", "-np", "1", "--metrics"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ready(base, process, log_path)
            _complete(base, prompts[0], 4)  # warm-up: first-call allocations and weight paging
            before = parse_metrics(_get(f"{base}/metrics"))
            answers = [_complete(base, prompt, max_new_tokens) for prompt in prompts]
            after = parse_metrics(_get(f"{base}/metrics"))
        finally:
            process.terminate()
            process.wait(timeout=60)
    return {
        "command": command,
        "tokens": [a["tokens"] for a in answers],
        "timings": [a["timings"] for a in answers],
        "seconds": [(a["timings"]["prompt_ms"] + a["timings"]["predicted_ms"]) / 1000 for a in answers],
        "counters": subtract_counters(after, before),
    }


def parse_metrics(text: str) -> dict[str, Any]:
    """The speculative counters of a ``/metrics`` page: drafts, draft tokens, accepted, accepted per position."""
    counters: dict[str, Any] = {}
    for key in (
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
    ):
        found = re.search(rf"^llamacpp:{key} (\S+)$", text, re.M)
        counters[key] = float(found.group(1)) if found else 0.0
    per_pos = {int(k): float(v) for k, v in _PER_POS.findall(text)}
    counters["accepted_per_pos"] = [per_pos[k] for k in sorted(per_pos)]
    return counters


def subtract_counters(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` (the server's counters are cumulative; the warm-up is taken off)."""
    out = {key: after[key] - before.get(key, 0.0) for key in after if key != "accepted_per_pos"}
    earlier = before.get("accepted_per_pos", [])
    out["accepted_per_pos"] = [
        value - (earlier[k] if k < len(earlier) else 0.0) for k, value in enumerate(after["accepted_per_pos"])
    ]
    return out


def server_version(server: Path) -> str:
    """``llama-server --version`` (its build number and commit)."""
    done = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout or done.stderr) else "unknown"


def _complete(base: str, prompt: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": list(prompt),
        "n_predict": max_new_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }
    answer = _post(f"{base}/completion", body)
    return {"tokens": list(answer["tokens"]), "timings": answer["timings"]}


def _wait_ready(base: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}: {_log_tail(log_path)}")
        try:
            if json.loads(_get(f"{base}/health")).get("status") == "ok":
                return
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"llama-server did not become ready in {START_TIMEOUT_S:.0f} s: {_log_tail(log_path)}")


def _log_tail(path: Path, lines: int = 8) -> str:
    text = path.read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) + f" (log: {path})"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read().decode()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read().decode())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
