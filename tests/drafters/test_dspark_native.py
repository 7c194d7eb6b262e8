"""The native drafting round (vlmspec/kernels/cpu_draft.cpp) against the PyTorch drafter.

For every head kind, both dtypes, greedy and sampled drafting, and the whole or a reduced
draft vocabulary, a sequence of rounds (spans of 12, 3, 1, 0 and 5 committed tokens) runs
through :class:`NativeRound` and through :meth:`DSparkDrafter.draft` over a cache filled by
``context_kv``, with generators seeded alike. Stated tolerances (absolute, on the draft
probabilities, the confidences and the context keys/values the round writes):

* float32: ``FLOAT32_ATOL`` = 1e-5 (measured: under 1e-6; the linears are the same kernels, the
  norms, RoPE, attention and softmax differ by float32 summation order and exp/cos ulps);
* bfloat16: ``BFLOAT16_ATOL`` = 2e-2 (measured: under 6e-3): a bfloat16 ulp is 2^-8 relative,
  and one rounding that goes the other way moves a logit by about that much.

A bfloat16 drafter beside a float32 target (the default on a CPU with AVX512-BF16, see
``vlmspec.loading.drafting_dtype``) reads the target's float32 embedding and LM head rows in
bfloat16, with bfloat16's tolerance.

Drafts are the same tokens in every case checked here (a draft could differ only where two
logits tie within those tolerances; the tiny random models here have no such ties).
"""

from __future__ import annotations

import pytest
import torch
from test_dspark import StubTarget, make_drafter, random_context, updates

from vlmspec.drafters.dspark import DraftContextCache, DSparkProposer
from vlmspec.drafters.dspark.native import NativeRound
from vlmspec.types import SamplingParams

FLOAT32_ATOL = 1e-5
BFLOAT16_ATOL = 2e-2
SPANS = (12, 3, 1, 0, 5)


# (the drafter's dtype, the target's): each alone, and a float32 target drafting in bfloat16
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


def drafter_in(dtype: torch.dtype, kind: str, draft_vocab: int | None, target_dtype: torch.dtype | None = None):
    target = StubTarget(vocab=96, hidden=32)
    drafter = make_drafter(target, head_kind=kind, confidence_with_markov=kind != "none", draft_vocab_size=draft_vocab)
    if draft_vocab:
        drafter.set_draft_vocabulary(torch.arange(3, 3 + draft_vocab))
    drafter.to(dtype)
    for module in (target.input_embeddings, target.output_head):
        module.to(target_dtype or dtype)
    return drafter


def native_or_skip(drafter) -> NativeRound:
    native = NativeRound(drafter)
    if not native.available():
        pytest.skip("the native drafting round needs AVX-512 (float32) or AVX512-BF16 (bfloat16) and the CPU kernels")
    return native


@pytest.mark.parametrize("draft_vocab", [None, 40])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kind", ["none", "vanilla", "gated", "rnn"])
@pytest.mark.parametrize(("dtype", "target_dtype"), DTYPES)
def test_native_round_drafts_what_the_pytorch_drafter_drafts(dtype, target_dtype, kind, temperature, draft_vocab):
    drafter = drafter_in(dtype, kind, draft_vocab, target_dtype)
    native = native_or_skip(drafter)
    atol = FLOAT32_ATOL if dtype == torch.float32 else BFLOAT16_ATOL
    features, positions = random_context(drafter, sum(SPANS) + 1)
    features = features.to(target_dtype)  # the target's features: the round casts them to the drafter's dtype
    reference_cache, native_cache = DraftContextCache(), DraftContextCache()
    reference_gen, native_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    start = 0
    for n in SPANS:
        span, span_positions = features[start : start + n], positions[start : start + n]
        anchor, anchor_position = (7 * start + 1) % 90, int(positions[start + n])
        start += n
        with torch.inference_mode():
            if n:
                reference_cache.append(drafter.context_kv(span[None], span_positions[None]))
            reference = drafter.draft(
                torch.tensor([anchor]), torch.tensor([anchor_position]), reference_cache.layers(), temperature,
                reference_gen,
            )  # fmt: skip
        assert native.available()
        tokens, probs, confidences = native(
            native_cache, span, span_positions, anchor, anchor_position, temperature, native_gen
        )
        assert torch.equal(tokens, reference.tokens[0])
        torch.testing.assert_close(confidences, reference.confidences[0], atol=atol, rtol=0)
        if temperature == 0:
            assert probs is None
        else:
            expected = torch.softmax(reference.logits[0] / temperature, dim=-1)  # [G, N], what the draws used
            torch.testing.assert_close(probs, expected, atol=atol, rtol=0)
        assert len(native_cache) == len(reference_cache)
        for (k, v), (k_ref, v_ref) in zip(native_cache.layers(), reference_cache.layers()):
            torch.testing.assert_close(k.float(), k_ref.float(), atol=atol, rtol=0)
            torch.testing.assert_close(v.float(), v_ref.float(), atol=atol, rtol=0)
    assert torch.equal(reference_gen.get_state(), native_gen.get_state())  # the same draws, nothing more


@pytest.mark.parametrize(("dtype", "target_dtype"), DTYPES)
def test_proposer_takes_the_native_round_for_one_request_and_the_same_drafts_either_way(dtype, target_dtype):
    """One request through the proposer (native) and the same request padded into a batch (PyTorch)."""
    drafter = drafter_in(dtype, "vanilla", None, target_dtype)
    native_or_skip(drafter)
    proposer = DSparkProposer(drafter)
    params = [SamplingParams(temperature=0.0)] * 2
    alone, batched, other = proposer.new_state(), proposer.new_state(), proposer.new_state()
    stream, other_stream = list(updates(drafter, [70, 3, 1])), list(updates(drafter, [2, 2, 2]))
    for update, second in zip(stream, other_stream):  # the first span is longer than a native round absorbs
        update.features, second.features = update.features.to(target_dtype), second.features.to(target_dtype)
        single = proposer.propose([alone], [update], params[:1], [torch.Generator()])
        pair = proposer.propose([batched, other], [update, second], params, [torch.Generator()] * 2)
        assert torch.equal(single.tokens[0], pair.tokens[0])
        atol = FLOAT32_ATOL if dtype == torch.float32 else BFLOAT16_ATOL
        torch.testing.assert_close(single.confidences[0], pair.confidences[0], atol=atol, rtol=0)
    assert len(alone.cache) == len(batched.cache) == 74


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_greedy_tie_goes_to_the_first_draft_id_as_in_pytorch(dtype):
    """Greedy draws split the draft vocabulary over the threads, 8 logits at a time: a tie must still go to
    the lowest index, as torch.argmax gives it. Every LM head row is zero but two equal ones, in the
    second half of a 37-id vocabulary (37: a share that ends in a scalar tail), so the base logits tie
    exactly: at those two ids where their dot product is positive, else at the 35 zeros."""
    drafter = drafter_in(dtype, "none", 37)
    row = torch.randn(drafter.vocabulary.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        weight = drafter.vocabulary.lm_head.weight
        weight.zero_()
        weight[3 + 22] = weight[3 + 35] = row.to(dtype)  # draft ids 22 and 35 (the vocabulary is ids 3..39)
    native = native_or_skip(drafter)
    features, positions = random_context(drafter, 8)
    drafted = set()
    for anchor in range(8):
        with torch.inference_mode():
            cache = DraftContextCache()
            cache.append(drafter.context_kv(features[None, :7].to(dtype), positions[None, :7]))
            reference = drafter.draft(torch.tensor([anchor]), positions[7:8], cache.layers(), 0.0, None)
        tokens, _, _ = native(
            DraftContextCache(), features[:7].to(dtype), positions[:7], anchor, int(positions[7]), 0.0, None
        )
        assert torch.equal(tokens, reference.tokens[0])
        drafted |= set(tokens.tolist())
    assert drafted <= {3, 3 + 22}  # only ever the first of the tied ids


def test_weights_are_rebuilt_when_the_drafter_changes():
    drafter = drafter_in(torch.float32, "vanilla", None)
    native = native_or_skip(drafter)
    first = native.weights()
    assert native.weights() is first  # built once
    with torch.no_grad():
        drafter.head.out.weight.mul_(2.0)  # e.g. a training step between rounds
    assert native.weights() is not first


def test_native_round_refuses_a_span_longer_than_it_absorbs():
    drafter = drafter_in(torch.float32, "vanilla", None)
    native = native_or_skip(drafter)
    features, positions = random_context(drafter, 70)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        native(DraftContextCache(), features, positions, 1, 70, 0.0, None)
