"""The order of training: the learning-rate schedule and each epoch's permutation, both pure functions of the step."""

from __future__ import annotations

import math

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
