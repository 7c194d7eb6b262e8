"""End-to-end: speculation through SpecEngine gives exactly the target's output."""

from __future__ import annotations

import pytest
import torch
from stat_helpers import SUPPORT, chi_square_p_value, exact_first_tokens, sample_first_tokens

from vlmspec.drafters.base import PerRequestProposer
from vlmspec.drafters.prompt_lookup import PromptLookup
from vlmspec.engine import SpecEngine
from vlmspec.types import ContextUpdate, DraftBlock, SamplingParams

PROMPT = "Describe the picture in detail, then list three colours you can see."


def hf_greedy(target, images, prompt, max_new_tokens):
    """transformers' own generate, with the same EOS tokens the engine uses."""
    inputs = target.build_inputs(images, prompt)
    out = target.model.generate(
        **inputs.model_kwargs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(target.eos_token_ids)
    )
    return out[0, inputs.length :].tolist()


@pytest.mark.parametrize("images", ["one", "two", "none"])
def test_greedy_speculation_equals_the_target_alone_and_transformers(make_target, family, images, astronaut, coffee):
    target = make_target(family)
    engine = SpecEngine(target, PromptLookup(max_draft_tokens=5))
    chosen = {"one": astronaut, "two": [astronaut, coffee], "none": None}[images]
    alone = engine.generate(chosen, PROMPT, max_new_tokens=24, speculative=False)
    fast = engine.generate(chosen, PROMPT, max_new_tokens=24)
    assert fast.token_ids == alone.token_ids == hf_greedy(target, chosen, PROMPT, 24)
    assert fast.text == alone.text and len(fast.token_ids) == 24 and fast.finish_reason == "length"
    assert alone.stats.tau == 1.0 and alone.stats.rounds == 23  # the prefill gives the first token


def test_an_image_request_then_a_text_request_on_one_engine(make_target, astronaut):
    target = make_target("qwen2_vl")
    engine = SpecEngine(target, PromptLookup())
    engine.generate(astronaut, PROMPT, max_new_tokens=8)
    text_only = engine.generate(None, "Write a haiku about rain.", max_new_tokens=16)
    assert text_only.token_ids == hf_greedy(target, None, "Write a haiku about rain.", 16)


def test_prompt_lookup_accepts_drafts_on_a_repetitive_prompt_and_stays_lossless(make_target):
    target = make_target("qwen2_5_vl")
    engine = SpecEngine(target, PromptLookup(max_draft_tokens=6))
    # Random weights fall into loops quickly; prompt lookup then copies the loop.
    prompt = "Repeat after me: one two three four five six seven eight. " * 4
    alone = engine.generate(None, prompt, max_new_tokens=64, speculative=False)
    fast = engine.generate(None, prompt, max_new_tokens=64)
    assert fast.token_ids == alone.token_ids
    assert fast.stats.tau > 1.0 and fast.stats.accepted > 0
    stats = fast.stats
    assert stats.rounds + stats.accepted + 1 == len(fast.token_ids)  # every token is accounted for
    assert stats.verified_by_position[0] >= stats.verified_by_position[-1]
    assert 0 < stats.tokens_per_s and stats.other_s >= 0


def test_max_new_tokens_eos_and_stop_strings_end_where_the_target_alone_ends(make_target):
    target = make_target("qwen3_vl")
    engine = SpecEngine(target, PromptLookup(max_draft_tokens=6))
    prompt = "Say something long and repetitive. " * 3
    reference = engine.generate(None, prompt, max_new_tokens=40, speculative=False).token_ids

    for n in (1, 2, 7):
        result = engine.generate(None, prompt, max_new_tokens=n)
        assert result.token_ids == reference[:n] and result.finish_reason == "length"

    eos = reference[9]
    first = reference.index(eos)
    config = target.model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = [eos]
    try:
        for speculative in (False, True):
            result = engine.generate(None, prompt, max_new_tokens=40, speculative=speculative)
            assert result.token_ids == reference[: first + 1] and result.finish_reason == "eos"
    finally:
        config.eos_token_id = saved

    tokenizer = target.tokenizer
    text = tokenizer.decode(reference, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    results = [engine.generate(None, prompt, max_new_tokens=40, stop=[stop], speculative=s) for s in (False, True)]
    assert results[0].token_ids == results[1].token_ids and results[0].finish_reason == "stop"
    assert stop in results[1].text and results[1].text.count(stop) == 1 and len(results[1].token_ids) < 40


def test_a_prompt_that_leaves_too_little_context_warns_and_stops_there(make_target):
    target = make_target("qwen2_vl")
    engine = SpecEngine(target, PromptLookup(max_draft_tokens=6))
    phrase = "one two three four five six seven eight nine ten "
    per_phrase = target.build_inputs(None, phrase * 2).length - target.build_inputs(None, phrase).length
    overhead = target.build_inputs(None, phrase).length - per_phrase
    words = phrase * ((target.max_context - 20 - overhead) // per_phrase)
    prompt_length = target.build_inputs(None, words).length
    room = target.max_context - prompt_length + 1
    assert 0 < room < 64, "the prompt should leave a few tokens of context"
    with pytest.warns(UserWarning, match=f"room for only {room} of max_new_tokens=64"):
        result = engine.generate(None, words, max_new_tokens=64)
    assert result.finish_reason == "context" and len(result.token_ids) <= room  # not "length": max_new_tokens


def test_round_records_match_the_statistics_and_the_output(make_target):
    engine = SpecEngine(make_target("qwen2_vl"), PromptLookup(max_draft_tokens=4))
    stream = engine.stream(None, PROMPT, max_new_tokens=24)
    records = list(stream.records())
    result = stream.result
    stats = result.stats
    assert len(records) == stats.rounds and [r.verified for r in records] == stats.verified_lengths
    assert sum(r.accepted for r in records) == stats.accepted and sum(r.drafted for r in records) == stats.drafted
    assert [t for r in records for t in r.tokens] == result.token_ids[1:]  # the prefill commits the first token
    assert all(r.accepted <= r.verified <= r.drafted and r.confidences is None for r in records)  # no confidence head
    assert all(len(r.tokens) == r.accepted + 1 for r in records[:-1])  # only the last round can be cut short


def test_stream_yields_the_same_text(make_target):
    engine = SpecEngine(make_target("qwen2_vl"), PromptLookup())
    stream = engine.stream(None, "Tell me a story.", max_new_tokens=20)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == engine.generate(None, "Tell me a story.", max_new_tokens=20).text


@pytest.mark.parametrize("way", ["text", "records"])
def test_two_streams_open_on_one_engine_each_yield_only_their_own_request(make_target, way):
    engine = SpecEngine(make_target("qwen2_5_vl"), PromptLookup())
    prompts = ["Tell me a story.", "Write a haiku about rain."]
    expected = [engine.generate(None, p, max_new_tokens=12) for p in prompts]
    assert expected[0].token_ids != expected[1].token_ids
    streams = [engine.stream(None, p, max_new_tokens=12) for p in prompts]
    iterators = [iter(s) if way == "text" else s.records() for s in streams]
    got: list[list] = [[], []]
    running = [0, 1]
    for _ in range(100):  # a bound instead of a hang: both end within 2 x 12 turns
        for i in list(running):  # the two streams take turns, one item each
            item = next(iterators[i], None)
            if item is None:
                running.remove(i)
            else:
                got[i].append(item)
        if not running:
            break
    assert not running, "the streams did not end"
    for stream, items, want in zip(streams, got, expected, strict=True):
        assert stream.result.token_ids == want.token_ids
        if way == "text":
            assert "".join(items) == want.text
        else:
            assert [t for record in items for t in record.tokens] == want.token_ids[1:]  # the prefill drew the first


def test_a_stream_dropped_unfinished_leaves_the_host(make_target):
    """Never iterated, or left half-way: its request stops running and its result is not kept."""
    engine = SpecEngine(make_target("qwen2_vl"), PromptLookup())
    host = engine._host
    kept = engine.stream(None, "Tell me a story.", max_new_tokens=12)
    dropped = engine.stream(None, "Write a haiku about rain.", max_new_tokens=400)
    assert host.num_waiting == 2
    del dropped  # never iterated
    assert host.num_waiting == 1 and not host.num_results
    half_way = engine.stream(None, "Count to a hundred.", max_new_tokens=400)
    pieces = iter(half_way)
    next(pieces)  # one row: the kept request ran to its end first (its output waits for its stream), then this
    assert host.num_running == 1 and host.num_results == 1
    del pieces, half_way
    assert not host.has_unfinished and host.num_results == 1
    assert "".join(kept) == kept.result.text and not host.num_results


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(images="/no/such/image.png"), FileNotFoundError, "not found"),
        (dict(images=b"not an image at all"), ValueError, "not a readable image"),
        (dict(images=3.14), TypeError, "unsupported image type"),
        (dict(prompt=""), ValueError, "empty"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(top_p=float("nan")), ValueError, "top_p"),
        (dict(temprature=0.5), TypeError, "unknown request options"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(prompt="word " * 3000), ValueError, "context"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_engine_keeps_working(make_target, kwargs, error, match):
    target = make_target("qwen2_vl")
    engine = SpecEngine(target, PromptLookup())
    args = dict(images=None, prompt="Hello there.", max_new_tokens=4) | kwargs
    with pytest.raises(error, match=match):
        engine.generate(args.pop("images"), args.pop("prompt"), **args)
    assert engine.generate(None, "Hello there.", max_new_tokens=6).token_ids == hf_greedy(
        target, None, "Hello there.", 6
    )


def test_a_drafter_with_the_wrong_vocabulary_is_refused(make_target):
    class WrongVocab(PromptLookup):
        vocab_size = 32000

    with pytest.raises(ValueError, match="vocabulary"):
        SpecEngine(make_target("qwen2_vl"), WrongVocab())


class OracleDrafter(PerRequestProposer):
    """A test proposer that drafts from a noisy copy of the target's own distribution.

    q = 0.6 * p_target + 0.4 * uniform(SUPPORT), recomputed by a plain forward over the
    request's history, so drafts are often accepted and sometimes rejected. With
    ``deterministic=True`` it proposes argmax q and returns no ``draft_probs`` (the one-hot
    path of verification, as prompt lookup uses).
    """

    feature_layers = ()
    vocab_size = None
    position_rule = "interpolate"

    def __init__(self, target, gamma: int = 2, deterministic: bool = False):
        self.model = target.model
        self.max_draft_tokens = gamma
        self.deterministic = deterministic

    def new_state(self):
        return {"history": []}

    @torch.no_grad()
    def propose_one(self, state, update: ContextUpdate, params: SamplingParams, generator) -> DraftBlock:
        from vlmspec.sampling import target_probs

        state["history"] += update.token_ids.tolist()
        history = state["history"] + [update.anchor]
        tokens, probs = [], []
        for _ in range(self.max_draft_tokens):
            logits = self.model(input_ids=torch.tensor([history]), logits_to_keep=1).logits[0, -1]
            q = 0.6 * target_probs(logits, SamplingParams(temperature=1.0))
            q[list(SUPPORT)] += 0.4 / len(SUPPORT)
            token = int(q.argmax()) if self.deterministic else int(torch.multinomial(q, 1, generator=generator))
            tokens.append(token)
            probs.append(q)
            history = history + [token]
        draft_probs = None if self.deterministic else torch.stack(probs)[None]
        return DraftBlock(torch.tensor([tokens]), torch.tensor([len(tokens)]), draft_probs=draft_probs)


@pytest.mark.parametrize("temperature, top_p, deterministic", [(1.0, None, False), (0.7, 0.8, True)])
def test_sampled_output_follows_the_target_distribution(confined_target, temperature, top_p, deterministic):
    """The first three generated tokens (token 1 from the prefill, 2 and 3 through drafting
    and verification) fit the target's exact joint law: chi-square over SUPPORT^3, p > 1e-3."""
    params = SamplingParams(temperature=temperature, top_p=top_p)
    joint = exact_first_tokens(confined_target, None, params)
    engine = SpecEngine(confined_target, OracleDrafter(confined_target, deterministic=deterministic))
    runs = 300
    counts, totals = sample_first_tokens(engine, None, runs, params, joint)
    assert 0 < totals["accepted"] < totals["verified"], "both accepted and rejected drafts must occur"
    expected = runs * torch.tensor(list(joint.values()), dtype=torch.float64)
    assert chi_square_p_value(counts, expected) > 1e-3
