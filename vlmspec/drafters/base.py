"""The Proposer protocol: how the engine asks any drafter for a block of draft tokens.

A proposer keeps nothing about a request on itself: ``new_state()`` gives an opaque
per-request state that the engine stores beside the target's request state and hands
back every round. Drafters never import ``vlmspec.target``: target features reach them
as plain tensors inside a :class:`~vlmspec.types.ContextUpdate`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from vlmspec.types import DEFAULT_POSITION_RULE, ContextUpdate, DraftBlock, SamplingParams


@runtime_checkable
class Proposer(Protocol):
    """Anything that drafts tokens for the speculative loop."""

    #: Most draft tokens one ``propose`` returns (gamma).
    max_draft_tokens: int
    #: Target decoder layers whose outputs this proposer consumes, in order; () for none.
    feature_layers: tuple[int, ...]
    #: Vocabulary size the drafter's token ids live in, or None if it only copies target tokens.
    vocab_size: int | None
    #: Name of the rule mapping the target's M-RoPE positions to the 1-D positions this
    #: proposer sees (see ``vlmspec.target.positions``); stored in a drafter's config so
    #: training and inference agree.
    position_rule: str

    def new_state(self) -> Any:
        """Fresh per-request state (caches, token history)."""
        ...

    def propose(
        self,
        state: Any,
        update: ContextUpdate,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftBlock:
        """Absorb ``update`` into ``state`` and draft up to ``max_draft_tokens`` after the anchor.

        Returns a block with batch size 1. ``draft_probs`` must be the float32
        distribution each token was drawn from, or None for a deterministic drafter.
        """
        ...


class NoDraft:
    """A proposer that never drafts: the engine then runs the target alone, one token per round.

    ``SpecEngine.generate(..., speculative=False)`` uses it so that the baseline goes
    through exactly the same code path as speculation.
    """

    max_draft_tokens = 0
    feature_layers: tuple[int, ...] = ()
    vocab_size = None
    position_rule = DEFAULT_POSITION_RULE

    def new_state(self) -> None:
        return None

    def propose(self, state: None, update: ContextUpdate, params: SamplingParams, generator: torch.Generator) -> DraftBlock:
        return DraftBlock(
            tokens=torch.zeros(1, 0, dtype=torch.long),
            num_tokens=torch.zeros(1, dtype=torch.long),
        )
