"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the last n-gram.

No model, no features: it shines when the answer repeats the prompt or itself (code
edits, quoting, extraction) and costs almost nothing when it finds no match.
"""

from __future__ import annotations

import torch

from vlmspec.drafters.base import PerRequestProposer
from vlmspec.types import ContextUpdate, DraftBlock, SamplingParams


class PromptLookupState:
    """The request's token history (prompt and everything committed)."""

    def __init__(self) -> None:
        self.history = torch.empty(0, dtype=torch.long)  # [L]

    def absorb(self, update: ContextUpdate) -> torch.Tensor:  # -> [L + n + 1] history then the anchor
        """Append the update's committed span; return the context a lookup reads (the history, then the anchor)."""
        self.history = torch.cat([self.history, update.token_ids.to(torch.long).cpu()])
        # the anchor is not kept: it returns inside the next update's span
        return torch.cat([self.history, torch.tensor([update.anchor], dtype=torch.long)])


class PromptLookup(PerRequestProposer):
    """Proposer that matches the trailing ``max_ngram .. min_ngram`` tokens against the history.

    Drafts are deterministic copies, so ``draft_probs`` is None (verification treats
    them as one-hot) and there are no confidences. Requests are looked up one by one
    (there is no model forward to share).
    """

    def __init__(self, max_draft_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_draft_tokens = max_draft_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def new_state(self) -> PromptLookupState:
        return PromptLookupState()

    def propose_one(
        self, state: PromptLookupState, update: ContextUpdate, params: SamplingParams, generator: torch.Generator
    ) -> DraftBlock:
        return self.draft(state.absorb(update))

    def draft(self, context: torch.Tensor) -> DraftBlock:  # context: [L] history and anchor -> one row
        """The copy after ``context`` as a one-row block (``draft_probs`` None: a deterministic draft)."""
        continuation = self.lookup(context)
        tokens = torch.zeros(1, self.max_draft_tokens, dtype=torch.long)
        tokens[0, : continuation.numel()] = continuation
        return DraftBlock(tokens=tokens, num_tokens=torch.tensor([continuation.numel()]))

    def lookup(self, history: torch.Tensor) -> torch.Tensor:  # history: [L] -> [<= max_draft_tokens]
        """Tokens that followed the latest earlier occurrence of the longest matching tail n-gram."""
        for n in range(min(self.max_ngram, history.numel() - 1), self.min_ngram - 1, -1):
            tail = history[-n:]
            windows = history[:-1].unfold(0, n, 1)  # [L - n, n]; excludes the tail's own window
            starts = torch.nonzero((windows == tail).all(dim=1)).flatten()
            if starts.numel():
                follow = int(starts[-1]) + n
                return history[follow : follow + self.max_draft_tokens]
        return history[:0]
