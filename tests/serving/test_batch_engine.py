"""BatchEngine: many concurrent requests, each with exactly the output it gets alone.

Greedy outputs are compared token for token (float32) with each request's own batch-1
target-alone output, while requests join and leave mid-way. A scripted drafter proposes
each request's true continuation with a mistake at a position that changes every round,
so rows accept different numbers of drafts and roll back different amounts.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_drafters import tiny_drafter

from vlmspec.drafters.base import PerRequestProposer
from vlmspec.drafters.dspark import DSparkProposer
from vlmspec.drafters.prompt_lookup import PromptLookup
from vlmspec.engine import SpecEngine
from vlmspec.serving import BatchEngine
from vlmspec.targets.ragged import RaggedBatch
from vlmspec.types import DEFAULT_POSITION_RULE, ContextUpdate, DraftBlock, SamplingParams

PROMPTS = [
    "Describe the picture.",
    "Write a haiku about rain.",
    "Compare the two pictures.",
    "Count from one to ten.",
    "Hi",
]


class ScriptedDrafter(PerRequestProposer):
    """Drafts each request's known answer, wrong from position ``round % (gamma + 1)`` on.

    ``answers`` maps a prompt (its token ids) to the target-alone output. Round k of a
    request keeps ``k % (gamma + 1)`` correct drafts, then proposes a wrong token, so every
    acceptance length from 0 to gamma occurs.
    """

    def __init__(self, answers: dict[tuple[int, ...], list[int]], gamma: int = 3) -> None:
        self.answers = answers
        self.max_draft_tokens = gamma
        self.states: list[dict] = []  # every request's state, with the updates it received

    def new_state(self) -> dict:
        self.states.append({"answer": None, "generated": 0, "round": 0, "updates": []})
        return self.states[-1]

    def propose_one(self, state, update: ContextUpdate, params: SamplingParams, generator) -> DraftBlock:
        state["updates"].append(update)
        tokens = tuple(update.token_ids.tolist())
        if state["answer"] is None:  # the prompt, and the spans of any steps that skipped drafting
            prompt = next(p for p in self.answers if tokens[: len(p)] == p)
            state["answer"], state["generated"] = self.answers[prompt], len(tokens) - len(prompt)
        else:
            state["generated"] += len(tokens)
        done = state["generated"] + 1  # tokens the request has committed, the anchor included
        truth = state["answer"][done : done + self.max_draft_tokens]
        drafts = list(truth)
        right = state["round"] % (self.max_draft_tokens + 1)
        if right < len(drafts):
            drafts[right] = (drafts[right] + 1) % 1000
        state["round"] += 1
        return DraftBlock(torch.tensor([drafts], dtype=torch.long).reshape(1, -1), torch.tensor([len(drafts)]))


def request_list(astronaut, coffee, lengths=(12, 20, 6, 16, 9)):
    picture = astronaut.resize((96, 96))
    images = [picture, None, [picture, coffee], None, None]
    return [dict(images=image, prompt=prompt, max_new_tokens=n) for image, prompt, n in zip(images, PROMPTS, lengths)]


def alone_outputs(target, requests) -> list[list[int]]:
    """Each request's batch-1 target-alone greedy output (tests/test_engine.py ties it to transformers')."""
    engine = SpecEngine(target)
    return [
        engine.generate(r.get("images"), r["prompt"], max_new_tokens=r["max_new_tokens"], speculative=False).token_ids
        for r in requests
    ]


def scripted(target, requests, expected, gamma=3) -> ScriptedDrafter:
    prompts = [tuple(target.build_inputs(r.get("images"), r["prompt"]).input_ids[0].tolist()) for r in requests]
    return ScriptedDrafter(dict(zip(prompts, expected)), gamma)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_greedy_outputs_equal_each_request_alone_as_requests_join_and_leave(make_target, family, astronaut, coffee):
    target = make_target(family)
    requests = request_list(astronaut, coffee)
    expected = alone_outputs(target, requests)
    engine = BatchEngine(target, scripted(target, requests, expected), max_batch_size=3)  # 5 requests, 3 rows
    results = engine.generate_many(requests)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    verified = [n for r in results for n in r.stats.verified_lengths]
    accepted = sum(r.stats.accepted for r in results)
    assert 0 < accepted < sum(verified) and len(set(verified)) > 2  # ragged: rows verified and kept different counts
    assert not engine.has_unfinished and engine.num_running == 0


def test_speculation_pauses_above_speculate_up_to_and_the_drafter_catches_up(make_target, astronaut, coffee):
    target = make_target("qwen2_vl")
    requests = request_list(astronaut, coffee)  # 12, 20, 6, 16 and 9 new tokens
    expected = alone_outputs(target, requests)
    drafter = scripted(target, requests, expected)
    engine = BatchEngine(target, drafter, max_batch_size=4, speculate_up_to=2)
    results = engine.generate_many(requests)
    assert [r.token_ids for r in results] == expected
    for result, state in zip(results, drafter.states):
        updates = state["updates"]
        if not updates:  # it finished while the batch was too big to draft
            assert set(result.stats.verified_lengths) == {0}
            continue
        positions = torch.cat([u.positions for u in updates])
        assert torch.equal(positions, torch.arange(int(positions[0]), int(positions[0]) + len(positions)))
        assert all(u.anchor_position == int(u.positions[-1]) + 1 for u in updates)  # no span lost or repeated
    paused = [n for r in results[:3] for n in r.stats.verified_lengths[:3]]
    assert paused == [0] * len(paused)  # 4 running: every step verified the anchors alone
    # The last to finish drafts again once alone. Its drafter caught up on every skipped span: round k of the
    # scripted drafter gets exactly k % 4 drafts accepted only when its idea of the context is right.
    drafting_rounds = len(drafter.states[1]["updates"])
    assert drafting_rounds >= 3 and results[1].stats.accepted == sum(k % 4 for k in range(drafting_rounds))


class VerifyNothing:
    """A scheduler that verifies no draft: every round commits the target's own next token."""

    def schedule(self, confidences, num_drafted):
        return torch.zeros_like(num_drafted)


def dspark_confidences(target, speculate_up_to):
    """The confidences a DSpark drafter gives the long request in each round, while a short one runs beside it."""
    engine = BatchEngine(target, DSparkProposer(tiny_drafter(target)), VerifyNothing(), speculate_up_to=speculate_up_to)
    long_id = engine.add_request(None, "Tell me everything about rain.", max_new_tokens=14)
    engine.add_request(None, "Hi", max_new_tokens=5)
    rounds = []
    while engine.has_unfinished:
        rounds += [out.record for out in engine.step() if out.request_id == long_id and out.record is not None]
    return [None if r.confidences is None else r.confidences[: r.drafted] for r in rounds]


def test_a_dspark_drafter_drafts_after_skipped_steps_as_if_it_had_drafted_all_along(make_target):
    target = make_target("qwen2_vl")
    always = dspark_confidences(target, speculate_up_to=None)
    paused = dspark_confidences(target, speculate_up_to=1)  # no drafting while both requests run
    assert paused[0] is None and paused[-1] is not None and len(paused) == len(always)
    resumed = [k for k, c in enumerate(paused) if c is not None]
    for k in resumed:  # same committed context, so the same drafter state: the same confidences
        torch.testing.assert_close(paused[k], always[k], rtol=1e-5, atol=1e-6)


def test_the_drafter_reads_the_features_of_every_span_it_absorbs_from_beside_the_kv(make_target):
    """Requests start and commit without features; the proposer gets them from the runner when it drafts.

    The long request sits out drafting while the short one runs, then drafts alone: the spans it
    absorbs join into the committed sequence, and their features are a cold prefill's of it.
    """
    target = make_target("qwen2_vl")
    proposer = DSparkProposer(tiny_drafter(target))
    absorbed: list[ContextUpdate] = []
    propose = proposer.propose

    def recording(states, updates, params, generators):
        absorbed.append(updates[0])  # one request drafts at a time here (speculate_up_to=1)
        return propose(states, updates, params, generators)

    proposer.propose = recording
    engine = BatchEngine(target, proposer, VerifyNothing(), speculate_up_to=1)
    long_id = engine.add_request(None, "Tell me everything about rain.", max_new_tokens=14)
    engine.add_request(None, "Hi", max_new_tokens=5)
    while engine.has_unfinished:
        engine.step()
    ids = torch.cat([u.token_ids for u in absorbed])
    features = torch.cat([u.features for u in absorbed])
    prompt = target.row_prompt(target.build_inputs(None, "Tell me everything about rain.")).ids
    answer = engine.result(long_id).token_ids
    # every span once, up to the last round's anchor (the answer's last token but one, which drew the last)
    assert ids.tolist() == prompt.tolist() + answer[:-2]
    assert absorbed[0].token_ids.numel() > prompt.numel()  # the first draft caught up on the skipped steps
    (cold,) = RaggedBatch(target, feature_layers=proposer.feature_layers).prefill([ids])
    torch.testing.assert_close(features, cold.features, atol=1e-4, rtol=1e-4)


def test_step_by_step_with_joins_leaves_and_an_abort(make_target, astronaut, coffee):
    target = make_target("qwen2_vl")
    requests = request_list(astronaut, coffee, lengths=(10, 14, 5, 12, 8))
    expected = alone_outputs(target, requests)
    engine = BatchEngine(target, scripted(target, requests, expected))
    streamed: dict[str, list[int]] = {}
    ids = [engine.add_request(**requests[0]), engine.add_request(**requests[1])]
    for step in range(12):
        if step == 2:
            ids.append(engine.add_request(**requests[2]))  # joins while two run
        if step == 3:
            ids += [engine.add_request(**requests[3]), engine.add_request(**requests[4])]
        if step == 5:
            assert engine.abort(ids[3]) and not engine.abort(ids[3])
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.tokens)
    while engine.has_unfinished:
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.tokens)
    for i, request_id in enumerate(ids):
        result = engine.result(request_id)
        assert streamed[request_id] == result.token_ids
        if i == 3:
            assert result.finish_reason == "abort" and result.token_ids == expected[3][: len(result.token_ids)]
        else:
            assert result.token_ids == expected[i] and result.finish_reason == "length"


def test_prompt_lookup_and_the_target_alone_batched_are_lossless(make_target, astronaut, coffee):
    target = make_target("qwen3_vl")
    requests = request_list(astronaut, coffee)
    requests[3]["prompt"] = "Repeat after me: one two three four five six seven eight. " * 3
    expected = alone_outputs(target, requests)
    for proposer in (PromptLookup(max_draft_tokens=4), None):
        results = BatchEngine(target, proposer, max_batch_size=4).generate_many(requests)
        assert [r.token_ids for r in results] == expected
    alone = BatchEngine(target).generate_many(requests[:2])
    assert all(r.stats.tau == 1.0 for r in alone)


def test_requests_that_do_not_speculate_share_the_batch_and_never_reach_the_proposer(make_target, astronaut, coffee):
    target = make_target("qwen2_5_vl")
    requests = request_list(astronaut, coffee)
    expected = alone_outputs(target, requests)
    drafter = scripted(target, requests, expected)
    for row in (1, 3):
        requests[row]["speculative"] = False
    results = BatchEngine(target, drafter, max_batch_size=3).generate_many(requests)
    assert [r.token_ids for r in results] == expected
    assert [r.stats.drafted > 0 for r in results] == [True, False, True, False, True]
    assert len(drafter.states) == 3  # the proposer opened state for the three that speculate, and no others


def test_prompts_prefill_in_chunks_of_the_budget_while_requests_run_and_outputs_stay_exact(
    make_target, astronaut, coffee
):
    target = make_target("qwen2_5_vl")
    requests = request_list(astronaut, coffee, lengths=(40,) * 5)  # the target alone: 40 steps of decoding
    expected = alone_outputs(target, requests)
    budget = 7
    engine = BatchEngine(target, max_prefill_tokens=budget, prefix_caching=False)  # chunks, not hits
    ids = [engine.add_request(**request) for request in requests]
    first = engine.admit()  # nothing runs yet: nothing to stall, every prompt runs whole
    assert len(first) == 5 and engine.num_waiting == 0
    late = [engine.add_request(**request) for request in requests[:2]]
    lengths = [target.build_inputs(request["images"], request["prompt"]).length for request in requests[:2]]
    first_token_step = {}
    step = 0
    while engine.has_unfinished:
        step += 1
        for output in engine.step():
            if output.request_id in late and output.tokens and output.request_id not in first_token_step:
                first_token_step[output.request_id] = step
    # requests were decoding throughout: each late prompt ran in chunks of at most `budget` tokens, one a step
    assert first_token_step[late[0]] >= -(-lengths[0] // budget)
    assert first_token_step[late[1]] >= -(-(lengths[0] + lengths[1]) // budget)
    assert [engine.result(i).token_ids for i in ids + late] == expected + expected[:2]


def test_eos_and_stop_strings_end_requests_where_the_target_alone_ends(make_target):
    target = make_target("qwen3_vl")
    prompt = "Say something long and repetitive. " * 3
    reference = SpecEngine(target).generate(None, prompt, max_new_tokens=30, speculative=False).token_ids
    text = target.tokenizer.decode(reference, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    requests = [dict(prompt=prompt, max_new_tokens=30, stop=[stop]), dict(prompt=prompt, max_new_tokens=30)]
    engine = BatchEngine(target, PromptLookup(max_draft_tokens=6))
    alone = SpecEngine(target).generate(None, prompt, max_new_tokens=30, stop=[stop], speculative=False)
    stopped, full = engine.generate_many(requests)
    assert stopped.token_ids == alone.token_ids and stopped.finish_reason == "stop" and full.token_ids == reference


def test_a_seed_gives_the_same_sample_whatever_else_is_in_the_batch(make_target, astronaut):
    from test_engine import OracleDrafter  # drafts from a noisy copy of the target: sampled drafts, some accepted

    target = make_target("qwen2_5_vl")
    mine = dict(
        images=None, prompt="Tell me a story about a fox.", max_new_tokens=16, temperature=0.9, top_p=0.95, seed=11
    )
    engine = BatchEngine(target, OracleDrafter(target, gamma=3))
    alone = engine.generate_many([mine])[0].token_ids
    assert (
        alone
        == SpecEngine(target, OracleDrafter(target, gamma=3))
        .generate(None, mine["prompt"], max_new_tokens=16, temperature=0.9, top_p=0.95, seed=11)
        .token_ids
    )
    others = [
        dict(images=astronaut.resize((64, 64)), prompt="Describe it.", max_new_tokens=12, temperature=1.0, seed=3),
        dict(prompt="Hi", max_new_tokens=20),
        dict(prompt="Write a poem.", max_new_tokens=6, temperature=0.5, seed=11),
    ]
    first = engine.add_request(**others[0])
    engine.step()
    engine.step()  # the request joins a batch already two steps in, then others join and leave around it
    ids = [engine.add_request(**mine), engine.add_request(**others[1]), engine.add_request(**others[2])]
    while engine.has_unfinished:
        engine.step()
    assert engine.result(ids[0]).token_ids == alone
    assert engine.result(first).finish_reason == "length"


def test_bad_input_is_refused_and_running_requests_go_on(make_target, astronaut, coffee):
    target = make_target("qwen2_vl")
    requests = request_list(astronaut, coffee)[:2]
    expected = alone_outputs(target, requests)
    engine = BatchEngine(target, scripted(target, requests, expected), max_batch_size=4)
    ids = [engine.add_request(**r) for r in requests]
    engine.step()
    bad = [
        (dict(images="/no/such/image.png", prompt="Hi"), FileNotFoundError, "not found"),
        (dict(images=b"not an image", prompt="Hi"), ValueError, "not a readable image"),
        (dict(prompt=""), ValueError, "empty"),
        (dict(prompt="Hi", temperature=-1.0), ValueError, "temperature"),
        (dict(prompt="Hi", max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(prompt="Hi", seed=1.5), ValueError, "seed"),
        (dict(prompt="word " * 3000), ValueError, "context"),
        (dict(prompt="Hi", request_id=ids[0]), ValueError, "already in use"),
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            engine.add_request(**kwargs)
        engine.step()
    with pytest.raises(TypeError, match="unknown request options"):
        engine.generate_many([dict(prompt="Hi"), dict(prompt="Hi", temprature=0.5)])
    while engine.has_unfinished:
        engine.step()
    assert [engine.result(i).token_ids for i in ids] == expected
    with pytest.raises(KeyError, match="unknown"):
        engine.result("nobody")
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchEngine(target, max_batch_size=0)


def test_a_request_whose_images_fail_ends_alone_and_the_others_prefill_together(make_target, astronaut, coffee):
    """Image and text prompts share one prefill forward; a vision-tower failure ends only its own request."""
    target = make_target("qwen2_vl")
    requests = request_list(astronaut, coffee)[:3]
    expected = alone_outputs(target, requests)
    engine = BatchEngine(target, scripted(target, requests, expected))
    original, forwards = target.row_prompt, []

    def row_prompt(inputs, position_rule=DEFAULT_POSITION_RULE):
        if inputs.num_images == 2:
            raise RuntimeError("injected vision failure")
        return original(inputs, position_rule)

    def extend(rows, pieces, batch_extend=engine._batch.extend):
        forwards.append(len(pieces))
        return batch_extend(rows, pieces)

    target.row_prompt, engine._batch.extend = row_prompt, extend
    try:
        results = engine.generate_many(requests)
    finally:
        del target.row_prompt  # the session's target gets its own method back
    assert results[2].finish_reason == "error" and "injected" in str(results[2].error)
    assert [r.token_ids for r in results[:2]] == expected[:2]
    assert forwards == [2]  # the image prompt and the text prompt in one forward
    assert all(r.stats.prefill_s > 0 for r in results[:2])


class FaultyDrafter(ScriptedDrafter):
    """The scripted drafter, except that one request breaks at its third round: its propose raises
    (``fault="propose"``) or it drafts a token id the target has no embedding for (``fault="forward"``)."""

    def __init__(self, answers, poisoned: tuple[int, ...], fault: str) -> None:
        super().__init__(answers)
        self.poisoned, self.fault = poisoned, fault

    def propose_one(self, state, update, params, generator):
        poisoned = state.get("poisoned", tuple(update.token_ids.tolist()) == self.poisoned)
        state["poisoned"] = poisoned
        if poisoned and state["round"] == 2:
            if self.fault == "propose":
                raise RuntimeError("injected drafter failure")
            state["round"] += 1
            return DraftBlock(torch.tensor([[10**9]]), torch.tensor([1]))
        return super().propose_one(state, update, params, generator)


@pytest.mark.parametrize("fault", ["propose", "forward"])
def test_an_exception_in_one_requests_step_does_not_lose_the_others(make_target, astronaut, coffee, fault):
    target = make_target("qwen2_vl")
    requests = request_list(astronaut, coffee)[:4]
    expected = alone_outputs(target, requests)
    drafter = scripted(target, requests, expected)
    poisoned = tuple(target.build_inputs(None, requests[1]["prompt"]).input_ids[0].tolist())
    engine = BatchEngine(target, FaultyDrafter(drafter.answers, poisoned, fault))
    results = engine.generate_many(requests)
    broken = results[1]
    assert broken.finish_reason == "error" and broken.error is not None
    assert broken.token_ids == expected[1][: len(broken.token_ids)]
    assert [r.token_ids for i, r in enumerate(results) if i != 1] == [e for i, e in enumerate(expected) if i != 1]


def test_a_one_request_proposer_gets_told_how_to_port_it(make_target):
    class OldStyle:
        max_draft_tokens, feature_layers, vocab_size, position_rule = 2, (), None, "interpolate"

        def new_state(self):
            return None

        def propose(self, state, update, params, generator):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="PerRequestProposer"):
        BatchEngine(make_target("qwen2_vl"), OldStyle())


class CountingLookup(PromptLookup):
    """Prompt lookup that counts how often each request's state absorbed an update (one per propose)."""

    def __init__(self) -> None:
        super().__init__(max_draft_tokens=4)
        self.states: list = []  # in the order the requests started
        self.absorbed: dict[int, int] = {}  # id(state) -> updates absorbed

    def new_state(self):
        self.states.append(super().new_state())
        return self.states[-1]

    def propose_one(self, state, update, params, generator):
        self.absorbed[id(state)] = self.absorbed.get(id(state), 0) + 1
        return super().propose_one(state, update, params, generator)

    def absorbs(self, request: int) -> int:
        return self.absorbed.get(id(self.states[request]), 0)


def raise_once(method, at_call: int):
    """``method``, except that its ``at_call``-th call raises (the calls before and after run as usual)."""
    calls = 0

    def faulty(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at_call:
            raise RuntimeError("injected fault after verification")
        return method(*args, **kwargs)

    return faulty


FAULT_REQUESTS = [
    dict(prompt="Repeat after me: one two three four five six. " * 2, max_new_tokens=14),
    dict(prompt="Tell me a story about a fox.", max_new_tokens=12, temperature=1.0, seed=5),
    dict(prompt="Count from one to ten.", max_new_tokens=10, temperature=0.8, top_k=50, seed=9),
]


@pytest.mark.parametrize("fault", ["advance", "confidences"])
def test_a_fault_after_verification_never_commits_a_round_twice(make_target, monkeypatch, fault):
    target = make_target("qwen2_5_vl")
    clean = BatchEngine(target, PromptLookup(max_draft_tokens=4)).generate_many(FAULT_REQUESTS)
    proposer = CountingLookup()
    engine = BatchEngine(target, proposer)
    if fault == "advance":  # the rows' KV lengths: the last act before the requests commit, at the third step
        monkeypatch.setattr(engine._batch, "advance", raise_once(engine._batch.advance, at_call=3))
    else:  # the first request's round record, after its commit, at the third step
        import vlmspec.serving.steps as steps

        monkeypatch.setattr(steps, "_row_confidences", raise_once(steps._row_confidences, at_call=7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "every request succeeded alone" after the advance fault
        results = engine.generate_many(FAULT_REQUESTS)

    survivors = [i for i, r in enumerate(results) if r.finish_reason != "error"]
    assert survivors == ([0, 1, 2] if fault == "advance" else [1, 2])  # a failed commit ends only its request
    for i in survivors:
        assert results[i].token_ids == clean[i].token_ids and results[i].finish_reason == clean[i].finish_reason
        assert results[i].stats.rounds == clean[i].stats.rounds
        assert proposer.absorbs(i) == results[i].stats.rounds  # one absorbed update per committed round
    if fault == "confidences":
        broken = results[0]
        assert broken.error is not None and broken.token_ids == clean[0].token_ids[: len(broken.token_ids)]


class RandomDrafter:
    """Drafts 3 tokens per request, uniform over the first 64 ids, each from the request's generator.

    When the batch holds a request sampled at ``faulty_temperature``, it raises after
    drawing everybody else's drafts: the failed attempt has used their generators.
    """

    max_draft_tokens, feature_layers, vocab_size, position_rule = 3, (), None, DEFAULT_POSITION_RULE

    def __init__(self, target_vocab: int, faulty_temperature: float) -> None:
        self.draft_probs = torch.zeros(target_vocab)
        self.draft_probs[:64] = 1 / 64
        self.faulty_temperature = faulty_temperature

    def new_state(self) -> None:
        return None

    def propose(self, states, updates, params, generators) -> DraftBlock:
        tokens = torch.stack([torch.randint(0, 64, (3,), generator=g) for g in generators])  # [R, 3]
        if any(p.temperature == self.faulty_temperature for p in params):
            raise RuntimeError("injected drafter failure")
        probs = self.draft_probs.expand(len(params), 3, -1).clone()  # [R, 3, V] the distribution drawn from
        return DraftBlock(tokens, torch.full((len(params),), 3), probs)


def test_a_seeded_sample_is_the_same_when_a_batch_mate_fails_after_drawing(make_target):
    target = make_target("qwen2_5_vl")
    mine = dict(prompt="Tell me a story about a fox.", max_new_tokens=12, temperature=1.0, seed=7)
    doomed = dict(prompt="Hi", max_new_tokens=12, temperature=0.5, seed=1)
    alone = BatchEngine(target, RandomDrafter(target.vocab_size, 0.5)).generate_many([mine])[0]
    assert alone.stats.accepted < alone.stats.verified  # rejections: the sample depends on the generator's draws
    engine = BatchEngine(target, RandomDrafter(target.vocab_size, 0.5))
    result, failed = engine.generate_many([mine, doomed])
    assert failed.finish_reason == "error" and "injected" in str(failed.error)
    assert result.token_ids == alone.token_ids and result.finish_reason == alone.finish_reason


def test_inputs_processed_beforehand_give_the_same_answer(make_target, astronaut):
    """A server builds a request's inputs off the engine's thread and queues them ready (add_request(inputs=...))."""
    target = make_target("qwen2_vl")
    engine = BatchEngine(target, PromptLookup())
    image = astronaut.resize((64, 64))
    inputs = target.build_inputs(image, "Describe it.")
    ready, built = engine.generate_many(
        [dict(inputs=inputs, max_new_tokens=8), dict(images=image, prompt="Describe it.", max_new_tokens=8)]
    )
    assert ready.token_ids == built.token_ids and ready.prompt_tokens == built.prompt_tokens
    with pytest.raises(ValueError, match="either inputs"):
        engine.add_request(image, inputs=inputs)
    with pytest.raises(TypeError, match="TargetInputs"):
        engine.add_request(inputs={"input_ids": inputs.input_ids})
