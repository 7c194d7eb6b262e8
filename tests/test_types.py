"""SpecStats (per-round counting, pooled statistics of several generations) and DraftBlock.truncated."""

from __future__ import annotations

import re

import pytest
import torch

from vlmspec.types import DraftBlock, RequestOptions, SamplingParams, SpecStats


def _stats(*rounds: tuple[int, int, int], new_tokens: int = 0, total_s: float = 0.0) -> SpecStats:
    """A SpecStats with rounds given as (drafted, verified, accepted)."""
    stats = SpecStats(new_tokens=new_tokens, total_s=total_s)
    for drafted, verified, accepted in rounds:
        stats.record_round(drafted=drafted, verified=verified, accepted=accepted)
    return stats


def test_acceptance_by_position_counts_only_rounds_that_verified_the_position():
    stats = _stats((2, 2, 2), (2, 2, 1), (2, 1, 0))
    assert stats.verified_by_position == [3, 2] and stats.accepted_by_position == [2, 1]
    assert stats.acceptance_by_position == pytest.approx([2 / 3, 0.5])
    assert stats.tau == pytest.approx((3 + 3) / 3) and stats.mean_verified_length == pytest.approx(5 / 3)
    assert SpecStats().tau == 0.0 and SpecStats().acceptance_by_position == []


def test_merge_pools_every_round_not_the_mean_of_taus():
    short = _stats((4, 4, 4), new_tokens=5, total_s=1.0)  # tau 5 over one round
    long = _stats((4, 3, 0), (4, 3, 0), (4, 3, 0), new_tokens=3, total_s=2.0)  # tau 1 over three rounds
    merged = SpecStats.merge([short, long])
    assert merged.rounds == 4 and merged.accepted == 4 and merged.drafted == 16 and merged.verified == 13
    assert merged.tau == pytest.approx(8 / 4)  # the mean of the two taus would be 3
    assert merged.verified_by_position == [4, 4, 4, 1] and merged.accepted_by_position == [1, 1, 1, 1]
    assert merged.acceptance_by_position == pytest.approx([0.25, 0.25, 0.25, 1.0])
    assert merged.verified_lengths == [4, 3, 3, 3] and merged.new_tokens == 8 and merged.total_s == pytest.approx(3.0)
    assert short.rounds == 1 and long.rounds == 3  # the inputs are left as they were
    assert SpecStats.merge([]).tau == 0.0 and SpecStats.merge([short]).as_dict() == short.as_dict()


def test_truncated_block_keeps_the_slots_to_verify():
    block = DraftBlock(
        tokens=torch.tensor([[5, 6, 7, 8], [1, 2, 0, 0]]),  # [B=2, gamma=4]; row 1 drafted two
        num_tokens=torch.tensor([4, 2]),
        draft_probs=torch.full((2, 4, 9), 1 / 9),
        confidences=torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.0, 0.0]]),
    )
    cut = block.truncated(torch.tensor([3, 5]))
    assert cut.num_tokens.tolist() == [3, 2] and cut.gamma == 3  # never more than drafted; as wide as the longest row
    assert cut.tokens.tolist() == [[5, 6, 7], [1, 2, 0]] and cut.draft_probs.shape == (2, 3, 9)
    assert torch.equal(cut.confidences, block.confidences[:, :3])
    none = block.truncated(torch.tensor([0, 0]))
    assert none.gamma == 0 and none.num_tokens.tolist() == [0, 0]


@pytest.mark.parametrize("sources", [None, ("ngram", "model")])
def test_scattered_block_places_the_drafting_rows_and_gives_the_others_nothing(sources):
    block = DraftBlock(
        tokens=torch.tensor([[5, 6], [7, 0]]),  # [2, gamma=2]: the two requests that speculate
        num_tokens=torch.tensor([2, 1]),
        draft_probs=torch.full((2, 2, 9), 1 / 9),
        confidences=torch.tensor([[0.9, 0.8], [0.5, 0.0]]),
        sources=sources,
    )
    full = block.scattered([3, 0], total=4)
    assert full.tokens.tolist() == [[7, 0], [0, 0], [0, 0], [5, 6]] and full.num_tokens.tolist() == [1, 0, 0, 2]
    assert full.draft_probs.shape == (4, 2, 9) and not full.draft_probs[1:3].any()
    assert torch.equal(full.confidences[[3, 0]], block.confidences) and not full.confidences[1:3].any()
    assert full.sources == (None if sources is None else ("model", "none", "none", "ngram"))


@pytest.mark.parametrize(
    "field, value, valid",
    [
        ("temperature", float("nan"), ">= 0"),
        ("temperature", float("inf"), ">= 0"),
        ("temperature", -0.5, ">= 0"),
        ("top_p", float("nan"), "(0, 1]"),
        ("top_p", float("inf"), "(0, 1]"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_k", 0, ">= 1"),
        ("top_k", True, ">= 1"),
        ("max_new_tokens", 0, ">= 1"),
        ("max_new_tokens", 2.0, ">= 1"),
        ("seed", 1.5, "[-2**63, 2**64)"),
        ("seed", 2**64, "[-2**63, 2**64)"),
        ("stop", "", "non-empty"),
        ("stop", ["ok", 3], "non-empty"),
        ("speculative", 1, "True or False"),
    ],
)
def test_request_options_refuse_a_bad_value_naming_the_field_and_its_range(field, value, valid):
    with pytest.raises(ValueError, match=f"^{field} .*{re.escape(valid)}"):
        RequestOptions.build(**{field: value})
    if field in ("temperature", "top_k", "top_p"):  # the distribution alone checks the same, in the same place
        with pytest.raises(ValueError, match=f"^{field} "):
            SamplingParams(**{field: value})


def test_request_options_normalise_stop_strings_once_and_build_from_keywords():
    assert RequestOptions(stop="###").stop == ("###",) and RequestOptions(stop=None).stop == ()
    options = RequestOptions.build(max_new_tokens=8, temperature=0.7, stop=["a", "b"])
    assert options.stop == ("a", "b") and hash(options) == hash(RequestOptions.build(options))
    assert RequestOptions.build(options) is options  # no keywords: the same object, not a copy
    reseeded = RequestOptions.build(options, seed=3)
    assert (reseeded.seed, reseeded.max_new_tokens, reseeded.stop) == (3, 8, ("a", "b"))
    assert options.sampling == SamplingParams(temperature=0.7) == reseeded.sampling  # seeds apart, one distribution
    assert RequestOptions.build() == RequestOptions() and RequestOptions().sampling.greedy
    with pytest.raises(TypeError, match="unknown request options \\['temprature'\\]"):
        RequestOptions.build(temprature=0.5)
    with pytest.raises(TypeError, match="RequestOptions"):
        RequestOptions.build(SamplingParams())
