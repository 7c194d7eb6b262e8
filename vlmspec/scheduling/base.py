"""The Scheduler protocol: how many of the drafted tokens to send to the target.

Schedulers are pure: confidences in, lengths out. They must be *non-anticipating*: the
decision to verify position k may use only information available before x_k was
sampled (see the Appendix A counterexample in the design notes).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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
    """The default: verify every drafted token."""

    def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
        return num_drafted.clone()
