"""llama.cpp's ``llama-server`` as a peer: start it on GGUF files, answer token prompts, read its counters.

``run_llama_server`` starts one server (``-np 1``, ``--metrics``), sends each prompt as a list of
token ids to ``/completion`` (greedy: ``temperature`` 0, ``top_k`` 1, no prompt cache), and
returns the generated tokens, per-request timings (``prompt_ms``, ``predicted_ms``, ``draft_n``,
``draft_n_accepted``) and, from ``/metrics``, the speculative counters:
``spec_decode_num_drafts_total`` (verification steps) and
``spec_decode_num_accepted_tokens_per_pos_total{position="k"}`` (steps whose draft k+1 was
accepted). The server log goes to ``work_dir/<name>.log``.

``LlamaServer`` is one ``llama-server`` process (``-np`` slots; its command line, launch, readiness
and stop are ``benchmarks/peer_process``'s) with llama.cpp's client: ``complete`` and
``stream`` (which also times the first token) answer one prompt; ``run_concurrent`` sends many at
once to ``-np N`` slots. ``reference_ggufs`` converts the reference target's own language model to
GGUF in a run's dtype (and Q8_0) once, cached under ``runs/llamacpp-peer/gguf``;
``reference_multimodal_ggufs`` converts its whole folder (qwen2vl) and its vision tower
(``--mmproj``); ``peer_rows`` names the batch-1 rows (plain, n-gram types, Q8_0 marked lossy).

Where llama.cpp lives: ``--llama-cpp DIR`` / ``$LLAMA_CPP_DIR`` (``vlmspec.llama_cpp.LlamaCpp``),
``runs/llamacpp`` by default (``bash scripts/build_llama_cpp.sh`` builds it there).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.peer_process import PeerProcess, free_port, llama_server_command

DEFAULT_LLAMA_CPP = Path(__file__).resolve().parents[1] / "runs" / "llamacpp"
_PER_POS = re.compile(r'^llamacpp:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)$', re.M)


class LlamaServer(PeerProcess):
    """One ``llama-server`` process (a context manager): greedy ``/completion`` calls on token-id prompts.

    ``parallel`` is ``-np`` (slots: requests decoded together); ``--metrics`` is always on; ``port``
    is a free one unless given. The server log goes to ``work_dir/<name>.log``; a server that exits
    or does not get ready raises ``PeerNotReady`` (a ``RuntimeError``) with the log's last lines.
    """

    def __init__(
        self,
        server: Path,
        args: Sequence[str],
        *,
        work_dir: Path,
        name: str,
        parallel: int = 1,
        port: int | None = None,
    ) -> None:
        port = port or free_port()
        command = llama_server_command(server, args, port=port, parallel=parallel)
        super().__init__(name, command, port=port, log_path=Path(work_dir) / f"{name}.log")

    def complete(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: dict[str, float] | None = None
    ) -> dict[str, Any]:
        """Tokens, llama.cpp's timings and the client's wall seconds for one token-id prompt (greedy by default;
        ``sampling``: see :func:`completion_body`)."""
        tick = time.perf_counter()
        answer = _post(f"{self.url}/completion", completion_body(prompt, max_new_tokens, sampling))
        return {"tokens": list(answer["tokens"]), "timings": answer["timings"], "wall_s": time.perf_counter() - tick}

    def stream(self, prompt: Sequence[int] | dict, max_new_tokens: int) -> dict[str, Any]:
        """Like :meth:`complete`, streamed: also the client's time to the first generated token (``ttft_s``).

        ``prompt`` may be a dict of ``/completion`` prompt fields (a multimodal prompt: ``prompt_string``
        and ``multimodal_data``).
        """
        tick = time.perf_counter()
        first, tokens, timings = None, [], {}
        request = urllib.request.Request(
            f"{self.url}/completion",
            json.dumps({**completion_body(prompt, max_new_tokens), "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=1800) as response:
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("tokens"):
                    first = first or time.perf_counter()
                    tokens += chunk["tokens"]
                timings = chunk.get("timings", timings)
        done = time.perf_counter()
        return {"tokens": tokens, "timings": timings, "wall_s": done - tick, "ttft_s": (first or done) - tick}

    def metrics(self) -> dict[str, Any]:
        return parse_metrics(_get(f"{self.url}/metrics"))

    def props(self) -> dict[str, Any]:
        """``/props``: the model, its modalities and the media marker an image prompt must hold (random per server)."""
        return json.loads(_get(f"{self.url}/props"))


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
    with LlamaServer(server, args, work_dir=work_dir, name=name) as running:
        running.complete(prompts[0], 4)  # warm-up: first-call allocations and weight paging
        before = running.metrics()
        answers = [running.complete(prompt, max_new_tokens) for prompt in prompts]
        after = running.metrics()
    return {
        "command": running.command,
        "tokens": [a["tokens"] for a in answers],
        "timings": [a["timings"] for a in answers],
        "seconds": [(a["timings"]["prompt_ms"] + a["timings"]["predicted_ms"]) / 1000 for a in answers],
        "counters": subtract_counters(after, before),
    }


# ---------------------------------------------------------------- the reference target as GGUF, and the peer rows
GGUF_CACHE = DEFAULT_LLAMA_CPP.parent / "llamacpp-peer" / "gguf"
OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}  # the run's dtype -> the GGUF of the same weights
EXACT, QUANTIZED = "exact", "q8_0"


def locate_llama_cpp(path: str | Path | None = None):
    """``vlmspec.llama_cpp.LlamaCpp`` at ``path``, ``$LLAMA_CPP_DIR`` or runs/llamacpp, with ``llama-server`` built.

    Raises ``ValueError`` naming the build command when it is missing (callers skip the rows and say so).
    """
    from vlmspec.llama_cpp import LlamaCpp

    found = LlamaCpp.locate(path or os.environ.get("LLAMA_CPP_DIR") or DEFAULT_LLAMA_CPP)
    found.binary("llama-server")
    return found


def reference_ggufs(target: Any, dtype: str, llama_cpp: Any, *, quantized: bool = True, cache: Path = GGUF_CACHE):
    """The reference target's language model as GGUF in the run's dtype (and Q8_0), converted once and cached.

    ``vlmspec.llama_cpp.write_llama_text_model`` writes the loaded target's own weights (49,156-row
    vocabulary, the same token ids) as a Llama folder; llama.cpp's converter makes F32 or BF16 of it,
    ``llama-quantize`` Q8_0 of that. The cache key is the reference checkpoint and the llama.cpp build.
    """
    from vlmspec.llama_cpp import write_llama_text_model

    outtype = OUTTYPES[dtype]
    folder = Path(cache) / _fingerprint(llama_cpp)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {EXACT: folder / f"reference-{outtype}.gguf"}
    if not paths[EXACT].is_file():
        print(f"[llama.cpp] converting the reference target to {paths[EXACT]} (once) ...", flush=True)
        hf = write_llama_text_model(target, folder / f"hf-{outtype}")
        partial = paths[EXACT].with_suffix(".partial")
        llama_cpp.convert(hf, partial, outtype)
        partial.rename(paths[EXACT])
        shutil.rmtree(hf, ignore_errors=True)
    if quantized:
        paths[QUANTIZED] = folder / f"reference-{outtype}-q8_0.gguf"
        if not paths[QUANTIZED].is_file():
            partial = paths[QUANTIZED].with_suffix(".partial")
            quantize = [str(llama_cpp.binary("llama-quantize")), str(paths[EXACT]), str(partial), "Q8_0"]
            done = subprocess.run(quantize, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"llama-quantize failed: {done.stderr.strip().splitlines()[-3:]}")
            partial.rename(paths[QUANTIZED])
    return paths


def reference_multimodal_ggufs(dtype: str, llama_cpp: Any, *, cache: Path = GGUF_CACHE) -> tuple[Path, Path]:
    """The reference target's folder through llama.cpp's converter as is: its qwen2vl text model and (``--mmproj``)
    its vision tower, in the run's dtype; cached like :func:`reference_ggufs`. Raises with the converter's error."""
    from vlmspec.reference import reference_target_dir

    outtype = OUTTYPES[dtype]
    folder = Path(cache) / _fingerprint(llama_cpp)
    folder.mkdir(parents=True, exist_ok=True)
    text, mmproj = folder / f"reference-qwen2vl-{outtype}.gguf", folder / f"reference-mmproj-{outtype}.gguf"
    for path, extra in ((text, ()), (mmproj, ("--mmproj",))):
        if not path.is_file():
            print(f"[llama.cpp] converting the reference target to {path} (once) ...", flush=True)
            _convert(llama_cpp, Path(reference_target_dir()), path, outtype, *extra)
    return text, mmproj


def _convert(llama_cpp: Any, source: Path, outfile: Path, outtype: str, *extra: str) -> None:
    """``convert_hf_to_gguf.py SOURCE --outfile OUT --outtype T EXTRA`` with the checkout's gguf-py."""
    partial = outfile.with_suffix(".partial")
    command = [sys.executable, str(llama_cpp.source / "convert_hf_to_gguf.py"), str(source)]
    command += ["--outfile", str(partial), "--outtype", outtype, *extra]
    paths = [str(llama_cpp.source / "gguf-py"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise RuntimeError(f"convert_hf_to_gguf.py {' '.join(extra)} failed: {lines[-1] if lines else done.returncode}")
    # --mmproj names its output itself in some versions: take the file the converter wrote
    written = partial if partial.is_file() else next(partial.parent.glob(f"{partial.stem}*"), None)
    if written is None:
        raise RuntimeError(f"convert_hf_to_gguf.py wrote no {partial}")
    written.rename(outfile)


def _fingerprint(llama_cpp: Any) -> str:
    """The reference checkpoint (its manifest, the weights' size and time) and the llama.cpp build, hashed."""
    from vlmspec.reference import reference_target_dir

    ref = Path(reference_target_dir())
    parts = [server_version(llama_cpp.binary("llama-server"))]
    for name in ("vlmspec-reference.json", "model.safetensors"):
        path = ref / name
        if path.is_file():
            stat = path.stat()
            parts.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def server_args(model: Path, threads: int, context: int = 4096, extra: Sequence[str] = ()) -> list[str]:
    """``llama-server`` arguments as a user would pass them: the model, the threads, the context, ``extra``."""
    return ["-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(context), *extra]


def spec_types(server: Path) -> set[str]:
    """The ``--spec-type`` values this ``llama-server`` build lists in its ``--help``."""
    done = subprocess.run([str(server), "--help"], capture_output=True, text=True, timeout=60)
    found = re.search(r"--spec-type (\S+)", done.stdout + done.stderr)
    return set(found.group(1).split(",")) if found else set()


def peer_rows(ggufs: dict[str, Path], server: Path, threads: int) -> dict[str, list[str]]:
    """The batch-1 llama.cpp rows: plain, its n-gram speculation (each type this build has), Q8_0 (lossy)."""
    rows = {"llama.cpp plain": server_args(ggufs[EXACT], threads)}
    for kind in [k for k in ("ngram-simple", "ngram-mod") if k in spec_types(server)]:
        rows[f"llama.cpp n-gram ({kind})"] = server_args(ggufs[EXACT], threads, extra=("--spec-type", kind))
    if QUANTIZED in ggufs:
        rows[LOSSY_ROW] = server_args(ggufs[QUANTIZED], threads)
    return rows


LOSSY_ROW = "llama.cpp Q8_0 (lossy)"


def run_concurrent(
    server: Path,
    args: Sequence[str],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    work_dir: Path,
    name: str,
) -> tuple[float, list[dict[str, Any]]]:
    """All ``prompts`` sent at once to one ``llama-server -np len(prompts)`` (streamed, one client thread each).

    Returns the wall time from the first request to the last answer and each answer (tokens, timings,
    ``wall_s`` and ``ttft_s`` from its request). The server starts, and is warmed up, before the clock.
    """
    with LlamaServer(server, args, work_dir=work_dir, name=name, parallel=len(prompts)) as running:
        running.complete(prompts[0], 4)  # warm-up
        tick = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda ids: running.stream(ids, max_new_tokens), prompts))
        return time.perf_counter() - tick, answers


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


def completion_body(
    prompt: Sequence[int] | dict, max_new_tokens: int, sampling: dict[str, float] | None = None
) -> dict[str, Any]:
    """A ``/completion`` request: token ids (or prompt fields), no prompt cache, EOS ends it as elsewhere.

    Greedy unless ``sampling`` gives ``temperature``, ``top_p`` and ``seed``: then llama.cpp samples with
    those and with its other samplers off (top-k 0, min-p 0: its default min-p is 0.05), the chain
    vlmspec's own sampled rows run.
    """
    fields = dict(prompt) if isinstance(prompt, dict) else {"prompt": list(prompt)}
    if sampling is not None:
        fields |= {"top_k": 0, "min_p": 0.0, **sampling}
    return {
        "temperature": 0.0,
        "top_k": 1,
        **fields,
        "n_predict": max_new_tokens,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read().decode()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read().decode())
