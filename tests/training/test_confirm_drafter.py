"""recipes/confirm_reference_drafter.py: a drafter from elsewhere measured against the shipped one, calibrated here."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_train_recipe import load_script
from training_helpers import GSM8K_MINI, tiny_drafter

SCRIPT = Path(__file__).parents[2] / "recipes" / "confirm_reference_drafter.py"


def test_the_new_drafter_is_measured_beside_the_shipped_one_and_calibrated(target, tmp_path):
    script = load_script(SCRIPT)
    shipped, new = tmp_path / "shipped", tmp_path / "gpu-run" / "drafter"
    tiny_drafter(target).save_pretrained(shipped, dtype=torch.float16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        tiny_drafter(target).save_pretrained(new)
    (tmp_path / "gpu-run" / "report.json").write_text('{"trained": {"tau": 1.5}}')
    argv = [
        *("--drafter", str(new), "--shipped", str(shipped), "--prompts", str(GSM8K_MINI)),
        *("--report", str(tmp_path / "gpu-run" / "report.json"), "--out", str(tmp_path / "confirm")),
        *("--heldout-prompts", "2", "--eval-max-new-tokens", "6", "--threads", "1"),
    ]
    report = script.main(argv, target=target)
    assert report["untrained"]["identical_to_target"] and report["trained"]["identical_to_target"]
    assert report["untrained"]["prompts"] == report["trained"]["prompts"] == 2
    assert report["training_run"] == {"trained": {"tau": 1.5}}
    out = tmp_path / "confirm"
    # What recipes/ship_reference_drafter.py reads: the drafter with its calibration fitted here, and the report.
    assert (out / "drafter" / "model.safetensors").read_bytes() == (new / "model.safetensors").read_bytes()
    assert (out / "drafter" / "calibration.json").is_file()
    assert json.loads((out / "report.json").read_text())["trained"]["tau"] == report["trained"]["tau"]
