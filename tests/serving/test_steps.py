"""The step API's pending context: what a proposer absorbs after the steps it sat out (vlmspec/serving/steps.py)."""

from __future__ import annotations

import torch

from vlmspec.drafters.base import NoDraft
from vlmspec.serving.steps import PendingContext, SpecDecoder
from vlmspec.types import PrefillOutput

VOCAB = 32
WIDTH = 6  # m * d of the hooked features


class Recording(NoDraft):
    """Drafts nothing, but wants features and keeps every update it is handed."""

    feature_layers = (0,)

    def __init__(self) -> None:
        self.updates = []

    def propose(self, states, updates, params, generators):
        self.updates += updates
        return super().propose(states, updates, params, generators)


def prefill(length: int) -> PrefillOutput:
    logits = torch.zeros(VOCAB)
    logits[7] = 5.0  # greedy draws 7 first
    return PrefillOutput(
        token_ids=torch.arange(length),
        positions=torch.arange(length) + 100,
        features=torch.full((length, WIDTH), -1.0),
        logits=logits,
        next_position=length + 100,
    )


def one_step(decoder: SpecDecoder, request, step: int, drafting: bool) -> None:
    """A step of the target alone: the anchor's logits pick ``10 + step``; its features are all ``step``."""
    drafts = decoder.propose([request]) if drafting else decoder.skip_drafting([request])
    plan = decoder.plan([request], drafts)
    logits = torch.zeros(1, plan.input_ids.shape[1], VOCAB)
    logits[0, 0, 10 + step] = 5.0
    features = torch.full((1, plan.input_ids.shape[1], WIDTH), float(step))
    decoder.accept([request], plan, logits, features)


def test_the_steps_a_request_sits_out_reach_the_proposer_as_one_span_after_its_prompt():
    proposer = Recording()
    decoder = SpecDecoder(proposer, vocab_size=VOCAB)
    request = decoder.new_request(max_new_tokens=50, eos_token_ids=[0])
    decoder.start(request, prefill(4))
    for step in range(5):
        one_step(decoder, request, step, drafting=False)
    assert proposer.updates == []
    one_step(decoder, request, 5, drafting=True)

    (update,) = proposer.updates
    inputs = [7, 10, 11, 12, 13]  # each skipped step's input: the token the one before drew (the first: start's)
    assert update.token_ids.tolist() == [0, 1, 2, 3, *inputs]
    assert update.positions.tolist() == list(range(100, 109))
    assert update.features[:4].eq(-1).all() and update.features[4:, 0].tolist() == [0, 1, 2, 3, 4]
    assert (update.anchor, update.anchor_position) == (14, 109)  # drawn by the last skipped step, not yet run


def test_a_request_that_sits_out_many_steps_keeps_a_fixed_number_of_tensors():
    """Spans of skipped steps are Python ints: a tensor or two per step, alive until the request drafts, split the
    allocator's free chunks so that every step's logits landed on fresh pages (docs/design.md §21.5)."""
    decoder = SpecDecoder(Recording(), vocab_size=VOCAB)
    request = decoder.new_request(max_new_tokens=50, eos_token_ids=[0])
    decoder.start(request, prefill(3))
    for step in range(20):
        one_step(decoder, request, step % 10, drafting=False)
    pending = request.pending
    assert len(pending.token_ids) == 20 and all(type(token) is int for token in pending.token_ids)
    assert all(type(position) is int for position in pending.positions)
    # the features of those steps are the host's rows, kept as given (a host with a feature plane gives None)
    assert len(pending.features) == 20


def test_pending_features_are_none_once_a_span_came_without_them():
    pending = PendingContext.of_prefill(prefill(2), anchor=7)
    pending.extend([7], [102], torch.ones(1, WIDTH), anchor=8, anchor_position=103)
    assert pending.update().features.shape == (3, WIDTH)
    pending.extend([8], [103], None, anchor=9, anchor_position=104)
    update = pending.update()
    assert update.features is None and update.token_ids.tolist() == [0, 1, 7, 8]
    assert pending.absorbed() == PendingContext(9, 104)


def test_a_request_the_proposer_never_sees_keeps_only_its_anchor():
    decoder = SpecDecoder(Recording(), vocab_size=VOCAB)
    request = decoder.new_request(max_new_tokens=50, eos_token_ids=[0], speculative=False)
    decoder.start(request, prefill(3))
    for step in range(4):
        one_step(decoder, request, step, drafting=True)
    assert request.pending == PendingContext(13, 107)
    assert decoder.proposer.updates == []
