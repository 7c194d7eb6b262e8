"""How much prompt a step prefills: a token budget shared first come, first served (chunked prefill).

A prefill forward holds every decoding request: a 6,000-token prompt run whole stalled
four running streams for 15.9 s on this project's 2-core CPU. While requests decode, a
step therefore prefills at most a budget of prompt tokens: the prompts in the batch take
their next chunks in order, a long one over many steps, and a waiting request joins only
while some of the budget is left. Decoding goes on between the chunks. With nothing
decoding there is nothing to stall, and every prompt runs whole.
"""

from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens one step may prefill while other requests decode. On the 2-core CPU of this
# project a text prefill runs at about 900 tokens/s, so a running request's next token waits
# about 0.3 s for a chunk (plus its own step); late in a long prompt a chunk's attention over
# the tokens before it adds to that (see docs/design.md).
DEFAULT_MAX_PREFILL_TOKENS = 256


def chunk_sizes(remaining: Sequence[int], budget: int | None) -> list[int]:  # remaining: [P] tokens left each
    """How many of its remaining prompt tokens each prefilling request runs this step, in order (a pure function).

    Requests are served first come, first served: each takes what it has left, or what is
    left of ``budget``; once the budget is spent the rest take 0. ``budget`` None: everything.
    """
    if budget is None:
        return list(remaining)
    sizes = []
    for tokens in remaining:
        take = max(0, min(tokens, budget))
        sizes.append(take)
        budget -= take
    return sizes
