"""The target cache: what it stores, round trip, resume after an interruption, refusal of a foreign cache."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest
import torch
from training_helpers import FEATURE_LAYERS, greedy_spec, tiny_drafter, write_cache

from vlmspec.engine import SpecEngine
from vlmspec.targets.inputs import TargetInputs
from vlmspec.training import (
    CacheSpec,
    GenerationConfig,
    PackedDataset,
    TargetCache,
    build_cache,
    estimate_cache_size,
    finalize_cache,
    open_cache_dir,
    pack_sequence,
    packed_hidden,
    regenerate_item,
    target_fingerprint,
)
from vlmspec.training.cache import select_rows
from vlmspec.training.cache_build import format_size
from vlmspec.training.packing import collate


def assert_same_sequence(a, b) -> None:
    assert a.id == b.id
    assert a.images == b.images
    for field in fields(a):
        if field.name not in ("id", "images"):
            left, right = getattr(a, field.name), getattr(b, field.name)
            assert left.dtype == right.dtype and torch.equal(left, right), field.name


def test_cache_holds_the_targets_own_answer_its_features_and_final_norm_states(target, prompts, small_cache):
    sequence = small_cache[0]
    item = next(p for p in prompts if f"{p.id}#0" == sequence.id)
    answer = sequence.input_ids[sequence.loss_mask]
    # The loss mask covers exactly the answer, which is what the target alone generates (greedy).
    alone = SpecEngine(target).generate(messages=item.messages, max_new_tokens=10, speculative=False)
    assert answer.tolist() == alone.token_ids
    start = int(sequence.loss_mask.nonzero()[0])
    assert not sequence.loss_mask[:start].any() and sequence.loss_mask[start:].all()
    # Features of hooked layers (never the last) and final-norm states match one full forward.
    ids = sequence.input_ids[None]
    inputs = TargetInputs(ids, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, num_images=0)
    features, last_hidden, positions = target.forward_sequence(inputs, FEATURE_LAYERS)
    assert torch.equal(sequence.feature_index, torch.arange(sequence.length - 1))
    assert torch.equal(sequence.hidden_index, torch.arange(start, sequence.length - 1))
    torch.testing.assert_close(sequence.features.float(), features[:-1].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(sequence.last_hidden.float(), last_hidden[start:-1].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(sequence.positions, positions)
    assert sequence.features.dtype == torch.bfloat16 and sequence.anchors.numel() == 0


def test_round_trip_reopens_identical_tensors_and_a_manifest(target, prompts, small_cache):
    spec = small_cache.spec
    expected = {}
    for item in prompts[:8]:
        for sequence in regenerate_item(target, item, spec.generation, spec.feature_layers, spec.position_rule):
            expected[sequence.id] = select_rows(sequence, spec)
    reopened = TargetCache(small_cache.directory)
    assert sorted(reopened.ids) == sorted(expected)
    for index, sequence_id in enumerate(reopened.ids):
        assert_same_sequence(reopened[index], expected[sequence_id])
    manifest = json.loads((small_cache.directory / "manifest.json").read_text())
    assert manifest["complete"] and manifest["counts"]["sequences"] == 8 and manifest["counts"]["shards"] == 2
    assert manifest["spec"]["feature_layers"] == list(FEATURE_LAYERS) and manifest["spec"]["dtype"] == "bfloat16"
    assert manifest["spec"]["target"]["vocab_size"] == target.vocab_size
    index = json.loads((small_cache.directory / "index.json").read_text())
    assert sum(len(shard["ids"]) for shard in index["shards"]) == 8


def test_an_interrupted_build_resumes_to_the_same_cache(target, prompts, small_cache, tmp_path):
    spec = small_cache.spec
    directory = tmp_path / "cache"
    open_cache_dir(directory, spec)

    def interrupt(number: int) -> None:
        if number == 4:  # five prompts done, shards of two committed, the fifth still in memory
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_cache(target, prompts[:8], directory, spec, shard_size=2, show_progress=False, on_item=interrupt)
    with pytest.raises(ValueError, match="incomplete"):
        TargetCache(directory)
    (directory / "shards" / ".tmp-r0-00009").mkdir()  # what a kill during a shard write leaves
    assert open_cache_dir(directory, spec) is True
    assert not list((directory / "shards").glob(".tmp-*"))
    report = build_cache(target, prompts[:8], directory, spec, shard_size=2, show_progress=False)
    assert report.prompts_skipped == 4 and report.prompts_done == 4
    finalize_cache(directory)
    resumed = TargetCache(directory)
    by_id = {small_cache.ids[i]: i for i in range(len(small_cache))}
    assert sorted(resumed.ids) == sorted(by_id)
    for index, sequence_id in enumerate(resumed.ids):
        assert_same_sequence(resumed[index], small_cache[by_id[sequence_id]])


def test_a_cache_built_for_another_target_or_settings_is_refused(target, small_cache):
    spec = small_cache.spec
    retrained = {**spec.target, "lm_head_sample": [x + 0.05 for x in spec.target["lm_head_sample"]]}
    with pytest.raises(ValueError, match="target weights differ"):  # same shape, other weights
        open_cache_dir(small_cache.directory, replace(spec, target=retrained))
    assert open_cache_dir(small_cache.directory, replace(spec, target=target_fingerprint(target))) is True
    with pytest.raises(ValueError, match="feature_layers"):
        open_cache_dir(small_cache.directory, replace(spec, feature_layers=(0, 2)))
    with pytest.raises(ValueError, match="generation"):
        open_cache_dir(small_cache.directory, replace(spec, generation=GenerationConfig(max_new_tokens=11)))
    with pytest.raises(ValueError, match="num_layers"):
        wider = {**spec.target, "num_layers": 8}
        open_cache_dir(small_cache.directory, replace(spec, target=wider))


def test_window_mode_keeps_only_anchor_windows_and_trains_the_same(target, prompts, small_cache, tmp_path):

    spec = greedy_spec(target, anchors_per_sequence=2, context_window=6, block_size=4)
    windows = write_cache(target, prompts[:8], tmp_path / "windows", spec)
    assert windows.manifest["counts"]["bytes"] < small_cache.manifest["counts"]["bytes"]
    drafter = tiny_drafter(target)
    full_by_id = {small_cache.ids[i]: i for i in range(len(small_cache))}
    for index in range(len(windows)):
        kept = windows[index]
        full = small_cache[full_by_id[kept.id]]
        anchors = kept.anchors
        assert anchors.numel() == 2 and torch.equal(kept.input_ids, full.input_ids)
        window_rows = {j for a in anchors.tolist() for j in range(max(0, a - 6), a)}
        assert set(kept.feature_index.tolist()) == window_rows
        rows = [pack_sequence(s, anchors, 4, context_window=6) for s in (kept, full)]
        hidden = [packed_hidden(drafter, collate([row]), "sdpa", context_window=6) for row in rows]
        torch.testing.assert_close(hidden[0], hidden[1])
        torch.testing.assert_close(rows[0].target_hidden, rows[1].target_hidden, atol=0, rtol=0)
    dataset = PackedDataset(windows, range(len(windows)), num_anchors=8, block_size=4)
    assert dataset[0].anchor_index.numel() == 2  # the cache's own anchors


def test_size_estimate_is_an_upper_bound(target, prompts, small_cache):
    estimate = estimate_cache_size(target, prompts[:8], small_cache.spec)
    assert estimate.sequences == 8
    assert small_cache.manifest["counts"]["bytes"] <= estimate.bytes < 3 * small_cache.manifest["counts"]["bytes"]
    assert "at most 0.00" not in estimate.describe() and "iB" in estimate.describe()


def test_sizes_are_printed_in_a_unit_that_shows_them():
    assert [format_size(n) for n in (0, 999, 4096, 5 * 2**20 + 2**19, 3 * 2**30)] == [
        "0 B",
        "999 B",
        "4.0 KiB",
        "5.5 MiB",
        "3.0 GiB",
    ]


def test_bad_cache_specs_and_directories_are_refused(target, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        CacheSpec(target_fingerprint(target), FEATURE_LAYERS, "interpolate", "float32")
    with pytest.raises(ValueError, match="window mode"):
        CacheSpec(target_fingerprint(target), FEATURE_LAYERS, "interpolate", anchors_per_sequence=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=1)
    (tmp_path / "stuff.txt").write_text("not a cache")
    with pytest.raises(ValueError, match="not empty"):
        open_cache_dir(tmp_path, greedy_spec(target))
    with pytest.raises(ValueError, match="not a vlmspec target cache"):
        TargetCache(tmp_path)
