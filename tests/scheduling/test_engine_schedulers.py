"""Schedulers through SpecEngine: the verified length changes, the output law does not.

An untrained DSpark drafter on the confined target (see stat_helpers) with its confidence
head scaled up, so confidences spread over (0, 1) and every scheduler picks a variety of
lengths. At temperature 1 the first three generated tokens must fit the target's exact
joint law (chi-square, p > 1e-3), as in the drafter's own end-to-end test.
"""

from __future__ import annotations

import pytest
import torch
from stat_helpers import PROMPT, chi_square_p_value, exact_first_tokens, sample_first_tokens

from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkProposer
from vlmspec.engine import SpecEngine
from vlmspec.scheduling import build_scheduler
from vlmspec.types import SamplingParams

SCHEDULERS = {
    "threshold": dict(threshold=0.5),
    "sps": dict(sps="cpu"),
    "prefix": dict(sps="cpu"),
}


def spread_drafter(target) -> DSparkDrafter:
    torch.manual_seed(0)
    config = DSparkConfig.for_target(target, head_rank=16, block_size=4)
    drafter = DSparkDrafter.from_target(target, config)
    with torch.no_grad():
        drafter.confidence.proj.weight.normal_(0.0, 1.0)  # confidences spread over (0, 1)
        for p in drafter.head.parameters():
            p.normal_(0.0, 0.5)
    return drafter


@pytest.fixture(scope="module")
def drafter(confined_target) -> DSparkDrafter:
    return spread_drafter(confined_target)


@pytest.mark.parametrize("name", SCHEDULERS)
def test_greedy_output_is_unchanged_and_lengths_vary(name, confined_target, drafter, astronaut):
    engine = SpecEngine(confined_target, DSparkProposer(drafter), build_scheduler(name, **SCHEDULERS[name]))
    alone = engine.generate(astronaut, PROMPT, max_new_tokens=24, speculative=False)
    spec = engine.generate(astronaut, PROMPT, max_new_tokens=24)
    assert spec.token_ids == alone.token_ids
    lengths = spec.stats.verified_lengths
    assert len(lengths) == spec.stats.rounds and max(lengths) <= drafter.config.block_size


@pytest.mark.parametrize("name", SCHEDULERS)
def test_sampled_output_follows_the_target_distribution(name, confined_target, drafter, astronaut):
    params = SamplingParams(temperature=1.0)
    joint = exact_first_tokens(confined_target, astronaut, params)
    engine = SpecEngine(confined_target, DSparkProposer(drafter), build_scheduler(name, **SCHEDULERS[name]))
    runs = 300
    counts, totals = sample_first_tokens(engine, astronaut, runs, params, joint)
    # The scheduler must really have cut blocks short, and drafts must be both kept and rejected.
    assert totals["verified"] < totals["drafted"], f"{name} verified every draft: the test would not bite"
    assert 0 < totals["accepted"] < totals["verified"]
    assert chi_square_p_value(counts, runs * torch.tensor(list(joint.values()), dtype=torch.float64)) > 1e-3
