"""The engines stay lossless on every forward path a machine may take, not only on the one this machine takes.

A CPU with AVX-512 runs the packed AVX-512 kernels; one with AVX2 only, the AVX2 kernel; a
machine without a C++ compiler (or with ``VLMSPEC_CPU_KERNEL=0``), oneDNN/ATen. Each path is
selected here on this one machine: ``default`` is whatever the machine does by itself,
``VLMSPEC_CPU_ISA=avx2`` holds an AVX-512 CPU to the AVX2 kernel, ``VLMSPEC_CPU_KERNEL=0``
takes the fallback, and a child process with ``CXX`` pointed at nothing and an empty
kernel cache is a fresh machine without a compiler (a process loads the kernel once, so
that one cannot be simulated in this process). A fresh tiny target is built under each
path, since a target packs its weights for the path of its first fast forward. Greedy
speculation must then give the target alone's tokens and transformers' own, and a batch
every request's output alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from tiny_drafters import tiny_drafter

from vlmspec.drafters.dspark import DSparkProposer
from vlmspec.drafters.prompt_lookup import PromptLookup
from vlmspec.engine import SpecEngine
from vlmspec.kernels import cpu_kernels
from vlmspec.paths import CACHE_ENV
from vlmspec.serving import BatchEngine
from vlmspec.targets import QwenVLTarget
from vlmspec.targets.tiny import tiny_model, tiny_processor

REPEAT = "Repeat after me: one two three four five six seven eight. " * 3  # prompt lookup accepts drafts here
FALLBACK_BACKENDS = ("onednn", "aten")  # vlmspec.kernels.linear.PackedLinear's backends without the kernel


@pytest.fixture(params=["default", "avx2", "off"])
def kernel_path(request, monkeypatch):
    """One forward path for the test's duration; the kernel's cached availability is decided again around it."""
    path = request.param
    if path == "avx2":
        if not (cpu_kernels.kernel_available() and cpu_kernels.cpu_has_avx512()):
            pytest.skip("the AVX2 kernel is the default path on a CPU without AVX-512 (and absent without the kernel)")
        monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    if path == "off":
        monkeypatch.setenv(cpu_kernels.KERNEL_ENV, "0")
    cpu_kernels.kernel_available.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = cpu_kernels.kernel_available()
    if not available and path == "default" and cpu_kernels._cpu_has_avx2():  # it was tried and failed: say why
        assert any("Install a C++ compiler" in str(w.message) for w in caught), [str(w.message) for w in caught]
    yield path if available else "fallback"
    cpu_kernels.kernel_available.cache_clear()  # the next caller decides under the environment monkeypatch restores


def expected_backends(path: str) -> tuple[str, ...]:
    if path in ("off", "fallback"):
        return FALLBACK_BACKENDS
    if path == "avx2":
        return ("kernel",)
    return ("packed",) if cpu_kernels.kernel_isa().startswith("avx512") else ("kernel",)


def fresh_target(family: str, tokenizer, path: str) -> QwenVLTarget:
    """A tiny target whose fast forward is packed now, under ``path``, and checked to have taken it."""
    target = QwenVLTarget(tiny_model(family), tiny_processor(family, tokenizer), name=f"tiny-{family}-{path}")
    decoder = target.packed_decoder()
    assert decoder.layers[0].qkv.backend in expected_backends(path), (path, decoder.layers[0].qkv.backend)
    assert decoder.fused_rope == (path in ("default", "avx2"))
    return target


def hf_greedy(target, images, prompt, max_new_tokens):
    """transformers' own generate: the same answer whatever path vlmspec's forward takes."""
    inputs = target.build_inputs(images, prompt)
    out = target.model.generate(
        **inputs.model_kwargs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(target.eos_token_ids)
    )
    return out[0, inputs.length :].tolist()


def test_greedy_speculation_equals_the_target_alone_and_transformers(kernel_path, tokenizer, astronaut):
    target = fresh_target("qwen2_5_vl", tokenizer, kernel_path)
    engine = SpecEngine(target, PromptLookup(max_draft_tokens=5))
    picture = astronaut.resize((96, 96))
    for image, prompt in ((picture, "Describe the picture in detail."), (None, REPEAT)):
        alone = engine.generate(image, prompt, max_new_tokens=24, speculative=False)
        fast = engine.generate(image, prompt, max_new_tokens=24)
        assert fast.token_ids == alone.token_ids == hf_greedy(target, image, prompt, 24), (kernel_path, prompt)
    assert fast.stats.accepted > 0  # drafts were verified several at a time, not only one token per step


def test_a_batch_of_requests_each_gets_its_output_alone(kernel_path, tokenizer, astronaut):
    target = fresh_target("qwen3_vl", tokenizer, kernel_path)  # per-head q/k norms: the fused norm too
    picture = astronaut.resize((96, 96))
    requests = [
        dict(images=picture, prompt="Describe the picture.", max_new_tokens=12),
        dict(images=None, prompt=REPEAT, max_new_tokens=16),
        dict(images=None, prompt="Write a haiku about rain.", max_new_tokens=8),
    ]
    engine = SpecEngine(target)
    expected = [
        engine.generate(r["images"], r["prompt"], max_new_tokens=r["max_new_tokens"], speculative=False).token_ids
        for r in requests
    ]
    for proposer in (PromptLookup(max_draft_tokens=4), DSparkProposer(tiny_drafter(target))):
        results = BatchEngine(target, proposer, max_batch_size=3).generate_many(requests)
        assert [r.token_ids for r in results] == expected, (kernel_path, type(proposer).__name__)


def test_a_machine_without_a_compiler_falls_back_with_a_warning_and_stays_lossless(tmp_path):
    """The first test above in a child process that finds no compiler and no built kernel: warning, fallback, lossless."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), CACHE_ENV: str(tmp_path / "cache")}
    env.pop(cpu_kernels.KERNEL_ENV, None)
    test = f"{__file__}::test_greedy_speculation_equals_the_target_alone_and_transformers[default]"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
    done = subprocess.run(command, env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing was built, so the child ran the fallback


def test_a_build_lock_left_by_a_dead_build_is_removed_and_a_fresh_one_is_kept(tmp_path):
    import time

    from vlmspec.kernels.cpu_kernels import STALE_LOCK_S, _remove_stale_lock

    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    fresh.touch()
    stale.touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    with pytest.warns(RuntimeWarning, match="did not finish"):
        assert _remove_stale_lock(stale)
    assert not _remove_stale_lock(fresh)  # a build may hold it right now: left alone, silently
    assert _remove_stale_lock(tmp_path / "missing")
    assert fresh.exists() and not stale.exists()


def test_waiting_for_another_build_ends_when_its_lock_goes(tmp_path):
    import threading

    from vlmspec.kernels.cpu_kernels import _wait_for_other_build

    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()  # the other build finishes
    _wait_for_other_build(lock, poll_s=0.05)
    assert not lock.exists()


def test_a_built_kernel_loads_while_a_killed_process_left_the_build_lock(tmp_path):
    """A process killed inside torch's loader (even while it only checked an up-to-date build) leaves the
    lock behind: a later process must load the built library at once, not wait on that lock."""
    if not cpu_kernels.kernel_available():
        pytest.skip("the CPU kernel does not build here")
    import shutil

    built = cpu_kernels._build_directory() / "vlmspec_cpu_kernels.so"
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}
    env.pop(cpu_kernels.KERNEL_ENV, None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, env[CACHE_ENV])
        build_dir = cpu_kernels._build_directory()  # the same source's directory under the other cache
    build_dir.mkdir(parents=True)
    shutil.copy(built, build_dir / built.name)
    (build_dir / "lock").touch()  # fresh: a live build could hold it, so it is not stale
    probe = "from vlmspec.kernels.cpu_kernels import kernel_available; print(kernel_available())"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
    assert "waiting for another process" not in done.stderr and (build_dir / "lock").exists()
