"""The Scheduler protocol: how many of the drafted tokens to send to the target.

Schedulers are pure: confidences in, lengths out. They must be *non-anticipating*: the
decision to verify position k may use only information available before x_k was
sampled (see the Appendix A counterexample, docs/design.md §9).

Vocabulary used by every scheduler in this package:

* ``c[r, k]`` (``confidences``) is the drafter's conditional survival probability of
  draft position k of request r, given that positions 1..k-1 survived. It may depend on
  the tokens drafted *before* position k, never on x_k itself.
* ``a[r, k] = prod_{i <= k} c[r, i]`` (:func:`survival_probabilities`) is the probability
  that the whole prefix 1..k survives. It is non-increasing in k, so extending request r
  from k-1 to k verified tokens adds exactly ``a[r, k]`` expected accepted tokens.
* A verification batch of R requests with lengths l_r holds ``B = sum_r (1 + l_r)``
  tokens: every request's anchor is always verified (it yields the recovered or bonus
  token).

The helpers at the bottom validate what a scheduler receives, so every implementation
refuses bad input with the same clear messages.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Scheduler(Protocol):
    def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
        """Return the number of draft tokens to verify per request.

        confidences: [R, gamma] float32 conditional survival probabilities c[r, k], or None
            when the drafter has no confidence head.
        num_drafted: [R] int64, drafted tokens per request.
        Returns: [R] int64 with 0 <= out[r] <= num_drafted[r].
        """
        ...


class VerifyAll:
    """The default: verify every drafted token (the "fixed gamma" policy)."""

    def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
        return num_drafted.clone()


def checked_rows(
    confidences: torch.Tensor | None, num_drafted: torch.Tensor, scheduler: str
) -> tuple[list[list[float]], list[int]]:
    """Validate a scheduler's inputs; return them as Python lists: ``(confidences [R][gamma], num_drafted [R])``.

    ``scheduler`` names the caller in the messages. A missing confidence head (``None``)
    is refused with a message that points at :class:`VerifyAll`. Schedulers run on every
    round's critical path with a few dozen numbers, so the single-request ones walk Python
    lists: two ``tolist`` calls, where each numpy or torch call costs 10-60 us in the engine
    (its caches are cold after the target's weights stream through them; docs/design.md §21.5).
    """
    if confidences is None:
        raise ValueError(
            f"{scheduler} needs per-position confidences, but the drafter has no confidence head "
            "(DraftBlock.confidences is None). Use VerifyAll (the default scheduler, verify every "
            "drafted token) or a drafter with a confidence head."
        )
    drafted = _checked_num_drafted(num_drafted)
    if not isinstance(confidences, torch.Tensor) or confidences.dim() != 2:
        raise ValueError(
            f"confidences must be a 2-D tensor [R, gamma], got {type(confidences).__name__} "
            f"{tuple(getattr(confidences, 'shape', ()))}"
        )
    if confidences.shape[0] != len(drafted):
        raise ValueError(
            f"confidences has {confidences.shape[0]} rows but num_drafted has {len(drafted)}; "
            "both must describe the same R requests"
        )
    gamma = confidences.shape[1]
    if any(n > gamma for n in drafted):
        raise ValueError(f"num_drafted {drafted} exceeds the block size gamma={gamma} of confidences")
    rows = confidences.tolist()  # [R][gamma] Python floats: float32 values exactly, as float64
    if not all(0.0 <= c <= 1.0 for row, n in zip(rows, drafted) for c in row[:n]):  # also refuses NaN
        raise ValueError(
            "confidences must be probabilities in [0, 1] at every drafted position; got values outside "
            "that range (pass the confidence head's sigmoid output, not its logits)"
        )
    return rows, drafted


def _checked_num_drafted(num_drafted: torch.Tensor) -> list[int]:
    """Validate ``num_drafted`` ([R] integer tensor, >= 0); return it as a list of R ints."""
    if not isinstance(num_drafted, torch.Tensor) or num_drafted.dim() != 1:
        raise ValueError(
            f"num_drafted must be a 1-D tensor [R] of drafted-token counts, got "
            f"{type(num_drafted).__name__} {tuple(getattr(num_drafted, 'shape', ()))}; pass DraftBlock.num_tokens"
        )
    if num_drafted.dtype.is_floating_point or num_drafted.dtype == torch.bool:
        raise ValueError(f"num_drafted must hold integers, got dtype {num_drafted.dtype}; pass DraftBlock.num_tokens")
    drafted = num_drafted.tolist()  # [R]
    if any(n < 0 for n in drafted):
        raise ValueError(f"num_drafted must be >= 0, got {drafted}")
    return drafted


def check_confidences(
    confidences: torch.Tensor | None, num_drafted: torch.Tensor, scheduler: str
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`checked_rows` as numpy, for the batch schedulers: ``(confidences [R, gamma] float64, num_drafted [R] int64)``."""
    rows, drafted = checked_rows(confidences, num_drafted, scheduler)
    conf = np.array(rows, dtype=np.float64).reshape(len(rows), confidences.shape[1])  # [R, gamma]
    return conf, np.array(drafted, dtype=np.int64)


def lengths_tensor(lengths: list[int], like: torch.Tensor) -> torch.Tensor:
    """[R] scheduled lengths (Python ints) as an int64 tensor on ``like``'s device (the scheduler's return value)."""
    return torch.tensor(lengths, dtype=torch.long, device=like.device)


def positions_mask(num_drafted: np.ndarray, gamma: int) -> np.ndarray:
    """[R, gamma] bool: True where position k (0-based) is a real draft of request r."""
    return np.arange(gamma)[None, :] < num_drafted[:, None]


def prefix_survival(confidences: np.ndarray, num_drafted: np.ndarray) -> np.ndarray:
    """Prefix survival ``a[r, k] = prod_{i <= k} c[r, i]``; 0 at padded positions.

    confidences: [R, gamma] validated conditional survival probabilities.
    num_drafted: [R] int64.
    Returns: [R, gamma] float64, non-increasing along each row.
    """
    real = positions_mask(num_drafted, confidences.shape[1])  # [R, gamma]
    return np.cumprod(np.where(real, confidences, 0.0), axis=1)


def survival_probabilities(confidences: torch.Tensor, num_drafted: torch.Tensor) -> torch.Tensor:
    """Tensor form of :func:`prefix_survival`: [R, gamma] confidences -> [R, gamma] float64 a[r, k]."""
    conf, drafted = check_confidences(confidences, num_drafted, "survival_probabilities")
    return torch.from_numpy(prefix_survival(conf, drafted))


def as_lengths(lengths: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """[R] scheduled lengths as an int64 tensor on ``like``'s device (the scheduler's return value)."""
    return torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int64)).to(like.device)
