"""A static confidence threshold: the offline diagnostic of docs/design.md §11."""

from __future__ import annotations

import torch

from vlmspec.scheduling.base import checked_rows, lengths_tensor


class ThresholdScheduler:
    """Verify each request up to (not including) its first position with ``c[r, k] < threshold``.

    Non-anticipating by construction: whether position k is verified depends on
    ``c[r, 1..k]`` only, and ``c[r, k]`` is known before ``x_k`` is sampled. Raising the
    threshold trades accepted length for acceptance rate (docs/design.md §12.3, the paper's Figure 5).
    """

    def __init__(self, threshold: float) -> None:
        if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be a probability in [0, 1], got {threshold!r}")
        self.threshold = float(threshold)

    def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
        rows, drafted = checked_rows(confidences, num_drafted, type(self).__name__)  # [R][gamma], [R]
        return lengths_tensor([self._leading_passes(row[:n]) for row, n in zip(rows, drafted)], num_drafted)  # [R]

    def _leading_passes(self, confidences: list[float]) -> int:
        """How many drafts lead the row before its first confidence below the threshold."""
        for position, confidence in enumerate(confidences):
            if not confidence >= self.threshold:
                return position
        return len(confidences)

    def __repr__(self) -> str:
        return f"ThresholdScheduler(threshold={self.threshold})"
