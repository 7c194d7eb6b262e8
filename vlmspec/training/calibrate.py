"""After training: run the drafter through the speculative engine on held-out prompts.

:func:`run_heldout` decodes each held-out prompt with speculation (and, for greedy runs,
with the target alone, to check that the output is identical) and records every round:
the confidences the scheduler saw and the accepted prefix. It reports tau and the
acceptance by position. :func:`calibrate` fits Sequential Temperature Scaling on those
rounds (``vlmspec.scheduling.calibration.fit_sts``) and saves ``calibration.json`` beside
the drafter's weights.

``training/`` never imports the engine: these functions receive a ready engine
(anything with ``stream``/``generate``, a ``scheduler`` attribute and the engine's
result types), built by the recipe.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from vlmspec.scheduling.base import Scheduler, VerifyAll
from vlmspec.scheduling.calibration import Calibration, RoundRecorder, RoundRecords, fit_sts
from vlmspec.training.prompts import PromptItem
from vlmspec.types import SpecStats


class RecordingScheduler:
    """Passes every call to ``inner`` and keeps what it was asked: confidences and drafted counts."""

    def __init__(self, inner: Scheduler | None = None) -> None:
        self.inner = inner if inner is not None else VerifyAll()
        self.calls: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # ([1, gamma] or None, [1])

    def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
        kept = None if confidences is None else confidences.detach().float().cpu().clone()
        self.calls.append((kept, num_drafted.detach().cpu().clone()))
        return self.inner.schedule(confidences, num_drafted)


@contextmanager
def recording(engine) -> Any:
    """Temporarily wrap ``engine.scheduler`` in a :class:`RecordingScheduler` (restored on exit)."""
    original = engine.scheduler
    recorder = RecordingScheduler(original)
    engine.scheduler = recorder
    try:
        yield recorder
    finally:
        engine.scheduler = original


@dataclass
class HeldoutRun:
    """Speculative decoding of held-out prompts: tau, acceptance and the recorded rounds."""

    prompts: int
    stats: SpecStats  # pooled over every held-out generation (SpecStats.merge)
    identical_to_target: bool | None  # greedy only: every output equals the target alone
    mismatches: list[str] = field(default_factory=list)  # prompt ids whose output differed
    records: RoundRecords | None = None  # rounds with confidences (None without a confidence head)
    seconds: float = 0.0

    @property
    def rounds(self) -> int:
        return self.stats.rounds

    @property
    def accepted(self) -> int:
        return self.stats.accepted

    @property
    def new_tokens(self) -> int:
        return self.stats.new_tokens

    @property
    def tau(self) -> float:
        """Mean tokens committed per round over every held-out generation (accepted drafts + 1)."""
        return self.stats.tau

    @property
    def acceptance_by_position(self) -> list[float]:
        return self.stats.acceptance_by_position

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "rounds": self.rounds,
            "tau": self.tau,
            "accepted": self.accepted,
            "new_tokens": self.new_tokens,
            "acceptance_by_position": self.acceptance_by_position,
            "identical_to_target": self.identical_to_target,
            "mismatches": self.mismatches,
            "seconds": self.seconds,
        }


def run_heldout(
    engine,
    items: Sequence[PromptItem],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    compare_with_target: bool = True,
    show_progress: bool = True,
) -> HeldoutRun:
    """Speculative decoding of each item's first turn, with every round recorded.

    With ``temperature == 0`` and ``compare_with_target`` each output is also produced by
    the target alone and compared token for token (speculation must be lossless).
    """
    if not items:
        raise ValueError("no held-out prompts: pass --heldout-prompts > 0 to measure tau and calibrate")
    started = time.perf_counter()
    recorder = RoundRecorder()
    all_stats, mismatches = [], []
    for item in tqdm(items, desc="held-out decoding", unit="prompt", disable=not show_progress, dynamic_ncols=True):
        options = dict(messages=item.messages, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        with recording(engine) as calls:
            stream = engine.stream(item.images or None, **options)
            committed = list(stream.rounds())[1:]  # the first entry is the prefill's token
        result = stream.result
        stats = result.stats
        all_stats.append(stats)
        _record_rounds(recorder, calls.calls, committed, stats.verified_lengths, result.finish_reason)
        if compare_with_target and temperature == 0:
            alone = engine.generate(item.images or None, speculative=False, **options)
            if alone.token_ids != result.token_ids:
                mismatches.append(item.id)
    meta = {"temperature": temperature, "max_new_tokens": max_new_tokens}
    records = recorder.records(meta) if len(recorder) else None
    return HeldoutRun(
        prompts=len(items),
        stats=SpecStats.merge(all_stats),
        identical_to_target=(not mismatches) if compare_with_target and temperature == 0 else None,
        mismatches=mismatches,
        records=records,
        seconds=time.perf_counter() - started,
    )


def _record_rounds(
    recorder: RoundRecorder,
    calls: list[tuple[torch.Tensor | None, torch.Tensor]],
    committed: list[list[int]],
    verified: list[int],
    finish_reason: str | None,
) -> None:
    """Add one record per round whose outcome is fully known.

    A round commits its accepted drafts and one more token, so ``accepted = len(committed) - 1``,
    except in a last round that ended on EOS or a stop string, where the commit may have
    been cut short: that round is left out.
    """
    rounds = len(verified)
    if finish_reason in ("eos", "stop"):
        rounds -= 1
    for (confidences, drafted), tokens, length in zip(calls[:rounds], committed[:rounds], verified[:rounds]):
        if confidences is None:
            return
        recorder.record(
            confidences, drafted, torch.tensor([length]), torch.tensor([len(tokens) - 1])
        )


def calibrate(run: HeldoutRun, drafter_dir: str | Path) -> Calibration:
    """Fit STS on the recorded rounds and save ``calibration.json`` (and the rounds) beside the drafter."""
    if run.records is None or len(run.records) == 0:
        raise ValueError("no recorded rounds with confidences: the drafter needs a confidence head to be calibrated")
    records = run.records
    calibration = fit_sts(
        records.confidences, records.num_accepted, num_verified=records.num_verified, num_drafted=records.num_drafted
    )
    calibration = Calibration(calibration.temperatures, {**calibration.meta, **records.meta, "prompts": run.prompts})
    calibration.save(drafter_dir)
    records.save(Path(drafter_dir) / "calibration_rounds.npz")
    return calibration


def write_report(path: str | Path, report: dict[str, Any]) -> Path:
    """Write a JSON report (numbers that are not finite become null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
