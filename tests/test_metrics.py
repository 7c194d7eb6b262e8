"""Calibration metrics: ECE, Brier, AUC, reliability bins, prefix labels."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from vlmspec.metrics import (
    brier_score,
    conditional_labels,
    expected_calibration_error,
    expected_calibration_error_rows,
    position_metrics,
    prefix_labels,
    reliability_bins,
    roc_auc,
)


def test_ece_by_hand() -> None:
    # Bins of width 0.5: {0.2, 0.4} -> mean 0.3 vs frequency 0.5; {0.8, 1.0} -> mean 0.9 vs 1.0.
    probs, labels = [0.2, 0.4, 0.8, 1.0], [0, 1, 1, 1]
    assert expected_calibration_error(probs, labels, num_bins=2) == pytest.approx(0.5 * 0.2 + 0.5 * 0.1)
    bins = reliability_bins(probs, labels, num_bins=2)
    assert bins.count.tolist() == [2, 2]
    assert bins.mean_confidence.tolist() == pytest.approx([0.3, 0.9])
    assert bins.frequency.tolist() == pytest.approx([0.5, 1.0])


def test_ece_is_small_for_calibrated_and_large_for_overconfident_predictions() -> None:
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(20000, generator=generator, dtype=torch.float64)
    labels = torch.rand(20000, generator=generator, dtype=torch.float64) < probs
    assert expected_calibration_error(probs, labels) < 0.02
    overconfident = torch.sigmoid(3 * torch.logit(probs))
    assert expected_calibration_error(overconfident, labels) > 0.08


def test_ece_rows_matches_the_scalar_form() -> None:
    generator = torch.Generator().manual_seed(1)
    probs = torch.rand(4, 500, generator=generator, dtype=torch.float64)
    probs[0, :5] = 1.0
    labels = torch.rand(500, generator=generator) < 0.6
    rows = expected_calibration_error_rows(probs, labels, num_bins=10)
    assert rows.tolist() == pytest.approx([expected_calibration_error(row, labels, num_bins=10) for row in probs])


def test_empty_bins_are_nan_and_empty_input_is_nan() -> None:
    bins = reliability_bins([0.05, 0.06], [0, 1], num_bins=4)
    assert bins.count.tolist() == [2, 0, 0, 0] and math.isnan(float(bins.mean_confidence[1]))
    assert math.isnan(expected_calibration_error([], []))


def test_brier() -> None:
    assert brier_score([1.0, 0.0, 0.5], [1, 0, 1]) == pytest.approx(0.25 / 3)


def test_probabilities_are_checked() -> None:
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        expected_calibration_error([1.5], [1])
    with pytest.raises(ValueError, match="same number"):
        brier_score([0.5, 0.5], [1])


def brute_force_auc(scores: list[float], labels: list[int]) -> float:
    positives = [s for s, y in zip(scores, labels) if y]
    negatives = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(positives, negatives))
    return wins / (len(positives) * len(negatives))


def test_auc_matches_pairwise_counting_with_ties() -> None:
    generator = torch.Generator().manual_seed(2)
    scores = (torch.randint(0, 8, (200,), generator=generator) / 8).tolist()  # many ties
    labels = (torch.rand(200, generator=generator) < 0.4).long().tolist()
    assert roc_auc(scores, labels) == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)


def test_auc_edge_cases() -> None:
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert roc_auc([0.5] * 4, [0, 1, 0, 1]) == 0.5
    assert math.isnan(roc_auc([0.1, 0.2], [1, 1]))
    assert roc_auc(np.array([0.3, 0.7]), np.array([0, 1])) == 1.0  # numpy input


def test_prefix_and_conditional_labels() -> None:
    # gamma 3. Round 0: all verified, 1 accepted. Round 1: verified 1, accepted 1 (later unknown).
    # Round 2: verified 2, accepted 0 (later surely 0). Round 3: drafted 2 only.
    accepted, verified, drafted = [1, 1, 0, 2], [3, 1, 2, 2], [3, 3, 3, 2]
    labels, observed = prefix_labels(accepted, 3, verified, drafted)
    assert labels.tolist() == [[True, False, False], [True, False, False], [False, False, False], [True, True, False]]
    assert observed.tolist() == [[True, True, True], [True, False, False], [True, True, True], [True, True, False]]
    cond, reached = conditional_labels(accepted, 3, verified, drafted)
    assert reached.tolist() == [[True, True, False], [True, False, False], [True, False, False], [True, True, False]]
    assert cond[reached].tolist() == [True, False, True, False, True, True]
    with pytest.raises(ValueError, match="num_accepted <= num_verified"):
        prefix_labels([2], 3, [1])


def test_position_metrics() -> None:
    confidences = torch.tensor([[0.9, 0.5], [0.9, 0.5], [0.1, 0.5], [0.1, 0.5]])
    metrics = position_metrics(confidences, [2, 1, 0, 0])
    assert metrics.count == [4, 4]
    assert metrics.auc[0] == 1.0 and metrics.conditional_auc[0] == 1.0
    assert metrics.ece[0] == pytest.approx(0.1)  # 0.9 vs 1.0 and 0.1 vs 0.0
    assert metrics.ece[1] == pytest.approx((2 * abs(0.45 - 0.5) + 2 * 0.05) / 4)
    assert set(metrics.as_dict()) == {"ece", "brier", "auc", "conditional_auc", "count"}
