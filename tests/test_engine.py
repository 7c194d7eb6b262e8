"""End-to-end: speculation through SpecEngine gives exactly the target's output."""

from __future__ import annotations

import pytest
import torch

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


def test_stream_yields_the_same_text(make_target):
    engine = SpecEngine(make_target("qwen2_vl"), PromptLookup())
    stream = engine.stream(None, "Tell me a story.", max_new_tokens=20)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == engine.generate(None, "Tell me a story.", max_new_tokens=20).text


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
    assert engine.generate(None, "Hello there.", max_new_tokens=6).token_ids == hf_greedy(target, None, "Hello there.", 6)


def test_a_drafter_with_the_wrong_vocabulary_is_refused(make_target):
    class WrongVocab(PromptLookup):
        vocab_size = 32000

    with pytest.raises(ValueError, match="vocabulary"):
        SpecEngine(make_target("qwen2_vl"), WrongVocab())


class OracleDrafter:
    """A test proposer that drafts from a noisy copy of the target's own distribution.

    q = 0.6 * p_target + 0.4 * (uniform over the target's 16 likeliest tokens), recomputed
    by a plain forward over the request's history: drafts are often accepted, sometimes
    rejected, and the bonus path runs too, so every branch of verification is exercised.
    """

    feature_layers = ()
    vocab_size = None
    position_rule = "interpolate"

    def __init__(self, target, gamma: int = 2):
        self.model = target.model
        self.max_draft_tokens = gamma

    def new_state(self):
        return {"history": []}

    @torch.no_grad()
    def propose(self, state, update: ContextUpdate, params: SamplingParams, generator) -> DraftBlock:
        from vlmspec.sampling import target_probs

        state["history"] += update.token_ids.tolist()
        history = state["history"] + [update.anchor]
        tokens, probs = [], []
        for _ in range(self.max_draft_tokens):
            p = target_probs(self.model(input_ids=torch.tensor([history]), logits_to_keep=1).logits[0, -1], params)
            noise = torch.zeros_like(p)
            noise[p.topk(16).indices] = 1 / 16
            q = 0.6 * p + 0.4 * noise
            token = int(torch.multinomial(q, 1, generator=generator))
            tokens.append(token)
            probs.append(q)
            history = history + [token]
        return DraftBlock(torch.tensor([tokens]), torch.tensor([len(tokens)]), draft_probs=torch.stack(probs)[None])


def randomized_pit(tokens: list[int], probs: torch.Tensor, generator: torch.Generator) -> list[float]:
    """u = F(x - 1) + U * p(x): exactly Uniform(0, 1) when x ~ p (probs: [n, V])."""
    cdf = probs.double().cumsum(-1)
    values = []
    for row, token in enumerate(tokens):
        below = float(cdf[row, token - 1]) if token > 0 else 0.0
        values.append(below + float(torch.rand((), generator=generator, dtype=torch.float64)) * float(probs[row, token]))
    return values


def ks_uniform(values: list[float]) -> float:
    """Kolmogorov-Smirnov distance between the sample and Uniform(0, 1)."""
    u = torch.tensor(sorted(values), dtype=torch.float64)
    n = len(u)
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(ranks / n - u, u - (ranks - 1) / n).max())


@pytest.mark.parametrize("temperature, top_p", [(1.0, None), (0.7, 0.8)])
def test_sampled_output_follows_the_target_distribution(make_target, temperature, top_p):
    """Tokens 2 and 3 (the ones that go through drafting and verification) follow the target.

    For each sample, the exact target distribution at those positions given the sampled
    prefix turns the token into a randomized PIT value, Uniform(0, 1) iff the token was
    drawn from the target's law. The KS distance of N such values stays below
    1.63 / sqrt(N) with probability 0.99 (Kolmogorov's limit); a sampler that, e.g., keeps
    accepted drafts without the min(1, p/q) test lands far above it at this N.
    """
    from vlmspec.sampling import target_probs

    target = make_target("qwen2_vl")
    params = SamplingParams(temperature=temperature, top_p=top_p)
    engine = SpecEngine(target, OracleDrafter(target))
    prompt_ids = target.build_inputs(None, "Name a colour.").input_ids
    pit_generator = torch.Generator().manual_seed(1234)
    n, pit, accepted = 300, {1: [], 2: []}, 0
    for seed in range(n):
        result = engine.generate(None, "Name a colour.", max_new_tokens=3, temperature=temperature, top_p=top_p, seed=seed)
        accepted += result.stats.accepted
        ids = torch.cat([prompt_ids, torch.tensor([result.token_ids])], dim=1)
        with torch.no_grad():
            probs = target_probs(target.model(input_ids=ids, logits_to_keep=3).logits[0, -3:], params)
        for position in (1, 2):
            pit[position] += randomized_pit([result.token_ids[position]], probs[position : position + 1], pit_generator)
    bound = 1.63 / n**0.5
    assert accepted > n // 2, "the drafter should get many drafts accepted"
    for position, values in pit.items():
        assert ks_uniform(values) < bound, f"token {position + 1}: KS {ks_uniform(values):.3f} >= {bound:.3f}"
