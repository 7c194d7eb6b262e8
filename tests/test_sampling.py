"""vlmspec.sampling: the target's warper chain, and seeded inverse-CDF draws."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vlmspec.sampling import mask_top_k, mask_top_p, residual_probs, sample, sample_from_uniforms, target_probs
from vlmspec.types import SamplingParams


def generators(num: int, seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + r) for r in range(num)]


def tv_bound(num_categories: int, num_samples: int, failure_prob: float = 1e-6) -> float:
    """A bound that the TV distance between an empirical and the true distribution exceeds
    with probability at most ``failure_prob``.

    E[TV] <= 1/2 sum_x sqrt(p_x (1 - p_x) / N) <= 1/2 sqrt(V / N) (Cauchy-Schwarz), and TV
    moves by at most 1/N when one sample changes, so McDiarmid gives
    P(TV >= E[TV] + t) <= exp(-2 N t^2), i.e. t = sqrt(ln(1 / failure_prob) / (2 N)).
    """
    return 0.5 * math.sqrt(num_categories / num_samples) + math.sqrt(math.log(1 / failure_prob) / (2 * num_samples))


def test_temperature_divides_logits_before_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = target_probs(logits, SamplingParams(temperature=0.5))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, dim=-1))
    assert torch.equal(target_probs(logits, SamplingParams(temperature=1.0)), torch.softmax(logits, dim=-1))


def test_input_logits_are_not_modified_and_any_float_dtype_works() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    before = logits.clone()
    probs = target_probs(logits, SamplingParams(temperature=0.7, top_k=5, top_p=0.9))
    assert torch.equal(logits, before)
    assert probs.dtype == torch.float32 and probs.shape == (3, 50)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_top_k_keeps_exactly_k_distinct_tokens() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=7))
    assert ((probs > 0).sum(-1) == 7).all()
    assert torch.equal((probs > 0).nonzero()[:, 1].view(4, 7).sort(-1).values, logits.topk(7).indices.sort(-1).values)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_top_k_keeps_every_token_tied_with_the_kth_as_transformers_does() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])
    kept = target_probs(logits, SamplingParams(temperature=1.0, top_k=2)) > 0
    assert kept.tolist() == [[True, True, True, True, False]]
    hf = TopKLogitsWarper(2)(None, logits)
    assert torch.equal(kept, hf > float("-inf"))


def test_top_p_keeps_the_minimal_nucleus_hand_computed() -> None:
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()  # ranks: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    # 0.5 < 0.7 <= 0.5 + 0.3: the nucleus is {1, 3}, renormalised to 0.5/0.8 and 0.3/0.8.
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.625, 0.0, 0.375]))
    # 0.8 < 0.9 <= 0.95: three tokens.
    assert (target_probs(logits, SamplingParams(temperature=1.0, top_p=0.9)) > 0).tolist() == [False, True, True, True]
    # 0.4 <= 0.5: the top token alone reaches it.
    top_only = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.4)) > 0
    assert top_only.tolist() == [False, True, False, False]


def test_top_p_always_keeps_one_token() -> None:
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 64).float())


def test_top_p_breaks_ties_by_lowest_index() -> None:
    logits = torch.zeros(1, 4)  # four tokens of 0.25: two of them reach top_p = 0.5
    kept = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5)) > 0
    assert kept.tolist() == [[True, True, False, False]]


def test_top_p_after_top_k_sorts_only_the_survivors_with_the_same_result() -> None:
    # six tokens tie for the top: top-k=3 keeps all six, top-p=0.5 then keeps the three lowest indices
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0, 2.0, 2.0, 2.0, 0.5, 2.0, 1.0]])
    kept = target_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.5)) > 0
    assert kept.nonzero()[:, 1].tolist() == [1, 2, 4]
    # the fast path (sorting the survivors of top-k) equals sorting the whole vocabulary, ties included
    tied = (4.0 * torch.randn(8, 5000, generator=torch.Generator().manual_seed(6))).to(torch.bfloat16)
    params = SamplingParams(temperature=0.9, top_k=60, top_p=0.7)
    full_sort = torch.softmax(mask_top_p(mask_top_k(tied.float() / 0.9, 60), 0.7), dim=-1)
    fast = target_probs(tied, params)
    assert torch.equal(fast > 0, full_sort > 0)
    torch.testing.assert_close(fast, full_sort, atol=1e-6, rtol=1e-5)


def test_greedy_is_the_one_hot_argmax_with_ties_to_the_lowest_index() -> None:
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [7.0, -1.0, 7.0, 7.0]], dtype=torch.bfloat16)
    probs = target_probs(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def hf_warped_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The chain transformers' ``generate`` builds for these params (float32 logits, then softmax)."""
    scores = logits.float()
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(float(params.temperature))(None, scores)
    if params.top_k is not None:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p is not None and params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
@pytest.mark.parametrize(("top_k", "top_p"), [(None, None), (20, None), (None, 0.8), (50, 0.95), (5, 0.5), (None, 1.0)])
def test_agrees_with_transformers_warpers(temperature: float, top_k: int | None, top_p: float | None) -> None:
    logits = 3.0 * torch.randn(16, 2000, generator=torch.Generator().manual_seed(3))  # distinct values: no ties
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours, theirs = target_probs(logits, params), hf_warped_probs(logits, params)
    # Same arithmetic in the same order, so the support is identical and the probabilities
    # agree to float32 rounding (we allow 1e-6 absolute, 1e-5 relative).
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"), [(None, None, 0.05), (50, None, 0.2), (None, 0.9, 0.1), (40, 0.8, 0.3)]
)
def test_min_p_agrees_with_transformers_warpers(top_k: int | None, top_p: float | None, min_p: float) -> None:
    logits = 3.0 * torch.randn(16, 2000, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
    ours, theirs = target_probs(logits, params), hf_warped_probs(logits, params)
    assert torch.equal(ours > 0, theirs > 0)
    assert ((ours > 0).sum(-1) < (target_probs(logits, SamplingParams(0.7, top_k, top_p)) > 0).sum(-1)).any()
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_top_k_agrees_with_transformers_on_tied_bf16_logits() -> None:
    # bf16 logits (what a bf16 model emits) tie often; both keep every tie at the k-th value.
    logits = (4.0 * torch.randn(8, 5000, generator=torch.Generator().manual_seed(4))).to(torch.bfloat16)
    params = SamplingParams(temperature=0.8, top_k=40)
    ours, theirs = target_probs(logits, params), hf_warped_probs(logits, params)
    assert ((ours > 0).sum(-1) > 40).any(), "the example should contain a tie at the boundary"
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_bad_logits_raise_a_clear_error() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        target_probs(torch.tensor([1, 2, 3]), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="top_k"):
        mask_top_k(torch.zeros(3), 0)


def test_sampled_frequencies_match_probs(sampler_path: str) -> None:
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    num = 20_000
    drawn = sample(probs.expand(num, -1), generators(num, seed=10))
    freq = torch.bincount(drawn, minlength=6).float() / num
    tv = 0.5 * (freq - probs).abs().sum().item()
    assert tv <= tv_bound(6, num), (tv, freq)


def test_zero_probability_tokens_are_never_drawn_even_at_the_edges(sampler_path: str) -> None:
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.0, 0.7, 0.0]] * 5)
    # the extreme uniforms: 0 and the largest float64 below 1, plus cut points of the CDF
    uniforms = torch.tensor([0.0, 1.0 - 2.0**-53, 0.3, 0.7, 0.5], dtype=torch.float64)
    drawn = sample_from_uniforms(probs, uniforms)
    assert set(drawn.tolist()) <= {1, 4}
    many = sample(torch.tensor([[0.0, 1e-30, 0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5000, -1), generators(5000, seed=11))
    assert set(many.tolist()) <= {1, 3, 5}


def test_same_seeds_give_the_same_draws() -> None:
    probs = torch.softmax(torch.randn(64, 1000, generator=torch.Generator().manual_seed(5)), dim=-1)
    first, second = sample(probs, generators(64, seed=7)), sample(probs, generators(64, seed=7))
    assert torch.equal(first, second)
    assert not torch.equal(first, sample(probs, generators(64, seed=8)))


def test_sample_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="one torch.Generator per row"):
        sample(torch.full((3, 4), 0.25), generators(2, seed=0))
    with pytest.raises(ValueError, match="positive mass"):
        sample(torch.zeros(1, 4), generators(1, seed=0))


def test_residual_is_the_normalised_positive_part_with_a_safe_fallback() -> None:
    target = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    draft = torch.tensor([[0.2, 0.6, 0.2], [0.2, 0.3, 0.5]])
    residual = residual_probs(target, draft)
    torch.testing.assert_close(residual[0], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual[1], target[1])  # target == draft: fall back to the target
