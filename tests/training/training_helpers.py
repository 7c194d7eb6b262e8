"""Helpers shared by the training tests (tiny drafters, greedy cache specs, cache writing)."""

from __future__ import annotations

from pathlib import Path

import torch

from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter
from vlmspec.training import (
    CacheSpec,
    GenerationConfig,
    TargetCache,
    build_cache,
    finalize_cache,
    open_cache_dir,
    target_fingerprint,
)

DATA = Path(__file__).parent / "data"
GSM8K_MINI = DATA / "gsm8k-mini.jsonl"  # the first 48 prompts of ../shared/data/prompts/gsm8k.jsonl
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


def greedy_spec(target, max_new_tokens: int = 10, **options) -> CacheSpec:
    generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, top_p=None, top_k=None)
    return CacheSpec(target_fingerprint(target), FEATURE_LAYERS, "interpolate", "bfloat16", generation, **options)


def write_cache(target, items, directory: Path, spec: CacheSpec, **options) -> TargetCache:
    open_cache_dir(directory, spec)
    build_cache(target, items, directory, spec, show_progress=False, **options)
    finalize_cache(directory)
    return TargetCache(directory)
