"""The prefill budget: prompts take their chunks first come, first served, each chunk costed with its attention."""

import pytest

from vlmspec.serving.admission import (
    IDLE_PREFILL_TOKENS,
    KEYS_PER_TOKEN_COST,
    chunk_cost,
    chunk_sizes,
    largest_chunk,
    step_budget,
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
    assert step_budget(256, decoding=True) == 256
    assert step_budget(256, decoding=False) == IDLE_PREFILL_TOKENS  # nobody waits, but one forward stays bounded
    assert step_budget(10_000, decoding=False) == 10_000  # a budget above the bound is never lowered
    assert step_budget(None, decoding=False) is None
    sizes = chunk_sizes([3_000, 3_000], step_budget(256, decoding=False))
    assert 2_000 < sizes[0] < 3_000 and sizes[1] == 0  # a burst of long prompts runs over several forwards
