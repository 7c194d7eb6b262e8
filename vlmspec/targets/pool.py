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
:meth:`KVPool.bytes_per_block`). A bounded pool reserves its ``max_blocks`` at once as
address space the operating system backs only when written (``torch.empty``), and growing
it copies nothing: a copy of a pool grown near a large budget would stall every running
stream for seconds and hold the old and the new storage at once (1.5x the budget). An
unbounded pool grows into a new reservation of twice the blocks, copying what it held.
A block is zeroed when first handed out (then only ever holds finite values), so a masked
slot cannot leak a NaN into a product, and memory is touched only as far as blocks are used.

Why 16 slots a block (the default): the kernel reads 16 slots at a time from one block, so
16 is the smallest block it takes (a power of two, a multiple of 16); a smaller block wastes
less of a row's last block (at most 15 slots) and would let a prefix cache share shorter
runs. The table lookup costs one load per 16 keys for the scores and per key for the values,
against the key's 64-256 bytes read either way.
"""

from __future__ import annotations

from collections import OrderedDict

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
        feature_width: int = 0,
        prefix_caching: bool = False,
    ) -> None:
        """``feature_width``: values per token of a plane kept beside the KV (the drafter's hooked target
        features, so a prefix cache hit gives the drafter its context too); 0: none. ``prefix_caching``:
        keep full blocks under their content keys after their rows leave (:class:`PrefixIndex`)."""
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
        reserved = first if max_blocks is None else max_blocks  # storage's blocks; [num_blocks:] not in service
        self.keys: list[torch.Tensor] = [self._empty(reserved) for _ in range(num_layers)]  # per layer [N, Hkv, bs, hd]
        self.values: list[torch.Tensor] = [self._empty(reserved) for _ in range(num_layers)]
        self._num_blocks = first
        self._zeroed = 0  # blocks [0, _zeroed) have been zeroed (see allocate)
        self._free = list(range(first - 1, -1, -1))  # a stack: the lowest ids are handed out first
        # Per block [N, bs, F]: the hooked target features of each slot's token (the drafter's context). Only a
        # committed slot's features are ever read (no product runs over the plane), so it is not zeroed.
        self.features = self._empty(reserved, (block_size, feature_width)) if feature_width else None
        self._refs = [0] * first  # rows (block tables) holding each block
        self.prefix = PrefixIndex() if prefix_caching else None

    @property
    def num_blocks(self) -> int:
        """Blocks the pool holds now (free or in use)."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out without growing (cached blocks no row holds included)."""
        return len(self._free) + self.num_cached_idle

    @property
    def num_used(self) -> int:
        """Blocks some row holds."""
        return self.num_blocks - self.num_free

    @property
    def num_cached_idle(self) -> int:
        """Blocks the prefix cache keeps that no row holds (handed out, least recently used first, when needed)."""
        return 0 if self.prefix is None else len(self.prefix.idle)

    @property
    def capacity(self) -> int | None:
        """The most blocks the pool may hold (None: unbounded)."""
        return self.max_blocks

    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer, keys and values (and the feature plane's share)."""
        heads, size, dim = self._shape
        plane = 0 if self.features is None else size * self.features.shape[-1] * self.features.element_size()
        return block_bytes(self._num_layers, heads, dim, self._dtype, size) + plane

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` slots."""
        return -(-tokens // self.block_size)

    def available(self) -> int | None:
        """Blocks :meth:`allocate` can still hand out, growing included (None: unbounded)."""
        if self.max_blocks is None:
            return None
        return self.num_free + self.max_blocks - self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks for one holder; grows the pool if needed, then takes back idle cached blocks (least
        recently used first). Raises :class:`KVPoolFull`, handing out nothing, past ``max_blocks``."""
        if count <= 0:
            return []
        if count > len(self._free):
            self._make_room(count)
        taken = self._free[-count:][::-1]
        del self._free[-count:]
        for block in taken:
            self._refs[block] = 1
        self._zero_through(max(taken))
        return taken

    def free(self, blocks: list[int]) -> None:
        """A holder gives blocks back: a block no one holds returns to the free list at once, or, when the
        prefix cache keeps it, waits there until a hit takes it again or room is needed."""
        released = []
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                released.append(block)
        if self.prefix is not None:
            released = self.prefix.park(released)
        self._free.extend(reversed(released))

    def share(self, blocks: list[int]) -> None:
        """One more holder (a row's block table) for blocks already in the pool: a prefix cache hit."""
        for block in blocks:
            if self._refs[block] == 0 and self.prefix is not None:
                self.prefix.unpark(block)
            self._refs[block] += 1

    def free_idle(self, blocks: list[int]) -> None:
        """Idle cached blocks the prefix index forgot (:meth:`PrefixIndex.clear`) join the free list."""
        self._free.extend(blocks)

    def holders(self, block: int) -> int:
        """How many block tables hold ``block`` now."""
        return self._refs[block]

    def _make_room(self, count: int) -> None:
        """Make the free list hold ``count`` blocks: grow (up to ``max_blocks``), then evict idle cached blocks.

        Growth comes first: an unbounded pool keeps every cached block (the engines always set a bound).
        """
        short = count - len(self._free)
        if self.max_blocks is None:
            self._grow(self.num_blocks + short)
            return
        growth = self.max_blocks - self.num_blocks
        if short > growth + self.num_cached_idle:
            raise KVPoolFull(
                f"the KV pool needs {count} free blocks of {self.block_size} tokens but has "
                f"{len(self._free) + growth + self.num_cached_idle} of at most {self.max_blocks} "
                f"({self.max_blocks * self.bytes_per_block() / 2**20:.0f} MiB): raise the KV memory budget"
            )
        if growth:
            self._grow(self.num_blocks + min(short, growth))
        short = count - len(self._free)
        if short > 0:
            self._free[:0] = self.prefix.evict(short)

    def _grow(self, needed: int) -> None:
        """Hold at least ``needed`` blocks (at most ``max_blocks``, which :meth:`_make_room` checked): double.

        A bounded pool's storage is reserved already: growing puts more of it in service. An unbounded one
        moves to storage twice the size (copying its zeroed blocks; the rest were never written)."""
        have = self.num_blocks
        target = max(needed, 2 * have)
        if self.max_blocks is not None:
            target = min(target, self.max_blocks)
        if target > self.keys[0].shape[0]:
            self._reserve(target)
        self._num_blocks = target
        self._refs += [0] * (target - have)
        self._free[:0] = range(target - 1, have - 1, -1)  # below the free stack's top: old free blocks go first

    def _reserve(self, blocks: int) -> None:
        """Move to storage of ``blocks`` blocks, keeping what the written blocks hold."""
        written = self._zeroed
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                new = self._empty(blocks)
                new[:written] = old[:written]
                tensors[i] = new
        if self.features is not None:
            grown = self._empty(blocks, self.features.shape[1:])
            grown[:written] = self.features[:written]
            self.features = grown

    def _zero_through(self, block: int) -> None:
        """Zero every block up to ``block`` not zeroed yet: their first use (blocks go out lowest first)."""
        if block < self._zeroed:
            return
        for tensor in (*self.keys, *self.values):
            tensor[self._zeroed : block + 1].zero_()
        self._zeroed = block + 1

    def _empty(self, blocks: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return torch.empty(blocks, *(shape or self._shape), dtype=self._dtype, device=self._device)


class PrefixIndex:
    """Which pool blocks hold which content, so a new prompt that starts the same way reuses them.

    A full block is known by its *key*: a digest of its tokens, their M-RoPE positions and the
    content of the images their placeholders stand for, chained to the previous block's key
    (:func:`vlmspec.targets.prefix_cache.block_keys`), so equal keys mean the same KV from the
    first token on. A block is *held* while some row's table has it (the pool counts holders);
    a cached block no row holds is *idle*: it keeps its KV for a later hit until the pool needs
    room, and then the least recently used idle block is evicted first.
    """

    def __init__(self) -> None:
        self._blocks: dict[bytes, int] = {}  # key -> block
        self._keys: dict[int, bytes] = {}  # block -> key
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no row holds, least recently used first
        self.queried_tokens = 0  # prompt tokens looked up (:meth:`match`)
        self.hit_tokens = 0  # of them, tokens found cached

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: list[bytes], block_size: int, tokens: int) -> list[int]:
        """The cached blocks of the longest run of ``keys`` from the first; counts ``tokens`` looked up."""
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        self.queried_tokens += tokens
        self.hit_tokens += len(found) * block_size
        return found

    def add(self, key: bytes, block: int) -> None:
        """Remember that ``block`` (full, never written again) holds the content ``key`` names."""
        if key in self._blocks or block in self._keys:
            return  # the same content cached already (two cold prompts alike), or the block has its key
        self._blocks[key], self._keys[block] = block, key

    def park(self, blocks: list[int]) -> list[int]:
        """Blocks no row holds any more: the cached ones turn idle (most recent last); returns the others."""
        loose = []
        for block in blocks:
            if block in self._keys:
                self.idle[block] = None
            else:
                loose.append(block)
        return loose

    def unpark(self, block: int) -> None:
        """An idle block is held again (a hit)."""
        del self.idle[block]

    def evict(self, count: int) -> list[int]:
        """Forget the ``count`` least recently used idle blocks; returns them (free now)."""
        evicted = []
        for _ in range(count):
            block, _ = self.idle.popitem(last=False)
            del self._blocks[self._keys.pop(block)]
            evicted.append(block)
        return evicted

    def clear(self) -> list[int]:
        """Forget every key (a weight changed); returns the idle blocks, now free."""
        idle = list(self.idle)
        self._blocks.clear()
        self._keys.clear()
        self.idle.clear()
        return idle
