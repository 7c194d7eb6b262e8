"""The prefill budget: prompts take their chunks first come, first served, each chunk costed with its attention."""

import pytest

from vlmspec.serving.admission import KEYS_PER_TOKEN_COST, chunk_cost, chunk_sizes, largest_chunk


@pytest.mark.parametrize(
    ("remaining", "budget", "expected"),
    [
        ([100, 100, 100], None, [100, 100, 100]),  # nothing decodes: everything runs whole
        ([100, 100, 100], 256, [100, 100, 50]),  # the third takes what is left (each costs a little attention)
        ([900, 10], 256, [241, 0]),  # a long prompt takes the whole budget, in chunks over steps
        ([10, 900, 10], 256, [10, 232, 0]),  # queue order is kept: no prompt jumps the long one
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
