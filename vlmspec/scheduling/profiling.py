"""SPS profiling: measure a forward's steps per second against the tokens in flight.

:func:`measure_sps` and :func:`profile_forward` time any callable ``step(n)`` that runs one
forward with ``n`` tokens in flight (nothing here knows about models; the target's runner
is timed by :mod:`vlmspec.targets.profile`), :func:`time_drafting` a drafting round beside a
target step, fit the curve non-decreasing and warn where a
measurement sits off the fit beyond its noise. :func:`sps_preset` gives named synthetic
curves, :func:`plot_sps` draws curves. The tables themselves are :mod:`vlmspec.scheduling.tables`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlmspec.provenance import cpu_signature
from vlmspec.scheduling.tables import DraftTiming, SPSMeta, SPSTable, is_int, monotone_fit

PRESETS = ("appendix_a", "gpu_like", "cpu")


# -- measuring ------------------------------------------------------------------------------


def measure_sps(
    step: Callable[[int], None],
    max_tokens: int,
    *,
    meta: SPSMeta,
    warmup: int = 3,
    repeats: int = 10,
    token_counts: Sequence[int] | None = None,
    synchronize: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> SPSTable:
    """Time ``step(n)`` (one forward with ``n`` tokens in flight) and tabulate steps/s.

    For each token count (default: every n in 1..max_tokens) the step runs ``warmup``
    untimed times; then ``repeats`` rounds time every count once each, round-robin from a
    rotating start, so a slow spell of the machine lands on all counts alike instead of
    inflating one count's block (on a shared 2-core VM such spells moved a step by up to 35%
    and compressed ``T(n) / T(1)``). The median times are then fitted
    non-decreasing in the token count (a forward over more tokens never costs less; the
    schedulers' early stop assumes a smooth curve, design notes §8), and the table holds
    1 / fitted time. A RuntimeWarning names the points whose median lies further from the
    fit than that point's own spread of repeats, 5% and 10 us (a busy machine, or a jagged
    curve).
    ``synchronize`` (e.g. ``torch.cuda.synchronize``) runs before each clock read, so
    asynchronous devices are timed to completion. ``meta`` says what was measured; its
    ``warmup``/``repeats`` fields are filled in here.
    """
    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    counts = list(range(1, max_tokens + 1)) if token_counts is None else sorted(set(token_counts))
    if not counts or not all(is_int(n) and 1 <= n <= max_tokens for n in counts):
        raise ValueError(f"token_counts must be integers in 1..max_tokens={max_tokens}, got {token_counts!r}")
    if not is_int(warmup) or warmup < 0 or not is_int(repeats) or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup!r}, repeats={repeats!r}")
    sync = synchronize or (lambda: None)
    timings = _interleaved_times(step, counts, warmup, repeats, sync, clock)
    medians = [statistics.median(times) for times in timings]
    fitted = monotone_fit(medians)
    off = [
        f"{n} tokens: median {m * 1e3:.2f} ms, fit {f * 1e3:.2f} ms"
        for n, m, f, times in zip(counts, medians, fitted, timings)
        if abs(m - f) > max(max(times) - min(times), 0.05 * f, 1e-5)  # beyond its spread, 5% and 10 us
    ]
    if off:
        warnings.warn(
            "the measured SPS curve is not monotone beyond its noise, so it was fitted; measure again on an idle "
            "machine (or with more --repeats) if this persists: " + "; ".join(off),
            RuntimeWarning,
            stacklevel=2,
        )
    notes = "step times fitted non-decreasing in tokens; medians (s): " + ", ".join(f"{m:.6g}" for m in medians)
    meta = dataclasses.replace(meta, warmup=warmup, repeats=repeats, notes=notes)
    return SPSTable(tuple(counts), tuple(1.0 / f for f in fitted), meta)


def _interleaved_times(
    step: Callable[[int], None],
    counts: list[int],
    warmup: int,
    repeats: int,
    sync: Callable[[], None],
    clock: Callable[[], float],
) -> list[list[float]]:
    """Each count's timed runs ([len(counts)][repeats] seconds): round r times every count once, from count r."""
    for n in counts:
        for _ in range(warmup):
            step(n)
    sync()
    times: dict[int, list[float]] = {n: [] for n in counts}
    for round_index in range(repeats):
        start_at = round_index % len(counts)
        for n in counts[start_at:] + counts[:start_at]:
            start = clock()
            step(n)
            sync()
            times[n].append(clock() - start)
    for n in counts:
        median = statistics.median(times[n])
        if not median > 0:
            raise ValueError(f"step({n}) took {median} s (median); the clock must advance while a step runs")
    return [times[n] for n in counts]


def profile_forward(
    forward: Callable[[int], None],
    max_tokens: int,
    *,
    model: str,
    device: str,
    dtype: str,
    context_length: int,
    model_config: dict[str, Any] | None = None,
    hardware: str = "",
    warmup: int = 3,
    repeats: int = 10,
    token_counts: Sequence[int] | None = None,
) -> SPSTable:
    """Profile a target's forward for the engine: :func:`measure_sps` plus the metadata.

    ``forward(n)`` must run the target once with ``n`` new tokens on top of a KV cache
    holding ``context_length`` tokens and leave the cache as it found it. On CUDA devices
    every timing is synchronised.
    """
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
    if not hardware and torch.device(device).type == "cuda" and torch.cuda.is_available():
        hardware = torch.cuda.get_device_name(torch.device(device))
    if not hardware and torch.device(device).type == "cpu":
        hardware = f"{torch.get_num_threads()} CPU threads"
    meta = SPSMeta(
        model=model,
        device=device,
        dtype=dtype,
        context_length=context_length,
        hardware=hardware,
        cpu=cpu_signature() if torch.device(device).type == "cpu" else "",
        model_config=dict(model_config or {}),
    )
    return measure_sps(
        forward, max_tokens, meta=meta, warmup=warmup, repeats=repeats, token_counts=token_counts, synchronize=sync
    )


def time_drafting(
    draft_round: Callable[[], None],
    target_step: Callable[[], None],
    *,
    drafter: str,
    dtype: str | None = None,
    source: str = "model",
    warmup: int = 3,
    repeats: int = 15,
    synchronize: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> DraftTiming:
    """Median seconds of a drafting round and of a one-token target step, timed alternately in one run.

    ``draft_round()`` runs one drafting round of one request (the drafter ``drafter``, drafting
    in ``dtype``, as draft source ``source``); ``target_step()`` one target forward of one token. They
    alternate, so drift on a shared machine moves both medians alike and their ratio
    (:meth:`DraftTiming.steps`, what the drafting policy reads) stays the pair's.
    """
    if not is_int(warmup) or warmup < 0 or not is_int(repeats) or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup!r}, repeats={repeats!r}")
    sync = synchronize or (lambda: None)
    rounds, steps = [], []
    for index in range(warmup + repeats):
        for work, times in ((draft_round, rounds), (target_step, steps)):
            sync()
            start = clock()
            work()
            sync()
            if index >= warmup:
                times.append(clock() - start)
    draft_s, step_s = statistics.median(rounds), statistics.median(steps)
    if not (draft_s > 0 and step_s > 0):
        raise ValueError("a drafting round or a target step took no time; the clock must advance while they run")
    return DraftTiming(drafter=drafter, round_s={source: draft_s}, step_s=step_s, repeats=repeats, dtype=dtype)


# -- presets ----------------------------------------------------------------------------------


def sps_preset(name: str, max_tokens: int = 1024) -> SPSTable:
    """A named curve (not a measurement; ``meta.source`` says ``preset:<name>``).

    * ``appendix_a``: {1: 1.0, 2: 0.5, 3: 0.45}, the Appendix A counterexample (docs/design.md §9)
      (``max_tokens`` is ignored).
    * ``gpu_like``: SYNTHETIC. Flat-ish while the forward is memory-bound, then decaying
      once compute-bound: step time ``t(B) = 20 ms * (1 + B/2048 + knee((B - 256) / 256))``
      with ``knee(x) = (x + sqrt(x^2 + 1/4)) / 2``, a smooth ``max(0, x)``. About 47 steps/s
      idle, -4 % at 64 tokens, -23 % at 256, 4.3x slower at 1024.
    * ``cpu``: the shape observed on this project's 2-thread CPU machines
      (``environment-notes.md``: a Qwen2.5-0.5B shaped VL target takes 116 ms for one token
      and 186 ms to verify 8, i.e. 1.6x; the notes' range is 1.5-1.9x). Modelled as
      ``t(B) = 116 ms + 10 ms * (B - 1)``, linear beyond 8 tokens because a CPU forward is
      compute-bound.
    """
    if name == "appendix_a":
        meta = _preset_meta(name, device="none", dtype="none", notes="docs/design.md §9 (Appendix A counterexample)")
        return SPSTable((1, 2, 3), (1.0, 0.5, 0.45), meta)
    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    tokens = tuple(range(1, max_tokens + 1))
    if name == "gpu_like":
        knee = [((b - 256) / 256 + math.sqrt(((b - 256) / 256) ** 2 + 0.25)) / 2 for b in tokens]
        step_time = [0.020 * (1 + b / 2048 + k) for b, k in zip(tokens, knee)]
        meta = _preset_meta(
            name,
            device="cuda",
            dtype="bfloat16",
            notes="synthetic: flat-ish while memory-bound, decaying past about 256 tokens",
        )
    elif name == "cpu":
        step_time = [0.116 + 0.010 * (b - 1) for b in tokens]
        meta = _preset_meta(
            name,
            device="cpu",
            dtype="float32",
            context_length=300,
            hardware="2 CPU threads",
            notes="environment-notes.md: 0.5B-shaped VL, 116 ms 1-token step, 186 ms 8-token verify; linear",
        )
    else:
        raise ValueError(f"unknown SPS preset {name!r}; choose one of {PRESETS} or load a measured table")
    return SPSTable(tokens, tuple(1.0 / t for t in step_time), meta)


def _preset_meta(
    name: str, *, device: str, dtype: str, notes: str, context_length: int | None = None, hardware: str = ""
) -> SPSMeta:
    """The metadata of preset ``name``: ``model`` and ``source`` say ``preset:<name>``, never a measurement's."""
    tag = f"preset:{name}"
    return SPSMeta(
        model=tag, device=device, dtype=dtype, context_length=context_length, hardware=hardware, source=tag, notes=notes
    )


# -- plotting -----------------------------------------------------------------------------------


def plot_sps(tables: SPSTable | Sequence[SPSTable], path: str | Path, *, labels: Sequence[str] | None = None) -> Path:
    """Write a PNG of steps/s and tokens/s (= B * SPS(B)) against tokens in flight, one line per table.

    Needs matplotlib (the ``plot`` extra), imported here so the library does not depend on it.
    """
    from matplotlib.figure import Figure

    tables = [tables] if isinstance(tables, SPSTable) else list(tables)
    labels = list(labels) if labels is not None else [t.meta.model for t in tables]
    if len(labels) != len(tables):
        raise ValueError(f"got {len(labels)} labels for {len(tables)} tables")
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_steps, ax_tokens = fig.subplots(1, 2)
    for table, label in zip(tables, labels):
        tokens, sps = np.asarray(table.tokens, dtype=np.float64), np.asarray(table.steps_per_s)
        ax_steps.plot(tokens, sps / sps[0], label=label)
        ax_tokens.plot(tokens, tokens * sps, label=label)
    ax_steps.set(xlabel="tokens in flight B", ylabel="SPS(B) / SPS(first)", title="forward steps per second (relative)")
    ax_tokens.set(xlabel="tokens in flight B", ylabel="tokens / s", title="tokens processed per second")
    for ax in (ax_steps, ax_tokens):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
