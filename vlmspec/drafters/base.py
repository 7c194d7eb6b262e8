"""The Proposer protocol: how the engines ask any drafter for draft tokens, many requests at a time.

A proposer keeps nothing about a request on itself: ``new_state()`` gives an opaque
per-request state that the engine stores beside the target's request state and hands
back every step. Drafters never import ``vlmspec.targets``: target features reach them
as plain tensors inside a :class:`~vlmspec.types.ContextUpdate`.

``propose`` is batched: it drafts for R requests at once (R = 1 for ``SpecEngine``, the
running requests for ``vlmspec.serving.BatchEngine``), so a model drafter runs one
forward for all of them. A drafter that works one request at a time subclasses
:class:`PerRequestProposer` and implements ``propose_one``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from vlmspec.types import DEFAULT_POSITION_RULE, ContextUpdate, DraftBlock, SamplingParams


@runtime_checkable
class Proposer(Protocol):
    """Anything that drafts tokens for the speculative loop."""

    #: Most draft tokens one request gets from ``propose`` (gamma).
    max_draft_tokens: int
    #: Target decoder layers whose outputs this proposer consumes, in order; () for none.
    feature_layers: tuple[int, ...]
    #: Vocabulary size the drafter's token ids live in, or None if it only copies target tokens.
    vocab_size: int | None
    #: Name of the rule mapping the target's M-RoPE positions to the 1-D positions this
    #: proposer sees (see ``vlmspec.targets.positions``); stored in a drafter's config so
    #: training and inference agree.
    position_rule: str

    def new_state(self) -> Any:
        """Fresh per-request state (caches, token history)."""
        ...

    def propose(
        self,
        states: Sequence[Any],
        updates: Sequence[ContextUpdate],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> DraftBlock:
        """Absorb ``updates[r]`` into ``states[r]`` and draft up to ``max_draft_tokens`` after each anchor.

        One entry per request in every sequence (R of them, R >= 1). Returns a block of
        R rows: ``tokens`` [R, gamma], ``num_tokens`` [R]; ``draft_probs`` [R, gamma, V]
        must be the float32 distributions the tokens were drawn from (None for a
        deterministic drafter); ``confidences`` [R, gamma] or None. Every random draw
        for request r comes from ``generators[r]``, so a request's drafts do not depend
        on the other requests in the batch. A propose that raises should leave every
        state as it was (validate all updates before changing any state): the engine
        then proposes for each request alone to find the one that fails, and a state
        that had already absorbed its update would absorb it twice (which costs draft
        quality, never correctness: every draft is verified).
        """
        ...


class PerRequestProposer(abc.ABC):
    """Base for drafters that work one request at a time: implement :meth:`propose_one`.

    :meth:`propose` calls it for each request and stacks the blocks, padding rows to the
    longest ``gamma``. Subclasses set the :class:`Proposer` attributes.
    """

    max_draft_tokens: int
    feature_layers: tuple[int, ...] = ()
    vocab_size: int | None = None
    position_rule: str = DEFAULT_POSITION_RULE

    @abc.abstractmethod
    def new_state(self) -> Any:
        """Fresh per-request state."""

    @abc.abstractmethod
    def propose_one(
        self, state: Any, update: ContextUpdate, params: SamplingParams, generator: torch.Generator
    ) -> DraftBlock:
        """Absorb ``update`` into ``state`` and draft one request's block (batch size 1)."""

    def propose(
        self,
        states: Sequence[Any],
        updates: Sequence[ContextUpdate],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> DraftBlock:
        check_batch(states, updates, params, generators)
        blocks = [self.propose_one(*request) for request in zip(states, updates, params, generators)]
        return stack_blocks(blocks)


class NoDraft:
    """A proposer that never drafts: the engine then runs the target alone, one token per step.

    ``SpecEngine.generate(..., speculative=False)`` and a ``BatchEngine`` without a drafter
    use it, so that the baseline goes through exactly the same code path as speculation.
    """

    max_draft_tokens = 0
    feature_layers: tuple[int, ...] = ()
    vocab_size = None
    position_rule = DEFAULT_POSITION_RULE

    def new_state(self) -> None:
        return None

    def propose(
        self,
        states: Sequence[None],
        updates: Sequence[ContextUpdate],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> DraftBlock:
        check_batch(states, updates, params, generators)
        return DraftBlock(
            tokens=torch.zeros(len(states), 0, dtype=torch.long),
            num_tokens=torch.zeros(len(states), dtype=torch.long),
        )


def check_batch(states: Sequence, updates: Sequence, params: Sequence, generators: Sequence) -> int:
    """Validate that ``propose``'s four sequences describe the same R >= 1 requests; returns R."""
    if isinstance(updates, ContextUpdate) or isinstance(generators, torch.Generator):
        raise TypeError(
            "propose takes sequences with one entry per request: propose([state], [update], [params], [generator])"
        )
    sizes = {len(states), len(updates), len(params), len(generators)}
    if len(sizes) != 1 or not len(states):
        raise ValueError(
            f"propose needs one state, update, params and generator per request, got {len(states)}, "
            f"{len(updates)}, {len(params)} and {len(generators)}"
        )
    return len(states)


def stack_blocks(blocks: Sequence[DraftBlock]) -> DraftBlock:
    """One-row blocks as one block of len(blocks) rows, padded to the widest (``draft_probs`` too).

    Rows without ``draft_probs`` get the one-hot of their tokens when another row has
    them (a deterministic draft is its own one-hot distribution); ``confidences`` must be
    present on every row or on none.
    """
    width = max(block.gamma for block in blocks)
    device = blocks[0].tokens.device
    tokens = torch.zeros(len(blocks), width, dtype=torch.long, device=device)
    for row, block in enumerate(blocks):
        tokens[row, : block.gamma] = block.tokens[0]
    num_tokens = torch.cat([block.num_tokens.reshape(1).to(device, torch.long) for block in blocks])
    draft_probs = None
    with_probs = [block.draft_probs for block in blocks if block.draft_probs is not None]
    if with_probs:
        vocab = with_probs[0].shape[-1]
        draft_probs = torch.zeros(len(blocks), width, vocab, dtype=torch.float32, device=device)
        for row, block in enumerate(blocks):
            if block.draft_probs is not None:
                draft_probs[row, : block.gamma] = block.draft_probs[0]
            else:
                draft_probs[row, : block.gamma].scatter_(1, tokens[row, : block.gamma, None], 1.0)
    confidences = None
    if any(block.confidences is not None for block in blocks):
        if not all(block.confidences is not None for block in blocks):
            raise ValueError("some rows have confidences and some do not; a proposer must give them for all or none")
        confidences = torch.zeros(len(blocks), width, dtype=torch.float32, device=device)
        for row, block in enumerate(blocks):
            confidences[row, : block.gamma] = block.confidences[0]
    return DraftBlock(tokens, num_tokens, draft_probs, confidences)
