"""The Appendix A counterexample (docs/design.md §9), simulated round by round.

One request, gamma = 2, vocabulary {A, B}. Each round: the drafter samples x1 from
draft_probs = (0.5, 0.5) and x2 after it; its confidence head reports c1 = 0.8 (known
before x1) and c2 = c2(x1), which depends on the sampled x1 (0.9 after A, 0.1 after B),
as a Markov confidence head's does. The scheduler picks l; the target verifies x1..x_l by
rejection sampling against target_probs = (0.7, 0.3) and emits the first output token Y
(x1 if accepted, else a sample from the residual; with l = 0 the target samples Y itself).

SPS = {1: 1.0, 2: 0.5, 3: 0.45}: Theta(0) = 1.0, Theta(1) = 0.9, and Theta(2) = 1.134
after A but 0.846 after B. A scheduler with the early break stops at Theta(1) and never
looks at c2: Y ~ (0.7, 0.3). A scheduler that searches all l (no break) verifies x1
exactly when x1 = A, and Y ~ (0.85, 0.15).

Bound: with N rounds, the estimated Pr(Y = A) must lie within 5 standard errors,
5 * sqrt(p (1 - p) / N), of the exact value (false-alarm probability below 1e-6;
0.85 and 0.7 are 20 standard errors apart at N = 4000).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vlmspec.scheduling import LaggedTopKScheduler, PrefixScheduler, Scheduler, SPSArgmaxScheduler, sps_preset

DRAFT_PROBS = torch.tensor([0.5, 0.5])  # over {A = 0, B = 1}
TARGET_PROBS = torch.tensor([0.7, 0.3])
C1 = 0.8
C2_AFTER = torch.tensor([0.9, 0.1])  # c2 as a function of the sampled x1
ROUNDS = 4000
APPENDIX = sps_preset("appendix_a")


class PeekingScheduler:
    """TEST HELPER, not library code: the single-request SPS search WITHOUT the early break.

    It evaluates Theta(l) for every l and takes the global maximum, so its decision on x1
    depends on c2, i.e. on the value of x1 itself. This is the scheduler Appendix A
    shows to be lossy.
    """

    def __init__(self, table) -> None:
        self.table = table

    def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
        assert confidences is not None
        survival = torch.cumprod(confidences.double(), dim=1)  # [R, gamma]
        gamma = confidences.shape[1]
        tau = 1 + torch.cat([torch.zeros(len(num_drafted), 1, dtype=torch.float64), survival.cumsum(1)], dim=1)
        sps = torch.from_numpy(self.table.steps_per_second(np.arange(1, gamma + 2)))  # [gamma + 1]
        theta = tau * sps
        theta[torch.arange(gamma + 1).unsqueeze(0) > num_drafted.unsqueeze(1)] = -math.inf
        return theta.argmax(dim=1)


def first_output_token(x1: int, verified: int, uniform: float, resample: float) -> int:
    """Y after verifying ``verified`` draft tokens of which x1 is the first (rejection sampling)."""
    if verified == 0:  # only the anchor was verified: the target samples the next token itself
        return int(resample >= TARGET_PROBS[0])
    if uniform < min(1.0, float(TARGET_PROBS[x1] / DRAFT_PROBS[x1])):
        return x1  # accepted
    residual = (TARGET_PROBS - DRAFT_PROBS).clamp(min=0)
    residual = residual / residual.sum()
    return int(resample >= residual[0])  # recovered token


def simulate_first_token(scheduler: Scheduler, rounds: int, seed: int) -> float:
    """Run whole rounds (draft, schedule, verify); return the observed Pr(Y = A)."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.rand(rounds, 4, generator=generator, dtype=torch.float64).tolist()  # x1, x2, accept, resample
    confidences_after = [torch.tensor([[C1, float(c2)]]) for c2 in C2_AFTER]  # [1, 2] head output given x1
    num_drafted = torch.tensor([2])
    count_a = 0
    for u_x1, u_x2, u_accept, u_resample in draws:
        x1 = int(u_x1 >= DRAFT_PROBS[0])
        _x2 = int(u_x2 >= DRAFT_PROBS[0])  # drafted after x1; its value never reaches Y
        verified = int(scheduler.schedule(confidences_after[x1], num_drafted)[0])
        count_a += first_output_token(x1, verified, u_accept, u_resample) == 0
    return count_a / rounds


def within_bound(estimate: float, exact: float, rounds: int) -> bool:
    return abs(estimate - exact) <= 5 * math.sqrt(exact * (1 - exact) / rounds)


def test_the_setup_matches_the_notes() -> None:
    confidences_a, confidences_b = torch.tensor([[C1, 0.9]]), torch.tensor([[C1, 0.1]])
    assert PeekingScheduler(APPENDIX).schedule(confidences_a, torch.tensor([2])).tolist() == [2]
    assert PeekingScheduler(APPENDIX).schedule(confidences_b, torch.tensor([2])).tolist() == [0]
    assert 1 - 0.5 * float((TARGET_PROBS - DRAFT_PROBS).abs().sum()) == pytest.approx(C1)  # c1 = 1 - TV


@pytest.mark.parametrize(
    "make_scheduler",
    [PrefixScheduler, SPSArgmaxScheduler, LaggedTopKScheduler],
    ids=["PrefixScheduler", "SPSArgmaxScheduler", "LaggedTopKScheduler"],
)
def test_causal_schedulers_keep_the_target_distribution(make_scheduler) -> None:
    estimate = simulate_first_token(make_scheduler(APPENDIX), ROUNDS, seed=11)
    assert within_bound(estimate, 0.7, ROUNDS), f"Pr(Y = A) = {estimate:.4f}, target 0.7"


def test_lagged_top_k_verifies_x1_sometimes_and_stays_lossless() -> None:
    # Not vacuous: with capacity from two rounds back, x1 is verified in about half the rounds.
    scheduler = LaggedTopKScheduler(APPENDIX)
    generator = torch.Generator().manual_seed(5)
    verified = []
    for x1 in torch.randint(0, 2, (400,), generator=generator).tolist():
        verified.append(int(scheduler.schedule(torch.tensor([[C1, float(C2_AFTER[x1])]]), torch.tensor([2]))[0]))
    assert 0.3 < np.mean(np.array(verified) > 0) < 0.7


def test_peeking_scheduler_drifts_to_085_015() -> None:
    estimate = simulate_first_token(PeekingScheduler(APPENDIX), ROUNDS, seed=11)
    assert within_bound(estimate, 0.85, ROUNDS), f"Pr(Y = A) = {estimate:.4f}, expected the lossy 0.85"
    assert not within_bound(estimate, 0.7, ROUNDS)
