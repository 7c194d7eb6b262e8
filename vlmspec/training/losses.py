"""DSpark training losses (docs/design.md §10.3), with the LM head kept in chunks.

Per block position k = 1..gamma, with the draft distribution ``p_d`` (backbone -> frozen
LM head -> sequential head, teacher-forced) and the target distribution ``p_t`` (the
frozen LM head over the cached final-norm target state):

* ``ce_k  = -log p_d(x*_k)`` (the target's own sampled token);
* ``tv_k  = ||p_d - p_t||_1`` (in [0, 2]; the per-step acceptance is ``1 - tv_k / 2``);
* ``bce_k = BCE(c_k, c*_k)`` with the label ``c*_k = 1 - tv_k / 2`` (no gradient through it).

``L = sum_k w_k valid_k (a_ce ce_k + a_tv tv_k + a_conf bce_k) / sum_k w_k valid_k`` with
``w_k = exp(-(k - 1) / decay)`` and ``valid`` the contiguous supervised prefix of each block
(defaults a = 0.1 / 0.9 / 1.0, decay 4).

First-error focus (``focus="first-error"``) multiplies ``w_k`` by the chance that the block
reaches position k, ``prod_{i<k} c*_i`` (no gradient): a position behind a likely
rejection is rarely verified, so the loss spends its weight where the first error falls.

Memory: ``blocks x gamma x vocabulary`` floats are large (64 anchors x 7 x 151,936 x 4 B =
272 MB per tensor per sequence), so the vocabulary-wide work runs over chunks of at
most ``chunk_tokens`` positions, each under activation checkpointing: only one chunk's
logits exist at a time, in the forward and in the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vlmspec.drafters.dspark import DSparkDrafter

#: How the position weights are focused (see the module docstring).
FOCUS_KINDS = ("decay", "first-error")


@dataclass(frozen=True)
class LossWeights:
    """Mixing weights of the three terms, the decay of the position weights and their focus."""

    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0
    decay: float = 4.0
    focus: str = "decay"  # one of FOCUS_KINDS: "decay" alone, or "first-error" (times the reach probability)

    def __post_init__(self) -> None:
        if min(self.ce, self.tv, self.confidence) < 0 or self.ce + self.tv + self.confidence == 0:
            raise ValueError(f"loss weights must be >= 0 and not all zero, got {self}")
        if not self.decay > 0:
            raise ValueError(f"the position-weight decay must be > 0, got {self.decay}")
        if self.focus not in FOCUS_KINDS:
            raise ValueError(f"loss focus must be one of {', '.join(FOCUS_KINDS)}, got {self.focus!r}")


def position_weights(block_size: int, decay: float, device: torch.device | str = "cpu") -> torch.Tensor:  # [G]
    """``w_k = exp(-(k - 1) / decay)`` for k = 1..block_size."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / decay)


def reach_probability(acceptance: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N, G]
    """``prod_{i<k} c*_i``: the chance each position is reached (1 at the first), without gradient."""
    survival = torch.cumprod(acceptance.detach(), dim=1)
    return torch.cat((torch.ones_like(survival[:, :1]), survival[:, :-1]), dim=1)


@dataclass
class PositionTerms:
    """Per-position loss terms and diagnostics of a set of blocks."""

    ce: torch.Tensor  # [N, G] float32, -log p_d(label)
    tv: torch.Tensor  # [N, G] float32, ||p_d - p_t||_1
    bce: torch.Tensor  # [N, G] float32, confidence BCE (zeros without a confidence head)
    acceptance: torch.Tensor  # [N, G] float32, c* = 1 - tv / 2 (no gradient)
    top1_match: torch.Tensor  # [N, G] bool, argmax p_d == argmax p_t


def position_terms(
    draft_logits: torch.Tensor,  # [N, G, V'] float32 over the draft vocabulary, after the sequential head
    target_logits: torch.Tensor,  # [N, G, V'] float32 over the same columns
    labels: torch.Tensor,  # [N, G] int64 columns of the labels, -1 for a label outside the draft vocabulary
    confidence_logits: torch.Tensor | None,  # [N, G] float32 pre-sigmoid, or None
) -> PositionTerms:
    """The three terms for every position (see the module docstring).

    With a reduced draft vocabulary the target distribution is taken conditioned on it
    (the softmax of its columns), the best the drafter can match; a label outside the
    draft vocabulary adds no CE term (no draft can hit it).
    """
    log_draft = torch.log_softmax(draft_logits.float(), dim=-1)
    target_probs = torch.softmax(target_logits.float(), dim=-1)
    tv = (log_draft.exp() - target_probs).abs().sum(-1)  # [N, G]
    reachable = labels >= 0
    ce = -log_draft.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * reachable
    acceptance = (1 - tv.detach() / 2).clamp(0, 1)
    if confidence_logits is None:
        bce = torch.zeros_like(tv)
    else:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), acceptance, reduction="none")
    top1 = draft_logits.argmax(-1) == target_logits.argmax(-1)
    return PositionTerms(ce=ce, tv=tv, bce=bce, acceptance=acceptance, top1_match=top1)


def block_terms(
    drafter: DSparkDrafter,
    hidden: torch.Tensor,  # [N, G, d] backbone states of supervised blocks
    prev_tokens: torch.Tensor,  # [N, G] int64 teacher-forced [anchor, labels[:-1]]
    labels: torch.Tensor,  # [N, G] int64
    target_hidden: torch.Tensor,  # [N, G, d_target] final-norm target states
    chunk_tokens: int = 1024,
) -> PositionTerms:
    """:func:`position_terms` over chunks of blocks, each chunk checkpointed when gradients flow."""
    chunk = max(1, chunk_tokens // hidden.shape[1])
    # One chunk needs no checkpoint: its logits are the peak either way, and recomputing costs a forward.
    recompute = torch.is_grad_enabled() and hidden.requires_grad and hidden.shape[0] > chunk
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        piece = slice(start, start + chunk)
        args = (hidden[piece], prev_tokens[piece], labels[piece], target_hidden[piece])
        if recompute:
            parts.append(checkpoint(_chunk_terms, drafter, *args, use_reentrant=False))
        else:
            parts.append(_chunk_terms(drafter, *args))
    return PositionTerms(*(torch.cat(column) for column in zip(*parts)))


def _chunk_terms(drafter: DSparkDrafter, hidden, prev_tokens, labels, target_hidden) -> tuple[torch.Tensor, ...]:
    draft_logits = drafter.head.teacher_forced(hidden, drafter.base_logits(hidden), prev_tokens)  # [n, G, N]
    with torch.no_grad():
        target_logits = drafter.target_logits(target_hidden)  # the frozen LM head's draft rows, [n, G, N]
    confidence = drafter.confidences(hidden, prev_tokens)  # [n, G] or None
    terms = position_terms(draft_logits, target_logits, drafter.draft_columns(labels), confidence)
    return terms.ce, terms.tv, terms.bce, terms.acceptance, terms.top1_match


@dataclass
class LossSums:
    """Weighted sums over one batch; the trainer divides by the global weight total."""

    ce: torch.Tensor  # [] sum_k w_k valid_k ce_k
    tv: torch.Tensor  # []
    bce: torch.Tensor  # []
    weight: torch.Tensor  # [] sum_k w_k valid_k (the denominator)
    # diagnostics (no gradient)
    acceptance: torch.Tensor  # [G] sum of c*_k over valid positions
    top1: torch.Tensor  # [G] argmax matches over valid positions
    count: torch.Tensor  # [G] valid positions
    expected_tau: torch.Tensor  # [] sum over fully valid blocks of 1 + sum_k prod_{i<=k} c*_i
    greedy_tau: torch.Tensor  # [] the same with the greedy acceptance 1{argmax p_d = argmax p_t}
    full_blocks: torch.Tensor  # [] blocks valid at every position

    def combined(self, weights: LossWeights) -> torch.Tensor:  # [] numerator of L
        return weights.ce * self.ce + weights.tv * self.tv + weights.confidence * self.bce


def reduce_terms(terms: PositionTerms, valid: torch.Tensor, weights: LossWeights) -> LossSums:
    """Weight and mask per-position terms (valid [N, G] bool, a contiguous prefix per block)."""
    w = position_weights(valid.shape[1], weights.decay, valid.device) * valid  # [N, G]
    if weights.focus == "first-error":
        w = w * reach_probability(terms.acceptance)
    mask = valid.float()
    full = valid.all(dim=1)  # [N]
    survival = torch.cumprod(terms.acceptance, dim=1).sum(dim=1) + 1  # [N]
    greedy = torch.cumprod(terms.top1_match.float(), dim=1).sum(dim=1) + 1  # [N] tau of a greedy round
    return LossSums(
        ce=(w * terms.ce).sum(),
        tv=(w * terms.tv).sum(),
        bce=(w * terms.bce).sum(),
        weight=w.sum(),
        acceptance=(terms.acceptance * mask).sum(0).detach(),
        top1=(terms.top1_match.float() * mask).sum(0),
        count=mask.sum(0),
        expected_tau=(survival * full).sum().detach(),
        greedy_tau=(greedy * full).sum(),
        full_blocks=full.sum().float(),
    )
