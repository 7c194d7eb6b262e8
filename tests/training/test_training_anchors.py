"""Anchors only where both tokens are in the loss mask; packed blocks equal separate forwards."""

from __future__ import annotations

import pytest
import torch
from training_helpers import tiny_drafter

from vlmspec.training import (
    CachedSequence,
    PackedDataset,
    block_targets,
    checked_flex,
    collate,
    pack_sequence,
    packed_hidden,
    packed_mask,
    sample_anchors,
    valid_anchor_mask,
    valid_prefix,
)

MASK = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)  # two answer spans


def test_valid_anchors_need_the_token_and_the_next_one_in_the_loss_mask():
    valid = valid_anchor_mask(MASK)
    assert valid.nonzero().flatten().tolist() == [2, 3, 6, 7, 8]  # not 4 (next is out), not 9 (no next)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        anchors = sample_anchors(MASK, 3, generator)
        assert anchors.numel() == 3 and len(set(anchors.tolist())) == 3
        assert bool(valid[anchors].all()) and torch.equal(anchors, anchors.sort().values)
    assert sample_anchors(MASK, 50, generator).tolist() == [2, 3, 6, 7, 8]  # fewer valid than asked: all
    same = [sample_anchors(MASK, 2, torch.Generator().manual_seed(7)).tolist() for _ in range(2)]
    assert same[0] == same[1]  # an explicit generator makes the draw reproducible
    assert sample_anchors(torch.zeros(5, dtype=torch.bool), 4, generator).numel() == 0
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(MASK, 0, generator)


def test_the_valid_prefix_cuts_at_the_first_invalid_position():
    assert valid_prefix(torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)).int().tolist() == [
        [1, 1, 0, 0],
        [0, 0, 0, 0],
        [1, 1, 1, 1],
    ]
    ids = torch.arange(100, 110)
    prev, labels, valid = block_targets(ids, MASK, torch.tensor([3, 7]), block_size=4)
    # anchor 3: labels 4 (in), 5 (out) -> supervised prefix of 1 although 6 and 7 are back in the mask
    assert prev[0].tolist() == [103, 104, 105, 106] and labels[0].tolist() == [104, 105, 106, 107]
    assert valid[0].tolist() == [True, False, False, False]
    # anchor 7: labels 8, 9, then past the end of the sequence
    assert labels[1].tolist() == [108, 109, 0, 0] and valid[1].tolist() == [True, True, False, False]
    assert prev[1].tolist() == [107, 108, 109, 0]  # teacher forcing: [anchor, labels[:-1]]


def random_sequence(length: int = 40, answer_start: int = 12, width: int = 128, hidden: int = 64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.arange(length) >= answer_start
    return CachedSequence(
        id="random#0",
        input_ids=torch.randint(0, 151_000, (length,), generator=generator),
        loss_mask=mask,
        positions=torch.arange(length) + 3,
        features=torch.randn(length - 1, width, generator=generator).bfloat16(),
        feature_index=torch.arange(length - 1),
        last_hidden=torch.randn(length - 1 - answer_start, hidden, generator=generator).bfloat16(),
        hidden_index=torch.arange(answer_start, length - 1),
        anchors=torch.zeros(0, dtype=torch.long),
    )


def separate_block_hidden(drafter, sequence: CachedSequence, anchor: int, window: int | None) -> torch.Tensor:
    """One block alone: context = the features before its anchor (its last ``window`` of them)."""
    low = 0 if window is None else max(0, anchor - window)
    context = drafter.context_kv(sequence.features[None, low:anchor], sequence.positions[None, low:anchor])
    anchors = sequence.input_ids[anchor].view(1, 1)
    return drafter.block_hidden(anchors, sequence.positions[anchor].view(1, 1), context)[0, 0]  # [G, d]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_packed_blocks_equal_each_block_run_separately(target, attention, window):
    drafter = tiny_drafter(target)
    sequence = random_sequence()
    anchors = torch.tensor([12, 13, 20, 31, 37])
    row = pack_sequence(sequence, anchors, drafter.block_size, context_window=window)
    with torch.no_grad():
        packed = packed_hidden(drafter, collate([row]), attention, context_window=window)[0]  # [A, G, d]
        for a, anchor in enumerate(anchors.tolist()):
            alone = separate_block_hidden(drafter, sequence, anchor, window)
            torch.testing.assert_close(packed[a], alone, atol=1e-5, rtol=1e-5)


def test_flex_and_dense_masked_attention_agree_on_a_padded_batch(target):
    drafter = tiny_drafter(target)
    rows = [
        pack_sequence(random_sequence(seed=0), torch.tensor([12, 20, 30]), 4),
        pack_sequence(random_sequence(length=25, answer_start=8, seed=1), torch.tensor([9, 15]), 4),
    ]
    batch = collate(rows)
    assert batch.valid[1, 2].any() == False  # noqa: E712 - the padded anchor is never supervised
    with torch.no_grad():
        dense = packed_hidden(drafter, batch, "sdpa")
        flex = packed_hidden(drafter, batch, "flex")
        torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
        # padding never leaks: the short row alone gives the same states
        alone = packed_hidden(drafter, collate(rows[1:]), "sdpa")
        torch.testing.assert_close(dense[1, :2], alone[0], atol=1e-5, rtol=1e-5)


def test_the_packed_mask_isolates_blocks_and_bounds_the_context():
    mask = packed_mask(torch.tensor([[0, 1, 2, 3, 4, 5]]), torch.tensor([[2, 5]]), block_size=2, context_window=2)[0, 0]
    context, blocks = mask[:, :6].int().tolist(), mask[:, 6:].int().tolist()
    assert context == [[1, 1, 0, 0, 0, 0]] * 2 + [[0, 0, 0, 1, 1, 0]] * 2  # before the anchor, last 2 only
    assert blocks == [[1, 1, 0, 0]] * 2 + [[0, 0, 1, 1]] * 2  # bidirectional inside, isolated across


def test_the_dataset_draws_fixed_anchors_per_epoch_and_sequence(small_cache):
    dataset = PackedDataset(small_cache, range(len(small_cache)), num_anchors=3, block_size=4, seed=5)
    first = [dataset[i].anchor_index.tolist() for i in range(len(dataset))]
    assert [dataset[i].anchor_index.tolist() for i in range(len(dataset))] == first
    dataset.set_epoch(1)
    assert [dataset[i].anchor_index.tolist() for i in range(len(dataset))] != first
    row = dataset[0]
    sequence = small_cache[dataset.indices[0]]
    assert bool(valid_anchor_mask(sequence.loss_mask)[row.anchor_index].all())
    assert int(row.context_index.max()) < int(row.anchor_index.max())  # context stops before the last anchor
    torch.testing.assert_close(row.anchor_positions, sequence.positions[row.anchor_index])


def test_auto_attention_keeps_flex_only_where_it_runs_and_agrees(target, monkeypatch):
    import vlmspec.training.attention as attention

    drafter = tiny_drafter(target)
    batch = collate([pack_sequence(random_sequence(), torch.tensor([12, 20]), 4)])
    assert checked_flex(drafter, batch) == "flex"

    def broken(*args):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(attention, "_flex_hidden", broken)
    with pytest.warns(UserWarning, match="no kernel"):
        assert checked_flex(drafter, batch) == "sdpa"
