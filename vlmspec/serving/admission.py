"""How much prompt a step prefills: a token budget shared first come, first served (chunked prefill).

A prefill forward holds every decoding request: a 6,000-token prompt run whole stalled
four running streams for 15.9 s on this project's 2-core CPU. While requests decode, a
step therefore prefills at most a budget of prompt tokens: the prompts in the batch take
their next chunks in order, a long one over many steps, and a waiting request joins only
while some of the budget is left. Decoding goes on between the chunks. With nothing
decoding there is nothing to stall, and a step prefills up to ``IDLE_PREFILL_TOKENS``, a
bound on one forward's activations rather than on anyone's wait.
"""

from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens one step may prefill while other requests decode (at the start of a prompt; later
# chunks are smaller, see chunk_cost). On the 2-core CPU of this project a chunk of the reference
# target costs about 1.0 ms a token in float32 and 0.4-0.55 in bfloat16 (plus its attention), so a
# running request's next token waits about 0.25 s (float32) or 0.12 s (bfloat16) for a chunk, plus
# its own step.
DEFAULT_MAX_PREFILL_TOKENS = 256

# Prompt tokens one step may prefill while nothing decodes. Unbounded, 32 requests of 2,000 tokens
# arriving together ran as one 64,000-token forward whose activations raised the RSS by 4.4 GB on top
# of their 2.8 GB of KV (benchmarks/kv_memory.py, reference target, float32); 4,096 tokens hold that to
# about 0.3 GB, and chunks this long run at the whole prompt's speed (the GEMMs are long either way).
IDLE_PREFILL_TOKENS = 4096


def step_budget(max_prefill_tokens: int | None, decoding: bool) -> int | None:
    """Prompt tokens (in :func:`chunk_cost`) one step may prefill: ``max_prefill_tokens`` while requests decode,
    ``IDLE_PREFILL_TOKENS`` (or more, if that is larger) while none does; None: no bound at all."""
    if max_prefill_tokens is None:
        return None
    return max_prefill_tokens if decoding else max(max_prefill_tokens, IDLE_PREFILL_TOKENS)


def chunk_sizes(
    remaining: Sequence[int],  # [P] prompt tokens each prefilling request has left, in order
    budget: int | None,
    done: Sequence[int] | None = None,  # [P] tokens each already holds (cached or prefilled); None: all 0
) -> list[int]:
    """How many of its remaining prompt tokens each prefilling request runs this step, in order (a pure function).

    Requests are served first come, first served, while the budget lasts; ``budget`` None:
    everything. A chunk of n tokens after ``done`` tokens costs :func:`chunk_cost` of the
    budget: its tokens, plus its attention over everything before it, so a late chunk of a
    long prompt is smaller and every chunk takes about the same time.
    """
    if budget is None:
        return list(remaining)
    done = [0] * len(remaining) if done is None else done
    sizes = []
    for tokens, before in zip(remaining, done, strict=True):
        take = largest_chunk(tokens, before, budget)
        sizes.append(take)
        budget -= chunk_cost(take, before)
    return sizes


# One prompt token's linear layers (projections, MLP) cost about as much as attending over this many
# earlier tokens: a least-squares fit of chunk times t = a n + b n (before + n / 2) over a 6,470-token
# prompt in chunks of 128 and 256 gave a / b = 2,320-2,500 (float32) and 2,570-2,780 (bfloat16) on the
# reference target on the 2-core EPYC (docs/design.md §21.4).
KEYS_PER_TOKEN_COST = 2500


def chunk_cost(tokens: int, before: int) -> float:
    """The budget a chunk of ``tokens`` after ``before`` prompt tokens takes: tokens, plus their attention in tokens."""
    return tokens * (1 + (before + tokens / 2) / KEYS_PER_TOKEN_COST)


def largest_chunk(tokens: int, before: int, budget: float) -> int:
    """The most of ``tokens`` whose :func:`chunk_cost` fits ``budget`` (0 when not even one token does)."""
    low, high = 0, tokens
    while low < high:  # the cost grows with the chunk: bisect
        middle = (low + high + 1) // 2
        if chunk_cost(middle, before) <= budget:
            low = middle
        else:
            high = middle - 1
    return low
