"""Fixtures for the training tests: one tiny target, prompts, and a small greedy cache built once."""

from __future__ import annotations

import pytest
from training_helpers import GSM8K_MINI, greedy_spec, write_cache

from vlmspec.training import TargetCache, load_prompt_sources


@pytest.fixture(scope="session")
def target(make_target):
    """Tiny random Qwen2.5-VL (hidden 64, 4 layers, the real 151,669-token vocabulary)."""
    return make_target("qwen2_5_vl")


@pytest.fixture(scope="session")
def prompts():
    return load_prompt_sources([GSM8K_MINI])


@pytest.fixture(scope="session")
def small_cache(target, prompts, tmp_path_factory) -> TargetCache:
    """Greedy answers of 10 tokens to 8 prompts."""
    return write_cache(target, prompts[:8], tmp_path_factory.mktemp("cache"), greedy_spec(target), shard_size=4)
