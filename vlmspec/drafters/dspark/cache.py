"""The draft context cache: projected context K/V of committed tokens, and nothing else.

Each round the proposer appends the keys/values of the newly committed span (computed
once from its target features) and runs the block against the cached context. The
block's own keys/values are never stored, so nothing needs cropping after a rejection
and the drafter never re-runs over the whole context, at any context length. Buffers
grow by doubling, so appending is amortised O(span), not O(context).
"""

from __future__ import annotations

import torch

from vlmspec.drafters.dspark.backbone import ContextKV


class DraftContextCache:
    """Per-layer keys/values [B, Hkv, L, hd] of the context, for a fixed batch of requests."""

    def __init__(self, initial_capacity: int = 256) -> None:
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._length = 0
        self._initial_capacity = initial_capacity

    def __len__(self) -> int:
        """Number of context tokens held."""
        return self._length

    def append(self, span: ContextKV) -> None:
        """Add the keys/values of a newly committed span (each [B, Hkv, n, hd]) after the held ones."""
        if not self._keys:
            self._allocate(span, max(self._initial_capacity, span[0][0].shape[2]))
        elif len(span) != len(self._keys) or span[0][0].shape[:2] != self._keys[0].shape[:2]:
            raise ValueError(
                "span does not match the cache (layers, batch or heads differ): "
                "use one DraftContextCache per drafter and batch of requests"
            )
        n = span[0][0].shape[2]
        end = self._length + n
        if end > self._keys[0].shape[2]:
            self._grow(max(end, 2 * self._keys[0].shape[2]))
        for buffer_k, buffer_v, (k, v) in zip(self._keys, self._values, span, strict=True):
            buffer_k[:, :, self._length : end] = k
            buffer_v[:, :, self._length : end] = v
        self._length = end

    def truncate(self, length: int) -> None:
        """Forget the context after its first ``length`` tokens (a propose that failed gives back what it appended)."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a context of {self._length} tokens to {length}")
        self._length = length

    def reserve(
        self, num_layers: int, shape: tuple[int, int, int], dtype: torch.dtype, length: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The whole key and value buffers, one per layer (each [B, Hkv, capacity, hd], ``shape`` = (B, Hkv, hd)),
        grown to hold at least ``length`` tokens: for a writer that fills slots past ``len(self)`` itself (the
        native drafting round), then counts the ones it added with :meth:`advance`."""
        batch, heads, head_dim = shape
        if not self._keys:
            for buffers in (self._keys, self._values):
                buffers.extend(
                    torch.empty(batch, heads, max(self._initial_capacity, length), head_dim, dtype=dtype)
                    for _ in range(num_layers)
                )
        elif len(self._keys) != num_layers or tuple(self._keys[0].shape[:2]) != (batch, heads):
            raise ValueError("the buffers do not match (layers, batch or heads differ): one cache per drafter")
        if length > self._keys[0].shape[2]:
            self._grow(max(length, 2 * self._keys[0].shape[2]))
        return self._keys, self._values

    def advance(self, n: int) -> None:
        """Count ``n`` more tokens as held: their slots were written through :meth:`reserve`'s buffers."""
        if not 0 <= self._length + n <= (self._keys[0].shape[2] if self._keys else 0):
            raise ValueError(f"cannot advance {n} tokens past the reserved buffers")
        self._length += n

    def layers(self) -> ContextKV:
        """Views of the held context, one (keys, values) pair per layer."""
        n = self._length
        return [(k[:, :, :n], v[:, :, :n]) for k, v in zip(self._keys, self._values)]

    def _allocate(self, span: ContextKV, capacity: int) -> None:
        for k, v in span:
            self._keys.append(k.new_empty(*k.shape[:2], capacity, k.shape[3]))
            self._values.append(v.new_empty(*v.shape[:2], capacity, v.shape[3]))

    def _grow(self, capacity: int) -> None:
        for buffers in (self._keys, self._values):
            for i, old in enumerate(buffers):
                new = old.new_empty(*old.shape[:2], capacity, old.shape[3])
                new[:, :, : self._length] = old[:, :, : self._length]
                buffers[i] = new
