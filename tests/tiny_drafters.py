"""Tiny random-init DSpark drafters for CPU tests (training, serving)."""

from __future__ import annotations

import torch

from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter

FEATURE_LAYERS = (1, 2)


def tiny_drafter_config(target, **overrides) -> DSparkConfig:
    """A drafter small enough for CPU tests (hidden 64, 1 layer, rank 32, gamma 4)."""
    options = dict(
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        head_dim=16,
        intermediate_size=128,
        head_rank=32,
        block_size=4,
        target_layer_ids=FEATURE_LAYERS,
    )
    return DSparkConfig.for_target(target, **{**options, **overrides})


def tiny_drafter(target, seed: int = 0, **overrides) -> DSparkDrafter:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DSparkDrafter.from_target(target, tiny_drafter_config(target, **overrides))
