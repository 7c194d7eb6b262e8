"""The rollback contract of the proposers: a propose that raises leaves every request's state as it was.

The engine answers a failed batched propose by proposing again for each request alone, with
the same updates. A drafter that had absorbed them before failing would hold the span twice:
still lossless (every draft is verified), but drafting from a wrong context, so tau drops.
Here a failure is injected inside the DSpark drafter's round (after the states took the
update), and everything after it must be what a run without the failure does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_hybrid import REPEATING, answers_corpus, hybrid
from tiny_drafters import tiny_drafter

from vlmspec.drafters.dspark import DSparkProposer
from vlmspec.serving import BatchEngine
from vlmspec.types import ContextUpdate, SamplingParams


class Injected(RuntimeError):
    """The failure a test injects into a drafting round."""


def fail_once(monkeypatch, proposer: DSparkProposer, at_call: int) -> list[int]:
    """Make the drafter's round raise on its ``at_call``-th call (1-based), once; returns the call count.

    The failure is planted in whichever path drafts: the PyTorch round's sequential head (several
    requests, or no native kernel) or the native round (one request), both after the states took
    the update's span.
    """
    calls = [0]

    def failing(run):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == at_call:
                raise Injected("a drafting round failed")
            return run(*args, **kwargs)

        return call

    monkeypatch.setattr(proposer, "_sample", failing(proposer._sample))
    monkeypatch.setattr(proposer, "_native", _FailingRound(proposer._native, failing))
    return calls


class _FailingRound:
    """A native round whose calls go through ``wrap`` (the injected failure)."""

    def __init__(self, native, wrap) -> None:
        self._native, self._call = native, wrap(native.__call__)

    def available(self) -> bool:
        return self._native.available()

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)


def prompt_update(proposer: DSparkProposer, length: int, seed: int) -> ContextUpdate:
    generator = torch.Generator().manual_seed(seed)
    width = proposer._feature_width
    return ContextUpdate(
        token_ids=torch.randint(0, 1000, (length,), generator=generator),
        positions=torch.arange(length),
        features=torch.randn(length, width, generator=generator),
        anchor=7,
        anchor_position=length,
    )


def test_a_failed_dspark_propose_leaves_the_caches_as_they_were(make_target, monkeypatch):
    target = make_target("qwen2_vl")
    proposer = DSparkProposer(tiny_drafter(target))
    updates = [prompt_update(proposer, 12, seed=1), prompt_update(proposer, 5, seed=2)]
    greedy = [SamplingParams()] * 2
    generators = [torch.Generator().manual_seed(0) for _ in range(2)]

    undisturbed = [proposer.new_state() for _ in range(2)]
    expected = proposer.propose(undisturbed, updates, greedy, generators)

    states = [proposer.new_state() for _ in range(2)]
    fail_once(monkeypatch, proposer, at_call=1)
    with pytest.raises(Injected):
        proposer.propose(states, updates, greedy, generators)
    assert [len(state.cache) for state in states] == [0, 0]  # the spans were given back
    drafts = proposer.propose(states, updates, greedy, generators)  # the engine's retry, with the same updates
    assert [len(state.cache) for state in states] == [len(state.cache) for state in undisturbed] == [12, 5]
    assert torch.equal(drafts.tokens, expected.tokens)
    assert torch.allclose(drafts.confidences, expected.confidences)


def test_a_failed_hybrid_propose_leaves_history_evidence_and_pending_spans_as_they_were(make_target, monkeypatch):
    target = make_target("qwen2_vl")
    proposer = hybrid(target)
    state = proposer.new_state()
    update = prompt_update(proposer.model, 9, seed=3)
    params, generator = [SamplingParams()], [torch.Generator().manual_seed(0)]
    proposer.propose([state], [update], params, generator)  # a first round: the policy now has a last source
    before = (state.history.history.clone(), dataclasses.replace(state.evidence["model"]), len(state.pending))

    def failing_model_propose(*args, **kwargs):
        raise Injected("the model drafter failed")

    monkeypatch.setattr(proposer.model, "propose", failing_model_propose)
    monkeypatch.setattr(proposer.policy, "choose", lambda evidence, offered: "model")  # the model is asked
    second = dataclasses.replace(update, token_ids=update.token_ids[:2], positions=torch.arange(9, 11))
    second = dataclasses.replace(second, features=update.features[:2], anchor_position=11)
    with pytest.raises(Injected):
        proposer.propose([state], [second], params, generator)
    assert torch.equal(state.history.history, before[0])
    assert state.evidence["model"] == before[1] and len(state.pending) == before[2]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_failed_draft_leaves_tau_and_every_round_as_without_it(make_target, monkeypatch, temperature):
    """Through the engine: a drafting round fails once; the generation's rounds, tokens and tau are unchanged."""
    target = make_target("qwen2_vl")
    corpus = answers_corpus(target, [(None, REPEATING)])

    def generate(fail_at: int | None):
        proposer = hybrid(target, corpus)
        calls = fail_once(monkeypatch, proposer.model, fail_at) if fail_at else None
        engine = BatchEngine(target, proposer)
        options = dict(prompt=REPEATING, max_new_tokens=24, temperature=temperature, seed=3)
        result = engine.generate_many([options])[0]
        return result, calls

    expected, _ = generate(None)
    with pytest.warns(RuntimeWarning, match="every request succeeded alone"):
        result, calls = generate(fail_at=2)
    assert calls[0] > 2  # the failure happened, and the drafter drafted again after it
    assert result.token_ids == expected.token_ids
    assert result.stats.tau == expected.stats.tau and result.stats.tau > 1.0  # copies survive: tau can drop
    assert result.stats.accepted_by_position == expected.stats.accepted_by_position
    assert result.stats.rounds_by_source == expected.stats.rounds_by_source
