"""The prefill budget: prompts take their chunks first come, first served."""

import pytest

from vlmspec.serving.admission import chunk_sizes


@pytest.mark.parametrize(
    ("remaining", "budget", "expected"),
    [
        ([100, 100, 100], None, [100, 100, 100]),  # nothing decodes: everything runs whole
        ([100, 100, 100], 256, [100, 100, 56]),  # the third takes what is left
        ([100, 100, 100], 300, [100, 100, 100]),  # exactly the budget
        ([900, 10], 256, [256, 0]),  # a long prompt takes the whole budget, in chunks over steps
        ([10, 900, 10], 256, [10, 246, 0]),  # queue order is kept: no prompt jumps the long one
        ([], 256, []),
    ],
)
def test_chunk_sizes(remaining, budget, expected):
    assert chunk_sizes(remaining, budget) == expected
