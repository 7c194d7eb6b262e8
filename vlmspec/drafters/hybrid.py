"""The hybrid proposer: n-gram copies (prompt and corpus lookup) and a model drafter (DSpark) behind one Proposer.

Each round, for each request, the drafting policy (:mod:`vlmspec.scheduling.policy`)
picks the source expected to cost the fewest target steps per committed token, or none:

* ``"ngram"``: a copy of what followed the latest earlier occurrence of the last n-gram
  of the prompt and answer so far. It costs almost nothing to draft, and it is offered
  only when such a match exists (a function of the committed tokens, known before the round);
* ``"corpus"``: the most frequent continuation of the context's tail in a corpus of the
  target's own answers (:class:`~vlmspec.drafters.corpus_lookup.CorpusLookup`), offered
  like the n-gram copy when the tail occurs there;
* ``"model"``: the model drafter's block (one forward for every request that chose it);
* ``"none"``: no drafts; the round verifies the anchor alone, as the target alone would.

The evidence is each request's own: how many of a source's drafts survived in the rounds
it drafted (read from the next round's update: its span is the anchor plus the accepted
drafts). Sources that were not chosen stay current: the copy sources' shared history
absorbs every round, and the spans the model did not see wait in the request's state until it drafts
again, then go in as one update (its context never has a hole).

Draft probabilities stay exact: model rows carry the distributions the model sampled
from; an n-gram draft is deterministic, a one-hot distribution, so verification keeps
the target's law whatever the mix. Copied rows carry confidence 1 (a copy is verified
whole; calibration maps 1 to 1), cut to one past the accepted drafts the request's copies
have averaged (:func:`~vlmspec.scheduling.policy.planned_drafts`): a long copy that rarely
survives would otherwise cost a wide verify for one token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmspec.drafters.base import Proposer, check_batch, stack_blocks
from vlmspec.drafters.prompt_lookup import PromptLookup, PromptLookupState
from vlmspec.scheduling.policy import NONE, DraftingPolicy, SourceEvidence, planned_drafts
from vlmspec.types import ContextUpdate, DraftBlock, SamplingParams

NGRAM = "ngram"
CORPUS = "corpus"
MODEL = "model"


@dataclass
class HybridState:
    """One request's state: every source's own state, the model's unabsorbed spans, the policy's evidence."""

    history: PromptLookupState  # the tokens every copy source looks up
    model: Any
    evidence: dict[str, SourceEvidence]
    pending: list[ContextUpdate] = field(default_factory=list)  # spans the model has not absorbed yet
    last_source: str | None = None  # None before the first round
    last_drafts: int = 0  # drafts the last round offered


class HybridProposer:
    """Copy sources and a model drafter, the source chosen per request and per round (see the module docstring).

    >>> policy = DraftingPolicy(DraftCosts.from_table(sps_table, {"model": 0.35, "ngram": 0.02, "corpus": 0.02}))
    >>> proposer = HybridProposer(dspark_proposer, policy, ngram=PromptLookup(), corpus=CorpusLookup(corpus))

    Without ``ngram`` and ``corpus`` the model is the only source: the policy then decides
    only whether a round drafts at all.
    """

    def __init__(
        self,
        model: Proposer,
        policy: DraftingPolicy,
        ngram: PromptLookup | None = None,
        corpus: PromptLookup | None = None,
    ) -> None:
        if not isinstance(model, Proposer):
            raise TypeError(f"model must implement the Proposer protocol, got {type(model).__name__}")
        self.model = model
        self.copiers = {name: source for name, source in ((NGRAM, ngram), (CORPUS, corpus)) if source is not None}
        self.policy = policy
        self.sources = (*self.copiers, MODEL)
        self.max_draft_tokens: int = max([model.max_draft_tokens, *(c.max_draft_tokens for c in self.copiers.values())])
        self.feature_layers: tuple[int, ...] = model.feature_layers
        self.vocab_size: int | None = model.vocab_size
        self.position_rule: str = model.position_rule

    def new_state(self) -> HybridState:
        return HybridState(PromptLookupState(), self.model.new_state(), self.policy.new_evidence(self.sources))

    def propose(
        self,
        states: Sequence[HybridState],
        updates: Sequence[ContextUpdate],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> DraftBlock:
        """Learn from last round, offer the copies, choose per request, draft the model rows in one call.

        If it raises, every state is put back as it was (the model's own state by the model's
        propose): the engine then proposes again with the same updates, which must not be
        absorbed twice (the copies' history, the model's pending spans, the policy's evidence).
        """
        check_batch(states, updates, params, generators)
        saved = [_Saved.of(state) for state in states]
        try:
            return self._propose(states, updates, params, generators)
        except BaseException:
            for state, before in zip(states, saved):
                before.restore(state)
            raise

    def _propose(
        self,
        states: Sequence[HybridState],
        updates: Sequence[ContextUpdate],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> DraftBlock:
        for state, update in zip(states, updates):
            self._observe(state, update)
        copies = [self._copies(state, update) for state, update in zip(states, updates)]
        choices = [
            self.policy.choose(
                state.evidence,
                {
                    **{name: int(copy.num_tokens[0]) for name, copy in offered.items()},
                    MODEL: self.model.max_draft_tokens,
                },
            )
            for state, offered in zip(states, copies)
        ]
        for state, update in zip(states, updates):
            state.pending.append(update)
        model_rows = [row for row, choice in enumerate(choices) if choice == MODEL]
        drafted = self._model_block(states, params, generators, model_rows) if model_rows else None
        if set(choices) in ({MODEL}, {NONE}):  # every row alike: no row-by-row restacking
            return self._uniform_block(states, choices, drafted)
        rows = []
        for row, choice in enumerate(choices):
            if choice == MODEL:
                rows.append(_with_confidences(drafted.select([model_rows.index(row)])))
            elif choice in self.copiers:  # a copy is verified whole: cut it to what is expected to pay
                copy = copies[row][choice]
                keep = planned_drafts(states[row].evidence[choice].accepted, int(copy.num_tokens[0]))
                rows.append(_with_confidences(copy.truncated(torch.tensor([keep]))))
            else:
                rows.append(_empty())
            states[row].last_source, states[row].last_drafts = choice, int(rows[-1].num_tokens[0])
        return dataclasses.replace(stack_blocks(rows), sources=tuple(choices))

    def _uniform_block(
        self, states: Sequence[HybridState], choices: list[str], drafted: DraftBlock | None
    ) -> DraftBlock:
        """The block when every row drafted from the model (``drafted``, rows in order) or none drafted at all.

        The same block the row-by-row assembly gives, in a couple of calls instead of a few
        per row (each tensor call costs tens of microseconds on the round's critical path).
        """
        if drafted is None:
            none = torch.zeros(len(states), dtype=torch.long)
            block = DraftBlock(none[:, None][:, :0], none, confidences=torch.zeros(len(states), 0))
        elif drafted.confidences is None:
            block = dataclasses.replace(
                drafted, confidences=torch.ones(drafted.tokens.shape, device=drafted.tokens.device)
            )
        else:
            block = drafted
        for state, drafts in zip(states, block.num_tokens.tolist(), strict=True):
            state.last_source, state.last_drafts = choices[0], drafts
        return dataclasses.replace(block, sources=tuple(choices))

    # ---------------------------------------------------------------- steps
    def _observe(self, state: HybridState, update: ContextUpdate) -> None:
        """What the last round showed: its span is the anchor plus the drafts that survived."""
        if state.last_source is None:  # the first round: the update is the prompt
            return
        span = update.token_ids.shape[0]
        # A longer span than the last round could commit holds rounds the host ran without drafting
        # (SpecDecoder.skip_drafting): what the last drafts did is then unknown.
        accepted = span - 1 if span <= state.last_drafts + 1 else None
        self.policy.observe(state.evidence, state.last_source, accepted)

    def _copies(self, state: HybridState, update: ContextUpdate) -> dict[str, DraftBlock]:
        """Each copy source's draft on offer this round, from the one history (which absorbs the update)."""
        if not self.copiers:  # the model alone: no history to keep
            return {}
        context = state.history.absorb(update)
        return {name: source.draft(context) for name, source in self.copiers.items()}

    def _model_block(
        self,
        states: Sequence[HybridState],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        rows: list[int],
    ) -> DraftBlock:
        """The model's drafts for ``rows``, each absorbing every span it has not seen (one model call)."""
        updates = [ContextUpdate.joined(states[row].pending) for row in rows]
        block = self.model.propose(
            [states[row].model for row in rows],
            updates,
            [params[row] for row in rows],
            [generators[row] for row in rows],
        )
        for row in rows:
            states[row].pending.clear()
        return block


@dataclass
class _Saved:
    """What a propose changes in a :class:`HybridState`, as it was before (to put back if it fails)."""

    history: torch.Tensor
    evidence: dict[str, SourceEvidence]
    pending: list[ContextUpdate]
    last_source: str | None
    last_drafts: int

    @classmethod
    def of(cls, state: HybridState) -> _Saved:
        evidence = {name: dataclasses.replace(seen) for name, seen in state.evidence.items()}
        return cls(state.history.history, evidence, list(state.pending), state.last_source, state.last_drafts)

    def restore(self, state: HybridState) -> None:
        state.history.history = self.history  # absorb builds a new tensor: this one is untouched
        state.evidence, state.pending = self.evidence, self.pending
        state.last_source, state.last_drafts = self.last_source, self.last_drafts


def _with_confidences(block: DraftBlock) -> DraftBlock:  # one row
    """A row with confidences: its own, or 1 for a source without (a copy is verified whole)."""
    if block.confidences is not None:
        return block
    return dataclasses.replace(block, confidences=torch.ones(1, block.gamma, device=block.tokens.device))


def _empty() -> DraftBlock:
    """One row that drafts nothing."""
    return DraftBlock(
        torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long), confidences=torch.zeros(1, 0)
    )
