"""Held-out decoding keeps the engine's record of every round; the fitted calibration lands beside the drafter."""

from __future__ import annotations

import pytest
from training_helpers import tiny_drafter

from vlmspec.drafters.dspark import DSparkProposer
from vlmspec.engine import SpecEngine
from vlmspec.scheduling.base import VerifyAll
from vlmspec.scheduling.calibration import Calibration, RoundRecords
from vlmspec.training import calibrate, run_heldout


def test_heldout_rounds_match_the_engines_statistics_and_calibrate(target, prompts, tmp_path):
    drafter = tiny_drafter(target)
    engine = SpecEngine(target, DSparkProposer(drafter))
    scheduler = engine.scheduler
    run = run_heldout(engine, prompts[:2], max_new_tokens=8, show_progress=False)
    assert engine.scheduler is scheduler and isinstance(scheduler, VerifyAll)  # the engine is read, never patched
    assert run.identical_to_target and run.prompts == 2 and run.stats.new_tokens == 16
    records = run.records
    assert len(records) == run.rounds  # the engine reports every round's outcome, a last one cut by EOS too
    assert int(records.num_accepted.sum()) == run.stats.accepted
    assert bool((records.num_verified <= records.num_drafted).all()) and records.gamma == drafter.block_size
    assert run.tau == pytest.approx(1 + run.stats.accepted / run.rounds)
    calibration = calibrate(run, tmp_path)
    assert Calibration.load(tmp_path).temperatures == calibration.temperatures
    assert len(RoundRecords.load(tmp_path / "calibration_rounds.npz")) == run.rounds


def test_a_drafter_without_confidence_head_cannot_be_calibrated(target, prompts, tmp_path):
    drafter = tiny_drafter(target, confidence_head=False, confidence_with_markov=False)
    run = run_heldout(SpecEngine(target, DSparkProposer(drafter)), prompts[:1], max_new_tokens=4, show_progress=False)
    assert run.records is None
    with pytest.raises(ValueError, match="confidence head"):
        calibrate(run, tmp_path)
