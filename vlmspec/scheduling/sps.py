"""The single-request SPS argmax scheduler (docs/design.md §8.1)."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from vlmspec.scheduling.base import checked_rows, lengths_tensor
from vlmspec.scheduling.prefix import check_sps_table, require_anchors_fit
from vlmspec.scheduling.tables import BatchSPSTable, SPSTable


class SPSArgmaxScheduler:
    """Choose ``l`` maximising ``Theta(l) = (1 + sum_{j<=l} a_j) * SPS(1 + l)``, stopping at the first drop.

    ``l`` grows from 0 while each step strictly raises Theta; the first ``l`` that does
    not (or that the SPS table does not cover) ends the walk. This is Algorithm 1 for a
    request that is alone on the engine, and it is lossless for the same reason: the
    decision on position ``l + 1`` is taken before any confidence that depends on
    ``x_{l+1}`` is looked at.

    With several rows, each row is scheduled *as if it were alone* (``B = 1 + l``, on the
    one-request curve of a :class:`~vlmspec.scheduling.tables.BatchSPSTable`); for a
    batch that shares one forward, use :class:`~vlmspec.scheduling.prefix.PrefixScheduler`.
    """

    def __init__(self, sps_table: SPSTable | BatchSPSTable) -> None:
        self.sps_table = check_sps_table(sps_table).for_requests(1)
        require_anchors_fit(1, self.sps_table)

    def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
        rows, drafted = checked_rows(confidences, num_drafted, type(self).__name__)  # [R][gamma], [R]
        return lengths_tensor([self._length(row, n) for row, n in zip(rows, drafted)], num_drafted)  # [R]

    def _length(self, confidences: list[float], drafted: int) -> int:
        """The walk for one request: ``Theta(l) = (1 + a_1 + ... + a_l) * SPS(1 + l)``, ``a_k = c_1 ... c_k``."""
        sps = self._sps  # sps[n - 1] = SPS(n) for n = 1 .. the table's largest count
        survival, expected = 1.0, 0.0  # a_l; a_1 + ... + a_l
        best = sps[0]  # Theta(0): the anchor alone
        length = 0
        while length < min(drafted, len(sps) - 1):  # never beyond the drafts or the table
            survival *= confidences[length]
            theta = (1.0 + (expected + survival)) * sps[length + 1]  # the order of numpy's 1 + cumsum
            if not theta > best:  # the first drop (NaN off-table counts as one) ends the walk
                break
            best, expected, length = theta, expected + survival, length + 1
        return length

    @functools.cached_property
    def _sps(self) -> list[float]:
        """SPS(n) for n = 1, 2, ... up to the first count the table does not cover (NaN: not feasible)."""
        values = self.sps_table.steps_per_second(np.arange(1, self.sps_table.max_tokens + 1)).tolist()
        for n, value in enumerate(values):
            if math.isnan(value):
                return values[:n]
        return values

    def __repr__(self) -> str:
        return f"SPSArgmaxScheduler(sps_table={self.sps_table.meta.model!r})"
