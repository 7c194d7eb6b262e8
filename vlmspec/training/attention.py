"""Packed teacher-forced backbone pass: every anchor block of a row in one forward.

Block ``a`` of a row attends to the context rows whose token index ``j`` satisfies
``anchor_index[a] - W <= j < anchor_index[a]`` (``W`` = context window, unbounded when
None) and bidirectionally to its own ``gamma`` positions; blocks never see each other.

Two implementations of the same mask:

* ``"sdpa"``: a dense boolean mask ``[B, 1, A*G, Lc + A*G]`` handed to the drafter's own
  backbone (``DSparkDrafter.block_hidden``). Runs everywhere; the mask is small (a few
  hundred queries against the context) but every masked score is still computed.
* ``"flex"``: ``torch.nn.attention.flex_attention`` with a block mask, so tiles that no
  query may see are skipped. Compiled on CUDA; on CPU it runs unfused (for tests). The
  drafter's attention layers call SDPA directly, so this path re-runs the same layers
  from the drafter's own submodules (projections, norms, rotary, MLP) with flex
  attention in place of SDPA; a test checks the two paths agree.

``"auto"`` picks flex on CUDA (after :func:`checked_flex` confirmed it on the first batch)
and SDPA elsewhere.
"""

from __future__ import annotations

import functools
import warnings

import torch

from vlmspec.drafters.dspark import DSparkDrafter
from vlmspec.drafters.dspark.backbone import apply_rotary, rotary
from vlmspec.training.packing import PackedBatch

ATTENTION_KINDS = ("auto", "sdpa", "flex")


def resolve_attention(kind: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA (where it compiles to a fused kernel), ``sdpa`` elsewhere."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")
    if kind == "auto":
        return "flex" if device.type == "cuda" and flex_available() else "sdpa"
    return kind


@functools.cache
def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def packed_mask(
    context_index: torch.Tensor,  # [B, Lc] int64 token index of each context row (huge on padding)
    anchor_index: torch.Tensor,  # [B, A] int64
    block_size: int,
    context_window: int | None = None,
) -> torch.Tensor:  # [B, 1, A*G, Lc + A*G] bool, True = may attend
    """The dense packed-blocks mask (see the module docstring)."""
    batch, anchors = anchor_index.shape
    high = anchor_index[:, :, None]  # [B, A, 1]
    ctx = context_index[:, None, :] < high  # [B, A, Lc]
    if context_window is not None:
        ctx &= context_index[:, None, :] >= high - context_window
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [B, A*G, Lc]
    block_id = torch.arange(anchors, device=anchor_index.device).repeat_interleave(block_size)  # [A*G]
    own = (block_id[:, None] == block_id[None, :]).expand(batch, -1, -1)  # [B, A*G, A*G]
    return torch.cat((ctx, own), dim=-1)[:, None]


def packed_hidden(
    drafter: DSparkDrafter,
    batch: PackedBatch,
    attention: str = "sdpa",
    context_window: int | None = None,
) -> torch.Tensor:
    """Backbone states [B, A, G, d] of every block of the batch, teacher-forced, in one pass."""
    context = drafter.context_kv(batch.context_features, batch.context_positions)  # per layer [B, Hkv, Lc, hd]
    if attention == "sdpa":
        mask = packed_mask(batch.context_index, batch.anchor_index, drafter.block_size, context_window)
        return drafter.block_hidden(batch.anchor_tokens, batch.anchor_positions, context, mask)
    if attention == "flex":
        return _flex_hidden(drafter, batch, context, context_window)
    raise ValueError(f"attention must be 'sdpa' or 'flex' here (resolve 'auto' first), got {attention!r}")


def checked_flex(drafter: DSparkDrafter, batch: PackedBatch, context_window: int | None = None) -> str:
    """``"flex"`` when flex attention runs here and agrees with the dense path on ``batch``, else ``"sdpa"``.

    ``auto`` picks flex on CUDA; this check (one extra forward, once) keeps a compiler or
    kernel problem on an untested stack from breaking or silently changing a training run.
    """
    try:
        with torch.no_grad():
            flex = packed_hidden(drafter, batch, "flex", context_window)
            dense = packed_hidden(drafter, batch, "sdpa", context_window)
    except Exception as err:  # noqa: BLE001 - compilation failures come in many exception types
        warnings.warn(
            f"flex_attention failed here ({type(err).__name__}: {err}); training uses SDPA with a dense mask",
            stacklevel=2,
        )
        return "sdpa"
    if not torch.allclose(flex.float(), dense.float(), atol=1e-3, rtol=1e-3):
        error = float((flex.float() - dense.float()).abs().max())
        warnings.warn(
            f"flex_attention disagrees with SDPA here (max error {error:.2e}); training uses SDPA", stacklevel=2
        )
        return "sdpa"
    return "flex"


def _flex_hidden(drafter: DSparkDrafter, batch: PackedBatch, context, context_window: int | None) -> torch.Tensor:
    """The drafter's backbone layers with flex attention over the packed mask (same math as its SDPA path)."""
    from torch.nn.attention.flex_attention import flex_attention

    backbone, config = drafter.backbone, drafter.config
    batch_size, anchors = batch.anchor_tokens.shape
    block = drafter.block_inputs(batch.anchor_tokens).flatten(1, 2)  # [B, A*G, d]
    positions = drafter.block_positions(batch.anchor_positions).flatten(1, 2)  # [B, A*G]
    cos, sin = rotary(positions, config.head_dim, config.rope_theta, block.dtype)
    mask = flex_block_mask(batch.context_index, batch.anchor_index, config.block_size, context_window)
    attend = _compiled(flex_attention) if block.device.type == "cuda" else _unfused(flex_attention)
    x = block
    for layer, (context_k, context_v) in zip(backbone.layers, context, strict=True):
        attn = layer.attn
        h = layer.input_norm(x)
        q = apply_rotary(attn.q_norm(_heads(attn.q_proj(h), attn.num_heads, attn.head_dim)), cos, sin)
        k, v = attn.keys_values(h, cos, sin)
        k, v = torch.cat((context_k, k), dim=2), torch.cat((context_v, v), dim=2)
        out = attend(q, k.to(q.dtype), v.to(q.dtype), block_mask=mask, enable_gqa=attn.num_heads != attn.num_kv_heads)
        x = x + attn.o_proj(out.transpose(1, 2).flatten(2))
        x = x + layer.mlp(layer.mlp_norm(x))
    return backbone.norm(x).view(batch_size, anchors, config.block_size, -1)


@functools.cache
def _compiled(flex_attention):
    """flex_attention compiled once per process (a fused kernel that skips fully masked tiles)."""
    return torch.compile(flex_attention, dynamic=True)


def _unfused(flex_attention):
    """flex_attention without compilation (CPU: a reference path for tests), minus its warning about that."""

    def attend(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return attend


def _heads(x: torch.Tensor, count: int, head_dim: int) -> torch.Tensor:  # [B, L, count*hd] -> [B, count, L, hd]
    return x.unflatten(-1, (count, head_dim)).transpose(1, 2)


def flex_block_mask(
    context_index: torch.Tensor,  # [B, Lc] int64
    anchor_index: torch.Tensor,  # [B, A] int64
    block_size: int,
    context_window: int | None = None,
):
    """A flex-attention BlockMask equal to :func:`packed_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, context_len = context_index.shape
    queries = anchor_index.shape[1] * block_size
    window = context_window if context_window is not None else -1

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = anchor_index[b, block]
        token = context_index[b, kv_idx.clamp(max=context_len - 1)]
        in_context = (kv_idx < context_len) & (token < anchor) & ((window < 0) | (token >= anchor - window))
        own = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        return in_context | own

    return create_block_mask(mask_mod, batch, None, queries, context_len + queries, device=context_index.device)
