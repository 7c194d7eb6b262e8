"""Calibration: STS on overconfident synthetic rounds, records and calibration files, plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlmspec.metrics import position_metrics
from vlmspec.scheduling import Calibration, RoundRecorder, RoundRecords, fit_sts, plot_reliability, synthetic_records


def overconfident_split(seed: int = 0) -> tuple[RoundRecords, RoundRecords]:
    """Fit and held-out halves of rounds whose head is overconfident (logits doubled)."""
    records = synthetic_records(6000, 5, generator=torch.Generator().manual_seed(seed), overconfidence=2.0)
    half = torch.arange(len(records)) < 3000
    return records.subset(half), records.subset(~half)


def test_sts_lowers_ece_on_overconfident_data_and_keeps_each_positions_auc() -> None:
    fit, held_out = overconfident_split()
    calibration = fit_sts(fit.confidences, fit.num_accepted)
    # The synthetic head doubled every logit, so each fitted temperature should be near 2.
    assert all(1.6 < t < 2.6 for t in calibration.temperatures)
    raw = held_out.metrics()
    calibrated = held_out.metrics(calibration)
    for k in range(held_out.gamma):
        assert raw.ece[k] > 0.08, "the synthetic head should start clearly overconfident"
        assert calibrated.ece[k] < 0.5 * raw.ece[k], (
            f"position {k + 1}: ECE {raw.ece[k]:.3f} -> {calibrated.ece[k]:.3f}"
        )
        assert calibrated.brier[k] < raw.brier[k]
    # Per-position temperature scaling is order-preserving: each position's own AUC is unchanged.
    # (In float64, so rounding cannot merge two distinct confidences into a tie.)
    outcomes = (held_out.num_accepted, held_out.num_verified, held_out.num_drafted)
    exact = held_out.confidences.double()
    before = position_metrics(exact, outcomes[0], num_verified=outcomes[1], num_drafted=outcomes[2]).conditional_auc
    after = position_metrics(calibration.apply(exact), outcomes[0], num_verified=outcomes[1], num_drafted=outcomes[2])
    assert after.conditional_auc == pytest.approx(before, abs=1e-12)
    assert calibrated.auc[0] == pytest.approx(raw.auc[0], abs=1e-6)  # position 1: cumulative == conditional


def test_sts_leaves_a_calibrated_head_nearly_alone() -> None:
    records = synthetic_records(4000, 4, generator=torch.Generator().manual_seed(1), overconfidence=1.0)
    calibration = fit_sts(records.confidences, records.num_accepted)
    assert all(0.75 < t < 1.35 for t in calibration.temperatures)


def test_sts_fits_left_to_right_with_earlier_positions_fixed() -> None:
    # Position 1 is calibrated, position 2 is overconfident: only T_2 should move.
    generator = torch.Generator().manual_seed(2)
    true = torch.rand(5000, 2, generator=generator, dtype=torch.float64) * 0.6 + 0.35  # [N, 2]
    survived = torch.rand(5000, 2, generator=generator, dtype=torch.float64) < true
    accepted = torch.cumprod(survived.long(), 1).sum(1)
    head = torch.stack([true[:, 0], torch.sigmoid(3 * torch.logit(true[:, 1]))], dim=1)
    calibration = fit_sts(head, accepted)
    assert 0.8 < calibration.temperatures[0] < 1.25
    assert 2.3 < calibration.temperatures[1] < 3.8
    assert calibration.meta["ece_after"][1] < calibration.meta["ece_before"][1]


def test_sts_uses_only_observed_labels() -> None:
    # Rounds verified only up to position 1 say nothing about position 2 when position 1 survived.
    confidences = torch.full((4, 2), 0.9)
    fit = fit_sts(confidences, torch.tensor([1, 1, 0, 0]), num_verified=torch.tensor([1, 1, 1, 1]))
    assert fit.meta["ece_before"][1] == pytest.approx(0.81)  # only the two rejected rounds (label 0) count


def test_calibration_apply_save_load(tmp_path: Path) -> None:
    calibration = Calibration((2.0, 0.5, 1.0), {"method": "sts"})
    confidences = torch.tensor([[0.9, 0.9, 0.9], [0.5, 0.2, 0.0]])
    out = calibration.apply(confidences)
    logit_09 = float(torch.logit(torch.tensor(0.9)))
    assert float(out[0, 0]) == pytest.approx(float(torch.sigmoid(torch.tensor(logit_09 / 2))))
    assert float(out[0, 1]) == pytest.approx(float(torch.sigmoid(torch.tensor(logit_09 * 2))))
    assert float(out[0, 2]) == pytest.approx(0.9) and float(out[1, 0]) == 0.5 and float(out[1, 2]) == 0.0
    assert calibration.apply(confidences[:, :2]).shape == (2, 2)  # a shorter block uses the leading temperatures
    with pytest.raises(ValueError, match="refit"):
        calibration.apply(torch.full((1, 4), 0.5))
    path = calibration.save(tmp_path / "drafter")
    assert path.name == "calibration.json"
    assert Calibration.load(tmp_path / "drafter") == calibration
    assert Calibration.load(path) == calibration


@pytest.mark.parametrize(
    "content, message",
    [
        ("{oops", "not valid JSON"),
        (json.dumps({"format": "other", "version": 1, "temperatures": [1.0]}), "not a 'vlmspec.calibration'"),
        (json.dumps({"format": "vlmspec.calibration", "version": 1, "temperatures": "hot"}), "list of numbers"),
        (json.dumps({"format": "vlmspec.calibration", "version": 1, "temperatures": [1.0, -2.0]}), "> 0"),
    ],
)
def test_bad_calibration_files_are_refused(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "calibration.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        Calibration.load(tmp_path)


def test_missing_calibration_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fit_sts"):
        Calibration.load(tmp_path)


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_records_round_trip(tmp_path: Path, suffix: str) -> None:
    records = synthetic_records(50, 3, generator=torch.Generator().manual_seed(3))
    path = records.save(tmp_path / f"rounds{suffix}")
    assert path.suffix == suffix
    loaded = RoundRecords.load(path)
    assert torch.equal(loaded.confidences, records.confidences)
    for name in ("num_drafted", "num_verified", "num_accepted"):
        assert torch.equal(getattr(loaded, name), getattr(records, name))
    assert loaded.meta == records.meta


def test_records_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_accepted <= num_verified"):
        RoundRecords(torch.full((1, 2), 0.5), [2], [1], [2])
    with pytest.raises(ValueError, match="num_drafted <= gamma"):
        RoundRecords(torch.full((1, 2), 0.5), [3], [1], [0])
    (tmp_path / "x.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="vlmspec.round_records"):
        RoundRecords.load(tmp_path / "x.json")


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_unreadable_or_missing_records_name_the_fix(tmp_path: Path, suffix: str) -> None:
    with pytest.raises(ValueError, match="no round records at .*RoundRecorder"):
        RoundRecords.load(tmp_path / f"missing{suffix}")
    (tmp_path / f"bad{suffix}").write_bytes(b"not a records file")
    with pytest.raises(ValueError, match=f"bad{suffix} is not .*; record rounds with RoundRecorder"):
        RoundRecords.load(tmp_path / f"bad{suffix}")


def test_recorder_accumulates_rounds_in_the_records_format(tmp_path: Path) -> None:
    recorder = RoundRecorder()
    recorder.record(
        torch.tensor([[0.9, 0.8], [0.5, 0.4]]), torch.tensor([2, 2]), torch.tensor([2, 1]), torch.tensor([1, 0])
    )
    recorder.record(torch.tensor([[0.7, 0.6]]), torch.tensor([1]), torch.tensor([1]), torch.tensor([1]))
    records = recorder.records(meta={"drafter": "tiny"})
    assert len(records) == len(recorder) == 3 and records.gamma == 2
    assert records.num_accepted.tolist() == [1, 0, 1] and records.meta == {"drafter": "tiny"}
    assert len(RoundRecords.load(records.save(tmp_path / "r.npz"))) == 3
    with pytest.raises(ValueError, match="gamma=3"):
        recorder.record(torch.full((1, 3), 0.5), torch.tensor([3]), torch.tensor([3]), torch.tensor([0]))
    with pytest.raises(ValueError, match="num_accepted <= num_verified"):
        recorder.record(torch.full((1, 2), 0.5), torch.tensor([2]), torch.tensor([1]), torch.tensor([2]))


def test_reliability_diagram_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = synthetic_records(500, 3, generator=torch.Generator().manual_seed(4), overconfidence=2.0)
    path = plot_reliability(records, tmp_path / "reliability.png", calibration=Calibration((2.0, 2.0, 2.0)))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
