"""The single-request SPS argmax scheduler (docs/design.md §8.1)."""

from __future__ import annotations

import numpy as np
import torch

from vlmspec.scheduling.base import as_lengths, check_confidences, prefix_survival
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
        conf, drafted = check_confidences(confidences, num_drafted, type(self).__name__)  # [R, gamma], [R]
        gamma = conf.shape[1]
        survival = prefix_survival(conf, drafted)  # [R, gamma]
        expected_tokens = 1 + np.concatenate(
            [np.zeros((len(drafted), 1)), survival.cumsum(1)], axis=1
        )  # [R, gamma + 1]
        theta = expected_tokens * self.sps_table.steps_per_second(
            np.arange(1, gamma + 2)
        )  # [R, gamma + 1]; NaN off-table
        theta[np.arange(gamma + 1)[None, :] > drafted[:, None]] = np.nan  # never beyond the drafts
        rises = theta[:, 1:] > theta[:, :-1]  # [R, gamma]; NaN is a drop
        return as_lengths(np.cumprod(rises, axis=1).sum(axis=1), num_drafted)  # [R]

    def __repr__(self) -> str:
        return f"SPSArgmaxScheduler(sps_table={self.sps_table.meta.model!r})"
