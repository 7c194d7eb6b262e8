"""Each loss term against a hand computation; masking, weighting and chunking."""

from __future__ import annotations

import math

import pytest
import torch
from training_helpers import tiny_drafter

from vlmspec.training import LossWeights, block_terms, position_terms, position_weights, reduce_terms
from vlmspec.training.losses import reach_probability

# One block of two positions over a vocabulary of three.
# p_d = (.5, .3, .2) then uniform; p_t = (.2, .3, .5) then uniform
DRAFT = torch.tensor([[[math.log(0.5), math.log(0.3), math.log(0.2)], [0.0, 0.0, 0.0]]])
TARGET = torch.tensor([[[math.log(0.2), math.log(0.3), math.log(0.5)], [0.0, 0.0, 0.0]]])
LABELS = torch.tensor([[2, 0]])
CONFIDENCE = torch.tensor([[0.0, math.log(3.0)]])  # c = 0.5, 0.75


def test_each_term_equals_its_hand_computed_value():
    terms = position_terms(DRAFT, TARGET, LABELS, CONFIDENCE)
    # CE: -log p_d(label)
    torch.testing.assert_close(terms.ce, torch.tensor([[-math.log(0.2), math.log(3.0)]]))
    # TV: ||p_d - p_t||_1 = |.5-.2| + |.3-.3| + |.2-.5| = 0.6; identical distributions: 0
    torch.testing.assert_close(terms.tv, torch.tensor([[0.6, 0.0]]), atol=1e-6, rtol=0)
    # label c* = 1 - tv/2 = 0.7 and 1.0; BCE(c, c*) = -(c* log c + (1 - c*) log(1 - c))
    torch.testing.assert_close(terms.acceptance, torch.tensor([[0.7, 1.0]]))
    expected_bce = [-(0.7 * math.log(0.5) + 0.3 * math.log(0.5)), -math.log(0.75)]
    torch.testing.assert_close(terms.bce, torch.tensor([expected_bce]))
    assert terms.top1_match.tolist() == [[False, True]]  # argmax 0 vs 2; uniform ties -> index 0 both
    assert not terms.acceptance.requires_grad


def test_weighted_masked_sums_by_hand():
    terms = position_terms(DRAFT.repeat(2, 1, 1), TARGET.repeat(2, 1, 1), LABELS.repeat(2, 1), CONFIDENCE.repeat(2, 1))
    valid = torch.tensor([[True, True], [True, False]])  # the second block is cut after its first position
    weights = LossWeights(ce=0.1, tv=0.9, confidence=1.0, decay=4.0)
    sums = reduce_terms(terms, valid, weights)
    w2 = math.exp(-1 / 4)
    torch.testing.assert_close(position_weights(2, 4.0), torch.tensor([1.0, w2]))
    ce = [-math.log(0.2), math.log(3.0)]
    torch.testing.assert_close(sums.ce, torch.tensor(2 * ce[0] + w2 * ce[1]))
    torch.testing.assert_close(sums.tv, torch.tensor(2 * 0.6))
    torch.testing.assert_close(sums.weight, torch.tensor(2 + w2))
    loss = sums.combined(weights) / sums.weight
    bce = [-math.log(0.5), -math.log(0.75)]
    expected = (0.1 * (2 * ce[0] + w2 * ce[1]) + 0.9 * 1.2 + 2 * bce[0] + w2 * bce[1]) / (2 + w2)
    torch.testing.assert_close(loss, torch.tensor(expected))
    # expected tau counts fully valid blocks only: 1 + 0.7 + 0.7 * 1.0
    torch.testing.assert_close(sums.expected_tau / sums.full_blocks, torch.tensor(2.4))
    assert sums.count.tolist() == [2.0, 1.0] and sums.acceptance.tolist() == pytest.approx([1.4, 1.0])


def test_first_error_focus_weights_each_position_by_its_reach_probability():
    terms = position_terms(DRAFT, TARGET, LABELS, CONFIDENCE)  # c* = 0.7, 1.0
    valid = torch.ones(1, 2, dtype=torch.bool)
    decay = reduce_terms(terms, valid, LossWeights(decay=4.0))
    focused = reduce_terms(terms, valid, LossWeights(decay=4.0, focus="first-error"))
    w2 = math.exp(-1 / 4)
    # position 1 is always reached; position 2 only when position 1 is accepted (0.7)
    torch.testing.assert_close(reach_probability(terms.acceptance), torch.tensor([[1.0, 0.7]]))
    torch.testing.assert_close(focused.weight, torch.tensor(1 + 0.7 * w2))
    ce = [-math.log(0.2), math.log(3.0)]
    torch.testing.assert_close(focused.ce, torch.tensor(ce[0] + 0.7 * w2 * ce[1]))
    torch.testing.assert_close(decay.ce, torch.tensor(ce[0] + w2 * ce[1]))
    # the focus moves weight, not the diagnostics
    torch.testing.assert_close(focused.expected_tau, decay.expected_tau)


def test_first_error_focus_sends_no_gradient_through_the_weights():
    draft = DRAFT.clone().requires_grad_(True)
    terms = position_terms(draft, TARGET, LABELS, CONFIDENCE)
    sums = reduce_terms(terms, torch.ones(1, 2, dtype=torch.bool), LossWeights(focus="first-error"))
    assert not sums.weight.requires_grad  # the denominator is a constant of the step


def test_no_confidence_head_means_no_confidence_term():
    terms = position_terms(DRAFT, TARGET, LABELS, None)
    assert torch.equal(terms.bce, torch.zeros(1, 2))


def test_chunked_lm_head_gives_the_same_terms_and_gradients(target):
    drafter = tiny_drafter(target).float()
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 4, 64, generator=generator, requires_grad=True)
    prev = torch.randint(0, 151_000, (5, 4), generator=generator)
    labels = torch.randint(0, 151_000, (5, 4), generator=generator)
    target_hidden = torch.randn(5, 4, 64, generator=generator)
    results = []
    for chunk_tokens in (1000, 4):  # one chunk, then one block per checkpointed chunk
        hidden.grad = None
        drafter.zero_grad()
        terms = block_terms(drafter, hidden, prev, labels, target_hidden, chunk_tokens)
        (terms.ce.sum() + terms.tv.sum() + terms.bce.sum()).backward()
        results.append((terms, hidden.grad.clone(), drafter.head.out.weight.grad.clone()))
    (one, grad_one, head_one), (many, grad_many, head_many) = results
    for name in ("ce", "tv", "bce", "acceptance"):
        torch.testing.assert_close(getattr(one, name), getattr(many, name))
    torch.testing.assert_close(grad_one, grad_many)
    torch.testing.assert_close(head_one, head_many)


def test_bad_loss_weights_are_refused():
    with pytest.raises(ValueError, match="not all zero"):
        LossWeights(0, 0, 0)
    with pytest.raises(ValueError, match="decay"):
        LossWeights(decay=0)
    with pytest.raises(ValueError, match="first-error"):
        LossWeights(focus="first_error")
