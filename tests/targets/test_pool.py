"""The KV pool: blocks handed out and returned, growth up to a bound, a clear error past it."""

import pytest
import torch

from vlmspec.targets.pool import KVPool, KVPoolFull


def pool(**kwargs) -> KVPool:
    return KVPool(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32, **kwargs)


def test_blocks_are_handed_out_once_and_come_back_at_once():
    kv = pool(initial_blocks=4)
    first, second = kv.allocate(3), kv.allocate(1)
    assert sorted(first + second) == [0, 1, 2, 3] and kv.num_free == 0 and kv.num_used == 4
    kv.free(first)
    assert kv.num_free == 3
    assert sorted(kv.allocate(3)) == sorted(first)  # the freed blocks, before any growth
    assert kv.num_blocks == 4


def test_the_pool_grows_by_doubling_and_keeps_what_its_blocks_hold():
    kv = pool(initial_blocks=2)
    blocks = kv.allocate(2)
    kv.keys[1][blocks[1]] = 7.0
    more = kv.allocate(3)  # 5 blocks needed: 2 -> 5 (at least double)
    assert kv.num_blocks >= 5 and len(set(blocks + more)) == 5
    assert bool((kv.keys[1][blocks[1]] == 7.0).all())
    assert all(bool((kv.keys[0][b] == 0).all()) for b in more)  # new blocks start zeroed


def test_a_bounded_pool_grows_to_its_bound_and_no_further():
    kv = pool(initial_blocks=2, max_blocks=5)
    assert kv.available() == 5
    kv.allocate(4)
    assert kv.num_blocks == 4 and kv.available() == 1  # doubling capped at the bound
    with pytest.raises(KVPoolFull, match="5"):
        kv.allocate(2)
    assert kv.num_free == 0 and kv.available() == 1  # nothing handed out by the refused call
    assert len(kv.allocate(1)) == 1 and kv.num_blocks == 5


def test_a_bounded_pool_grows_in_place_and_zeroes_a_block_at_its_first_use():
    kv = pool(initial_blocks=2, max_blocks=64)
    storage = [t.data_ptr() for t in (*kv.keys, *kv.values)]
    for tensor in (*kv.keys, *kv.values):
        tensor.fill_(float("nan"))  # what reserved memory may hold before a block's first use
    blocks = kv.allocate(2)
    kv.keys[0][blocks[0]] = 3.0
    more = kv.allocate(20)  # grows 2 -> 22 blocks: in place, no copy
    assert kv.num_blocks >= 22 and [t.data_ptr() for t in (*kv.keys, *kv.values)] == storage
    assert bool((kv.keys[0][blocks[0]] == 3.0).all())
    for tensor in (*kv.keys, *kv.values):
        assert bool((tensor[blocks[1:] + more] == 0).all())  # zeroed when handed out, NaN-free
    kv.free(more)
    again = kv.allocate(3)  # reused blocks keep what they hold (rows overwrite before they read)
    assert set(again) <= set(more)


def test_an_unbounded_pool_keeps_its_written_blocks_when_it_moves():
    kv = pool(initial_blocks=2)
    blocks = kv.allocate(2)
    kv.values[1][blocks[1]] = 5.0
    kv.allocate(7)  # 9 blocks: new storage of at least 9, the two written blocks copied
    assert kv.keys[0].shape[0] >= 9 and bool((kv.values[1][blocks[1]] == 5.0).all())


def test_block_sizes_the_kernel_cannot_read_are_refused():
    for size in (8, 24):
        with pytest.raises(ValueError, match="power of two"):
            pool(block_size=size)


def test_bytes_per_block_counts_every_layer_keys_and_values():
    assert pool(block_size=16).bytes_per_block() == 2 * 2 * 2 * 16 * 8 * 4
