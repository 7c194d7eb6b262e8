"""The admission rule: room, the caller's limit, and the prefill token budget while requests run."""

import pytest

from vlmspec.serving.admission import admission_count


@pytest.mark.parametrize(
    ("prompts", "room", "limit", "budget", "running", "expected"),
    [
        ([100, 100, 100], 8, None, 256, 0, 3),  # nothing running: nothing to stall, all that fit
        ([100, 100, 100], 8, None, 256, 2, 2),  # running: 200 <= 256 < 300
        ([100, 100, 100], 8, None, 300, 2, 3),  # exactly the budget fits
        ([900, 10], 8, None, 256, 2, 1),  # one prompt past the budget still goes alone, first
        ([10, 900, 10], 8, None, 256, 2, 1),  # queue order is kept: no prompt jumps the long one
        ([100, 100, 100], 2, None, None, 2, 2),  # no budget: room decides
        ([100, 100, 100], 8, 1, 256, 2, 1),  # the caller's limit
        ([100], 0, None, 256, 2, 0),  # no room
        ([], 8, None, 256, 2, 0),
    ],
)
def test_admission_count(prompts, room, limit, budget, running, expected):
    assert admission_count(prompts, room=room, limit=limit, max_prefill_tokens=budget, running=running) == expected
