"""The native sampler (vlmspec/kernels/cpu_sampling.cpp, cpu_rejection.cpp) against the PyTorch reference, draw for draw.

Stated tolerance (see vlmspec.sampling's docstring): the warped probabilities agree to float32
rounding with the same support, and the draws are the reference's bit for bit given the same
probabilities and uniforms. End to end (logits -> token, same uniforms), a token may differ
only where the uniform lands within float32 rounding of a boundary of the reference's CDF; the
checks below assert that every difference is such a case (with these seeds there are none).
The statistical tests of test_sampling, test_verify and test_sampling_params run through both
paths (the ``sampler_path`` fixture).
"""

from __future__ import annotations

import pytest
import torch

from vlmspec import sampling
from vlmspec.kernels import cpu_kernels
from vlmspec.types import DraftBlock, SamplingParams
from vlmspec.verify import native_rejection_from_uniforms, reference_rejection_from_uniforms

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernel_available(), reason="vlmspec's CPU kernel is not available here (no C++ compiler)"
)

REFERENCE_VOCAB = 49_156  # the reference target's vocabulary
PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    SamplingParams(temperature=0.8, min_p=0.05),
    SamplingParams(temperature=0.7, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=1.5, top_p=0.95),  # a flat nucleus of thousands of tokens
    SamplingParams(temperature=1.0, top_p=0.9995),  # past the ladder's margin: every token is a candidate
    SamplingParams(temperature=0.9, top_k=REFERENCE_VOCAB + 5, top_p=1.0, min_p=0.0),  # filters that keep all
    SamplingParams(temperature=0.5, top_k=1000, top_p=0.5, min_p=0.01, logit_bias={5: 30.0, 7: -100, 49_155: 2}),
]


def logits_like_a_model(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Heavy-tailed logits: a few clear favourites over a broad floor, as a language model's."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(rows, vocab, generator=gen)
    logits += 8.0 * (torch.rand(rows, vocab, generator=gen) < 0.002)
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_warped_probabilities_match_the_reference(params: SamplingParams, dtype: torch.dtype) -> None:
    logits = logits_like_a_model(24, REFERENCE_VOCAB, dtype, seed=1)
    ours, reference = sampling.native_target_probs(logits, params), sampling.reference_target_probs(logits, params)
    assert ours.dtype == torch.float32 and ours.shape == logits.shape
    assert torch.equal(ours > 0, reference > 0), "the same tokens survive"
    torch.testing.assert_close(ours, reference, atol=1e-7, rtol=2e-5)


@pytest.mark.parametrize("vocab", [1, 5, 8, 13, 100])
def test_small_vocabularies_and_leading_dims(vocab: int) -> None:
    logits = logits_like_a_model(6, vocab, torch.float32, seed=vocab).reshape(2, 3, vocab)
    for params in PARAMS[:7]:
        ours, reference = sampling.native_target_probs(logits, params), sampling.reference_target_probs(logits, params)
        assert torch.equal(ours > 0, reference > 0), params
        torch.testing.assert_close(ours, reference, atol=1e-7, rtol=2e-5)


def test_top_k_keeps_every_tie_in_bf16_as_the_reference() -> None:
    logits = (4.0 * torch.randn(8, 5000, generator=torch.Generator().manual_seed(4))).to(torch.bfloat16)
    params = SamplingParams(temperature=0.8, top_k=40)
    ours = sampling.native_target_probs(logits, params)
    assert ((ours > 0).sum(-1) > 40).any(), "the example should contain a tie at the boundary"
    assert torch.equal(ours > 0, sampling.reference_target_probs(logits, params) > 0)


def test_extreme_inputs_stay_finite() -> None:
    logits = 40.0 * torch.randn(3, 2000, generator=torch.Generator().manual_seed(2))
    logits[0, :100] = float("-inf")
    logits[1] = 0.0  # all tied
    for temperature in (1e-5, 1e-3, 1.0, 1e30, 1e300):
        params = SamplingParams(temperature=temperature, top_p=0.9, min_p=0.2, logit_bias={3: -100.0})
        ours, reference = sampling.native_target_probs(logits, params), sampling.reference_target_probs(logits, params)
        assert torch.isfinite(ours).all() and torch.allclose(ours.sum(-1), torch.ones(3))
        assert (ours[0, :100] == 0).all()
        if temperature <= 1.0:  # above, every score is within rounding of a tie: the nucleus edge is rounding
            assert torch.equal(ours > 0, reference > 0), temperature


def test_greedy_params_give_the_biased_argmax() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1e-30, logit_bias={17: 50.0})
    assert torch.equal(sampling.native_target_probs(logits, params), sampling.reference_target_probs(logits, params))
    assert sampling.native_target_probs(logits, params).argmax(-1).tolist() == [17] * 4


def test_the_draw_is_the_reference_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(3 * torch.randn(2000, 3000, generator=gen), -1)
    probs[:, 100:200] = 0.0  # zero chunks are skipped natively: they must change nothing
    uniforms = torch.rand(2000, generator=gen, dtype=torch.float64)
    uniforms[:3] = torch.tensor([0.0, 1.0 - 2.0**-53, 0.5], dtype=torch.float64)
    native = sampling.native_sample_from_uniforms(probs, uniforms)
    assert torch.equal(native, sampling.reference_sample_from_uniforms(probs, uniforms))
    assert not (probs.gather(1, native[:, None]) == 0).any()


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_is_the_reference_bit_for_bit(deterministic: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    batch, gamma, vocab = 512, 4, 3000
    for top_p in (None, 0.9):
        logits = 2 * torch.randn(batch, gamma + 1, vocab, generator=gen)
        target = sampling.reference_target_probs(logits, SamplingParams(temperature=0.8, top_p=top_p))
        draft = torch.softmax(logits[:, :gamma] + torch.randn(batch, gamma, vocab, generator=gen), -1)
        tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, gamma)
        tokens[:64, 0] = target[:64, 0].argmax(-1)  # some drafts the target likes
        num_tokens = torch.randint(0, gamma + 1, (batch,), generator=gen)
        uniforms = torch.rand(batch, gamma + 1, generator=gen, dtype=torch.float64)
        block = DraftBlock(tokens, num_tokens, None if deterministic else draft)
        ours = native_rejection_from_uniforms(block, target, uniforms)
        reference = reference_rejection_from_uniforms(block, target, uniforms)
        assert torch.equal(ours.num_accepted, reference.num_accepted)
        assert torch.equal(ours.next_tokens, reference.next_tokens)
        assert 0 < int(ours.num_accepted.sum()) < int(num_tokens.sum()), "both accepts and rejects occur"


def test_a_residual_without_mass_falls_back_to_the_target() -> None:
    target = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])  # [1, gamma + 1, 3]
    block = DraftBlock(torch.tensor([[2]]), torch.tensor([1]), draft_probs=target[:, :1].clone())
    uniforms = torch.tensor([[0.999, 0.7]], dtype=torch.float64)  # the draft (prob 0) is rejected
    ours = native_rejection_from_uniforms(block, target, uniforms)
    reference = reference_rejection_from_uniforms(block, target, uniforms)
    assert (ours.num_accepted.item(), ours.next_tokens.item()) == (0, reference.next_tokens.item())


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_logits_to_tokens_match_the_reference_draw_for_draw(params: SamplingParams) -> None:
    """Same logits and uniforms through both paths: the same token, except within rounding of a CDF boundary."""
    rows = 512
    logits = logits_like_a_model(rows, REFERENCE_VOCAB, torch.bfloat16, seed=7)
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    reference_probs = sampling.reference_target_probs(logits, params)
    reference = sampling.reference_sample_from_uniforms(reference_probs, uniforms)
    ours = sampling.native_sample_from_uniforms(sampling.native_target_probs(logits, params), uniforms)
    differ = (ours != reference).nonzero().flatten().tolist()
    cdf = reference_probs.double().cumsum(-1)
    for row in differ:  # each difference must sit within float32 rounding of a boundary of the CDF
        target = (1.0 - uniforms[row]) * cdf[row, -1]
        assert (cdf[row] - target).abs().min() <= 1e-5 * cdf[row, -1], (row, params)
    assert len(differ) <= rows // 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 63, REFERENCE_VOCAB])
def test_greedy_ids_are_torch_argmax_ties_and_nans_included(vocab: int, dtype: torch.dtype) -> None:
    logits = logits_like_a_model(2 * 9, vocab, dtype, seed=3).view(2, 9, vocab)  # leading dims, rows on 2 threads
    rows = logits.view(-1, vocab)
    if vocab > 1:  # planted ties: each a row's largest value twice, in the 8-lane body, the tail, across lanes
        for r, (first, second) in enumerate([(0, vocab - 1), (vocab // 2, vocab - 1), (1, 9), (vocab - 2, vocab - 1)]):
            first, second = min(first, vocab - 1), min(second, vocab - 1)
            rows[r, first] = rows[r, second] = rows[r].max() + 1
        rows[4, vocab // 3] = float("nan")  # torch.argmax takes a NaN as the largest
        rows[5] = float("-inf")  # nothing finite: the first index
        rows[6, vocab - 1] = float("inf")
    assert torch.equal(sampling.greedy_ids(logits), logits.argmax(dim=-1))
    assert torch.equal(sampling.greedy_ids(logits[0, 0]), logits[0, 0].argmax(dim=-1))  # one row, no leading dims
