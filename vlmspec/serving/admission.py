"""How much prompt a step prefills: a budget shared first come, first served (chunked prefill).

A prefill forward holds every decoding request: a 6,000-token prompt run whole stalled
four running streams for 15.9 s on this project's 2-core CPU. While requests decode, a
step therefore prefills at most a budget of prompt tokens: the prompts in the batch take
their next chunks in order, a long one over many steps, and a waiting request joins only
while some of the budget is left. Decoding goes on between the chunks. The budget is a
time, ``step_s`` (0.25 s by default), turned into tokens by the prefill speed the engine
measures on its own forwards (:class:`PrefillBudget`): a machine that prefills four times
faster (bfloat16 on a CPU with AMX) takes four times the tokens a step, a slow one fewer;
a fixed number of tokens can replace it. With nothing decoding there is nothing to stall,
and a step prefills up to ``IDLE_PREFILL_TOKENS``, a bound on one forward's activations
rather than on anyone's wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The longest a step's prefill should hold the decoding requests (issue #45's goal for a running
# stream's wait; the stream also waits for its own step).
DEFAULT_PREFILL_STEP_S = 0.25

# The prefill speed assumed before an engine has measured its own, in chunk_cost units (about prompt
# tokens) a second: the reference target in float32 on the 2-core EPYC, about 1.0 ms a token in
# chunks of 256 (bfloat16 0.4-0.55 ms), so 256 tokens for the default step.
FIRST_PREFILL_SPEED = 1024.0

# A step's budget never falls below this many tokens while requests decode: a prompt always moves.
MIN_STEP_TOKENS = 16

# Prompt tokens one step may prefill while nothing decodes. Unbounded, 32 requests of 2,000 tokens
# arriving together ran as one 64,000-token forward whose activations raised the RSS by 4.4 GB on top
# of their 2.8 GB of KV (benchmarks/kv_memory.py, reference target, float32); 4,096 tokens hold that to
# about 0.3 GB, and chunks this long run at the whole prompt's speed (the GEMMs are long either way).
IDLE_PREFILL_TOKENS = 4096


@dataclass
class PrefillBudget:
    """How much prompt (in :func:`chunk_cost` units) a step may prefill: from a time, or a fixed number of tokens.

    ``step_s``: the time a step's prefill may take while requests decode, turned into tokens
    by ``speed``, an exponential average over this engine's own prefill forwards
    (:meth:`record`). ``tokens``: a fixed budget instead. Both None: no bound at all.
    """

    step_s: float | None = DEFAULT_PREFILL_STEP_S
    tokens: int | None = None
    speed: float = FIRST_PREFILL_SPEED  # chunk_cost units a second, measured
    smoothing: float = 0.25  # the newest forward's weight in the average

    def for_step(self, decoding: bool) -> int | None:
        """The budget of a step while requests decode, or while none does (``IDLE_PREFILL_TOKENS``, or more)."""
        if self.tokens is None and self.step_s is None:
            return None
        if self.tokens is not None:
            while_decoding = self.tokens
        else:
            while_decoding = max(MIN_STEP_TOKENS, int(self.speed * self.step_s))
        return while_decoding if decoding else max(while_decoding, IDLE_PREFILL_TOKENS)

    def record(self, units: float, seconds: float) -> None:
        """A prefill forward of ``units`` (its chunks' costs summed) took ``seconds``: update the speed."""
        if units > 0 and seconds > 0:
            self.speed += self.smoothing * (units / seconds - self.speed)


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
