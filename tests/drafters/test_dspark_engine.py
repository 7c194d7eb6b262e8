"""End to end: SpecEngine with an untrained DSpark drafter is lossless on tiny Qwen-VL targets.

Greedy: token for token the target's own output, for each family, with an image.
Sampling (temperature 1): the joint distribution of the first three generated tokens
matches the target's exact distribution (chi-square). A random drafter over the
151,669-token vocabulary would almost never propose a token the target likes, and then
any wrong ``draft_probs`` would go unnoticed; so the sampling test gives the target's LM
head a bias that confines both models to the same four tokens. The untrained drafter
then overlaps the target well enough that drafts are both accepted and rejected.
"""

from __future__ import annotations

import torch
from stat_helpers import PROMPT, SUPPORT, chi_square_p_value, exact_first_tokens

from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkProposer
from vlmspec.engine import SpecEngine
from vlmspec.types import SamplingParams


def untrained_drafter(target, **overrides) -> DSparkDrafter:
    torch.manual_seed(0)
    config = DSparkConfig.for_target(target, **{"head_rank": 16, "block_size": 4, **overrides})
    return DSparkDrafter.from_target(target, config)


def test_greedy_with_an_untrained_drafter_equals_the_target_alone(family, make_target, astronaut):
    target = make_target(family)
    engine = SpecEngine(target, DSparkProposer(untrained_drafter(target)))
    alone = engine.generate(astronaut, PROMPT, max_new_tokens=10, speculative=False)
    spec = engine.generate(astronaut, PROMPT, max_new_tokens=10)
    assert spec.token_ids == alone.token_ids
    assert spec.stats.drafted > 0 and spec.stats.rounds > 0


def test_greedy_on_the_confined_target_accepts_drafts_and_stays_exact(confined_target, astronaut):
    engine = SpecEngine(confined_target, DSparkProposer(untrained_drafter(confined_target)))
    alone = engine.generate(astronaut, PROMPT, max_new_tokens=12, speculative=False)
    spec = engine.generate(astronaut, PROMPT, max_new_tokens=12)
    assert spec.token_ids == alone.token_ids
    assert spec.stats.accepted > 0  # the acceptance path ran


def scale_up_head(drafter: DSparkDrafter) -> None:
    """Random head weights of std 0.5, so that the head's bias visibly shapes ``draft_probs``."""
    with torch.no_grad():
        for p in drafter.head.parameters():
            p.normal_(0.0, 0.5)


def assert_first_tokens_follow(joint: dict, engine: SpecEngine, image, runs: int = 250) -> None:
    """``runs`` seeded generations at temperature 1: the first three tokens fit ``joint`` (chi-square p > 1e-3)."""
    index = {seq: i for i, seq in enumerate(joint)}
    counts = torch.zeros(len(joint), dtype=torch.float64)
    accepted = verified = 0
    for seed in range(runs):
        result = engine.generate(image, PROMPT, max_new_tokens=3, temperature=1.0, seed=seed)
        counts[index[tuple(result.token_ids)]] += 1
        accepted += result.stats.accepted
        verified += result.stats.verified
    assert 0 < accepted < verified, "both accepted and rejected drafts must occur for the test to bite"
    expected = runs * torch.tensor(list(joint.values()), dtype=torch.float64)
    assert chi_square_p_value(counts, expected) > 1e-3


def test_sampling_with_an_untrained_drafter_follows_the_target_distribution(confined_target, astronaut):
    """250 seeded generations at temperature 1: the first three tokens fit the exact joint (p > 1e-3).

    Token 1 comes from the prefill; tokens 2 and 3 from the first round (an accepted
    draft then the bonus token, or the recovered token then the next round). The head's
    random weights are scaled up so that its bias visibly shapes ``draft_probs``.
    """
    params = SamplingParams(temperature=1.0)
    joint = exact_first_tokens(confined_target, astronaut, params)
    assert abs(sum(joint.values()) - 1.0) < 1e-4  # the bias really confines the target to SUPPORT
    drafter = untrained_drafter(confined_target, block_size=3)
    scale_up_head(drafter)
    assert_first_tokens_follow(joint, SpecEngine(confined_target, DSparkProposer(drafter)), astronaut)


def reduced_vocabulary_drafter(target, ids, **overrides) -> DSparkDrafter:
    drafter = untrained_drafter(target, draft_vocab_size=len(ids), **overrides)
    drafter.set_draft_vocabulary(torch.tensor(ids))
    return drafter


def test_greedy_with_a_reduced_draft_vocabulary_equals_the_target_alone(confined_target, astronaut):
    # Three of the four tokens the target can produce, and ids it never produces.
    drafter = reduced_vocabulary_drafter(confined_target, [*SUPPORT[:3], 11, 12, 13])
    engine = SpecEngine(confined_target, DSparkProposer(drafter))
    alone = engine.generate(astronaut, PROMPT, max_new_tokens=12, speculative=False)
    spec = engine.generate(astronaut, PROMPT, max_new_tokens=12)
    assert spec.token_ids == alone.token_ids
    assert spec.stats.accepted > 0


def test_sampling_with_a_reduced_draft_vocabulary_follows_the_target_distribution(confined_target, astronaut):
    """As above, with a draft vocabulary that misses one of the target's four tokens (p > 1e-3, 250 runs).

    The drafter can never propose the missing token, so the target's recovered draws
    must restore its mass; wrong scattering of ``draft_probs`` onto the full vocabulary
    would shift the joint.
    """
    params = SamplingParams(temperature=1.0)
    joint = exact_first_tokens(confined_target, astronaut, params)
    drafter = reduced_vocabulary_drafter(confined_target, [*SUPPORT[:3], 11, 12], block_size=3)
    scale_up_head(drafter)
    assert_first_tokens_follow(joint, SpecEngine(confined_target, DSparkProposer(drafter)), astronaut)
