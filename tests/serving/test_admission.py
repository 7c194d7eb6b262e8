"""The prefill budget: prompts take their chunks first come, first served, each chunk costed with its attention."""

import pytest

from vlmspec.serving.admission import (
    IDLE_PREFILL_TOKENS,
    KEYS_PER_TOKEN_COST,
    MIN_STEP_TOKENS,
    PrefillBudget,
    chunk_cost,
    chunk_sizes,
    largest_chunk,
)


@pytest.mark.parametrize(
    ("remaining", "budget", "expected"),
    [
        ([100, 100, 100], None, [100, 100, 100]),  # nothing decodes: everything runs whole
        ([100, 100, 100], 256, [100, 100, 51]),  # the third takes what is left (each costs a little attention)
        ([900, 10], 256, [244, 0]),  # a long prompt takes the whole budget, in chunks over steps
        ([10, 900, 10], 256, [10, 234, 1]),  # queue order is kept: the third gets only the long one's crumbs
        ([], 256, []),
    ],
)
def test_chunk_sizes(remaining, budget, expected):
    sizes = chunk_sizes(remaining, budget)
    assert sizes == expected
    if budget is not None:
        assert sum(chunk_cost(n, 0) for n in sizes) <= budget


def test_a_later_chunk_of_a_long_prompt_is_smaller_and_costs_what_the_first_does():
    first, late = (largest_chunk(10_000, before, 256) for before in (0, 6_000))
    assert late < first / 3
    assert chunk_cost(late, 6_000) <= 256 < chunk_cost(late + 1, 6_000)
    assert chunk_cost(1, 0) == pytest.approx(1 + 0.5 / KEYS_PER_TOKEN_COST)
    assert chunk_sizes([10_000, 5], 256, done=[6_000, 0])[0] == late


def test_an_idle_step_is_bounded_too_but_by_the_activations_bound():
    fixed = PrefillBudget(tokens=256)
    assert fixed.for_step(decoding=True) == 256
    assert fixed.for_step(decoding=False) == IDLE_PREFILL_TOKENS  # nobody waits, but one forward stays bounded
    assert PrefillBudget(tokens=10_000).for_step(decoding=False) == 10_000  # a larger budget is never lowered
    assert PrefillBudget(step_s=None, tokens=None).for_step(decoding=False) is None
    sizes = chunk_sizes([3_000, 3_000], fixed.for_step(decoding=False))
    assert 2_000 < sizes[0] < 3_000 and sizes[1] == 0  # a burst of long prompts runs over several forwards


def test_a_timed_budget_follows_the_measured_prefill_speed():
    budget = PrefillBudget(step_s=0.25, smoothing=1.0)  # the newest forward alone: easy to read
    budget.record(units=2_000, seconds=1.0)
    assert budget.for_step(decoding=True) == 500  # 0.25 s at 2,000 units a second
    budget.record(units=100, seconds=10.0)  # a very slow forward (a loaded machine): a prompt still moves
    assert budget.for_step(decoding=True) == MIN_STEP_TOKENS
    budget.record(units=0, seconds=1.0)  # nothing measured: nothing changes
    assert budget.for_step(decoding=True) == MIN_STEP_TOKENS
    smooth = PrefillBudget(step_s=1.0, speed=1_000.0, smoothing=0.25)
    smooth.record(units=2_000, seconds=1.0)
    assert smooth.for_step(decoding=True) == 1_250  # one forward moves the average a quarter of the way
