"""Committed answers: a tokens-only cache rebuilt from them equals the regenerated one, without generating."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from training_helpers import greedy_spec, write_cache

from vlmspec.training import cache_build, read_prompts
from vlmspec.training.answers import answer_files, answers_meta, cached_answers, load_answers, save_answers


@pytest.fixture(scope="module")
def two_turn_items(prompts, tmp_path_factory):
    """Two GSM8K prompts and one with a second turn (answered after the target's own first answer)."""
    path = tmp_path_factory.mktemp("prompts") / "turns.jsonl"
    path.write_text('{"turns": ["Name a colour.", "Now another one."]}\n')
    return [*prompts[:2], *read_prompts(path)]


def tokens_spec(target):
    return dataclasses.replace(greedy_spec(target, max_new_tokens=8), feature_layers=(), contents="tokens")


def test_a_cache_replayed_from_saved_answers_equals_the_regenerated_one(target, two_turn_items, tmp_path, monkeypatch):
    spec = tokens_spec(target)
    regenerated = write_cache(target, two_turn_items, tmp_path / "regenerated", spec)
    answers = cached_answers(regenerated)
    assert sorted(answers)[-2:] == ["turns:1#0", "turns:1#1"]  # both turns of the two-turn prompt
    save_answers(tmp_path / "answers" / "answers-00000.npz", answers, answers_meta(spec))
    stored = load_answers(answer_files(tmp_path / "answers"), answers_meta(spec))
    assert stored == answers

    def no_generation(target, items, *args, **kwargs):
        assert not items, f"{[item.id for item in items]} were regenerated although their answers were stored"
        return []

    monkeypatch.setattr(cache_build, "regenerate_items", no_generation)
    replayed = write_cache(target, two_turn_items, tmp_path / "replayed", spec, answers=stored)
    assert replayed.ids == regenerated.ids
    for index in range(len(regenerated)):
        a, b = regenerated[index], replayed[index]
        for name in ("input_ids", "loss_mask", "positions"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (a.id, name)


def test_answers_of_other_settings_are_refused(target, tmp_path):
    spec = tokens_spec(target)
    path = save_answers(tmp_path / "answers-00000.npz", {"p:0#0": [1, 2, 3]}, answers_meta(spec))
    other = dataclasses.replace(spec, generation=dataclasses.replace(spec.generation, max_new_tokens=9))
    with pytest.raises(ValueError, match="other generation settings"):
        load_answers([path], answers_meta(other))
    assert load_answers([path], answers_meta(spec)) == {"p:0#0": [1, 2, 3]}


def test_regeneration_in_stages_commits_one_answers_file_a_stage(target, tmp_path):
    """What recipes/continue_10x.sh does: each stage answers more prompts; a new machine replays them all."""
    from test_train_recipe import load_recipe
    from training_helpers import GSM8K_MINI

    recipe = load_recipe()
    options = [
        *("--target", "tiny:qwen2_5_vl", "--prompts", str(GSM8K_MINI), "--heldout-prompts", "2"),
        *("--max-new-tokens", "6", "--temperature", "0", "--cache-contents", "tokens", "--cache-only"),
        *("--answers", str(tmp_path / "answers"), "--out", str(tmp_path / "out")),
    ]
    first = recipe.main([*options, "--num-prompts", "3", "--cache", str(tmp_path / "cache")], target=target)
    second = recipe.main([*options, "--num-prompts", "5", "--cache", str(tmp_path / "cache")], target=target)
    assert (first["cache"]["regenerated_prompts"], second["cache"]["regenerated_prompts"]) == (3, 2)
    files = answer_files(tmp_path / "answers")
    assert [len(load_answers([f])) for f in files] == [3, 2]
    elsewhere = recipe.main([*options, "--num-prompts", "5", "--cache", str(tmp_path / "new-cache")], target=target)
    assert elsewhere["cache"]["regenerated_prompts"] == 0 and elsewhere["cache"]["replayed_prompts"] == 5
    assert len(answer_files(tmp_path / "answers")) == 2
