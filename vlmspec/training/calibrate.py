"""After training: run the drafter through the speculative engine on held-out prompts.

:func:`run_heldout` decodes each held-out prompt with speculation (and, for greedy runs,
with the target alone, to check that the output is identical) and keeps the engine's
record of every round (:class:`~vlmspec.types.RoundRecord`): the confidences the
scheduler saw and the accepted prefix. It reports tau and the acceptance by position.
:func:`calibrate` fits Sequential Temperature Scaling on those rounds
(``vlmspec.scheduling.calibration.fit_sts``) and saves ``calibration.json`` beside the
drafter's weights.

``training/`` never imports the engine: these functions receive a ready engine
(anything with ``stream(...).records()``, ``generate`` and the engine's result types),
built by the recipe.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from vlmspec.scheduling.calibration import Calibration, RoundRecorder, RoundRecords, fit_sts
from vlmspec.training.prompts import PromptItem
from vlmspec.types import RoundRecord, SpecStats


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
        """Speculative rounds over every held-out generation."""
        return self.stats.rounds

    @property
    def tau(self) -> float:
        """Mean tokens committed per round over every held-out generation (accepted drafts + 1)."""
        return self.stats.tau

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "rounds": self.rounds,
            "tau": self.tau,
            "accepted": self.stats.accepted,
            "new_tokens": self.stats.new_tokens,
            "acceptance_by_position": self.stats.acceptance_by_position,
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
    the target alone and compared token for token (speculation must be lossless). Rounds
    are recorded for calibration when the drafter reports confidences; collect them with
    the engine's default scheduler (verify all), so that every position is observed.
    """
    if not items:
        raise ValueError("no held-out prompts: pass --heldout-prompts > 0 to measure tau and calibrate")
    started = time.perf_counter()
    recorder = RoundRecorder()
    all_stats, mismatches = [], []
    for item in tqdm(items, desc="held-out decoding", unit="prompt", disable=not show_progress, dynamic_ncols=True):
        options = dict(messages=item.messages, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        stream = engine.stream(item.images or None, **options)
        for record in stream.records():
            _record_round(recorder, record)
        result = stream.result
        all_stats.append(result.stats)
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


def _record_round(recorder: RoundRecorder, record: RoundRecord) -> None:
    """Add one engine round to ``recorder`` as a batch of one; rounds without confidences are skipped."""
    if record.confidences is None:
        return
    recorder.record(
        record.confidences[None],  # [1, gamma]
        torch.tensor([record.drafted]),
        torch.tensor([record.verified]),
        torch.tensor([record.accepted]),
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
