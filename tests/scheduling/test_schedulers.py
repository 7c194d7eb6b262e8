"""Schedulers: the contract, Algorithm 1 against exhaustive search, ordering, the lagged top-K."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from vlmspec.scheduling import (
    SCHEDULER_CLASSES,
    CalibratedScheduler,
    Calibration,
    LaggedTopKScheduler,
    PrefixScheduler,
    Scheduler,
    SPSArgmaxScheduler,
    SPSMeta,
    SPSTable,
    ThresholdScheduler,
    VerifyAll,
    build_scheduler,
    rank_candidates,
    sps_preset,
    survival_probabilities,
)

META = SPSMeta(model="test", device="cpu", dtype="float32", context_length=0)


def table_from(fn, max_tokens: int) -> SPSTable:
    """An SPS table with steps/s ``fn(B)`` for B = 1..max_tokens."""
    tokens = tuple(range(1, max_tokens + 1))
    return SPSTable(tokens, tuple(fn(b) for b in tokens), META)


def log_concave_table(generator: torch.Generator, max_tokens: int) -> SPSTable:
    """SPS(B) = exp(-alpha * max(0, B - knee) ** p), p >= 1: log-concave, so Theta is unimodal.

    log Theta(k) = log(tau(k)) + log SPS(R + k); tau(k) is concave in k (gains are sorted
    descending), hence log tau is concave, and so is the sum: one peak, no second rise.
    """
    alpha = 0.02 + 0.5 * float(torch.rand(1, generator=generator))
    power = 1.0 + float(torch.rand(1, generator=generator))
    knee = int(torch.randint(0, max_tokens // 2 + 1, (1,), generator=generator))
    return table_from(lambda b: float(np.exp(-alpha * max(0, b - knee) ** power)), max_tokens)


def exhaustive_best(survival: torch.Tensor, drafted: torch.Tensor, table: SPSTable) -> float:
    """max over every assignment l_r in 0..drafted[r] of (R + sum_r sum_{j<=l_r} a) * SPS(R + sum_r l_r)."""
    num_requests = survival.shape[0]
    prefix_gain = torch.cat([torch.zeros(num_requests, 1, dtype=survival.dtype), survival.cumsum(1)], dim=1)  # [R, g+1]
    best = -np.inf
    for lengths in itertools.product(*(range(int(d) + 1) for d in drafted)):
        tokens = num_requests + sum(lengths)
        tau = num_requests + sum(float(prefix_gain[r, n]) for r, n in enumerate(lengths))
        best = max(best, tau * table.sps(tokens))
    return best


def theta_of(lengths: torch.Tensor, survival: torch.Tensor, table: SPSTable) -> float:
    prefix_gain = torch.cat([torch.zeros(survival.shape[0], 1, dtype=survival.dtype), survival.cumsum(1)], dim=1)
    tau = survival.shape[0] + float(prefix_gain.gather(1, lengths.unsqueeze(1)).sum())
    return tau * table.sps(survival.shape[0] + int(lengths.sum()))


def random_round(generator: torch.Generator, num_requests: int, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    confidences = 0.05 + 0.95 * torch.rand(num_requests, gamma, generator=generator)  # [R, gamma]
    drafted = torch.randint(0, gamma + 1, (num_requests,), generator=generator)  # [R]
    return confidences, drafted


# -- the contract -------------------------------------------------------------------------------


ALL_TABLE = sps_preset("gpu_like", max_tokens=64)
SCHEDULERS = [
    VerifyAll(),
    ThresholdScheduler(0.5),
    SPSArgmaxScheduler(ALL_TABLE),
    PrefixScheduler(ALL_TABLE),
    LaggedTopKScheduler(ALL_TABLE),
    CalibratedScheduler(PrefixScheduler(ALL_TABLE), Calibration((1.5,) * 6)),
]


@pytest.mark.parametrize("scheduler", SCHEDULERS, ids=lambda s: type(s).__name__)
def test_contract_shape_dtype_bounds(scheduler: Scheduler) -> None:
    generator = torch.Generator().manual_seed(0)
    assert isinstance(scheduler, Scheduler)
    for _ in range(5):
        confidences, drafted = random_round(generator, 6, 6)
        out = scheduler.schedule(confidences, drafted)
        assert out.dtype == torch.int64 and out.shape == drafted.shape
        assert bool((out >= 0).all()) and bool((out <= drafted).all())


@pytest.mark.parametrize("scheduler", SCHEDULERS[1:], ids=lambda s: type(s).__name__)
def test_no_confidence_head_is_refused_with_the_fix(scheduler: Scheduler) -> None:
    with pytest.raises(ValueError, match="no confidence head.*VerifyAll"):
        scheduler.schedule(None, torch.tensor([3, 2]))


def test_each_name_builds_its_class_and_unknown_names_list_them_all() -> None:
    assert tuple(SCHEDULER_CLASSES) == ("none", "threshold", "sps", "prefix", "lagged-topk")
    for name, cls in SCHEDULER_CLASSES.items():
        assert type(build_scheduler(name, sps="appendix_a")) is cls
    with pytest.raises(
        ValueError, match=r"'algorithm1'; choose one of none \(VerifyAll\), .*prefix \(PrefixScheduler\)"
    ):
        build_scheduler("algorithm1")


def test_verify_all_ignores_missing_confidences() -> None:
    assert VerifyAll().schedule(None, torch.tensor([3, 0])).tolist() == [3, 0]


@pytest.mark.parametrize(
    "confidences, drafted, message",
    [
        (torch.tensor([[0.5, 1.5]]), torch.tensor([2]), "in \\[0, 1\\]"),
        (torch.tensor([[0.5, float("nan")]]), torch.tensor([2]), "in \\[0, 1\\]"),
        (torch.tensor([0.5, 0.5]), torch.tensor([2]), "2-D tensor"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([3]), "exceeds the block size"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([1, 1]), "same R requests"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([1.0]), "integers"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([-1]), ">= 0"),
    ],
)
def test_bad_input_is_refused(confidences: torch.Tensor, drafted: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefixScheduler(ALL_TABLE).schedule(confidences, drafted)


def test_padding_beyond_num_drafted_is_ignored() -> None:
    confidences = torch.tensor([[0.9, 0.9, float("nan")], [1.0, 7.0, 7.0]])  # garbage in the padding
    drafted = torch.tensor([2, 1])
    assert PrefixScheduler(ALL_TABLE).schedule(confidences, drafted).tolist() == [2, 1]
    assert ThresholdScheduler(0.5).schedule(confidences, drafted).tolist() == [2, 1]


def test_threshold_stops_at_first_low_confidence() -> None:
    confidences = torch.tensor([[0.9, 0.4, 0.95], [0.3, 0.9, 0.9], [0.8, 0.8, 0.8]])
    out = ThresholdScheduler(0.5).schedule(confidences, torch.tensor([3, 3, 2]))
    assert out.tolist() == [1, 0, 2]
    with pytest.raises(ValueError, match="threshold"):
        ThresholdScheduler(1.5)


def test_survival_probabilities_are_the_cumulative_product() -> None:
    out = survival_probabilities(torch.tensor([[0.5, 0.5, 0.5]]), torch.tensor([2]))
    assert out.tolist() == [[0.5, 0.25, 0.0]]


def test_anchors_beyond_the_table_are_refused() -> None:
    with pytest.raises(ValueError, match="profile up to"):
        PrefixScheduler(sps_preset("appendix_a")).schedule(torch.full((4, 2), 0.9), torch.full((4,), 2))


# -- Algorithm 1 --------------------------------------------------------------------------------


def test_prefix_scheduler_equals_exhaustive_search_on_unimodal_curves() -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(60):
        num_requests = int(torch.randint(1, 4, (1,), generator=generator))
        gamma = int(torch.randint(1, 5, (1,), generator=generator))
        confidences, drafted = random_round(generator, num_requests, gamma)
        table = log_concave_table(generator, num_requests * (1 + gamma))
        survival = survival_probabilities(confidences, drafted)
        lengths = PrefixScheduler(table).schedule(confidences, drafted)
        assert theta_of(lengths, survival, table) == pytest.approx(exhaustive_best(survival, drafted, table), rel=1e-12)


def test_single_request_prefix_equals_sps_argmax() -> None:
    generator = torch.Generator().manual_seed(2)
    for _ in range(40):
        confidences, drafted = random_round(generator, 1, 7)
        table = log_concave_table(generator, 8) if _ % 2 else sps_preset("cpu", max_tokens=8)
        assert (
            PrefixScheduler(table).schedule(confidences, drafted).tolist()
            == SPSArgmaxScheduler(table).schedule(confidences, drafted).tolist()
        )


def sps_argmax_reference(confidences: torch.Tensor, drafted: torch.Tensor, table: SPSTable) -> list[int]:
    """The SPS argmax walk over whole arrays: Theta(l) for every l, then the length of the leading rises."""
    conf, real = confidences.double().numpy(), np.arange(confidences.shape[1])[None, :] < drafted.numpy()[:, None]
    expected = 1 + np.concatenate([np.zeros((len(conf), 1)), np.cumprod(np.where(real, conf, 0.0), 1).cumsum(1)], 1)
    theta = expected * table.steps_per_second(np.arange(1, conf.shape[1] + 2))  # [R, gamma + 1]; NaN off-table
    theta[np.arange(conf.shape[1] + 1)[None, :] > drafted.numpy()[:, None]] = np.nan
    return np.cumprod(theta[:, 1:] > theta[:, :-1], axis=1).sum(axis=1).tolist()


def test_sps_argmax_walk_equals_the_array_form_on_any_curve() -> None:
    """Curves with second rises, tables shorter than the block, ties: the walk stops where the array form does."""
    generator = torch.Generator().manual_seed(7)
    for trial in range(200):
        num_requests, gamma = int(torch.randint(1, 5, (1,), generator=generator)), 7
        confidences, drafted = random_round(generator, num_requests, gamma)
        max_tokens = int(torch.randint(1, 10, (1,), generator=generator))
        steps = (0.3 + torch.rand(max_tokens, generator=generator)).tolist()  # any shape, not unimodal
        if trial % 5 == 0:  # a flat curve and a draft that cannot survive: Theta(3) = Theta(2), a tie, not a rise
            confidences[:, 2], steps = 0.0, [1.0] * max_tokens
        curve = SPSTable(tuple(range(1, max_tokens + 1)), tuple(steps), META)
        table = curve if trial % 3 else sps_preset("cpu", max_tokens=8)
        assert SPSArgmaxScheduler(table).schedule(confidences, drafted).tolist() == sps_argmax_reference(
            confidences, drafted, table
        )


def test_sps_argmax_schedules_rows_independently() -> None:
    table = sps_preset("cpu", max_tokens=8)
    confidences = torch.tensor([[0.95] * 7, [0.05] * 7, [0.9, 0.9, 0.05, 0.9, 0.9, 0.9, 0.9]])
    batch = SPSArgmaxScheduler(table).schedule(confidences, torch.full((3,), 7))
    alone = [int(SPSArgmaxScheduler(table).schedule(confidences[r : r + 1], torch.tensor([7]))) for r in range(3)]
    assert batch.tolist() == alone
    assert alone[0] == 7 and alone[1] == 0  # confident: verify the block; hopeless: anchor only


def test_prefix_scheduler_stops_at_the_first_drop() -> None:
    # Appendix A: Theta(0) = 1.0 > Theta(1) = 0.9 < Theta(2) = (1 + 0.8 + 0.72) * 0.45 = 1.134.
    appendix = sps_preset("appendix_a")
    confidences, drafted = torch.tensor([[0.8, 0.9]]), torch.tensor([2])
    assert PrefixScheduler(appendix).schedule(confidences, drafted).tolist() == [0]
    assert SPSArgmaxScheduler(appendix).schedule(confidences, drafted).tolist() == [0]
    # Two requests on a step-wise curve: Theta = 2, 2.9, 1.9 (drop), 2.26, 3.25 (the global max, not taken).
    jagged = SPSTable((1, 2, 3, 4, 5, 6), (1.0, 1.0, 1.0, 0.5, 0.49, 0.6), META)
    confidences, drafted = torch.full((2, 2), 0.9), torch.tensor([2, 2])
    assert PrefixScheduler(jagged).schedule(confidences, drafted).tolist() == [1, 0]


def test_candidates_are_ranked_so_each_request_is_admitted_in_order() -> None:
    # Ties everywhere (c = 1 keeps a flat): position order must still hold within a request.
    survival = survival_probabilities(torch.tensor([[1.0, 1.0, 0.5], [0.9, 1.0, 1.0]]), torch.tensor([3, 3]))
    ranked = rank_candidates(survival.numpy(), np.array([3, 3]))
    assert list(zip(ranked.rows.tolist(), ranked.positions.tolist())) == [
        (0, 1),
        (0, 2),
        (1, 1),
        (1, 2),
        (1, 3),
        (0, 3),
    ]
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        confidences, drafted = random_round(generator, 5, 6)
        confidences = torch.where(torch.rand(5, 6, generator=generator) < 0.3, 1.0, confidences)  # many ties
        ranked = rank_candidates(survival_probabilities(confidences, drafted).numpy(), drafted.numpy())
        assert np.all(np.diff(ranked.gains) <= 0)
        for r in range(5):
            assert ranked.positions[ranked.rows == r].tolist() == list(range(1, int(drafted[r]) + 1))


def test_prefix_scheduler_verifies_more_when_capacity_is_free() -> None:
    confidences, drafted = torch.full((4, 7), 0.85), torch.full((4,), 7)
    flat = PrefixScheduler(table_from(lambda b: 1.0 - 1e-4 * b, 32)).schedule(confidences, drafted)
    steep = PrefixScheduler(table_from(lambda b: 1.0 / b, 32)).schedule(confidences, drafted)
    assert flat.tolist() == [7, 7, 7, 7]
    assert steep.tolist() == [0, 0, 0, 0]


# -- lagged top-K --------------------------------------------------------------------------------


def test_lagged_top_k_warms_up_like_algorithm_1_then_uses_the_lagged_capacity() -> None:
    appendix = sps_preset("appendix_a")
    scheduler = LaggedTopKScheduler(appendix, lag=2)
    rich, poor, drafted = torch.tensor([[0.8, 0.9]]), torch.tensor([[0.8, 0.1]]), torch.tensor([2])
    # Warm-up: no history yet, so causal Algorithm 1 (which breaks at Theta(1) = 0.9).
    assert scheduler.schedule(rich, drafted).tolist() == [0] and scheduler.last_capacity is None
    assert scheduler.schedule(poor, drafted).tolist() == [0]
    # Step 3 uses step 1 (rich): global search finds K = 2 past the dip; the current block is admitted
    # even though its own confidences are poor -- K does not look at them.
    assert scheduler.schedule(poor, drafted).tolist() == [2] and scheduler.last_capacity == 2
    # Step 4 uses step 2 (poor): Theta(2) = 0.846 < 1, K = 0.
    assert scheduler.schedule(rich, drafted).tolist() == [0] and scheduler.last_capacity == 0
    scheduler.reset()
    assert scheduler.schedule(rich, drafted).tolist() == [0] and scheduler.last_capacity is None


def test_lagged_top_k_admits_current_top_candidates_across_requests() -> None:
    table = sps_preset("gpu_like", max_tokens=64)
    scheduler = LaggedTopKScheduler(table, lag=1)
    drafted = torch.full((3,), 4)
    scheduler.schedule(torch.full((3, 4), 0.99), drafted)  # a confident step: large capacity
    capacity_source = scheduler._lagged_capacity(*scheduler._history[0])
    current = torch.tensor([[0.99, 0.99, 0.99, 0.99], [0.5, 0.5, 0.5, 0.5], [0.9, 0.1, 0.9, 0.9]])
    out = scheduler.schedule(current, drafted)
    assert scheduler.last_capacity == capacity_source == 12
    assert out.tolist() == [4, 4, 4]  # K covers every candidate


def test_lagged_top_k_cuts_by_current_survival_when_capacity_is_small() -> None:
    # SPS drops sharply past 5 tokens: with R = 3 the lagged search admits K = 2 draft tokens.
    table = table_from(lambda b: 1.0 if b <= 5 else 0.1, 20)
    scheduler = LaggedTopKScheduler(table, lag=1)
    drafted = torch.full((3,), 3)
    scheduler.schedule(torch.full((3, 3), 0.9), drafted)
    current = torch.tensor([[0.3, 0.9, 0.9], [0.95, 0.95, 0.2], [0.6, 0.9, 0.9]])
    # a: r0 = .3 .27 .24; r1 = .95 .90 .18; r2 = .6 .54 .49 -> top 2 are (1,1), (1,2).
    assert scheduler.schedule(current, drafted).tolist() == [0, 2, 0]
    assert scheduler.last_capacity == 2


def test_lagged_top_k_rejects_lag_zero() -> None:
    with pytest.raises(ValueError, match="lag must be"):
        LaggedTopKScheduler(sps_preset("cpu", 16), lag=0)


def test_lagged_top_k_handles_requests_joining_and_leaving() -> None:
    table = sps_preset("gpu_like", max_tokens=128)
    scheduler = LaggedTopKScheduler(table)
    generator = torch.Generator().manual_seed(4)
    for num_requests in (4, 9, 2, 1, 16, 3, 0, 5):
        confidences, drafted = random_round(generator, num_requests, 7)
        out = scheduler.schedule(confidences, drafted)
        assert out.shape == (num_requests,) and bool((out <= drafted).all())


def test_calibrated_scheduler_feeds_calibrated_confidences() -> None:
    class Spy:
        seen: torch.Tensor | None = None

        def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
            self.seen = confidences
            return num_drafted.clone()

    spy = Spy()
    CalibratedScheduler(spy, Calibration((2.0, 1.0))).schedule(torch.tensor([[0.9, 0.9]]), torch.tensor([2]))
    expected_first = torch.sigmoid(torch.logit(torch.tensor(0.9)) / 2)
    assert (
        spy.seen is not None
        and spy.seen[0, 0] == pytest.approx(float(expected_first))
        and spy.seen[0, 1] == pytest.approx(0.9)
    )
