"""Metrics of speculative rounds and of confidence heads. Pure torch; no sklearn.

Labels of a confidence head, per recorded round i and draft position k (1-based):

* *prefix* label ``y[i, k] = 1`` if positions 1..k all survived (``num_accepted[i] >= k``):
  the target of the cumulative product ``a_k = prod_{i<=k} c_i``. It is *observed* when
  position k was verified, or when an earlier position was rejected (then it is surely 0);
  it is unknown when every verified position survived but k was not verified.
* *conditional* label: position k survived, among rounds that reached it (positions
  1..k-1 survived and k was verified): the target of ``c_k`` itself.

Calibration metrics compare predicted probabilities with labels: ECE (equal-width bins,
weighted by bin size), Brier score (mean squared error), ROC AUC (Mann-Whitney, ties
count half), and reliability bins (what a reliability diagram draws).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

ArrayLike = torch.Tensor | np.ndarray | Sequence[float]


def _as_tensor(values: ArrayLike) -> torch.Tensor:
    return values.detach().cpu() if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))


def _as_float(values: ArrayLike) -> torch.Tensor:
    return _as_tensor(values).to(torch.float64)


def _as_int(values: ArrayLike) -> torch.Tensor:
    return _as_tensor(values).to(torch.int64).reshape(-1)


def _pair(probs: ArrayLike, labels: ArrayLike) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened float64 (probs, labels) of equal length, probabilities checked to lie in [0, 1]."""
    p, y = _as_float(probs).reshape(-1), _as_float(labels).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"probs and labels must have the same number of elements, got {p.numel()} and {y.numel()}")
    if bool(((p < 0) | (p > 1) | torch.isnan(p)).any()):
        raise ValueError("probs must be probabilities in [0, 1] (apply the sigmoid to logits first)")
    return p, y


# -- per-sample metrics ---------------------------------------------------------------------


@dataclass
class ReliabilityBins:
    """Equal-width bins over [0, 1]: mean prediction and observed frequency per bin (NaN when empty)."""

    edges: torch.Tensor  # [num_bins + 1]
    mean_confidence: torch.Tensor  # [num_bins]
    frequency: torch.Tensor  # [num_bins], fraction of positive labels
    count: torch.Tensor  # [num_bins] int64

    @property
    def ece(self) -> float:
        total = int(self.count.sum())
        if total == 0:
            return float("nan")
        gap = torch.nan_to_num((self.mean_confidence - self.frequency).abs())
        return float((self.count.to(torch.float64) * gap).sum() / total)


def reliability_bins(probs: ArrayLike, labels: ArrayLike, num_bins: int = 15) -> ReliabilityBins:
    """Bin predictions into ``num_bins`` equal-width bins (1.0 falls in the last bin)."""
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive integer, got {num_bins!r}")
    p, y = _pair(probs, labels)
    index = (p * num_bins).floor().to(torch.int64).clamp(max=num_bins - 1)  # [N]
    count = torch.bincount(index, minlength=num_bins)  # [num_bins]
    sum_p = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, index, p)
    sum_y = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, index, y)
    safe = count.clamp(min=1).to(torch.float64)
    empty = count == 0
    return ReliabilityBins(
        edges=torch.linspace(0, 1, num_bins + 1, dtype=torch.float64),
        mean_confidence=torch.where(empty, torch.nan, sum_p / safe),
        frequency=torch.where(empty, torch.nan, sum_y / safe),
        count=count,
    )


def expected_calibration_error(probs: ArrayLike, labels: ArrayLike, num_bins: int = 15) -> float:
    """ECE: sum over bins of (bin size / N) * |mean prediction - observed frequency|; NaN if empty."""
    return reliability_bins(probs, labels, num_bins).ece


def expected_calibration_error_rows(probs: torch.Tensor, labels: torch.Tensor, num_bins: int = 15) -> torch.Tensor:
    """ECE of each row of ``probs`` [G, n] against the same ``labels`` [n]: [G] float64.

    The vectorised form of :func:`expected_calibration_error` for grid searches.
    """
    p, y = _as_float(probs), _as_float(labels).reshape(-1)
    if p.dim() != 2 or p.shape[1] != y.numel():
        raise ValueError(f"probs must be [G, n] with n = {y.numel()} labels, got shape {tuple(p.shape)}")
    rows, n = p.shape
    if n == 0:
        return torch.full((rows,), float("nan"), dtype=torch.float64)
    index = (p * num_bins).floor().to(torch.int64).clamp(0, num_bins - 1)  # [G, n]
    flat = (index + num_bins * torch.arange(rows).unsqueeze(1)).reshape(-1)  # [G * n], one bin range per row
    size = rows * num_bins
    sum_p = torch.zeros(size, dtype=torch.float64).index_add_(0, flat, p.reshape(-1))
    sum_y = torch.zeros(size, dtype=torch.float64).index_add_(0, flat, y.expand(rows, n).reshape(-1))
    return ((sum_p - sum_y).abs().reshape(rows, num_bins).sum(1)) / n  # sum_b |n_b * (mean_p - mean_y)| / n


def brier_score(probs: ArrayLike, labels: ArrayLike) -> float:
    """Mean squared error between predictions and 0/1 labels; NaN if empty."""
    p, y = _pair(probs, labels)
    return float(((p - y) ** 2).mean()) if p.numel() else float("nan")


def roc_auc(scores: ArrayLike, labels: ArrayLike) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties count half.

    Computed from mid-ranks (Mann-Whitney U). NaN when only one class is present.
    """
    s, y = _as_float(scores).reshape(-1), _as_float(labels).reshape(-1) > 0.5
    if s.shape != y.shape:
        raise ValueError(f"scores and labels must have the same number of elements, got {s.numel()} and {y.numel()}")
    positives, negatives = int(y.sum()), int((~y).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = torch.unique(s, sorted=True, return_inverse=True, return_counts=True)
    first_rank = torch.cumsum(counts, 0) - counts + 1  # 1-based rank of each distinct value's first copy
    mid_rank = first_rank.to(torch.float64) + (counts.to(torch.float64) - 1) / 2  # [distinct]
    rank_sum = mid_rank[inverse][y].sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


# -- per-position labels and metrics ------------------------------------------------------------


def _lengths(values: ArrayLike | None, n: int, default: int, name: str) -> torch.Tensor:
    if values is None:
        return torch.full((n,), default, dtype=torch.int64)
    out = _as_int(values)
    if out.numel() != n:
        raise ValueError(f"{name} must have one entry per round ({n}), got {out.numel()}")
    return out


def prefix_labels(
    num_accepted: ArrayLike, gamma: int, num_verified: ArrayLike | None = None, num_drafted: ArrayLike | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix-survival labels and where they are known.

    num_accepted: [N] leading draft tokens that survived in each round.
    num_verified / num_drafted: [N] (default: gamma, i.e. every position was drafted and verified).
    Returns (labels [N, gamma] bool, observed [N, gamma] bool).
    """
    accepted = _as_int(num_accepted)  # [N]
    verified = _lengths(num_verified, accepted.numel(), gamma, "num_verified")
    drafted = _lengths(num_drafted, accepted.numel(), gamma, "num_drafted")
    if bool((accepted > verified).any()) or bool((verified > drafted).any()) or bool((drafted > gamma).any()):
        raise ValueError("need num_accepted <= num_verified <= num_drafted <= gamma in every round")
    position = torch.arange(gamma).unsqueeze(0)  # [1, gamma], 0-based
    labels = accepted.unsqueeze(1) > position  # [N, gamma]
    rejected_earlier = (accepted < verified).unsqueeze(1)  # [N, 1]
    observed = ((position < verified.unsqueeze(1)) | rejected_earlier) & (position < drafted.unsqueeze(1))
    return labels, observed


def conditional_labels(
    num_accepted: ArrayLike, gamma: int, num_verified: ArrayLike | None = None, num_drafted: ArrayLike | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position survival labels among rounds that reached the position (see the module docstring).

    Returns (labels [N, gamma] bool, observed [N, gamma] bool).
    """
    labels, _ = prefix_labels(num_accepted, gamma, num_verified, num_drafted)
    accepted = _as_int(num_accepted)  # [N]
    verified = _lengths(num_verified, accepted.numel(), gamma, "num_verified")
    position = torch.arange(gamma).unsqueeze(0)  # [1, gamma]
    observed = (accepted.unsqueeze(1) >= position) & (position < verified.unsqueeze(1))
    return labels, observed


@dataclass
class PositionMetrics:
    """Calibration of a confidence head per draft position (index k-1 for position k).

    ``ece``, ``brier``, ``auc`` and ``bins`` judge the cumulative product ``a_k`` against
    the prefix labels (what the schedulers consume); ``conditional_auc`` judges ``c_k``
    against the conditional labels (the head's own discrimination, unchanged by any
    per-position monotone recalibration). ``count`` is the number of observed prefix labels.
    """

    ece: list[float] = field(default_factory=list)
    brier: list[float] = field(default_factory=list)
    auc: list[float] = field(default_factory=list)
    conditional_auc: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    bins: list[ReliabilityBins] = field(default_factory=list)

    def as_dict(self) -> dict[str, list]:
        return {
            "ece": self.ece,
            "brier": self.brier,
            "auc": self.auc,
            "conditional_auc": self.conditional_auc,
            "count": self.count,
        }


def position_metrics(
    confidences: ArrayLike,
    num_accepted: ArrayLike,
    *,
    num_verified: ArrayLike | None = None,
    num_drafted: ArrayLike | None = None,
    num_bins: int = 15,
) -> PositionMetrics:
    """ECE, Brier, AUC and reliability bins per position from recorded rounds.

    confidences: [N, gamma] conditional confidences c[i, k] as the scheduler saw them.
    num_accepted / num_verified / num_drafted: [N] per round (see :func:`prefix_labels`).
    """
    conf = _as_float(confidences)
    if conf.dim() != 2:
        raise ValueError(f"confidences must be [N, gamma], got shape {tuple(conf.shape)}")
    gamma = conf.shape[1]
    survival = torch.cumprod(conf, dim=1)  # [N, gamma]
    labels, observed = prefix_labels(num_accepted, gamma, num_verified, num_drafted)
    cond_labels, cond_observed = conditional_labels(num_accepted, gamma, num_verified, num_drafted)
    out = PositionMetrics()
    for k in range(gamma):
        seen, a, y = observed[:, k], survival[:, k], labels[:, k]
        bins = reliability_bins(a[seen], y[seen], num_bins)
        out.bins.append(bins)
        out.ece.append(bins.ece)
        out.brier.append(brier_score(a[seen], y[seen]))
        out.auc.append(roc_auc(a[seen], y[seen]))
        reached = cond_observed[:, k]
        out.conditional_auc.append(roc_auc(conf[reached, k], cond_labels[reached, k]))
        out.count.append(int(seen.sum()))
    return out
