"""A CPU smoke run of recipes/train_qwen3vl.py on a tiny target.

On a tiny random target the informative signal is the target's own greedy output: random
models fall into short loops, and tokens that follow each other in one answer often
follow each other in others. The recipe regenerates greedy answers to 24 GSM8K prompts,
trains a tiny drafter on them, and measures greedy tau on 3 held-out prompts through
SpecEngine before and after training; the output must stay identical to the target
alone. The near-uniform distributions of a random target teach little through the TV
term; what transfers to held-out prompts is the bigram structure, which the Markov head
picks up only after each pair was seen several times: many small steps at a high
learning rate beat fewer large ones for the same compute.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from training_helpers import GSM8K_MINI

from vlmspec.engine import SpecEngine
from vlmspec.scheduling.calibration import Calibration

RECIPE = Path(__file__).parents[2] / "recipes" / "train_qwen3vl.py"
LEARNING_CURVE = Path(__file__).parents[2] / "recipes" / "learning_curve.py"


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_recipe():
    return load_script(RECIPE)


SMOKE = [
    "--target",
    "tiny:qwen2_5_vl",
    "--prompts",
    str(GSM8K_MINI),
    "--num-prompts",
    "24",
    "--heldout-prompts",
    "4",
    "--max-new-tokens",
    "32",
    "--temperature",
    "0",
    "--feature-layers",
    "1,2",
    "--draft-hidden",
    "64",
    "--draft-layers",
    "1",
    "--draft-heads",
    "4",
    "--draft-head-dim",
    "16",
    "--draft-intermediate",
    "128",
    "--head-rank",
    "32",
    "--block-size",
    "4",
    "--steps",
    "60",
    "--batch-size",
    "1",
    "--num-anchors",
    "8",
    "--lr",
    "0.1",
    "--warmup-ratio",
    "0.1",
    "--eval-every",
    "30",
    "--draft-vocab",
    "4000",
    "--regen-batch-size",
    "8",
    "--save-every",
    "0",
    "--eval-sequences",
    "3",
    "--log-every",
    "10",
    "--eval-max-new-tokens",
    "32",
]


def test_recipe_smoke_run_trains_a_drafter_that_beats_the_untrained_one(target, tmp_path):
    recipe = load_recipe()
    out = tmp_path / "run"
    report = recipe.main([*SMOKE, "--out", str(out)], target=target)
    training = report["training"]
    assert training["last_loss"] < training["first_loss"]
    losses = [
        json.loads(line)["loss"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["split"] == "train"
    ]
    assert losses[-1] < losses[0]
    untrained, trained = report["untrained"], report["trained"]
    assert untrained["identical_to_target"] and trained["identical_to_target"]
    assert trained["tau"] > untrained["tau"] + 0.05, (trained["tau"], untrained["tau"])
    # the drafter, its calibration and a loadable target
    assert Calibration.load(out / "drafter").gamma == 4
    engine = SpecEngine.from_pretrained(out / "target", drafter=out / "drafter")
    alone = engine.generate(None, "What is 2 + 3?", max_new_tokens=8, speculative=False)
    assert engine.generate(None, "What is 2 + 3?", max_new_tokens=8).token_ids == alone.token_ids
    saved = json.loads((out / "report.json").read_text())
    assert saved["trained"]["tau"] == trained["tau"] and saved["cache"]["sequences"] == 24
    # the reduced draft vocabulary: the most frequent answer ids, EOS included, stored with the drafter
    assert report["draft_vocabulary"]["size"] == 4000 and report["draft_vocabulary"]["answer_token_coverage"] > 0.99
    assert set(target.eos_token_ids) <= set(engine.proposer.drafter.draft_token_ids.tolist())
    # the learning curve of the run: evaluations at steps 30 and 60
    curve = load_script(LEARNING_CURVE).main(["--run", str(out), "--out", str(tmp_path / "curve")])["run"]
    assert curve["steps"] == [30, 60] and curve["train_tokens"][0] < curve["train_tokens"][1]
    assert len(curve["top1_by_position"][0]) == 4 and curve["heldout_free_running"]["tau"] == trained["tau"]
    assert {p.name for p in (tmp_path / "curve").iterdir()} >= {"learning_curve.json", "learning_curve_tau.png"}
    # a warm-started chunk continues that curve: its tokens start where the earlier run's ended
    chunk = ["--run", str(out), "--name", "chunk", "--start-tokens", str(curve["train_tokens"][-1])]
    extended = load_script(LEARNING_CURVE).main(
        ["--previous", str(tmp_path / "curve" / "learning_curve.json"), *chunk, "--out", str(tmp_path / "curve2")]
    )
    assert list(extended) == ["run", "chunk"] and extended["chunk"]["train_tokens"][0] > curve["train_tokens"][-1]
    # running again reuses the cache and resumes from the final checkpoint: nothing to redo
    again = recipe.main([*SMOKE, "--out", str(out), "--skip-untrained-eval"], target=target)
    assert again["cache"]["regenerated_prompts"] == 0 and again["training"]["steps"] == 60


def test_recipe_defaults_are_the_papers():
    args = load_recipe().parse_args(["--target", "t", "--prompts", "p.jsonl", "--out", "o"])
    assert (args.block_size, args.draft_layers, args.head, args.head_rank) == (7, 2, "vanilla", 256)
    assert not args.no_confidence_head and not args.confidence_without_markov
    assert (args.lr, args.warmup_ratio, args.loss_weights, args.loss_decay) == (6e-4, 0.04, "0.1,0.9,1.0", 4.0)
    assert (args.temperature, args.top_p, args.top_k) == (0.7, 0.8, 20)


def test_recipe_refuses_a_checkpoint_of_another_drafter_shape(target, tmp_path):
    recipe = load_recipe()
    config = recipe.drafter_config(recipe.parse_args([*SMOKE, "--out", str(tmp_path)]), target)
    other = recipe.drafter_config(recipe.parse_args([*SMOKE, "--out", str(tmp_path), "--head-rank", "16"]), target)
    checkpoint = tmp_path / "checkpoints" / "step-0000001"
    other.save((checkpoint / "drafter").mkdir(parents=True) or checkpoint / "drafter")
    with pytest.raises(ValueError, match="another shape"):
        recipe.resume_point(recipe.parse_args([*SMOKE, "--out", str(tmp_path)]), tmp_path, config)


def test_recipe_refuses_bad_options_before_loading_the_target(tmp_path):
    recipe = load_recipe()
    with pytest.raises(ValueError, match="does not exist"):
        recipe.main(
            ["--target", "tiny:qwen2_vl", "--prompts", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]
        )
    with pytest.raises(ValueError, match="--loss-weights"):
        recipe.main(
            [
                "--target",
                "tiny:qwen2_vl",
                "--prompts",
                str(GSM8K_MINI),
                "--out",
                str(tmp_path / "o"),
                "--loss-weights",
                "1,2",
            ]
        )
    assert not (tmp_path / "o").exists()
