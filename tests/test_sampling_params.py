"""min_p, logit_bias and tiny temperatures: validation, the warper chain, and losslessness end to end."""

from __future__ import annotations

import math

import pytest
import torch
from stat_helpers import SUPPORT, chi_square_p_value, exact_first_tokens, sample_first_tokens

from vlmspec.drafters.base import PerRequestProposer
from vlmspec.drafters.prompt_lookup import PromptLookup
from vlmspec.engine import SpecEngine
from vlmspec.sampling import greedy_one_hot, sample, target_probs
from vlmspec.types import GREEDY_BELOW_TEMPERATURE, ContextUpdate, DraftBlock, RequestOptions, SamplingParams
from vlmspec.verify import verify

# ------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("min_p", -0.1, "[0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("min_p", float("nan"), "[0, 1]"),
        ("min_p", "0.1", "[0, 1]"),
        ("logit_bias", {5: float("nan")}, "[-100, 100]"),
        ("logit_bias", {5: float("inf")}, "[-100, 100]"),
        ("logit_bias", {5: 100.5}, "[-100, 100]"),
        ("logit_bias", {5: "1"}, "[-100, 100]"),
        ("logit_bias", {-1: 1.0}, "token ids"),
        ("logit_bias", {"abc": 1.0}, "token ids"),
        ("logit_bias", {1.5: 1.0}, "token ids"),
        ("logit_bias", {5: 1.0, "5": 2.0}, "twice"),
        ("logit_bias", "50256", "map token ids"),
        ("logit_bias", 3, "map token ids"),
    ],
)
def test_bad_min_p_and_logit_bias_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=f"^{field} ") as raised:
        RequestOptions.build(**{field: value})
    assert message in str(raised.value)
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_logit_bias_is_normalised_once_hashable_and_carried_to_the_distribution():
    options = RequestOptions.build(temperature=0.5, min_p=0.05, logit_bias={"7": 2, 3: -100.0})
    assert options.logit_bias == ((3, -100.0), (7, 2.0))  # sorted pairs, JSON's string keys accepted
    assert options.sampling == SamplingParams(temperature=0.5, min_p=0.05, logit_bias=[(7, 2.0), (3, -100)])
    assert hash(options.sampling) == hash(SamplingParams(temperature=0.5, min_p=0.05, logit_bias={3: -100, 7: 2}))
    assert dict(options.logit_bias) == {3: -100.0, 7: 2.0}
    assert SamplingParams(logit_bias={}).logit_bias is None  # an empty bias is no bias
    assert RequestOptions.build(options, seed=3).sampling == options.sampling


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    params = SamplingParams(temperature=1.0, logit_bias={3: 1.0, 12: -1.0})
    params.check_vocabulary(13)
    with pytest.raises(ValueError, match=r"logit_bias names token ids \[12\] outside the vocabulary \[0, 12\)"):
        params.check_vocabulary(12)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        target_probs(torch.zeros(2, 12), params)


# ------------------------------------------------------------------ tiny temperatures


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324, GREEDY_BELOW_TEMPERATURE / 2])
def test_a_tiny_temperature_samples_as_greedy(temperature, sampler_path):
    params = SamplingParams(temperature=temperature, top_p=0.5, min_p=0.3)
    assert params.greedy
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    probs = target_probs(logits, params)
    assert torch.equal(probs, greedy_one_hot(logits))
    drawn = sample(probs, [torch.Generator().manual_seed(r) for r in range(4)])  # no "positive mass" error
    assert torch.equal(drawn, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [GREEDY_BELOW_TEMPERATURE, 1e-3, 2.0, 1e30, 1e300])
def test_any_finite_temperature_gives_a_finite_distribution(temperature, sampler_path):
    logits = 30 * torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    logits[0, :10] = float("-inf")  # a model may mask tokens
    params = SamplingParams(temperature=temperature, top_k=50, top_p=0.9, min_p=0.01, logit_bias={4: 100.0})
    probs = target_probs(logits, params)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    assert (probs[0, :10] == 0).all()


# ------------------------------------------------------------ the chain: bias and min-p


def test_logit_bias_is_added_before_greedy_and_before_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.0, logit_bias={3: 4.0})
    assert greedy_one_hot(logits).argmax().item() == 0
    assert target_probs(logits, params).argmax().item() == 3  # 3.0 beats 2.0
    sampled = target_probs(logits, SamplingParams(temperature=0.5, logit_bias={3: 4.0, 0: -100}))
    expected = torch.softmax(torch.tensor([[2.0 - 100, 1.0, 0.0, 3.0]]) / 0.5, dim=-1)
    torch.testing.assert_close(sampled, expected)


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_probable():
    probs = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05]])
    kept = target_probs(probs.log(), SamplingParams(temperature=1.0, min_p=0.19))  # threshold 0.095
    torch.testing.assert_close(kept, torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.0, 0.0]]) / 0.9)
    tied = target_probs(torch.tensor([[1.0, 0.0, 1.0]]), SamplingParams(temperature=0.7, min_p=1.0))
    assert tied.tolist() == [[0.5, 0.0, 0.5]]  # min_p = 1 keeps every token tied with the top
    # min-p follows temperature: at T = 0.5 the ratios to the top square (0.4 -> 0.16, 0.2 -> 0.04)
    assert (target_probs(probs.log(), SamplingParams(temperature=1.0, min_p=0.15)) > 0).sum().item() == 4
    assert (target_probs(probs.log(), SamplingParams(temperature=0.5, min_p=0.15)) > 0).sum().item() == 2


def test_min_p_draws_follow_the_truncated_distribution(sampler_path):
    """Seeded draws through ``sample`` fit the min-p distribution built by hand (TV bound, 1e-6 failure)."""
    logits = torch.tensor([1.0, 0.6, 0.2, -0.5, -1.5, -3.0])
    params = SamplingParams(temperature=0.8, min_p=0.3)
    full = torch.softmax(logits / 0.8, dim=-1)
    expected = torch.where(full >= 0.3 * full.max(), full, 0.0)
    expected /= expected.sum()
    assert (expected == 0).sum() >= 2 and (expected > 0).sum() >= 3  # the filter bites, and leaves a choice
    num = 20_000
    probs = target_probs(logits.expand(num, -1), params)
    drawn = sample(probs, [torch.Generator().manual_seed(r) for r in range(num)])
    freq = torch.bincount(drawn, minlength=6).double() / num
    assert (freq[expected == 0] == 0).all()
    tv = 0.5 * (freq - expected.double()).abs().sum().item()
    assert tv <= tv_bound(6, num), (tv, freq, expected)


def tv_bound(num_categories: int, num_samples: int, failure_prob: float = 1e-6) -> float:
    """E[TV] <= 1/2 sqrt(V / N); McDiarmid adds sqrt(ln(1 / failure_prob) / (2 N)) (see test_sampling)."""
    return 0.5 * math.sqrt(num_categories / num_samples) + math.sqrt(math.log(1 / failure_prob) / (2 * num_samples))


def test_greedy_verification_matches_the_biased_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 4, 30, generator=gen)  # [B, gamma + 1, V]
    params = SamplingParams(logit_bias={7: 3.0, 11: 2.5})
    biased_argmax = target_probs(logits, params).argmax(-1)  # [B, gamma + 1]
    assert not torch.equal(biased_argmax, logits.argmax(-1)), "the bias must change some argmax"
    block = DraftBlock(tokens=biased_argmax[:, :3].clone(), num_tokens=torch.full((16,), 3))
    block.tokens[8:, 1] = (block.tokens[8:, 1] + 1) % 30  # half the rows deviate at slot 1
    result = verify(block, logits, params)
    assert result.num_accepted.tolist() == [3] * 8 + [1] * 8
    assert result.next_tokens.tolist() == biased_argmax[:8, 3].tolist() + biased_argmax[8:, 1].tolist()


# ---------------------------------------------------------------------- end to end


def test_greedy_speculation_with_logit_bias_equals_the_target_alone(make_target):
    target = make_target("qwen2_5_vl")
    engine = SpecEngine(target, PromptLookup(max_draft_tokens=6))
    prompt = "Repeat after me: one two three four five six seven eight. " * 4
    plain = engine.generate(None, prompt, max_new_tokens=40, speculative=False).token_ids
    banned = sorted(set(plain))[:3]  # tokens the unbiased target emits
    favoured = plain[5]
    bias = {**{token: -100.0 for token in banned if token != favoured}, favoured: 3.0}
    alone = engine.generate(None, prompt, max_new_tokens=40, speculative=False, logit_bias=bias)
    fast = engine.generate(None, prompt, max_new_tokens=40, logit_bias=bias)
    assert fast.token_ids == alone.token_ids
    assert alone.token_ids != plain and not set(alone.token_ids) & (set(banned) - {favoured})
    assert fast.stats.accepted > 0, "drafts must be verified against the biased argmax"


class UniformSupportDrafter(PerRequestProposer):
    """Drafts two tokens uniformly from the confined target's SUPPORT (so drafts are kept and rejected)."""

    feature_layers = ()
    vocab_size = None
    position_rule = "interpolate"
    max_draft_tokens = 2

    def __init__(self, vocab: int, deterministic: bool):
        self.vocab, self.deterministic = vocab, deterministic

    def new_state(self):
        return None

    def propose_one(self, state, update: ContextUpdate, params: SamplingParams, generator) -> DraftBlock:
        picks = torch.randint(len(SUPPORT), (2,), generator=generator)
        tokens = torch.tensor(SUPPORT)[picks][None]  # [1, 2]
        if self.deterministic:
            return DraftBlock(tokens, torch.tensor([2]))
        probs = torch.zeros(1, 2, self.vocab)
        probs[:, :, list(SUPPORT)] = 1 / len(SUPPORT)
        return DraftBlock(tokens, torch.tensor([2]), draft_probs=probs)


@pytest.mark.parametrize("deterministic", [False, True])
def test_sampled_speculation_with_min_p_and_logit_bias_follows_the_target(confined_target, deterministic, sampler_path):
    """The first three tokens fit the target's exact joint law under min-p and a bias (chi-square, p > 1e-3)."""
    params = SamplingParams(temperature=1.0, min_p=0.25, logit_bias={SUPPORT[3]: 1.5, SUPPORT[0]: -0.5})
    joint = exact_first_tokens(confined_target, None, params)
    unbiased = exact_first_tokens(confined_target, None, SamplingParams(temperature=1.0))
    assert sum(p == 0 for p in joint.values()) > sum(p == 0 for p in unbiased.values()), "min-p must cut tokens"
    vocab = confined_target.model.config.text_config.vocab_size
    engine = SpecEngine(confined_target, UniformSupportDrafter(vocab, deterministic))
    runs = 300
    counts, totals = sample_first_tokens(engine, None, runs, params, joint)
    assert 0 < totals["accepted"] < totals["verified"], "both accepted and rejected drafts must occur"
    expected = runs * torch.tensor(list(joint.values()), dtype=torch.float64)
    assert counts[expected == 0].sum() == 0, "a token cut by min-p was committed"
    assert chi_square_p_value(counts, expected) > 1e-3
