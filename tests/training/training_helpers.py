"""Helpers shared by the training tests (tiny drafters, greedy cache specs, cache writing)."""

from __future__ import annotations

from pathlib import Path

from tiny_drafters import FEATURE_LAYERS, tiny_drafter, tiny_drafter_config  # noqa: F401 - re-exported

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


def greedy_spec(target, max_new_tokens: int = 10, **options) -> CacheSpec:
    generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, top_p=None, top_k=None)
    return CacheSpec(target_fingerprint(target), FEATURE_LAYERS, "interpolate", "bfloat16", generation, **options)


def write_cache(target, items, directory: Path, spec: CacheSpec, **options) -> TargetCache:
    open_cache_dir(directory, spec)
    build_cache(target, items, directory, spec, show_progress=False, **options)
    finalize_cache(directory)
    return TargetCache(directory)
