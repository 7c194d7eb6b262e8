"""Corpus lookup: draft the most frequent continuation of the context's tail in a corpus of the target's own answers.

Prompt lookup copies from the request itself, so it drafts nothing until the answer
repeats the prompt or itself. A small model's answers also repeat *each other*: the same
openings ("To find the total, we need to"), list scaffolding, closing lines. This source
looks the last tokens of the context up in a :class:`TokenCorpus` (the target's answers
to training prompts, never to a benchmark's: ``recipes/build_reference_corpus.py``) and
drafts the path its continuations take most often:

1. the longest tail of ``max_ngram .. min_ngram`` tokens that occurs at least
   ``min_count`` times in the corpus;
2. then, token by token, the most frequent next token among those occurrences, as long as
   it follows at least ``min_share`` of them (and ``min_count`` times); the occurrences
   narrow to the ones that continue that way.

The corpus is a suffix array over the concatenated sequences, so each step is two binary
searches in the sorted suffixes that share the tail (their next tokens are themselves
sorted), whatever the corpus size. A draft is a deterministic function of the committed
tokens and the corpus, known before the round: like a prompt-lookup copy it is a one-hot
distribution, so verification keeps the target's law (and the drafting policy's choice
stays causal).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from vlmspec.drafters.prompt_lookup import PromptLookup

SEPARATOR = -1  # ends every sequence of the corpus: no continuation crosses into the next one
CORPUS_FORMAT = "vlmspec.token_corpus"


class TokenCorpus:
    """Token sequences and their suffix array: the frequent continuations of any tail (see the module docstring).

    >>> corpus = TokenCorpus.from_sequences([[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 8]])
    >>> corpus.continuation([1, 5, 6], max_tokens=3)
    [7, 8]
    """

    def __init__(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=np.int64)  # [T] sequences, each followed by SEPARATOR
        if tokens.ndim != 1 or (tokens.size and tokens[-1] != SEPARATOR):
            raise ValueError("tokens must be one flat array of sequences each ending in SEPARATOR (-1)")
        if tokens.size and int(tokens.min()) < SEPARATOR:
            raise ValueError("token ids must be >= 0 (-1 only as the separator)")
        self.tokens = tokens
        self.suffixes = suffix_array(tokens)  # [T] start of each suffix, in sorted order
        self._first = tokens[self.suffixes]  # [T] first token of each sorted suffix (sorted)

    @classmethod
    def from_sequences(cls, sequences: Iterable[Sequence[int]]) -> TokenCorpus:
        """A corpus of ``sequences`` (token ids), e.g. the target's answers."""
        parts = [np.append(np.asarray(list(seq), dtype=np.int64), SEPARATOR) for seq in sequences if len(seq)]
        return cls(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))

    @property
    def num_sequences(self) -> int:
        return int((self.tokens == SEPARATOR).sum())

    def __len__(self) -> int:
        """Tokens held, separators included."""
        return int(self.tokens.size)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokens (compressed; the suffix array is rebuilt on load, well under a second)."""
        dtype = np.int32 if self.tokens.size == 0 or int(self.tokens.max()) >= 2**15 else np.int16
        np.savez_compressed(Path(path), format=np.array(CORPUS_FORMAT), tokens=self.tokens.astype(dtype))

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenCorpus:
        """A corpus written by :meth:`save`."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"no token corpus at {path}; build one with recipes/build_reference_corpus.py or TokenCorpus.save"
            )
        with np.load(path) as data:
            if "format" not in data or str(data["format"]) != CORPUS_FORMAT:
                raise ValueError(f"{path} is not a token corpus (written by TokenCorpus.save)")
            return cls(data["tokens"])

    def continuation(
        self,
        context: Sequence[int],
        max_tokens: int,
        *,
        max_ngram: int = 8,
        min_ngram: int = 2,
        min_share: float = 0.5,
        min_count: int = 2,
    ) -> list[int]:
        """The most frequent path after the longest tail of ``context`` the corpus holds (at most ``max_tokens``)."""
        context = [int(t) for t in context[-max_ngram:]]
        for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
            lo, hi = self._matches(context[-n:])
            if hi - lo >= min_count:
                break
        else:
            return []
        drafted: list[int] = []
        offset = n  # tokens every suffix in [lo, hi) shares
        while len(drafted) < max_tokens:
            following = self.tokens[self.suffixes[lo:hi] + offset]  # [hi - lo], sorted as in _matches
            values, starts, counts = np.unique(following, return_index=True, return_counts=True)
            best = int(counts.argmax())
            token, count = int(values[best]), int(counts[best])
            if token == SEPARATOR or count < min_count or count < min_share * (hi - lo):
                break
            drafted.append(token)
            lo, hi = lo + int(starts[best]), lo + int(starts[best]) + count
            offset += 1
        return drafted

    def _matches(self, pattern: list[int]) -> tuple[int, int]:
        """The range of sorted suffixes that start with ``pattern`` (empty: lo == hi)."""
        lo, hi = 0, len(self.suffixes)
        for offset, token in enumerate(pattern):
            if lo == hi:
                break
            # the suffixes in [lo, hi) share their first `offset` tokens, so the next ones are sorted
            column = self._first[lo:hi] if offset == 0 else self.tokens[self.suffixes[lo:hi] + offset]
            lo, hi = lo + int(np.searchsorted(column, token, "left")), lo + int(np.searchsorted(column, token, "right"))
        return lo, hi


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start indices of the suffixes of ``tokens`` [T] in lexicographic order (prefix doubling, O(T log^2 T)).

    ``tokens`` must end in :data:`SEPARATOR` so that no comparison runs past the end.
    """
    n = tokens.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = tokens.astype(np.int64) + 1  # the separator ranks 0
    span = 1
    while True:
        following = np.zeros(n, dtype=np.int64)  # rank of the suffix `span` later (0 past the end)
        following[: n - span] = rank[span:] + 1
        key = rank * (n + 2) + following
        order = np.argsort(key, kind="stable")
        sorted_keys = key[order]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.concatenate(([0], np.cumsum(sorted_keys[1:] != sorted_keys[:-1])))
        if rank.max() == n - 1 or span >= n:
            return order
        span *= 2


class CorpusLookup(PromptLookup):
    """Proposer that drafts the corpus's most frequent continuation of the request's tail.

    Drafts are deterministic, so ``draft_probs`` is None (verification treats them as
    one-hot). ``min_share`` and ``min_count`` decide how far a draft runs: a path that few
    of the tail's occurrences take is rarely the target's.
    """

    def __init__(
        self,
        corpus: TokenCorpus,
        max_draft_tokens: int = 8,
        max_ngram: int = 8,
        min_ngram: int = 2,
        min_share: float = 0.5,
        min_count: int = 2,
    ) -> None:
        super().__init__(max_draft_tokens=max_draft_tokens, max_ngram=max_ngram, min_ngram=min_ngram)
        if not 0.0 < min_share <= 1.0:
            raise ValueError(f"min_share must lie in (0, 1], got {min_share}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1 occurrence, got {min_count}")
        self.corpus = corpus
        self.min_share = min_share
        self.min_count = min_count

    def lookup(self, history: torch.Tensor) -> torch.Tensor:  # history: [L] -> [<= max_draft_tokens]
        """The corpus's most frequent continuation of the longest matching tail of ``history``."""
        drafted = self.corpus.continuation(
            history[-self.max_ngram :].tolist(),
            self.max_draft_tokens,
            max_ngram=self.max_ngram,
            min_ngram=self.min_ngram,
            min_share=self.min_share,
            min_count=self.min_count,
        )
        return torch.tensor(drafted, dtype=torch.long)
