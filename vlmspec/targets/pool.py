"""The runner's KV memory: a pool of fixed-size blocks, handed to rows through block tables.

Every decoder layer keeps one key tensor and one value tensor of ``[N, Hkv, bs, hd]``: N
blocks of ``bs`` token slots. A row (one request in a :class:`~vlmspec.targets.ragged.RaggedBatch`)
owns a list of blocks, its *block table*; its slot j (the j-th token of its sequence) lives in
block ``table[j // bs]`` at offset ``j % bs``::

    physical slot = table[j // bs] * bs + j % bs

The attention kernel (:func:`~vlmspec.kernels.cpu_kernels.paged_attention`) and the reference
attention read a row's slots through its table, and the K/V writes go to the physical slot,
so a row needs no contiguous memory: a new request takes whatever blocks are free, and a
finished one returns its blocks at once (no row is copied). Rollback of rejected drafts
stays a change of length: the next forward writes over the rejected slots.

Blocks are handed out from a free list; the pool grows (doubling its block count, up to
``max_blocks``) only when the free list runs dry, so an unbounded pool holds about what its
rows use, and a bounded one never more than ``max_blocks`` blocks (its bytes:
:meth:`KVPool.bytes_per_block`). Blocks start zeroed and only ever hold finite values, so a
masked slot cannot leak a NaN into a product.

Why 16 slots a block (the default): the kernel reads 16 slots at a time from one block, so
16 is the smallest block it takes (a power of two, a multiple of 16); a smaller block wastes
less of a row's last block (at most 15 slots) and would let a prefix cache share shorter
runs. The table lookup costs one load per 16 keys for the scores and per key for the values,
against the key's 64-256 bytes read either way.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK_SIZE = 16


def block_bytes(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one block of ``block_size`` slots over every layer, keys and values."""
    return 2 * num_layers * kv_heads * block_size * head_dim * torch.tensor([], dtype=dtype).element_size()


class KVPoolFull(RuntimeError):
    """The pool has fewer free blocks than asked for and may not grow (its ``max_blocks`` is reached)."""


class KVPool:
    """Fixed-size KV blocks for every decoder layer, a free list, and growth up to a bound.

    >>> pool = KVPool(num_layers=2, kv_heads=2, head_dim=64, dtype=torch.float32)
    >>> blocks = pool.allocate(3)  # three block ids
    >>> pool.keys[0][blocks[0]]    # [Hkv, bs, hd]: layer 0's keys of the first one
    >>> pool.free(blocks)
    """

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
        initial_blocks: int = 16,
        max_blocks: int | None = None,
    ) -> None:
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two of at least 16 (the kernel's reads), got {block_size}")
        if max_blocks is not None and max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1 (or None: no bound), got {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._shape = (kv_heads, block_size, head_dim)
        self._dtype, self._device = dtype, torch.device(device)
        self._num_layers = num_layers
        first = max(1, initial_blocks if max_blocks is None else min(initial_blocks, max_blocks))
        self.keys: list[torch.Tensor] = [self._zeros(first) for _ in range(num_layers)]  # per layer [N, Hkv, bs, hd]
        self.values: list[torch.Tensor] = [self._zeros(first) for _ in range(num_layers)]
        self._free = list(range(first - 1, -1, -1))  # a stack: the lowest ids are handed out first

    @property
    def num_blocks(self) -> int:
        """Blocks the pool holds now (free or in use)."""
        return self.keys[0].shape[0]

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out without growing."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def capacity(self) -> int | None:
        """The most blocks the pool may hold (None: unbounded)."""
        return self.max_blocks

    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer, keys and values."""
        heads, size, dim = self._shape
        return block_bytes(self._num_layers, heads, dim, self._dtype, size)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` slots."""
        return -(-tokens // self.block_size)

    def available(self) -> int | None:
        """Blocks :meth:`allocate` can still hand out, growing included (None: unbounded)."""
        if self.max_blocks is None:
            return None
        return self.num_free + self.max_blocks - self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """``count`` free block ids; grows the pool if needed. Raises :class:`KVPoolFull` past ``max_blocks``."""
        if count <= 0:
            return []
        if count > len(self._free):
            self._grow(self.num_blocks + count - len(self._free))
        taken = self._free[-count:][::-1]
        del self._free[-count:]
        return taken

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the free list (their contents stay until overwritten)."""
        self._free.extend(reversed(blocks))

    def _grow(self, needed: int) -> None:
        """Hold at least ``needed`` blocks: double the block count, bounded by ``max_blocks``."""
        have = self.num_blocks
        target = max(needed, 2 * have)
        if self.max_blocks is not None:
            if needed > self.max_blocks:
                raise KVPoolFull(
                    f"the KV pool needs {needed} blocks of {self.block_size} tokens but may hold {self.max_blocks} "
                    f"({self.max_blocks * self.bytes_per_block() / 2**20:.0f} MiB): raise the KV memory budget"
                )
            target = min(target, self.max_blocks)
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                new = self._zeros(target)  # zeros: see the module docstring
                new[:have] = old
                tensors[i] = new
        self._free[:0] = range(target - 1, have - 1, -1)  # below the free stack's top: old free blocks go first

    def _zeros(self, blocks: int) -> torch.Tensor:
        return torch.zeros(blocks, *self._shape, dtype=self._dtype, device=self._device)
