"""recipes/gpu_train_reference.py at toy scale on the CPU: answers saved, replayed, a warm start measured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train_recipe import load_script
from training_helpers import GSM8K_MINI

from vlmspec.drafters.dspark import DSparkDrafter
from vlmspec.training.answers import answer_files

SCRIPT = Path(__file__).parents[2] / "recipes" / "gpu_train_reference.py"
TINY = [
    *("--feature-layers", "1,2", "--draft-hidden", "64", "--draft-layers", "1", "--draft-heads", "4"),
    *("--draft-head-dim", "16", "--draft-intermediate", "128", "--head-rank", "32", "--block-size", "4"),
    *("--draft-vocab", "2000", "--threads", "1", "--skip-calibration"),
]


def run(script, target, tmp_path: Path, out: str, *extra: str) -> dict:
    argv = [
        *("--target", "tiny:qwen2_5_vl", "--prompts", str(GSM8K_MINI), "--out", str(tmp_path / out)),
        *("--answers", str(tmp_path / "answers"), "--heldout-prompts", "2", "--max-new-tokens", "12"),
        *("--batch-size", "2", "--steps", "4", "--eval-sequences", "2", "--num-prompts", "8", *extra, "--", *TINY),
    ]
    return script.main(argv, target=target)


def test_the_gpu_script_trains_from_saved_answers_and_warm_starts(target, tmp_path):
    script = load_script(SCRIPT)
    first = run(script, target, tmp_path, "first")
    assert first["cache"]["regenerated_prompts"] == 8 and len(answer_files(tmp_path / "answers")) == 1
    assert first["trained"]["identical_to_target"]
    # What is committed: the drafter in float16 (recipes/ship_reference_drafter.py writes it so).
    shipped = tmp_path / "shipped"
    DSparkDrafter.from_pretrained(tmp_path / "first" / "drafter", target=target).save_pretrained(
        shipped, dtype=torch.float16
    )
    # A new machine: an empty cache, the committed answers replayed, the committed drafter as the start.
    second = run(script, target, tmp_path, "second", "--init-from", str(shipped))
    assert second["cache"]["regenerated_prompts"] == 0 and second["cache"]["replayed_prompts"] == 8
    assert len(answer_files(tmp_path / "answers")) == 1  # nothing new to write
    assert second["drafter_config"] == first["drafter_config"]  # the shape and vocabulary of the start
    assert second["untrained"]["tau"] == pytest.approx(first["trained"]["tau"], abs=0.3)  # the start: first's drafter
    assert second["trained"]["identical_to_target"]


def test_the_carry_plan_counts_the_working_tree_and_the_extra_paths(tmp_path):
    script = load_script(SCRIPT)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 1000)
    plan = script.carry_plan([tmp_path / "weights.bin"])
    assert plan["carried"] == {str(tmp_path / "weights.bin"): 1000}
    assert plan["tree"] > 2**20 and plan["total"] == plan["tree"] + 1000 and plan["limit"] == 64 * 2**20


def test_the_gpu_script_holds_out_the_sequences_its_answers_name(tmp_path):
    script = load_script(SCRIPT)
    argv = ["--target", "tiny:qwen2_5_vl", "--prompts", "p.jsonl", "--out", str(tmp_path / "o")]
    args = script.parse_args([*argv, "--answers", str(tmp_path)])
    assert script.heldout_options(args) == ("--eval-sequences", "32")
    (tmp_path / "eval-ids.txt").write_text("prompts:1#0\n")
    assert script.heldout_options(args) == ("--eval-ids", str(tmp_path / "eval-ids.txt"))
    committed = script.parse_args(argv)  # the 10x run's answers name chunk 1's held-out sequences
    assert script.gpu_options(committed)[-2:] == ["--eval-ids", str(committed.answers / "eval-ids.txt")]


def test_the_gpu_script_trains_on_the_answered_prompts_within_its_minutes(tmp_path):
    script = load_script(SCRIPT)
    argv = ["--target", "reference", "--prompts", "p.jsonl", "--out", str(tmp_path / "o")]
    options = script.gpu_options(script.parse_args(argv))
    # The committed answers cover REGENERATED_PROMPTS of the state file: nothing is regenerated on the GPU.
    state = dict(line.split("#")[0].strip().split("=") for line in script.STATE.read_text().splitlines() if "=" in line)
    assert options[options.index("--num-prompts") + 1] == state["REGENERATED_PROMPTS"]
    assert "--max-minutes" not in options
    timed = script.gpu_options(script.parse_args([*argv, "--max-minutes", "4.5"]))
    assert timed[timed.index("--max-minutes") + 1] == "4.5"
