"""Left-padded batches of requests that decode one token per row per step.

Training caches need the target's own answers to thousands of prompts. One request at a
time, the 135M reference target makes about 24 tokens/s on a 2-core CPU, because each
forward is dominated by per-layer overhead, not arithmetic; 32 rows in one forward make
about 5x as many. This module runs such batches with the same per-request position rules
as :class:`~vlmspec.targets.adapter.QwenVLTarget`:

* every row is left-padded to the longest prompt and masked with a 2-D attention mask;
* each row's M-RoPE ids are computed from its own unpadded inputs (its own
  ``rope_delta``), then shifted right by its padding; during decoding every row continues
  at ``cache_index - padding + rope_delta``;
* the model's own ``rope_deltas`` attribute is never used.

Prompts with images batch too: the processor outputs of the rows are concatenated in
row order, which is the order in which the model scatters image features into image
placeholder tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmspec.targets.adapter import QwenVLTarget
from vlmspec.targets.inputs import TargetInputs
from vlmspec.targets.positions import DEFAULT_POSITION_RULE, check_position_rule

# Processor outputs that are per token ([1, L]) and must be left-padded with the rows.
_PER_TOKEN_KWARGS = ("mm_token_type_ids", "token_type_ids")


@dataclass
class BatchState:
    """The shared cache of a left-padded batch and each row's offsets."""

    cache: object  # transformers DynamicCache over [B, Lpad + steps]
    padding: torch.Tensor  # [B] int64 left padding of each row
    rope_deltas: torch.Tensor  # [B] int64 M-RoPE position minus unpadded cache index
    attention_mask: torch.Tensor  # [B, length] int64, 0 on padding
    feature_layers: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.attention_mask.shape[1]


@dataclass
class BatchStep:
    """What one batched forward returns."""

    logits: torch.Tensor  # [B, V] float32 prediction for the token after each row's last input
    features: list[torch.Tensor]  # per row [n_b, m * d] hooked outputs of that row's inputs (padding removed)
    positions: list[torch.Tensor]  # per row [n_b] int64 1-D text-stream positions of those inputs
    final_hidden: torch.Tensor  # [B, d] final-norm state of each row's last input (before the LM head)


@torch.no_grad()
def prefill_batch(
    target: QwenVLTarget,
    batch: Sequence[TargetInputs],
    *,
    feature_layers: Sequence[int] = (),
    position_rule: str = DEFAULT_POSITION_RULE,
) -> tuple[BatchState, BatchStep]:
    """Run every row's prompt (with its images) in one left-padded forward."""
    from transformers import DynamicCache

    if not batch:
        raise ValueError("prefill_batch needs at least one request")
    layers = target.check_feature_layers(feature_layers)
    check_position_rule(position_rule)
    width = max(inputs.length for inputs in batch)
    padding = torch.tensor([width - inputs.length for inputs in batch])
    mrope = torch.zeros(3, len(batch), width, dtype=torch.long, device=target.device)
    positions, deltas = [], []
    for row, inputs in enumerate(batch):
        row_mrope, delta = target._prompt_positions(inputs)  # [3, 1, L_b] of this row alone
        mrope[:, row, int(padding[row]) :] = row_mrope[:, 0]
        positions.append(target._positions_1d(inputs, row_mrope, position_rule))
        deltas.append(delta)
    state = BatchState(
        cache=DynamicCache(config=target.model.config),
        padding=padding,
        rope_deltas=torch.tensor(deltas),
        attention_mask=_left_pad([torch.ones(i.length, dtype=torch.long) for i in batch], width, 0),
        feature_layers=layers,
    )
    input_ids = _left_pad([i.input_ids[0].cpu() for i in batch], width, target.tokenizer.pad_token_id or 0)
    kwargs = _batched_kwargs(batch, width)
    features, hidden, logits = _forward(target, state, input_ids, mrope, **kwargs)
    per_row = [features[row, int(padding[row]) :] for row in range(len(batch))] if features is not None else []
    return state, BatchStep(logits=logits, features=per_row, positions=positions, final_hidden=hidden)


@torch.no_grad()
def decode_batch(target: QwenVLTarget, state: BatchState, tokens: torch.Tensor) -> BatchStep:
    """Feed one token per row (``tokens`` [B] int64) and return the next predictions."""
    batch = state.padding.shape[0]
    if tokens.shape != (batch,):
        raise ValueError(f"decode_batch takes one token per row: expected shape ({batch},), got {tuple(tokens.shape)}")
    if state.length + 1 > target.max_context:
        raise ValueError(f"the batch reached the model's context length ({target.max_context} tokens)")
    index = state.length - state.padding + state.rope_deltas  # [B] this token's M-RoPE position per row
    mrope = index.to(target.device).view(1, batch, 1).expand(3, batch, 1)
    state.attention_mask = torch.cat((state.attention_mask, torch.ones(batch, 1, dtype=torch.long)), dim=1)
    features, hidden, logits = _forward(target, state, tokens.view(batch, 1), mrope)
    per_row = [features[row] for row in range(batch)] if features is not None else []
    return BatchStep(logits=logits, features=per_row, positions=list(index.view(batch, 1)), final_hidden=hidden)


def keep_rows(state: BatchState, rows: torch.Tensor) -> None:
    """Keep only ``rows`` ([R] int64 indices, in order) of the batch: finished requests leave."""
    state.cache.batch_select_indices(rows.to(state.attention_mask.device))
    state.padding = state.padding[rows]
    state.rope_deltas = state.rope_deltas[rows]
    state.attention_mask = state.attention_mask[rows]


def _forward(target: QwenVLTarget, state: BatchState, input_ids: torch.Tensor, mrope: torch.Tensor, **kwargs):
    """One model forward; returns features [B, n, m * d] (or None), final hidden [B, d] and logits [B, V]."""
    start = state.length - input_ids.shape[1]  # padded cache index of the first input
    text_row = torch.arange(start, start + input_ids.shape[1], device=target.device)
    text_row = text_row.view(1, 1, -1).expand(1, mrope.shape[1], -1)
    with target._capture(state.feature_layers, final_norm=True) as captured:
        out = target.model(
            input_ids=input_ids.to(target.device),
            attention_mask=state.attention_mask.to(target.device),
            position_ids=torch.cat((text_row, mrope), dim=0),
            **{target._cache_kwarg: state.cache},
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
    layers = state.feature_layers
    features = torch.cat([captured[i] for i in layers], dim=-1) if layers else None
    return features, captured["norm"][:, -1], out.logits[:, -1].float()


def _left_pad(rows: list[torch.Tensor], width: int, fill: int) -> torch.Tensor:  # rows [L_b] -> [B, width]
    out = torch.full((len(rows), width), fill, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, width - row.shape[0] :] = row
    return out


def _batched_kwargs(batch: Sequence[TargetInputs], width: int) -> dict[str, torch.Tensor]:
    """The rows' processor outputs joined: per-token ones left-padded, vision ones concatenated."""
    keys = {k for inputs in batch for k in inputs.model_kwargs} - {"input_ids", "attention_mask"}
    joined = {}
    for key in sorted(keys):
        values = [inputs.model_kwargs[key] for inputs in batch if key in inputs.model_kwargs]
        if key in _PER_TOKEN_KWARGS:
            rows = [inputs.model_kwargs.get(key, torch.zeros_like(inputs.input_ids))[0].cpu() for inputs in batch]
            joined[key] = _left_pad(rows, width, 0).to(values[0].device)
        else:
            joined[key] = torch.cat(values, dim=0)
    return joined
