"""Anchor sampling and anchor-bounded packing (docs/design.md §10.2).

An *anchor* is a token index ``i`` of a cached sequence. Its draft block is the input
``[x_i, MASK x (gamma - 1)]`` at positions ``pos(x_i) + [0 .. gamma - 1]``; block position
``k`` (1-based) predicts ``x_{i+k}`` and is taught by the target's distribution at index
``i + k - 1``. Teacher forcing feeds the sequential head ``[x_i, x_{i+1} .. x_{i+gamma-1}]``.

* An index is a valid anchor when it and the next token are inside the loss mask (the
  answer): the anchor is a committed answer token at inference, and position 1 is taught.
* A block is supervised on its contiguous valid prefix only: position k counts while
  ``x_{i+1} .. x_{i+k}`` all lie in the loss mask (a cumulative product).
* All blocks of one sequence are packed into one row over one shared context: block ``a``
  sees the context tokens before its anchor (``index < i_a``; the anchor itself has no
  features yet at inference) and, with a context window ``W``, only the last ``W`` of
  them; inside itself it attends bidirectionally; blocks never see each other.

This module holds the pure index arithmetic; ``packing.py`` builds the packed rows and
``attention.py`` the masks.
"""

from __future__ import annotations

import torch


def valid_anchor_mask(loss_mask: torch.Tensor) -> torch.Tensor:  # [L] bool -> [L] bool
    """True at ``i`` when tokens ``i`` and ``i + 1`` are both in the loss mask."""
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[:-1] = loss_mask[:-1].bool() & loss_mask[1:].bool()
    return valid


def sample_anchors(
    loss_mask: torch.Tensor,  # [L] bool
    num_anchors: int,
    generator: torch.Generator,
) -> torch.Tensor:  # [A] int64 sorted, A = min(num_anchors, number of valid anchors)
    """Up to ``num_anchors`` distinct valid anchors, uniformly without replacement, in increasing order."""
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    candidates = valid_anchor_mask(loss_mask).nonzero().flatten()
    if candidates.numel() > num_anchors:
        choice = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[choice]
    return candidates.sort().values


def valid_prefix(valid: torch.Tensor) -> torch.Tensor:  # [..., G] bool -> [..., G] bool
    """Keep each row's leading run of True; everything from the first False on is False."""
    return torch.cumprod(valid.to(torch.int64), dim=-1).bool()


def block_targets(
    input_ids: torch.Tensor,  # [L] int64
    loss_mask: torch.Tensor,  # [L] bool
    anchors: torch.Tensor,  # [A] int64
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced inputs, labels and supervision mask of each anchor's block.

    Returns ``prev_tokens`` [A, G] (``x_{i} .. x_{i+G-1}``), ``labels`` [A, G]
    (``x_{i+1} .. x_{i+G}``) and ``valid`` [A, G] (the contiguous in-mask prefix).
    Indices past the sequence end hold token 0 and are invalid.
    """
    length = input_ids.shape[0]
    index = anchors[:, None] + torch.arange(block_size + 1)  # [A, G + 1]
    inside = index < length
    tokens = torch.where(inside, input_ids[index.clamp(max=length - 1)], 0)  # [A, G + 1]
    in_mask = inside & loss_mask.bool()[index.clamp(max=length - 1)]
    return tokens[:, :-1], tokens[:, 1:], valid_prefix(in_mask[:, 1:])
