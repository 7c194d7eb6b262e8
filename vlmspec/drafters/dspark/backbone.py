"""The parallel backbone: Qwen3-style decoder layers with KV injection of target features.

Target features from the hooked layers are concatenated and projected once,
``H_ctx = RMSNorm(W_c . concat(H[l1], ..., H[lm]))``. In every attention layer the keys
and values are the projected context followed by the block's own,
``K = [W_k H_ctx ; W_k H_block]`` (same for V); the block attends bidirectionally to
itself and to all the context it is allowed to see. Positions are 1-D (the target's
text-stream positions); RoPE is applied to context keys once, when they are computed,
so a cache of them stays valid as the context grows.

Written from the architecture description (RMSNorm, q/k norm, RoPE, GQA, SwiGLU); no
Hugging Face modeling code is reused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmspec.drafters.dspark.config import DSparkConfig

#: One (keys, values) pair per layer, each [B, num_kv_heads, L_ctx, head_dim].
ContextKV = list[tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., size]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for 1-D ``positions`` [B, L] -> each [B, 1, L, head_dim]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, L, head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, L, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, L, head_dim] by the position tables (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    """Grouped-query attention whose keys/values are [projected context ; block]."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.q_proj = nn.Linear(d, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, config.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, config.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:  # [B, L, count * hd] -> [B, count, L, hd]
        return x.unflatten(-1, (count, self.head_dim)).transpose(1, 2)

    def keys_values(
        self,
        x: torch.Tensor,  # [B, L, d]
        cos: torch.Tensor,  # [B, 1, L, hd]
        sin: torch.Tensor,  # [B, 1, L, hd]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values of ``x``, each [B, num_kv_heads, L, hd]."""
        k = apply_rotary(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, d] block states (already normed)
        cos: torch.Tensor,  # [B, 1, S, hd]
        sin: torch.Tensor,  # [B, 1, S, hd]
        context: tuple[torch.Tensor, torch.Tensor],  # keys, values [B, Hkv, Lc, hd]
        mask: torch.Tensor | None,  # [B, 1, S, Lc + S] bool (True = may attend), None = all
    ) -> torch.Tensor:  # [B, S, d]
        q = apply_rotary(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k = torch.cat((context[0], k), dim=2)
        v = torch.cat((context[1], v), dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DraftAttention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, d]
        cos: torch.Tensor,  # [B, 1, S, hd]
        sin: torch.Tensor,  # [B, 1, S, hd]
        context: tuple[torch.Tensor, torch.Tensor],  # this layer's context keys, values
        mask: torch.Tensor | None,  # [B, 1, S, Lc + S] bool or None
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, context, mask)
        return x + self.mlp(self.mlp_norm(x))


class DSparkBackbone(nn.Module):
    """Context projection + decoder layers + final norm; one pass drafts a whole block."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.config = config
        num_features = len(config.target_layer_ids) * config.target_hidden_size
        self.context_proj = nn.Linear(num_features, config.hidden_size, bias=False)
        self.context_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context_kv(
        self,
        features: torch.Tensor,  # [B, L, m * d_target] hooked target features
        positions: torch.Tensor,  # [B, L] int64 1-D positions
    ) -> ContextKV:
        """Project target features once and turn them into every layer's keys and values."""
        dtype = self.context_proj.weight.dtype
        context = self.context_norm(self.context_proj(features.to(dtype)))  # [B, L, d]
        cos, sin = self._rotary(positions, dtype)
        return [layer.attn.keys_values(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        block: torch.Tensor,  # [B, S, d] block input embeddings
        positions: torch.Tensor,  # [B, S] int64 1-D positions of the block
        context: ContextKV,  # per layer [B, Hkv, Lc, hd] keys and values
        mask: torch.Tensor | None = None,  # [B, 1, S, Lc + S] bool, None = everything visible
    ) -> torch.Tensor:  # [B, S, d] final-normed hidden states
        cos, sin = self._rotary(positions, block.dtype)
        x = block
        for layer, layer_context in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, layer_context, mask)
        return self.norm(x)


def anchor_block_mask(
    anchor_index: torch.Tensor,  # [B, A] int64: index of each anchor in the context sequence
    context_len: int,
    block_size: int,
) -> torch.Tensor:  # [B, 1, A * block_size, context_len + A * block_size] bool
    """Attention mask for several blocks packed in one row over one shared context.

    Block ``a`` sees the context tokens before its anchor (``index < anchor_index[a]``: at
    inference the anchor has no features yet) and every position of its own block, and
    nothing of the other blocks. Use it with ``DSparkBackbone.forward`` for training.
    """
    batch, anchors = anchor_index.shape
    device = anchor_index.device
    ctx = torch.arange(context_len, device=device)[None, None, :] < anchor_index[..., None]  # [B, A, Lc]
    ctx = ctx[:, :, None, :].expand(batch, anchors, block_size, context_len).flatten(1, 2)  # [B, A*G, Lc]
    block_id = torch.arange(anchors, device=device).repeat_interleave(block_size)  # [A*G]
    own = (block_id[:, None] == block_id[None, :]).expand(batch, -1, -1)  # [B, A*G, A*G]
    return torch.cat((ctx, own), dim=-1)[:, None]
