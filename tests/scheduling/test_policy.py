"""The drafting policy: its choices, and non-anticipation (docs/design.md §9 applied to drafting).

The statistical test simulates whole rounds on a two-token vocabulary {A, B}: the target
samples Y ~ (0.7, 0.3); a drafter proposes x1 ~ (0.5, 0.5), verified by rejection
sampling. Whether a round drafts may depend on anything that happened before it, but not
on the x1 it is about to verify. A policy that decides from earlier rounds keeps
Pr(Y = A) = 0.7; a policy that drafts exactly when x1 = A (and otherwise lets the target
sample alone) gives 0.5 * 1 + 0.5 * 0.7 = 0.85. Bound: the estimate must lie within 5
standard errors of the exact value (false alarm below 1e-6; 0.7 and 0.85 are 20 standard
errors apart at N = 4000).
"""

from __future__ import annotations

import math

import pytest
import torch

from vlmspec.scheduling.policy import NONE, DraftCosts, DraftingPolicy, expected_steps_per_token, planned_drafts
from vlmspec.scheduling.profiling import sps_preset
from vlmspec.scheduling.tables import DraftTiming

COSTS = DraftCosts(verify_steps=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7), draft_steps={"model": 0.4, "ngram": 0.0})
TARGET_A, DRAFT_A = 0.7, 0.5
ROUNDS = 4000


def evidence(policy: DraftingPolicy, **accepted: float):
    found = policy.new_evidence(("model", "ngram"))
    for source, value in accepted.items():
        found[source].accepted = value
    return found


def test_a_source_that_rarely_survives_is_not_worth_its_drafting_round():
    policy = DraftingPolicy(COSTS)
    assert policy.choose(evidence(policy, model=0.2, ngram=0.0), {"model": 7, "ngram": 0}) == NONE
    # (0.4 + T_verify(3)) / 3 tokens = 0.53 steps per token: well worth it
    assert policy.choose(evidence(policy, model=2.0, ngram=0.0), {"model": 7, "ngram": 0}) == "model"


def test_a_free_copy_wins_over_the_model_at_equal_evidence_and_only_when_offered():
    policy = DraftingPolicy(COSTS)
    seen = evidence(policy, model=1.0, ngram=1.0)
    assert policy.choose(seen, {"model": 7, "ngram": 4}) == "ngram"
    assert policy.choose(seen, {"model": 7, "ngram": 0}) == "model"  # no match this round: no copy on offer


def test_expected_cost_counts_the_drafting_round_and_one_verified_past_the_accepted():
    # 1 accepted of 7: verify 1 + 2 tokens (1.2 steps) plus 0.4 to draft, for 2 tokens
    assert expected_steps_per_token(1.0, 7, 0.4, COSTS) == pytest.approx((0.4 + 1.2) / 2)
    assert planned_drafts(0.2, 7) == 1 and planned_drafts(2.6, 7) == 4 and planned_drafts(5.0, 3) == 3
    assert COSTS.verify(20) == pytest.approx(1.7 * 20 / 8)  # past the table: grown linearly


def test_an_idle_source_is_probed_then_judged_on_what_it_showed():
    policy = DraftingPolicy(COSTS, probe_every=3)
    seen = evidence(policy, model=0.1, ngram=0.0)
    choices = []
    for _ in range(5):
        chosen = policy.choose(seen, {"model": 7, "ngram": 0})
        choices.append(chosen)
        policy.observe(seen, chosen, accepted=0 if chosen == "model" else None)
    assert choices == [NONE] * 3 + ["model", NONE]  # after 3 idle rounds: one probe
    assert seen["model"].rounds == 1 and seen["model"].accepted < 0.1  # the probe's zero pulled it down


def probe_rounds(policy: DraftingPolicy, rounds: int, survived_at: frozenset[int] = frozenset()) -> list[int]:
    """The rounds at which ``policy`` probes a source not worth drafting; probes at ``survived_at`` accept 2."""
    seen = evidence(policy, model=0.0, ngram=0.0)
    probes = []
    for round_index in range(rounds):
        chosen = policy.choose(seen, {"model": 7, "ngram": 0})
        if chosen == "model":
            probes.append(round_index)
        accepted = (2 if round_index in survived_at else 0) if chosen == "model" else None
        policy.observe(seen, chosen, accepted)
        seen["model"].accepted = 0.0  # keep it not worth drafting on merit: only probes draft
    return probes


def test_probes_of_a_source_that_keeps_failing_thin_out_up_to_the_longest_wait():
    policy = DraftingPolicy(COSTS, probe_every=3, max_probe_every=12)
    # waits 3, 6, 12, 12: a failed probe doubles the wait, up to max_probe_every
    assert probe_rounds(policy, 50) == [3, 10, 23, 36, 49]


def test_a_probe_whose_draft_survived_brings_the_wait_back_to_probe_every():
    policy = DraftingPolicy(COSTS, probe_every=3, max_probe_every=12)
    # the probe at round 10 accepts drafts: the next wait is 3 again, then doubles from there
    assert probe_rounds(policy, 30, survived_at=frozenset({10})) == [3, 10, 14, 21]


def test_with_prior_rounds_the_average_is_a_mean_until_the_newest_round_weighs_smoothing():
    policy = DraftingPolicy(COSTS, priors={"model": 0.8}, smoothing=0.1, prior_rounds=4)
    seen = policy.new_evidence(("model",))
    outcomes = [0, 0, 3, 1, 0]
    for accepted in outcomes:
        policy.observe(seen, "model", accepted)
    # weights 1/5, 1/6, ..., 1/9: all above 0.1, so the prior counts as 4 rounds of 0.8 in a plain mean
    assert seen["model"].accepted == pytest.approx((4 * 0.8 + sum(outcomes)) / (4 + len(outcomes)))
    assert policy.newest_weight(100) == 0.1  # past 1 / smoothing rounds: an exponential average
    plain = DraftingPolicy(COSTS, smoothing=0.3)  # prior_rounds None: every round weighs smoothing
    assert [plain.newest_weight(n) for n in (0, 1, 10)] == pytest.approx([0.3] * 3)


def test_a_mean_keeps_drafting_through_unlucky_rounds_that_an_exponential_average_gives_up_on():
    # a source that pays on average (break-even here is 0.6 accepted drafts), then misses three rounds
    outcomes = [2, 1, 0, 0, 0]
    short = DraftingPolicy(COSTS, priors={"model": 0.8}, smoothing=0.5)
    mean = DraftingPolicy(COSTS, priors={"model": 0.8}, smoothing=0.05, prior_rounds=4)
    for policy in (short, mean):
        seen = policy.new_evidence(("model",))
        for accepted in outcomes:
            policy.observe(seen, "model", accepted)
        choice = policy.choose(seen, {"model": 7})
        assert choice == (NONE if policy is short else "model"), (policy, seen["model"].accepted)


def test_costs_come_from_a_measured_table():
    costs = DraftCosts.from_table(sps_preset("cpu", max_tokens=8), {"model": 0.3})
    assert costs.verify(1) == pytest.approx(1.0) and len(costs.verify_steps) == 8
    assert all(b >= a for a, b in zip(costs.verify_steps, costs.verify_steps[1:]))


def test_bad_settings_are_refused_with_what_to_pass():
    with pytest.raises(ValueError, match="smoothing"):
        DraftingPolicy(COSTS, smoothing=0.0)
    with pytest.raises(ValueError, match="prior_rounds"):
        DraftingPolicy(COSTS, prior_rounds=-1)
    with pytest.raises(ValueError, match="max_probe_every"):
        DraftingPolicy(COSTS, probe_every=16, max_probe_every=8)
    with pytest.raises(ValueError, match="verify_steps"):
        DraftCosts(verify_steps=(), draft_steps={})


# ---------------------------------------------------------------- non-anticipation
def first_output_token(x1: int | None, uniform: float, resample: float) -> int:
    """Y (0 = A) of a round that verifies draft x1 by rejection sampling, or lets the target sample (x1 None)."""
    if x1 is None:
        return int(resample >= TARGET_A)
    target, draft = (TARGET_A, 1 - TARGET_A), (DRAFT_A, 1 - DRAFT_A)
    if uniform < min(1.0, target[x1] / draft[x1]):
        return x1
    residual = [max(t - d, 0.0) for t, d in zip(target, draft)]
    return int(resample >= residual[0] / sum(residual))


def simulate(decide, seed: int) -> tuple[float, float]:
    """Observed Pr(Y = A) over ROUNDS rounds, and the share of rounds that drafted.

    ``decide(x1, history)`` says whether the round verifies its draft x1.
    """
    generator = torch.Generator().manual_seed(seed)
    draws = torch.rand(ROUNDS, 3, generator=generator, dtype=torch.float64).tolist()
    history: list[int] = []  # Y of earlier rounds
    count_a = drafted = 0
    for u_x1, u_accept, u_resample in draws:
        x1 = int(u_x1 >= DRAFT_A)
        drafts = decide(x1, history)
        y = first_output_token(x1 if drafts else None, u_accept, u_resample)
        history.append(y)
        count_a += y == 0
        drafted += drafts
    return count_a / ROUNDS, drafted / ROUNDS


def causal_policy_decision():
    """The library's policy, fed the evidence of earlier rounds only (x1 is ignored)."""
    policy = DraftingPolicy(COSTS, probe_every=4)
    seen = policy.new_evidence(("model",))
    last = [NONE]

    def decide(x1: int, history: list[int]) -> bool:
        if history:  # what the previous round showed: its draft survived when Y was A after a drafted round
            policy.observe(seen, last[0], accepted=int(history[-1] == 0))
        last[0] = policy.choose(seen, {"model": 1})
        return last[0] == "model"

    return decide


def peeking_decision(x1: int, history: list[int]) -> bool:
    """TEST HELPER, not library code: drafts exactly when the draft it is about to verify is A."""
    return x1 == 0


def within_bound(observed: float, exact: float) -> bool:
    return abs(observed - exact) <= 5 * math.sqrt(exact * (1 - exact) / ROUNDS)


def test_a_causal_drafting_policy_keeps_the_target_distribution():
    for seed in range(3):
        observed, drafted = simulate(causal_policy_decision(), seed)
        assert within_bound(observed, TARGET_A)
        assert 0.2 < drafted < 0.95  # it does switch, on the evidence of earlier rounds


def test_a_policy_that_peeks_at_its_draft_is_caught():
    observed, _ = simulate(peeking_decision, seed=0)
    assert within_bound(observed, 0.85) and not within_bound(observed, TARGET_A)


def test_costs_come_from_the_drafting_round_the_table_carries_or_are_given():
    table = sps_preset("cpu", max_tokens=8)
    with pytest.raises(ValueError, match="vlmspec profile --drafter"):
        DraftCosts.from_table(table)  # no remembered constant to fall back on
    timed = table.with_drafting(DraftTiming(drafter="mine", round_s={"model": 0.0116}, step_s=0.116))
    assert DraftCosts.from_table(timed).draft_steps == {"model": pytest.approx(0.1)}
    assert DraftCosts.from_table(timed, {"model": 0.3}).draft_steps == {"model": 0.3}  # given costs win


@pytest.mark.parametrize(("draft_steps", "declines_below"), [(0.1, 0.1), (0.35, 0.35)])
def test_a_lone_model_declines_exactly_where_its_round_does_not_pay(draft_steps, declines_below):
    """One source (DSpark alone): it drafts when (T_draft + T_verify(1 + v)) / (1 + a) < 1 step, else the target
    runs alone; cheaper rounds pay at lower acceptance. Flat verify costs (the bf16 curve is flat to 4 tokens)."""
    costs = DraftCosts(verify_steps=(1.0,) * 8, draft_steps={"model": draft_steps})
    policy = DraftingPolicy(costs)
    for accepted in (0.05, 0.2, 0.5, 1.5):
        seen = policy.new_evidence(("model",))
        seen["model"].accepted = accepted
        expected = "model" if (draft_steps + 1.0) / (1 + accepted) < 1.0 else NONE
        assert policy.choose(seen, {"model": 7}) == expected
        assert (expected == NONE) == (accepted <= declines_below)
