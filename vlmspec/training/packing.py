"""Packed rows: all anchor blocks of a cached sequence over its shared context (docs/design.md §10.2).

:func:`pack_sequence` gathers, for a set of anchors, the context rows some block may see,
the teacher-forced block inputs, the labels, the supervision mask and the target's
final-norm states; :func:`collate` pads rows into a :class:`PackedBatch`;
:class:`PackedDataset` turns a cache into rows, drawing anchors with a generator seeded
from (seed, epoch, sequence), so a run and its resumption see the same anchors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from vlmspec.training.anchors import block_targets, sample_anchors
from vlmspec.training.cache import CachedSequence, TargetCache

#: Context index of padded context rows: never smaller than an anchor, so never visible.
PAD_INDEX = 2**40


@dataclass
class PackedRow:
    """All anchor blocks of one sequence over its shared context (one batch row)."""

    context_features: torch.Tensor  # [Lc, m * d] target features (cache dtype)
    context_positions: torch.Tensor  # [Lc] int64 1-D positions
    context_index: torch.Tensor  # [Lc] int64 token index of each context row in the sequence
    anchor_tokens: torch.Tensor  # [A] int64
    anchor_index: torch.Tensor  # [A] int64
    anchor_positions: torch.Tensor  # [A] int64
    prev_tokens: torch.Tensor  # [A, G] int64 teacher-forced head inputs
    labels: torch.Tensor  # [A, G] int64
    valid: torch.Tensor  # [A, G] bool contiguous supervised prefix
    target_hidden: torch.Tensor  # [A, G, d] final-norm target hidden predicting each label (cache dtype)


@dataclass
class PackedBatch:
    """Rows padded to a common context length Lc and anchor count A."""

    context_features: torch.Tensor  # [B, Lc, m * d]
    context_positions: torch.Tensor  # [B, Lc] int64
    context_index: torch.Tensor  # [B, Lc] int64, PAD_INDEX on padding rows
    anchor_tokens: torch.Tensor  # [B, A] int64
    anchor_index: torch.Tensor  # [B, A] int64, 0 on padding anchors
    anchor_positions: torch.Tensor  # [B, A] int64
    prev_tokens: torch.Tensor  # [B, A, G] int64
    labels: torch.Tensor  # [B, A, G] int64
    valid: torch.Tensor  # [B, A, G] bool, False on padding anchors
    target_hidden: torch.Tensor  # [B, A, G, d]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """Move every tensor (what accelerate's prepared DataLoader calls)."""
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)}
        return PackedBatch(**moved)

    @property
    def num_blocks(self) -> int:
        """Blocks with at least one supervised position."""
        return int(self.valid[..., 0].sum())


def pack_sequence(
    sequence: CachedSequence,
    anchors: torch.Tensor,  # [A] int64 sorted valid anchors
    block_size: int,
    context_window: int | None = None,
) -> PackedRow:
    """Gather the context and the per-block tensors of ``anchors`` from a cached sequence.

    The context holds the cached feature rows that some block may see: indices in
    ``[min(anchor) - W, max(anchor))`` (``W = context_window``, unbounded when None).
    """
    if anchors.numel() == 0:
        raise ValueError(f"sequence {sequence.id!r} has no valid anchor; filter it out before packing")
    low = 0 if context_window is None else int(anchors[0]) - context_window
    rows = (sequence.feature_index >= low) & (sequence.feature_index < int(anchors[-1]))  # [Lf]
    context_index = sequence.feature_index[rows]
    prev_tokens, labels, valid = block_targets(sequence.input_ids, sequence.loss_mask, anchors, block_size)
    return PackedRow(
        context_features=sequence.features[rows],
        context_positions=sequence.positions[context_index],
        context_index=context_index,
        anchor_tokens=sequence.input_ids[anchors],
        anchor_index=anchors,
        anchor_positions=sequence.positions[anchors],
        prev_tokens=prev_tokens,
        labels=labels,
        valid=valid,
        target_hidden=_gather_hidden(sequence, anchors, valid, block_size),
    )


def _gather_hidden(
    sequence: CachedSequence,
    anchors: torch.Tensor,  # [A]
    valid: torch.Tensor,  # [A, G]
    block_size: int,
) -> torch.Tensor:  # [A, G, d]
    """Final-norm hidden at ``anchor + k - 1`` for each valid block position (zeros elsewhere)."""
    wanted = anchors[:, None] + torch.arange(block_size)  # [A, G] token index predicting each label
    lookup = torch.full((sequence.length,), -1, dtype=torch.long)
    lookup[sequence.hidden_index] = torch.arange(sequence.hidden_index.numel())
    rows = lookup[wanted.clamp(max=sequence.length - 1)]  # [A, G]
    missing = valid & (rows < 0)
    if bool(missing.any()):
        raise ValueError(
            f"sequence {sequence.id!r} lacks target hidden states for anchor blocks it supervises; the cache "
            "was built for other anchors or a smaller block size: rebuild it or train with its own anchors"
        )
    out = sequence.last_hidden[rows.clamp(min=0)]  # [A, G, d]
    return torch.where(valid[..., None], out, torch.zeros((), dtype=out.dtype))


def collate(rows: Sequence[PackedRow]) -> PackedBatch:
    """Pad rows to the longest context and the largest anchor count of the batch."""
    context = max(r.context_index.numel() for r in rows)
    anchors = max(r.anchor_index.numel() for r in rows)

    def pad(values: list[torch.Tensor], size: int, fill) -> torch.Tensor:
        out = values[0].new_full((len(values), size, *values[0].shape[1:]), fill)
        for b, v in enumerate(values):
            out[b, : v.shape[0]] = v
        return out

    def column(name: str) -> list[torch.Tensor]:
        return [getattr(r, name) for r in rows]

    return PackedBatch(
        context_features=pad(column("context_features"), context, 0),
        context_positions=pad(column("context_positions"), context, 0),
        context_index=pad(column("context_index"), context, PAD_INDEX),
        anchor_tokens=pad(column("anchor_tokens"), anchors, 0),
        anchor_index=pad(column("anchor_index"), anchors, 0),
        anchor_positions=pad(column("anchor_positions"), anchors, 0),
        prev_tokens=pad(column("prev_tokens"), anchors, 0),
        labels=pad(column("labels"), anchors, 0),
        valid=pad(column("valid"), anchors, False),
        target_hidden=pad(column("target_hidden"), anchors, 0),
    )


class PackedDataset(torch.utils.data.Dataset):
    """Cached sequences as packed rows with freshly drawn anchors each epoch.

    Anchors of sequence ``i`` in epoch ``e`` come from a generator seeded with
    ``(seed, e, i)``: independent of worker, process count and resumption. A cache built
    with fixed anchors (window mode) supplies its own anchors instead (up to
    ``num_anchors`` of them, drawn the same way). Sequences without any valid anchor are
    left out.
    """

    def __init__(
        self,
        cache: TargetCache,
        indices: Sequence[int],
        *,
        num_anchors: int,
        block_size: int,
        seed: int = 0,
        context_window: int | None = None,
    ) -> None:
        self.cache = cache
        self.num_anchors = num_anchors
        self.block_size = block_size
        self.seed = seed
        self.context_window = effective_context_window(context_window, cache)
        spec = cache.spec
        if spec.window_mode and block_size > spec.block_size:
            raise ValueError(
                f"the cache keeps target states for blocks of {spec.block_size} tokens but the drafter drafts "
                f"{block_size}; rebuild the cache with this block size or train a drafter with block_size <= "
                f"{spec.block_size}"
            )
        self.epoch = 0
        self.indices = [i for i in indices if cache.num_valid_anchors(i) > 0]
        if not self.indices:
            raise ValueError(
                "no cached sequence has a valid anchor (an answer of at least two tokens); "
                "raise --max-new-tokens or add prompts"
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item: int) -> PackedRow:
        index = self.indices[item]
        sequence = self.cache[index]
        generator = torch.Generator().manual_seed(_mix(self.seed, self.epoch, index))
        if sequence.anchors.numel():  # fixed at cache time (window mode)
            choice = torch.randperm(sequence.anchors.numel(), generator=generator)[: self.num_anchors]
            anchors = sequence.anchors[choice].sort().values
        else:
            anchors = sample_anchors(sequence.loss_mask, self.num_anchors, generator)
        return pack_sequence(sequence, anchors, self.block_size, self.context_window)


def effective_context_window(requested: int | None, cache: TargetCache) -> int | None:
    """The context window training must use: the requested one, bounded by what the cache kept."""
    kept = cache.spec.context_window
    if kept is None:
        return requested
    if requested is not None and requested > kept:
        raise ValueError(
            f"the cache keeps only {kept} context tokens before each anchor; train with a context window of "
            f"at most {kept} (--context-window {kept}) or rebuild the cache with a wider window"
        )
    return kept if requested is None else requested


def _mix(*values: int) -> int:
    """A 62-bit seed from several integers (a simple, stable hash)."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (int(value) + 0x9E3779B97F4A7C15 + (state << 6) + (state >> 2))) & ((1 << 62) - 1)
    return state
