"""vlmspec.verify: greedy verification by hand, rejection sampling by statistics.

The statistical tests simulate many independent requests at once: B = N rows in one
verify call, each row with its own generator. They check that the committed tokens follow
the target's distribution within a total-variation bound that shrinks like 1/sqrt(N)
(see ``tv_bound``), and a negative control shows that the same check catches a wrong
verifier.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from vlmspec import sampling
from vlmspec.types import DraftBlock, SamplingParams, VerifyResult
from vlmspec.verify import verify, verify_greedy, verify_rejection

NUM_ROWS = 30_000  # requests simulated per statistical test (one verify call per round)
FAILURE_PROB = 1e-6  # chance that a correct verifier exceeds a bound below, per check


def generators(num: int, seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + 7919 * r) for r in range(num)]


@pytest.fixture(scope="module")
def row_generators() -> list[torch.Generator]:
    """Created once (30k generators take a while); every test seeds them afresh."""
    return generators(NUM_ROWS, seed=0)


def reseeded(gens: list[torch.Generator], seed: int) -> list[torch.Generator]:
    for r, g in enumerate(gens):
        g.manual_seed(seed + 7919 * r)
    return gens


def tv_bound(num_categories: int, num_samples: int) -> float:
    """TV(empirical, true) stays below this with probability >= 1 - FAILURE_PROB.

    E[TV] <= 1/2 sum_x sqrt(p_x (1 - p_x) / N) <= 1/2 sqrt(V / N) (Cauchy-Schwarz), and TV
    moves by at most 1/N when one sample changes, so McDiarmid gives
    P(TV >= E[TV] + t) <= exp(-2 N t^2) with t = sqrt(ln(1 / FAILURE_PROB) / (2 N)).
    For V = 6 and N = 30k that is about 0.022.
    """
    return 0.5 * math.sqrt(num_categories / num_samples) + math.sqrt(math.log(1 / FAILURE_PROB) / (2 * num_samples))


def rate_bound(num_samples: int) -> float:
    """Hoeffding: |mean of N Bernoullis - their mean| <= this with probability >= 1 - FAILURE_PROB."""
    return math.sqrt(math.log(2 / FAILURE_PROB) / (2 * num_samples))


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:  # tokens [N] int64, probs [V]
    freq = torch.bincount(tokens, minlength=probs.numel()).double() / tokens.numel()
    return 0.5 * (freq - probs.double()).abs().sum().item()


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:  # probs [N, V] -> [N] int64
    """The drafter's own draw (torch.multinomial, independent of the code under test)."""
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


Verifier = Callable[[DraftBlock, torch.Tensor, list[torch.Generator]], VerifyResult]

# ---------------------------------------------------------------------------- greedy


def logits_with_argmax(argmax: torch.Tensor, vocab: int) -> torch.Tensor:  # argmax [B, S] -> [B, S, V]
    noise = torch.rand(*argmax.shape, vocab, generator=torch.Generator().manual_seed(0))
    return noise + 2.0 * torch.nn.functional.one_hot(argmax, vocab)


def test_greedy_hand_made_cases() -> None:
    argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])  # [B=5, gamma+1]
    tokens = torch.tensor(
        [
            [1, 2, 3],  # all accepted -> bonus at slot 3
            [1, 0, 3],  # mismatch at k=1 -> recovered = argmax at 1 (later matches don't count)
            [0, 0, 0],  # num_tokens 0 -> the target's own token at slot 0
            [1, 2, 0],  # two real drafts, both match; the padding at slot 2 is ignored -> bonus at 2
            [4, -1, -1],  # mismatch at k=0, padded with -1
        ]
    )
    block = DraftBlock(tokens=tokens, num_tokens=torch.tensor([3, 3, 0, 2, 1]))
    result = verify_greedy(block, logits_with_argmax(argmax, vocab=6))
    assert result.num_accepted.tolist() == [3, 1, 0, 2, 0]
    assert result.next_tokens.tolist() == [4, 2, 1, 3, 1]


def test_greedy_ties_go_to_the_lowest_index_and_bf16_works() -> None:
    logits = torch.tensor([[[0.0, 3.0, 3.0], [1.0, 1.0, 0.0]]], dtype=torch.bfloat16)  # [1, 2, 3]
    result = verify_greedy(DraftBlock(tokens=torch.tensor([[2]]), num_tokens=torch.tensor([1])), logits)
    assert (result.num_accepted.item(), result.next_tokens.item()) == (0, 1)
    result = verify_greedy(DraftBlock(tokens=torch.tensor([[1]]), num_tokens=torch.tensor([1])), logits)
    assert (result.num_accepted.item(), result.next_tokens.item()) == (1, 0)


def test_verify_dispatches_and_top_k_1_sampling_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(1)
    target_logits = torch.randn(64, 4, 30, generator=gen)  # [B, gamma+1, V]
    argmax = target_logits.argmax(-1)
    # drafts that follow the target for a random prefix, then deviate
    deviate = torch.rand(64, 3, generator=gen) >= 0.7
    tokens = torch.where(deviate, torch.randint(0, 30, (64, 3), generator=gen), argmax[:, :3])
    draft_probs = torch.softmax(torch.randn(64, 3, 30, generator=gen), -1)
    block = DraftBlock(tokens=tokens, num_tokens=torch.randint(0, 4, (64,), generator=gen), draft_probs=draft_probs)
    greedy = verify_greedy(block, target_logits)
    assert greedy.num_accepted.float().mean() > 0.3  # the example exercises acceptance
    dispatched = verify(block, target_logits, SamplingParams(temperature=0.0))
    assert torch.equal(dispatched.num_accepted, greedy.num_accepted)
    assert torch.equal(dispatched.next_tokens, greedy.next_tokens)
    # with top_k=1 the target is one-hot on its argmax: rejection sampling must be greedy
    top1 = verify(block, target_logits, SamplingParams(temperature=1.0, top_k=1), generators(64, seed=2))
    assert torch.equal(top1.num_accepted, greedy.num_accepted)
    assert torch.equal(top1.next_tokens, greedy.next_tokens)


# ------------------------------------------------------------------ rejection: one slot

TARGET = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05, 0.00])
BONUS = torch.full((6,), 1 / 6)  # target at the bonus slot: any distribution will do
FIRST_SLOT_CASES = {
    "draft_much_worse": (TARGET, torch.tensor([0.02, 0.03, 0.05, 0.10, 0.30, 0.50])),
    "draft_equals_target": (TARGET, TARGET),
    "draft_zero_where_target_has_mass": (TARGET, torch.tensor([0.0, 0.6, 0.4, 0.0, 0.0, 0.0])),
    "target_zero_where_draft_has_mass": (torch.tensor([0.7, 0.3, 0.0, 0.0, 0.0, 0.0]), torch.full((6,), 1 / 6)),
}


def first_token_round(
    target: torch.Tensor,  # [V]
    draft: torch.Tensor,  # [V], the distribution the draft token is drawn from
    gens: list[torch.Generator],
    deterministic: bool = False,  # pass draft_probs=None (the drafted token is still drawn from `draft`)
    verifier: Verifier = verify_rejection,
) -> tuple[torch.Tensor, VerifyResult]:  # first committed token [N], the result
    num = len(gens)
    tokens = draw(draft.expand(num, -1), torch.Generator().manual_seed(123)).unsqueeze(1)  # [N, 1]
    target_probs = torch.stack([target, BONUS]).expand(num, -1, -1)  # [N, 2, V]
    draft_probs = None if deterministic else draft.expand(num, 1, -1)  # [N, 1, V]
    block = DraftBlock(tokens=tokens, num_tokens=torch.ones(num, dtype=torch.int64), draft_probs=draft_probs)
    result = verifier(block, target_probs, gens)
    first = torch.where(result.num_accepted >= 1, tokens[:, 0], result.next_tokens)
    return first, result


@pytest.mark.parametrize("case", sorted(FIRST_SLOT_CASES))
def test_first_token_follows_the_target(case: str, row_generators: list[torch.Generator], sampler_path: str) -> None:
    target, draft = FIRST_SLOT_CASES[case]
    first, result = first_token_round(target, draft, reseeded(row_generators, seed=100))
    tv = total_variation(first, target)
    assert tv <= tv_bound(6, NUM_ROWS), f"{case}: TV {tv:.4f}"
    # acceptance rate = sum_x min(target(x), draft(x))
    expected_rate = torch.minimum(target, draft).sum().item()
    rate = result.num_accepted.double().mean().item()
    assert abs(rate - expected_rate) <= rate_bound(NUM_ROWS), f"{case}: rate {rate:.4f} vs {expected_rate:.4f}"


def test_deterministic_drafts_without_draft_probs_follow_the_target(
    row_generators: list[torch.Generator], sampler_path: str
) -> None:
    # Tokens chosen by the drafter (here: varied per row), verified as one-hot drafts.
    draft = torch.tensor([0.1, 0.1, 0.2, 0.1, 0.0, 0.5])  # only how the tokens were chosen; not passed
    first, result = first_token_round(TARGET, draft, reseeded(row_generators, seed=200), deterministic=True)
    assert total_variation(first, TARGET) <= tv_bound(6, NUM_ROWS)
    expected_rate = (draft * TARGET).sum().item()  # a one-hot draft x survives with probability target(x)
    assert abs(result.num_accepted.double().mean().item() - expected_rate) <= rate_bound(NUM_ROWS)


def accept_always(block: DraftBlock, target_probs: torch.Tensor, gens: list[torch.Generator]) -> VerifyResult:
    """A deliberately wrong verifier: every draft survives, the bonus comes from the target."""
    rows = torch.arange(block.tokens.shape[0])
    return VerifyResult(block.num_tokens.clone(), sampling.sample(target_probs[rows, block.num_tokens], gens))


def test_negative_control_accept_always_is_caught(row_generators: list[torch.Generator], sampler_path: str) -> None:
    target, draft = FIRST_SLOT_CASES["draft_much_worse"]
    first, _ = first_token_round(target, draft, reseeded(row_generators, seed=300), verifier=accept_always)
    tv = total_variation(first, target)  # the draft's distribution: TV(draft, target) = 0.6
    assert tv > 10 * tv_bound(6, NUM_ROWS), tv


def test_negative_control_resampling_from_the_target_is_caught(
    row_generators: list[torch.Generator], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A subtle bug: recover from target_probs instead of the residual. Output is
    # min(target, draft) + (1 - alpha) * target, at TV 0.125 from the target here. The bug is
    # planted in the reference (Python) path, which the check then runs.
    monkeypatch.setattr(sampling, "native_sampling_applies", lambda tensor: False)
    monkeypatch.setattr(sampling, "positive_residual", lambda target_probs, draft_probs: target_probs)
    target, draft = FIRST_SLOT_CASES["draft_much_worse"]
    first, _ = first_token_round(target, draft, reseeded(row_generators, seed=400))
    assert total_variation(first, target) > 4 * tv_bound(6, NUM_ROWS)


# ------------------------------------------------------------- rejection: two positions

V2 = 5


def bigram_model(seed: int, zeros: float) -> tuple[torch.Tensor, torch.Tensor]:  # start [V], next [V, V]
    """A random first-token distribution and transition matrix with some zero entries."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(V2 + 1, V2, generator=gen) ** 3
    weights[torch.rand(V2 + 1, V2, generator=gen) < zeros] = 0.0
    weights[torch.arange(V2 + 1), torch.arange(V2 + 1) % V2] += 0.05  # every row keeps some mass
    probs = weights / weights.sum(-1, keepdim=True)
    return probs[V2], probs[:V2]


def draft_round(
    target_start: torch.Tensor,  # [N, V] target at slot 0 (given the committed context)
    draft_start: torch.Tensor,  # [N, V] draft at slot 0
    target_next: torch.Tensor,  # [V, V] target transition
    draft_next: torch.Tensor,  # [V, V] draft transition
    gens: list[torch.Generator],
    gen: torch.Generator,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # first [N], second [N] committed token (-1: none)
    """One speculative round with gamma = 2 and random per-row draft lengths 0..2."""
    num = target_start.shape[0]
    if deterministic:  # the drafter's argmax chain, verified as one-hot drafts
        x1 = draft_start.argmax(-1)
        x2 = draft_next[x1].argmax(-1)
    else:
        x1 = draw(draft_start, gen)
        x2 = draw(draft_next[x1], gen)
    tokens = torch.stack([x1, x2], 1)  # [N, 2]
    target_probs = torch.stack([target_start, target_next[x1], target_next[x2]], 1)  # [N, 3, V]
    draft_probs = None if deterministic else torch.stack([draft_start, draft_next[x1]], 1)  # [N, 2, V]
    num_tokens = torch.randint(0, 3, (num,), generator=gen)
    result = verify_rejection(DraftBlock(tokens, num_tokens, draft_probs), target_probs, gens)
    accepted, next_tokens = result.num_accepted, result.next_tokens
    first = torch.where(accepted >= 1, x1, next_tokens)
    second = torch.where(accepted >= 2, x2, torch.where(accepted == 1, next_tokens, -1))
    return first, second


@pytest.mark.parametrize("deterministic", [False, True])
def test_two_emitted_tokens_follow_the_target_jointly(
    deterministic: bool, row_generators: list[torch.Generator], sampler_path: str
) -> None:
    target_start, target_next = bigram_model(seed=1, zeros=0.2)
    draft_start, draft_next = bigram_model(seed=2, zeros=0.3)  # a different model, zeros elsewhere
    gens, gen = reseeded(row_generators, seed=500), torch.Generator().manual_seed(501)
    num = len(gens)
    first, second = draft_round(
        target_start.expand(num, -1), draft_start.expand(num, -1), target_next, draft_next, gens, gen, deterministic
    )
    # Rows that committed a single token draft again after it; their next first token is the second.
    again, _ = draft_round(target_next[first], draft_next[first], target_next, draft_next, gens, gen, deterministic)
    second = torch.where(second >= 0, second, again)
    assert total_variation(first, target_start) <= tv_bound(V2, num)
    joint = (target_start[:, None] * target_next).flatten()  # [V * V]
    tv = total_variation(first * V2 + second, joint)
    assert tv <= tv_bound(V2 * V2, num), tv


# ------------------------------------------------------------ rejection: exact behaviour


def test_certain_and_impossible_drafts() -> None:
    target_probs = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]]])  # [2, 2, 3]
    block = DraftBlock(torch.tensor([[1], [1]]), torch.tensor([1, 1]), torch.full((2, 1, 3), 1 / 3))
    for seed in range(20):
        result = verify_rejection(block, target_probs, generators(2, seed))
        assert result.num_accepted.tolist() == [1, 0]  # target(x) = 1 always survives, 0 never
        assert result.next_tokens[0].item() == 2  # the bonus, from a one-hot
        assert result.next_tokens[1].item() in (0, 2)  # recovered from the residual, never the rejected 1


def test_rows_without_drafts_sample_slot_zero() -> None:
    target_probs = torch.zeros(3, 3, 4)
    target_probs[torch.arange(3), 0, torch.tensor([3, 0, 2])] = 1.0
    target_probs[:, 1:] = 0.25
    block = DraftBlock(torch.full((3, 2), -1), torch.zeros(3, dtype=torch.int64), torch.full((3, 2, 4), 0.25))
    result = verify_rejection(block, target_probs, generators(3, seed=0))
    assert result.num_accepted.tolist() == [0, 0, 0]
    assert result.next_tokens.tolist() == [3, 0, 2]
    empty = DraftBlock(torch.zeros(3, 0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))  # gamma = 0
    assert verify_rejection(empty, target_probs[:, :1], generators(3, seed=0)).next_tokens.tolist() == [3, 0, 2]


def test_same_seeds_give_the_same_result() -> None:
    gen = torch.Generator().manual_seed(3)
    target_probs = torch.softmax(torch.randn(32, 5, 100, generator=gen), -1)
    draft_probs = torch.softmax(torch.randn(32, 4, 100, generator=gen), -1)
    tokens = draw(draft_probs.reshape(-1, 100), gen).view(32, 4)
    block = DraftBlock(tokens, torch.randint(0, 5, (32,), generator=gen), draft_probs)
    first = verify_rejection(block, target_probs, generators(32, seed=9))
    second = verify_rejection(block, target_probs, generators(32, seed=9))
    other = verify_rejection(block, target_probs, generators(32, seed=10))
    assert torch.equal(first.num_accepted, second.num_accepted) and torch.equal(first.next_tokens, second.next_tokens)
    assert not torch.equal(first.next_tokens, other.next_tokens)


def test_bad_input_raises_a_clear_error() -> None:
    target_probs = torch.full((2, 3, 4), 0.25)
    block = DraftBlock(torch.zeros(2, 2, dtype=torch.int64), torch.tensor([2, 1]), torch.full((2, 2, 4), 0.25))
    with pytest.raises(ValueError, match="one torch.Generator per request"):
        verify_rejection(block, target_probs, generators(1, seed=0))
    with pytest.raises(ValueError, match=r"\[B, gamma \+ 1, V\]"):
        verify_rejection(block, target_probs[:, :2], generators(2, seed=0))
    with pytest.raises(ValueError, match="float32"):
        verify_rejection(block, target_probs.double(), generators(2, seed=0))
    half_drafts = DraftBlock(block.tokens, block.num_tokens, block.draft_probs.half())
    with pytest.raises(ValueError, match="draft_probs must be float32"):
        verify_rejection(half_drafts, target_probs, generators(2, seed=0))
    smaller_vocab = DraftBlock(block.tokens, block.num_tokens, torch.full((2, 2, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"draft_probs must have shape"):
        verify_rejection(smaller_vocab, target_probs, generators(2, seed=0))
    with pytest.raises(ValueError, match="num_tokens outside"):
        verify_greedy(DraftBlock(block.tokens, torch.tensor([3, 0])), target_probs)
    with pytest.raises(ValueError, match="vocabulary"):
        verify_greedy(DraftBlock(torch.tensor([[0, 9], [0, 0]]), torch.tensor([2, 0])), target_probs)
    with pytest.raises(ValueError, match="needs generators"):
        verify(block, target_probs, SamplingParams(temperature=1.0))
