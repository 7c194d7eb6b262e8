"""The load-time settings of a target, validated: dtype, attention implementation and decode mode."""

from __future__ import annotations

import torch

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
# How decode/verify forwards run: "fast" (vlmspec.targets.packed, fused linears over the CPU kernel) or
# "reference" (transformers' own forward, the eager reference the fast one is tested against).
DECODE_MODES = ("fast", "reference")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_decode_mode(decode: str) -> str:
    """``decode`` if it is one of :data:`DECODE_MODES`, else ValueError listing them."""
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(map(repr, DECODE_MODES))}, got {decode!r}")
    return decode


def check_attention(attn_implementation: str) -> str:
    """``attn_implementation`` if transformers can run it here, else ValueError / ImportError saying what to do."""
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTENTION_IMPLEMENTATIONS}, got {attn_implementation!r}")
    if attn_implementation == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError as err:
            raise ImportError("flash_attention_2 needs the gpu extra: pip install 'vlmspec[gpu]'") from err
    return attn_implementation


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its name in :data:`DTYPES` (or a torch dtype as it is)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]
