"""Batch SPS tables: one curve per number of concurrent requests, what the schedulers read for R requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmspec.scheduling import (
    BatchSPSTable,
    LaggedTopKScheduler,
    PrefixScheduler,
    SPSArgmaxScheduler,
    SPSTable,
    load_sps_table,
    sps_preset,
)


def curve(requests: int, per_token: float, gamma: int = 3) -> SPSTable:
    tokens = tuple(range(requests, requests * (1 + gamma) + 1))
    return SPSTable(
        tokens, tuple(1.0 / (0.1 + 0.01 * requests + per_token * b) for b in tokens), sps_preset("cpu").meta
    )


TABLE = BatchSPSTable((1, 4), (curve(1, 0.001), curve(4, 0.004)))


def test_measured_curves_are_returned_and_others_interpolated_in_requests():
    assert TABLE.for_requests(1) is TABLE.curves[0] and TABLE.for_requests(4) is TABLE.curves[1]
    two = TABLE.for_requests(2)
    assert two.min_tokens == 2 and two.max_tokens == 16
    low, high = (
        1 / TABLE.curves[0].sps(3),
        1 / TABLE.curves[1].sps(4),
    )  # B = 3 lies below the 4-request curve: held flat
    assert 1 / two.sps(3) == pytest.approx(low * 2 / 3 + high / 3)
    assert TABLE.for_requests(2) is two  # cached
    with pytest.raises(ValueError, match="1..4 concurrent requests, not 5"):
        TABLE.for_requests(5)


def test_json_round_trip_and_loading_either_kind(tmp_path):
    path = TABLE.save(tmp_path / "batch.json")
    loaded = load_sps_table(path)
    assert isinstance(loaded, BatchSPSTable) and loaded.requests == (1, 4)
    assert loaded.curves[1].steps_per_s == TABLE.curves[1].steps_per_s
    single = sps_preset("cpu", 8).save(tmp_path / "single.json")
    assert isinstance(load_sps_table(single), SPSTable)
    with pytest.raises(ValueError, match="anchors"):
        BatchSPSTable((1, 20), (curve(1, 0.001), curve(4, 0.004)))
    with pytest.raises(ValueError, match="no SPS table"):
        load_sps_table(tmp_path / "missing.json")
    later = TABLE.save(tmp_path / "later.json")
    later.write_text(later.read_text().replace('"version": 1', '"version": 2', 1))
    with pytest.raises(ValueError, match="not a batch SPS table: version 2 is not supported.*vlmspec profile"):
        load_sps_table(later)


def test_schedulers_use_the_curve_of_the_batch_they_schedule():
    confidences = torch.full((4, 3), 0.9)
    drafted = torch.full((4,), 3)
    lengths = PrefixScheduler(TABLE).schedule(confidences, drafted)
    theta_cap = TABLE.for_requests(4).max_tokens
    assert int((1 + lengths).sum()) <= theta_cap
    assert (
        int((1 + PrefixScheduler(TABLE).schedule(confidences[:2], drafted[:2])).sum())
        <= TABLE.for_requests(2).max_tokens
    )
    assert SPSArgmaxScheduler(TABLE).sps_table is TABLE.curves[0]
    lagged = LaggedTopKScheduler(TABLE, lag=1)
    for rows in (4, 2, 3):
        out = lagged.schedule(confidences[:rows], drafted[:rows])
        assert int((1 + out).sum()) <= TABLE.for_requests(rows).max_tokens
    with pytest.raises(ValueError, match="BatchSPSTable"):
        PrefixScheduler(np.zeros(3))
