"""Measure a Qwen-VL target's SPS curves (forward steps per second against tokens in flight).

:func:`profile_target` times one request's verify forward of 1..N tokens (the runner's);
:func:`profile_target_batched` times the ragged forward R concurrent requests share
(:class:`~vlmspec.targets.ragged.RaggedBatch`), for each R asked for, with B tokens from R
(anchors only) to ``R * (1 + gamma)`` spread as evenly over the rows as a step would.
:func:`profile_draft_round` times a drafter's round beside the one-token step (the drafting
policy's ``T_draft / T(1)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlmspec.scheduling.profiling import profile_forward
from vlmspec.scheduling.tables import BatchSPSTable, DraftTiming, SPSTable
from vlmspec.targets.adapter import QwenVLTarget
from vlmspec.targets.ragged import RaggedBatch

FILLER = "The quick brown fox jumps over the lazy dog while the committee reviews the quarterly report. "


def profile_target(
    target: QwenVLTarget,
    *,
    max_tokens: int = 16,
    context_length: int = 256,
    warmup: int = 3,
    repeats: int = 10,
    token_counts: Sequence[int] | None = None,
) -> SPSTable:
    """Time one verify forward of 1..``max_tokens`` tokens (or of ``token_counts``, each at most
    ``max_tokens``) on top of ``context_length`` cached tokens.

    The forward is the runner's (a one-row :class:`~vlmspec.targets.ragged.RaggedBatch`,
    in the target's decode mode), the one SpecEngine and BatchEngine run. It is rolled
    back after every forward, so each timing sees the same context.
    """
    if not 1 <= context_length < target.max_context - max_tokens:
        raise ValueError(
            f"context_length must lie in [1, {target.max_context - max_tokens}) for this model, got {context_length}"
        )
    ids = filler_ids(target, context_length)
    batch = RaggedBatch(target, initial_capacity=context_length + max_tokens)
    batch.prefill([ids[0]])  # the runner's own prefill: the row a host would have
    probe = ids[0, :max_tokens].cpu()[None]  # [1, max_tokens]

    def forward(n: int) -> None:
        batch.verify(probe[:, :n], torch.tensor([n]))
        batch.advance([0])

    return profile_forward(
        forward,
        max_tokens,
        **_description(target),
        context_length=context_length,
        warmup=warmup,
        repeats=repeats,
        token_counts=token_counts,
    )


def profile_target_batched(
    target: QwenVLTarget,
    *,
    requests: Sequence[int] = (1, 4, 16, 32),
    gamma: int = 7,
    context_length: int = 256,
    points: int = 8,
    warmup: int = 2,
    repeats: int = 5,
) -> BatchSPSTable:
    """Time the ragged verification forward of R requests, for each R in ``requests``.

    Every row holds ``context_length`` cached tokens. For each R, about ``points`` token
    counts B between R and ``R * (1 + gamma)`` are timed (the schedulers interpolate in
    between): R + 0, 1, 2, 4, ... extra drafts, spread evenly over the rows. Rows are
    rolled back after every forward, so each timing sees the same contexts.
    """
    counts = sorted({int(r) for r in requests})
    if not counts or counts[0] < 1:
        raise ValueError(f"requests must be positive integers, e.g. 1,4,16,32; got {list(requests)}")
    if not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an integer >= 0 (drafts per request), got {gamma!r}")
    if not 1 <= context_length < target.max_context - gamma - 1:
        raise ValueError(
            f"context_length must lie in [1, {target.max_context - gamma - 1}) for this model, got {context_length}"
        )
    ids = filler_ids(target, context_length)
    probe = ids[0, : 1 + gamma].cpu()
    curves = []
    for num_requests in counts:
        batch = RaggedBatch(target, initial_capacity=context_length + gamma + 1)
        batch.prefill([ids[0]] * num_requests)  # every row the same context, in one packed forward

        def forward(num_tokens: int, batch: RaggedBatch = batch, rows: int = num_requests) -> None:
            per_row = spread(num_tokens, rows)  # [R]
            batch.verify(probe[: int(per_row.max())].expand(rows, -1), per_row)
            batch.advance(torch.zeros(rows, dtype=torch.long))

        curves.append(
            profile_forward(
                forward,
                num_requests * (1 + gamma),
                **_description(target),
                context_length=context_length,
                warmup=warmup,
                repeats=repeats,
                token_counts=_token_counts(num_requests, gamma, points),
            )
        )
    return BatchSPSTable(tuple(counts), tuple(curves))


def profile_draft_round(
    target: QwenVLTarget,
    proposer: Any,
    *,
    drafter: str,
    context_length: int = 256,
    span: int = 2,
    warmup: int = 3,
    repeats: int = 15,
) -> DraftTiming:
    """Time one request's drafting round of ``proposer`` beside the target's one-token step (the runner's).

    The proposer (any :class:`~vlmspec.drafters.base.Proposer`, duck-typed: ``targets/`` does
    not import drafters) first absorbs a ``context_length``-token prompt, then every round a
    span of ``span`` committed tokens (a round's accepted drafts plus one) with their target
    features (random: the cost does not depend on them) and drafts greedily. The target step
    is the forward :func:`profile_target` times for one token, rolled back after each.
    """
    from vlmspec.scheduling.profiling import time_drafting
    from vlmspec.types import ContextUpdate, SamplingParams

    ids = filler_ids(target, context_length)
    batch = RaggedBatch(target, initial_capacity=context_length + 1)
    batch.prefill([ids[0]])
    width = len(proposer.feature_layers) * target.hidden_size
    generator = torch.Generator().manual_seed(0)
    state, position = proposer.new_state(), 0
    greedy = SamplingParams(temperature=0.0)

    def draft_round(n: int = span) -> None:
        nonlocal position
        features = torch.randn(n, width, generator=generator).to(target.dtype) if width else None
        update = ContextUpdate(
            token_ids=ids[0, :n].cpu(),
            positions=torch.arange(position, position + n),
            features=features,
            anchor=int(ids[0, 0]),
            anchor_position=position + n,
        )
        position += n
        proposer.propose([state], [update], [greedy], [generator])

    draft_round(context_length)  # the prompt
    probe = ids[0, :1].cpu()[None]  # [1, 1]

    def target_step() -> None:
        batch.verify(probe, torch.tensor([1]))
        batch.advance([0])

    drafts_in = getattr(proposer, "dtype", None)  # a model drafter's own dtype, which may differ from the target's
    dtype = None if drafts_in is None else str(drafts_in).removeprefix("torch.")
    return time_drafting(draft_round, target_step, drafter=drafter, dtype=dtype, warmup=warmup, repeats=repeats)


def spread(num_tokens: int, rows: int) -> torch.Tensor:  # -> [rows] int64, summing to num_tokens
    """``num_tokens`` inputs over ``rows`` requests as evenly as possible (each at least its anchor)."""
    base, extra = divmod(num_tokens, rows)
    return torch.tensor([base + (row < extra) for row in range(rows)], dtype=torch.long)


def _token_counts(num_requests: int, gamma: int, points: int) -> list[int]:
    """B = R + 0, 1, 2, 4, ... up to R * gamma extra drafts (about ``points`` values, always both ends)."""
    most = num_requests * gamma
    extras = {0, most} | {min(2**i, most) for i in range(max(points - 1, 1))}
    if most > 0:
        extras |= {int(round(most * k / (points - 1))) for k in range(1, max(points - 1, 1))}
    return sorted(num_requests + e for e in extras if e <= most)


def _description(target: QwenVLTarget) -> dict:
    """What ``profile_forward`` records about the target."""
    config = target.model.config.get_text_config()
    return dict(
        model=target.name,
        device=str(target.device),
        dtype=str(target.dtype).removeprefix("torch."),
        model_config={
            "family": target.family,
            "hidden_size": config.hidden_size,
            "num_layers": target.num_layers,
            "vocab_size": target.vocab_size,
        },
    )


def filler_ids(target: QwenVLTarget, length: int) -> torch.Tensor:  # -> [1, length] int64
    """Real-text token ids of exactly ``length`` tokens (the content does not affect timing)."""
    one = target.tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    repeated = (one * (length // len(one) + 1))[:length]
    return torch.tensor([repeated], dtype=torch.long, device=target.device)
