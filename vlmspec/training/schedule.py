"""The order of training: the learning-rate schedule and each epoch's permutation, both pure functions of the step.

:class:`TimeBudget` fits the schedule's length to a wall-clock budget (``TrainConfig.max_minutes``).
"""

from __future__ import annotations

import math
import time

import torch


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine from 1 to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class EpochSampler(torch.utils.data.Sampler[int]):
    """A fresh permutation per epoch from ``(seed, epoch)``: resumable without saved RNG state."""

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle, self.epoch = size, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.size))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())


# With a wall-clock budget: the first steps compile kernels and warm caches, so the pace is measured from the
# step after these, and the schedule is fitted again every PACE_STEPS steps.
PACE_SKIP_STEPS = 5
PACE_STEPS = 20


class TimeBudget:
    """A wall-clock budget for training steps, and the pace measured against it."""

    def __init__(self, minutes: float, start_step: int, planned_steps: int, clock=time.perf_counter) -> None:
        self.minutes = minutes
        self.planned_steps = planned_steps  # the schedule asked for: the budget never lengthens it past this
        self.deadline = clock() + 60 * minutes
        self.mark_step = start_step + PACE_SKIP_STEPS  # the pace is timed from the end of this step
        self.mark_time: float | None = None
        self.seconds_a_step = float("nan")
        self.announced = False

    def steps_that_fit(self, step: int, now: float) -> int | None:
        """The step the run can reach by the deadline (None: no new estimate at this step)."""
        if now >= self.deadline:
            return step
        if step == self.mark_step:
            self.mark_time = now
        if self.mark_time is None or step == self.mark_step or (step - self.mark_step) % PACE_STEPS:
            return None
        self.seconds_a_step = (now - self.mark_time) / (step - self.mark_step)
        return step + int((self.deadline - now) / self.seconds_a_step)
