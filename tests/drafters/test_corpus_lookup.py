"""Corpus lookup: the suffix array, the most frequent continuation, the proposer, the saved corpus."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vlmspec.drafters.corpus_lookup import CorpusLookup, TokenCorpus, suffix_array
from vlmspec.reference import reference_corpus_path
from vlmspec.types import ContextUpdate, SamplingParams


def brute_continuation(sequences, context, max_tokens, max_ngram=8, min_ngram=2, min_share=0.5, min_count=2):
    """The definition, by scanning every sequence: the longest tail seen min_count times, then the frequent path."""
    context = list(context)[-max_ngram:]
    for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        tail = context[-n:]
        # occurrences: (sequence, index just past the tail)
        hits = [
            (s, i + n) for s, seq in enumerate(sequences) for i in range(len(seq) - n + 1) if seq[i : i + n] == tail
        ]
        if len(hits) >= min_count:
            break
    else:
        return []
    drafted = []
    while len(drafted) < max_tokens:
        following = [sequences[s][i] if i < len(sequences[s]) else None for s, i in hits]
        counts = {}
        for token in following:
            counts[token] = counts.get(token, 0) + 1
        # the most frequent; ties go to the smallest id (None, the end of a sequence, first)
        token, count = max(counts.items(), key=lambda kv: (kv[1], -(-1 if kv[0] is None else kv[0])))
        if token is None or count < min_count or count < min_share * len(hits):
            break
        drafted.append(token)
        hits = [(s, i + 1) for (s, i), t in zip(hits, following) if t == token]
    return drafted


def random_sequences(rng: random.Random, vocab: int = 4):
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 15))] for _ in range(rng.randrange(1, 8))]


def test_the_suffix_array_sorts_every_suffix():
    rng = random.Random(0)
    for _ in range(100):
        corpus = TokenCorpus.from_sequences(random_sequences(rng))
        tokens = corpus.tokens.tolist()
        assert corpus.suffixes.tolist() == sorted(range(len(tokens)), key=lambda i: tokens[i:])
    assert suffix_array(np.zeros(0, dtype=np.int64)).size == 0


def test_the_continuation_is_the_most_frequent_path_after_the_longest_tail():
    rng = random.Random(1)
    for _ in range(300):
        sequences = random_sequences(rng)
        corpus = TokenCorpus.from_sequences(sequences)
        context = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        settings = {
            "max_ngram": rng.choice((2, 3, 8)),
            "min_share": rng.choice((0.3, 0.5, 1.0)),
            "min_count": rng.choice((1, 2)),
        }
        expected = brute_continuation(sequences, context, 5, **settings)
        assert corpus.continuation(context, 5, **settings) == expected, (sequences, context, settings)


def test_a_worked_example():
    corpus = TokenCorpus.from_sequences([[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 8], [1, 2]])
    assert corpus.continuation([1, 5, 6], 3) == [7, 8]  # (1, 5, 6) is not there, (5, 6) three times; 8 in 2 of 3
    assert corpus.continuation([5, 6], 3, min_share=0.7) == [7]  # 8 follows only 2 of 3
    assert corpus.continuation([7, 8], 3, min_count=1) == []  # a sequence's end is never crossed
    assert corpus.continuation([3, 4], 3) == []  # nothing matches
    assert corpus.continuation([5, 6], 1) == [7]  # at most max_tokens


def test_a_saved_corpus_loads_back_and_bad_files_are_refused(tmp_path):
    corpus = TokenCorpus.from_sequences([[1, 2, 3], [40000, 2, 3]])
    corpus.save(tmp_path / "corpus.npz")
    loaded = TokenCorpus.load(tmp_path / "corpus.npz")
    assert np.array_equal(loaded.tokens, corpus.tokens) and loaded.num_sequences == 2
    with pytest.raises(FileNotFoundError, match="build_reference_corpus"):
        TokenCorpus.load(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", tokens=np.arange(3))
    with pytest.raises(ValueError, match="not a token corpus"):
        TokenCorpus.load(tmp_path / "other.npz")
    with pytest.raises(ValueError, match="SEPARATOR"):
        TokenCorpus(np.array([1, 2, 3]))


def update(tokens, anchor):
    tokens = torch.tensor(tokens)
    return ContextUpdate(tokens, torch.arange(len(tokens)), None, anchor, len(tokens))


def test_the_proposer_drafts_the_continuation_of_history_and_anchor_as_a_one_hot_copy():
    corpus = TokenCorpus.from_sequences([[10, 11, 12, 13, 14], [10, 11, 12, 13, 15], [20, 11, 12, 16]])
    lookup = CorpusLookup(corpus, max_draft_tokens=3)
    state = lookup.new_state()
    params, generator = [SamplingParams()], [torch.Generator()]
    block = lookup.propose([state], [update([1, 2, 10], anchor=11)], params, generator)
    assert block.tokens[0, : int(block.num_tokens[0])].tolist() == [12, 13]  # 14 and 15 split the two
    assert block.draft_probs is None  # deterministic: verification treats it as one-hot
    # the next round: the old anchor and one accepted draft, then the new anchor, continue the same history
    block = lookup.propose([state], [update([11, 12], anchor=13)], params, generator)
    assert (
        state.history.tolist() == [1, 2, 10, 11, 12] and int(block.num_tokens[0]) == 0
    )  # (10, 11, 12, 13) twice, then a split


def test_bad_settings_are_refused_with_what_to_pass():
    corpus = TokenCorpus.from_sequences([[1, 2]])
    with pytest.raises(ValueError, match="min_share"):
        CorpusLookup(corpus, min_share=0.0)
    with pytest.raises(ValueError, match="min_count"):
        CorpusLookup(corpus, min_count=0)
    with pytest.raises(ValueError, match="min_ngram"):
        CorpusLookup(corpus, max_ngram=1, min_ngram=2)


def test_the_reference_corpus_ships_with_the_package():
    corpus = TokenCorpus.load(reference_corpus_path())
    assert corpus.num_sequences > 1000 and len(corpus) > 100_000
    assert int(corpus.tokens.max()) < 49_156  # ids of the reference target's vocabulary
