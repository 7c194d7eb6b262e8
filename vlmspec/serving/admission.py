"""Which waiting requests join the batch at a step: room, a caller's limit, and a prefill token budget.

A prefill is one packed forward over every admitted prompt, and the running requests wait
for it: sixteen prompts of a hundred tokens each hold every running row for a couple of
seconds on a small CPU. While requests are running, a step therefore admits prompts only
up to a token budget (always at least one, so a long prompt is not starved), and the next
waiting prompts join after the next decode step: prefills interleave with decoding instead
of stalling it. With nothing running there is nothing to stall, and everything that fits
is admitted at once.
"""

from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens one step may prefill while other requests decode. On the 2-core CPU of this
# project a text prefill runs at about 900 tokens/s, so a running request's next token waits
# at most about 0.3 s for a prefill (plus its own step).
DEFAULT_MAX_PREFILL_TOKENS = 256


def admission_count(
    prompt_tokens: Sequence[int],  # [W] each waiting request's prompt length, in queue order
    *,
    room: int,  # free rows in the batch
    limit: int | None,  # most requests the caller wants admitted (None: no limit)
    max_prefill_tokens: int | None,  # the token budget while requests run (None: no budget)
    running: int,  # requests decoding now
) -> int:
    """How many of the first waiting requests to admit now (a pure function of its arguments).

    The first one is always admitted if there is room (even past the budget); the next
    ones while their prompts together stay within ``max_prefill_tokens``, which applies
    only while ``running > 0``.
    """
    count = min(len(prompt_tokens), max(room, 0) if limit is None else min(limit, max(room, 0)))
    if running == 0 or max_prefill_tokens is None or count <= 1:
        return count
    total = prompt_tokens[0]
    for admitted in range(1, count):
        total += prompt_tokens[admitted]
        if total > max_prefill_tokens:
            return admitted
    return count
