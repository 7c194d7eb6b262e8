"""Hardware-aware prefix scheduling for many requests (docs/design.md §8 and §12.5).

Both schedulers here rank every drafted position ``(r, j)`` of every request by its
prefix survival probability ``a[r, j]`` (:func:`rank_candidates`) and admit a leading
part of that ranking. Admitting the first k candidates verifies ``B = R + k`` tokens and
yields ``tau(k) = R + sum of their a`` expected committed tokens, so the expected system
throughput is ``Theta(k) = tau(k) * SPS(B)`` (:func:`throughput_curve`).

* :class:`PrefixScheduler` is Algorithm 1: walk the ranking and stop at the first k that
  does not raise Theta (the early break, which is what keeps it lossless).
* :class:`LaggedTopKScheduler` is the production adaptation: the number of admitted
  tokens K comes from a global search (no break) over confidences from ``lag`` steps
  earlier; the current step admits its top-K candidates.

Why a prefix of the ranking is always a valid schedule: ``a[r, j]`` is non-increasing in
j and ties are broken by position, so a request's positions appear in the ranking in
order 1, 2, 3, ...; any leading part of the ranking is a set of per-request prefixes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from vlmspec.scheduling.base import as_lengths, check_confidences, positions_mask, prefix_survival
from vlmspec.scheduling.tables import BatchSPSTable, SPSTable


@dataclass(frozen=True)
class Candidates:
    """Drafted positions in admission order: descending ``a``, ties by position, then request."""

    rows: np.ndarray  # [M] int64, request index r
    positions: np.ndarray  # [M] int64, 1-based draft position j
    gains: np.ndarray  # [M] float64, a[r, j] > 0 (the expected accepted tokens admitting it adds)

    def lengths(self, num_admitted: int, num_requests: int) -> np.ndarray:
        """[R] int64 verification lengths when the first ``num_admitted`` candidates are admitted."""
        return np.bincount(self.rows[:num_admitted], minlength=num_requests)


def rank_candidates(survival: np.ndarray, num_drafted: np.ndarray) -> Candidates:
    """Rank the drafted positions with ``a[r, j] > 0`` for admission.

    survival: [R, gamma] prefix survival probabilities a[r, j] (non-increasing per row).
    num_drafted: [R] int64; positions beyond it are padding and never candidates.
    """
    survival, num_drafted = np.asarray(survival, dtype=np.float64), np.asarray(num_drafted, dtype=np.int64)
    num_requests, gamma = survival.shape
    rows, positions = np.indices((num_requests, gamma))  # [R, gamma] each
    keep = positions_mask(num_drafted, gamma) & (survival > 0)  # [R, gamma]
    rows, positions, gains = rows[keep], positions[keep] + 1, survival[keep]  # [M]
    order = np.lexsort((rows, positions, -gains))  # last key is primary: gain desc, then position, then row
    return Candidates(rows[order], positions[order], gains[order])


def throughput_curve(num_requests: int, gains: np.ndarray, table: SPSTable) -> np.ndarray:
    """Expected throughput ``Theta(k)`` after admitting the first k ranked candidates, k = 0..M.

    gains: [M] ranked a-values. ``table`` is the curve for R requests (a batch table's
    ``for_requests(R)``). Returns [M + 1] float64; NaN where ``B = R + k`` lies outside the
    SPS table. Raises if even ``B = R`` (anchors only) is outside it.
    """
    require_anchors_fit(num_requests, table)
    expected_tokens = num_requests + np.concatenate([[0.0], np.cumsum(gains)])  # [M + 1]
    return expected_tokens * table.steps_per_second(num_requests + np.arange(len(gains) + 1))  # [M + 1]


def require_anchors_fit(num_requests: int, table: SPSTable) -> None:
    """Refuse a batch whose anchors alone (``B = R``) fall outside the SPS table."""
    if not table.min_tokens <= num_requests <= table.max_tokens:
        raise ValueError(
            f"{num_requests} requests put at least {num_requests} tokens in flight, but the SPS table covers "
            f"{table.min_tokens}..{table.max_tokens}; profile up to R * (1 + gamma) tokens "
            "(`vlmspec profile --max-tokens N`)"
        )


def check_sps_table(table: SPSTable | BatchSPSTable) -> SPSTable | BatchSPSTable:
    """Refuse anything but an SPS table (one curve, or one per measured number of requests)."""
    if not isinstance(table, (SPSTable, BatchSPSTable)):
        raise ValueError(
            f"sps_table must be an SPSTable or a BatchSPSTable (see vlmspec.scheduling.tables), "
            f"got {type(table).__name__}"
        )
    return table


def first_drop(theta: np.ndarray) -> int:
    """Largest k with ``theta[0] < theta[1] < ... < theta[k]``: the greedy walk with the early break.

    A NaN (a batch the table does not cover) counts as a drop.
    """
    rises = theta[1:] > theta[:-1]  # [M]; False for NaN
    return int(np.cumprod(rises).sum())


def global_best(theta: np.ndarray) -> int:
    """The k maximising ``theta`` over the whole curve (no break); the smallest such k on ties."""
    return int(np.argmax(np.nan_to_num(theta, nan=-np.inf)))


class PrefixScheduler:
    """Algorithm 1 (docs/design.md §8): greedy admission by descending ``a[r, j]`` with the early break.

    Starting from anchors only (``B = R``), candidates are admitted one at a time in
    :func:`rank_candidates` order while each admission strictly raises
    ``Theta = tau * SPS(B)``; the first admission that does not is undone and the walk
    stops. ``sps_table`` is indexed by the total tokens in the verification batch,
    ``B = sum_r (1 + l_r)``; batches beyond the table count as a drop. With a
    :class:`~vlmspec.scheduling.tables.BatchSPSTable` the curve is the one measured for
    the R requests of the call (``for_requests(R)``).

    Lossless because it is non-anticipating: the decision on candidate ``(r, j)`` is made
    when the walk reaches it, and everything the walk has seen by then ranks at or above
    it: ``a[r, 1..j]`` (known before ``x_{r,j}`` is sampled) and other requests' positions
    (independent of request r's draft). Request r's later positions, whose confidences
    depend on ``x_{r,j}``, rank below it and are never consulted for it. Theta is only
    maximised globally when it is unimodal in the number of admitted tokens (a smoothly
    decaying SPS curve); see :class:`LaggedTopKScheduler` for jagged curves.
    """

    def __init__(self, sps_table: SPSTable | BatchSPSTable) -> None:
        self.sps_table = check_sps_table(sps_table)

    def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
        conf, drafted = check_confidences(confidences, num_drafted, type(self).__name__)  # [R, gamma], [R]
        return as_lengths(self.lengths(prefix_survival(conf, drafted), drafted), num_drafted)

    def lengths(self, survival: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        """The schedule from prefix survival probabilities: [R, gamma], [R] -> [R] int64 (numpy)."""
        if len(drafted) == 0:
            return np.zeros(0, dtype=np.int64)
        candidates = rank_candidates(survival, drafted)
        table = self.sps_table.for_requests(len(drafted))
        theta = throughput_curve(len(drafted), candidates.gains, table)  # [M + 1]
        return candidates.lengths(first_drop(theta), len(drafted))

    def __repr__(self) -> str:
        return f"PrefixScheduler(sps_table={self.sps_table.meta.model!r})"


class LaggedTopKScheduler:
    """Production form of the prefix scheduler: lagged global capacity, current top-K admission.

    At each call (one per engine step):

    1. The capacity K (draft tokens to verify across the whole batch) is found by a
       *global* search, without the early break, over the candidates of the call ``lag``
       steps earlier: ``K = argmax_k Theta_lagged(k)``. With no break, jagged (step-wise)
       SPS curves are searched properly; and K is known ``lag`` steps ahead, which an
       asynchronous engine (CUDA-graph replay, zero-overhead scheduling) needs to fix the
       next batch size before the current step ends.
    2. The current step admits its top-K candidates by their *current* survival
       probabilities (:func:`rank_candidates` order), capped so ``R + K`` stays inside
       the SPS table.

    Why this stays lossless (non-anticipation): ``x_{r,j}`` must be admitted or not
    independently of its own value. K is a function of confidences from ``lag >= 1`` steps
    ago: they were computed before any of the current step's tokens were sampled, so K
    cannot depend on them. Given K, ``(r, j)`` is admitted iff fewer than K candidates rank
    above it; those are request r's own earlier positions (their ``a`` uses ``c[r, 1..j-1]``,
    known before ``x_{r,j}``) and other requests' positions (independent of request r's
    draft). Request r's later positions, whose confidences depend on ``x_{r,j}``, always
    rank below it (their ``a`` is no larger and ties go to the earlier position). The
    Appendix A failure needs the decision on ``x_1`` to depend on ``c_2(x_1)``; here it
    cannot. A global search over the *current* confidences would reintroduce exactly that.

    State and contract: the scheduler remembers the survival probabilities of its last
    ``lag`` calls. Call it once per engine step. Requests may join or leave between steps:
    K is a batch-level token count, not a per-request assignment, so it carries over (it
    adapts to the new load ``lag`` steps later; the lag can cost throughput, never
    correctness). Until ``lag`` calls have been seen it schedules like
    :class:`PrefixScheduler` (causal, with the break). Call :meth:`reset` to start over,
    e.g. when the engine restarts with a different workload. ``last_capacity`` holds the
    K used by the latest call (None during warm-up).
    """

    def __init__(self, sps_table: SPSTable | BatchSPSTable, lag: int = 2) -> None:
        if not isinstance(lag, int) or isinstance(lag, bool) or lag < 1:
            raise ValueError(
                f"lag must be an integer >= 1 (steps between the confidences that set the capacity and "
                f"the step that uses it; 0 would peek at the current tokens), got {lag!r}"
            )
        self._warmup = PrefixScheduler(sps_table)
        self.sps_table = check_sps_table(sps_table)
        self.lag = lag
        self._history: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=lag)  # (a [R', gamma'], drafted [R'])
        self.last_capacity: int | None = None

    def reset(self) -> None:
        """Forget all remembered confidences (the next ``lag`` calls warm up again)."""
        self._history.clear()
        self.last_capacity = None

    def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
        conf, drafted = check_confidences(confidences, num_drafted, type(self).__name__)  # [R, gamma], [R]
        if len(drafted) == 0:
            return as_lengths(np.zeros(0), num_drafted)  # an idle step: nothing to schedule, nothing to remember
        survival = prefix_survival(conf, drafted)  # [R, gamma]
        if len(self._history) < self.lag:
            self.last_capacity = None
            lengths = self._warmup.lengths(survival, drafted)
        else:
            self.last_capacity = self._lagged_capacity(*self._history[0])
            lengths = self._admit_top(survival, drafted, self.last_capacity)
        self._history.append((survival, drafted))
        return as_lengths(lengths, num_drafted)

    def _lagged_capacity(self, survival: np.ndarray, drafted: np.ndarray) -> int:
        """K: the global argmax of Theta over the lagged step's ranked candidates."""
        candidates = rank_candidates(survival, drafted)
        table = self.sps_table.for_requests(len(drafted))
        return global_best(throughput_curve(len(drafted), candidates.gains, table))

    def _admit_top(self, survival: np.ndarray, drafted: np.ndarray, capacity: int) -> np.ndarray:
        """[R] lengths admitting the current top-``capacity`` candidates (within the SPS table)."""
        num_requests = len(drafted)
        table = self.sps_table.for_requests(num_requests)
        require_anchors_fit(num_requests, table)
        capacity = min(capacity, table.max_tokens - num_requests)
        return rank_candidates(survival, drafted).lengths(capacity, num_requests)

    def __repr__(self) -> str:
        return f"LaggedTopKScheduler(sps_table={self.sps_table.meta.model!r}, lag={self.lag})"
