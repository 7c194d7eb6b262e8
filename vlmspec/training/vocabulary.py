"""The reduced draft vocabulary: the target ids a drafter may propose (EAGLE-3's d2t map).

A drafter's LM head over the whole vocabulary (49k rows for the reference target, 152k
for Qwen) is the largest part of a drafting round on a CPU. The target's own answers use
a small part of it: the ids that cover most answer tokens are few. Drafting over those
only shrinks the GEMM (and the sequential head's W2) by the same factor, at the price of
never proposing the rest, which costs at most their share of answer tokens in acceptance.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vlmspec.training.cache import TargetCache


def answer_token_counts(cache: TargetCache, vocab_size: int) -> torch.Tensor:  # [V] int64
    """How often each target id occurs in the cached answers (the tokens a drafter must draft)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for index in range(len(cache)):
        sequence = cache[index]
        counts += torch.bincount(sequence.input_ids[sequence.loss_mask], minlength=vocab_size)
    return counts


def draft_vocabulary(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:  # [size] int64
    """The ``size`` most frequent ids (ties by id), always including ``always`` (e.g. the EOS ids).

    Returned in increasing id order, so the map reads like a vocabulary slice.
    """
    counts = counts.clone().double()
    forced = torch.tensor(sorted(set(always)), dtype=torch.long)
    if size < forced.numel() or size > counts.numel():
        raise ValueError(f"draft vocabulary size must be in [{forced.numel()}, {counts.numel()}], got {size}")
    counts[forced] = float("inf")
    # Stable sort on -count keeps increasing ids among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return order[:size].sort().values


def coverage(counts: torch.Tensor, token_ids: torch.Tensor) -> float:
    """Share of answer tokens that the draft vocabulary ``token_ids`` contains."""
    total = int(counts.sum())
    return float(counts[token_ids].sum()) / total if total else 0.0
