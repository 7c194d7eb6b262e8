"""The accelerate trainer: exact resume, only the drafter trains, checkpoints, metrics, schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from training_helpers import tiny_drafter

from vlmspec.drafters.dspark import DSparkDrafter
from vlmspec.training import TrainConfig, Trainer, latest_checkpoint
from vlmspec.training.schedule import warmup_cosine
from vlmspec.training.trainer import heldout_split


def config(**overrides) -> TrainConfig:
    options = dict(
        steps=6,
        batch_size=2,
        num_anchors=3,
        lr=3e-3,
        warmup_ratio=0.2,
        eval_every=3,
        eval_sequences=2,
        save_every=3,
        log_every=1,
        chunk_tokens=8,
    )
    return TrainConfig(**{**options, **overrides})


def train_records(directory) -> list[dict]:
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def test_resuming_from_a_checkpoint_continues_with_the_same_losses(target, small_cache, tmp_path):
    straight = Trainer(tiny_drafter(target), small_cache, tmp_path / "straight", config())
    straight.train()
    interrupted = Trainer(tiny_drafter(target), small_cache, tmp_path / "resumed", config())
    interrupted.train(until=3)
    checkpoint = latest_checkpoint(tmp_path / "resumed")
    assert checkpoint.name == "step-0000003" and (checkpoint / "model.safetensors").is_file()
    # a new process: a freshly initialised drafter, then the checkpoint restores everything
    resumed = Trainer(tiny_drafter(target, seed=123), small_cache, tmp_path / "resumed", config())
    resumed.train(resume_from=checkpoint)
    expected = {r["step"]: r["loss"] for r in train_records(tmp_path / "straight")}
    got = {r["step"]: r["loss"] for r in train_records(tmp_path / "resumed")}
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4, 5, 6]
    for step in range(4, 7):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    runs = (tmp_path / "straight", tmp_path / "resumed")
    final = [DSparkDrafter.from_pretrained(run / "drafter", target=target) for run in runs]
    for (name, a), b in zip(final[0].state_dict().items(), final[1].state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_only_the_drafter_trains_and_metrics_are_logged(target, small_cache, tmp_path):
    head_before = target.output_head.weight.detach().clone()
    embedding_before = target.input_embeddings.weight.detach().clone()
    drafter = tiny_drafter(target)
    trainer = Trainer(drafter, small_cache, tmp_path, config(steps=3, save_every=0))
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in drafter.parameters()}
    summary = trainer.train()
    assert torch.equal(target.output_head.weight, head_before)
    assert torch.equal(target.input_embeddings.weight, embedding_before)
    assert not target.output_head.weight.requires_grad
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluation = [r for r in records if r["split"] == "eval"]
    assert evaluation and len(evaluation[-1]["acceptance_by_position"]) == drafter.block_size
    assert 1.0 <= evaluation[-1]["expected_tau"] <= 1 + drafter.block_size
    assert summary.blocks > 0 and summary.blocks_per_second > 0 and summary.peak_memory_mb > 0
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    DSparkDrafter.from_pretrained(tmp_path / "drafter", target=target)


def test_warmup_then_cosine():
    values = [warmup_cosine(step, total=100, warmup=4, min_ratio=0.1) for step in range(100)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == pytest.approx(1.0) and values[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))


def test_bad_training_options_are_refused(target, small_cache, tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="mixed_precision"):
        TrainConfig(mixed_precision="fp8")
    trainer = Trainer(tiny_drafter(target), small_cache, tmp_path, config(steps=1))
    with pytest.raises(ValueError, match="not a training checkpoint"):
        trainer.load_checkpoint(tmp_path)


def test_heldout_split_by_ids_is_stable_as_the_cache_grows():
    first = [f"prompts:{i}#0" for i in range(40)] + ["prompts:3#1"]
    held = ("prompts:3#0", "prompts:17#0")
    grown = ["prompts:99#0", *reversed(first), "prompts:41#0"]  # more answers, another order
    for ids in (first, grown):
        train, evaluation = heldout_split(ids, 32, 0, held)
        assert [ids[i] for i in evaluation] == list(held)  # the named ones, in the named order
        names = {ids[i] for i in train}
        assert not names & {"prompts:3#0", "prompts:3#1", "prompts:17#0"}  # nor their other turns
        assert len(train) == len(ids) - 3
    with pytest.raises(ValueError, match="not in the cache"):
        heldout_split(first, 32, 0, ("prompts:77#0",))


def test_heldout_split_without_ids_is_seeded_and_at_most_a_fifth():
    ids = [f"s{i}" for i in range(20)]
    train, evaluation = heldout_split(ids, 32, 0)
    assert len(evaluation) == 4 and sorted(train + evaluation) == list(range(20))
    assert heldout_split(ids, 32, 0) == (train, evaluation) != heldout_split(ids, 32, 1)


def test_the_10x_runs_held_out_sequences_are_named_once():
    ids = (Path(__file__).parents[2] / "recipes/data/reference-10x/eval-ids.txt").read_text().split()
    assert len(ids) == len(set(ids)) == 32 and all(i.startswith("prompts:") and "#" in i for i in ids)


def test_a_wall_clock_budget_shortens_the_schedule_and_still_finishes_it(target, small_cache, tmp_path):
    # A budget long spent by the first step: the schedule ends there, with its final evaluation and drafter.
    trainer = Trainer(tiny_drafter(target), small_cache, tmp_path, config(steps=40, save_every=0, max_minutes=1e-9))
    summary = trainer.train()
    assert summary.steps == 1 and summary.planned_steps == 40 and summary.final_eval
    assert trainer.config.steps == 1  # the schedule's length: the learning rate decays by the new last step
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="max_minutes"):
        TrainConfig(max_minutes=0)


def test_the_budget_times_the_pace_after_the_warm_up_steps_and_fits_the_steps_to_the_deadline():
    from vlmspec.training.schedule import PACE_SKIP_STEPS, PACE_STEPS, TimeBudget

    clock = iter([0.0]).__next__
    budget = TimeBudget(minutes=1.0, start_step=0, planned_steps=1000, clock=clock)  # deadline at 60 s
    # Slow first steps (compilation) are not the pace: 10 s until the mark, then 0.5 s a step.
    assert budget.steps_that_fit(PACE_SKIP_STEPS, now=10.0) is None
    assert budget.steps_that_fit(PACE_SKIP_STEPS + 1, now=10.5) is None
    fits = budget.steps_that_fit(PACE_SKIP_STEPS + PACE_STEPS, now=10.0 + 0.5 * PACE_STEPS)
    assert budget.seconds_a_step == pytest.approx(0.5)
    assert fits == PACE_SKIP_STEPS + PACE_STEPS + int((60 - 10 - 0.5 * PACE_STEPS) / 0.5)
    assert budget.steps_that_fit(10_000, now=61.0) == 10_000  # past the deadline: stop now
