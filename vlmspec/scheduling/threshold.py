"""A static confidence threshold: the offline diagnostic of docs/design.md §11."""

from __future__ import annotations

import numpy as np
import torch

from vlmspec.scheduling.base import as_lengths, check_confidences, positions_mask


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
        conf, drafted = check_confidences(confidences, num_drafted, type(self).__name__)  # [R, gamma], [R]
        passes = (conf >= self.threshold) & positions_mask(drafted, conf.shape[1])  # [R, gamma]
        return as_lengths(np.cumprod(passes, axis=1).sum(axis=1), num_drafted)  # [R] leading passes

    def __repr__(self) -> str:
        return f"ThresholdScheduler(threshold={self.threshold})"
