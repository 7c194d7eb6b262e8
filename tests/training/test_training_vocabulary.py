"""The reduced draft vocabulary: the most frequent answer tokens, EOS always."""

import pytest
import torch

from vlmspec.training import answer_token_counts, coverage, draft_vocabulary


def test_most_frequent_ids_with_forced_ones_in_id_order():
    counts = torch.tensor([5, 0, 9, 9, 1, 3, 0, 7])
    assert draft_vocabulary(counts, 3).tolist() == [2, 3, 7]
    assert draft_vocabulary(counts, 3, always=[6]).tolist() == [2, 3, 6]  # 6 never occurs but is kept
    assert draft_vocabulary(counts, 4).tolist() == [0, 2, 3, 7]
    ids = draft_vocabulary(counts, 3)
    assert coverage(counts, ids) == pytest.approx(25 / 34)
    with pytest.raises(ValueError, match="size"):
        draft_vocabulary(counts, 9)


def test_counts_come_from_the_cached_answers_only(small_cache, target):
    counts = answer_token_counts(small_cache, target.vocab_size)
    answers = sum(int(small_cache[i].loss_mask.sum()) for i in range(len(small_cache)))
    assert int(counts.sum()) == answers
    ids = draft_vocabulary(counts, 50, always=target.eos_token_ids)
    assert set(target.eos_token_ids) <= set(ids.tolist())
