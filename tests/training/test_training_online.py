"""Tokens-only caches regenerated through the runner, and the online features training reads from them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image
from training_helpers import FEATURE_LAYERS, greedy_spec, tiny_drafter, write_cache

from vlmspec.training import TrainConfig, Trainer, latest_checkpoint
from vlmspec.training.cache import CacheSpec
from vlmspec.training.online import OnlineFeatures
from vlmspec.training.prompts import PromptItem


def tokens_spec(target, max_new_tokens: int = 10) -> CacheSpec:
    return dataclasses.replace(greedy_spec(target, max_new_tokens), feature_layers=(), contents="tokens")


def mixed_items(image_path: str) -> list[PromptItem]:
    """Text prompts, two with an image and one with a second turn."""
    items = []
    for i in range(5):
        if i % 2:
            content = [{"type": "image"}, {"type": "text", "text": f"Describe picture {i}."}]
            items.append(PromptItem(f"mix:{i}", [{"role": "user", "content": content}], [image_path]))
        else:
            followups = ["And then?"] if i == 2 else []
            items.append(PromptItem(f"mix:{i}", [{"role": "user", "content": f"Count to {i + 3}."}], [], followups))
    return items


@pytest.fixture(scope="module")
def image_path(tmp_path_factory) -> str:
    pixels = (np.random.default_rng(0).random((56, 84, 3)) * 255).astype(np.uint8)
    path = tmp_path_factory.mktemp("images") / "picture.png"
    Image.fromarray(pixels).save(path)
    return str(path)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_online_features_equal_the_stored_ones(make_target, family, image_path, tmp_path):
    """Same tokens from the runner as from left-padded batches; the same features from a forward over the ids."""
    target = make_target(family)
    items = mixed_items(image_path)
    stored = write_cache(target, items, tmp_path / "features", greedy_spec(target), batch_size=3)
    tokens = write_cache(target, items, tmp_path / "tokens", tokens_spec(target), batch_size=3)
    online = OnlineFeatures(tokens, target, FEATURE_LAYERS)
    assert sorted(online.ids) == sorted(stored.ids) and len(online) == 6  # the two-turn prompt gives two
    for index, sequence_id in enumerate(online.ids):
        expected, got = stored[stored.ids.index(sequence_id)], online[index]
        for name in ("input_ids", "loss_mask", "positions", "feature_index", "hidden_index"):
            assert torch.equal(getattr(expected, name), getattr(got, name)), (sequence_id, name)
        # decode-time capture against one forward over the sequence: equal up to bf16 storage rounding
        torch.testing.assert_close(got.features.float(), expected.features.float(), rtol=1.6e-2, atol=1e-3)
        torch.testing.assert_close(got.last_hidden.float(), expected.last_hidden.float(), rtol=1.6e-2, atol=1e-3)
        assert got.images == ((image_path,) if "mix:1" in sequence_id or "mix:3" in sequence_id else ())
    assert online.spec.feature_layers == FEATURE_LAYERS and online.spec.stores_features


def test_a_tokens_only_cache_stores_nine_bytes_a_token(target, prompts, tmp_path):
    cache = write_cache(target, prompts[:4], tmp_path / "tokens", tokens_spec(target))
    counts = cache.manifest["counts"]
    assert counts["bytes"] == 9 * counts["tokens"]
    assert cache[0].features.shape == (0, 0) and cache[0].last_hidden.shape[0] == 0


def test_online_features_refuse_what_they_cannot_serve(target, make_target, small_cache, prompts, tmp_path):
    with pytest.raises(ValueError, match="stores its features already"):
        OnlineFeatures(small_cache, target, FEATURE_LAYERS)
    tokens = write_cache(target, prompts[:2], tmp_path / "tokens", tokens_spec(target))
    with pytest.raises(ValueError, match="another target"):
        OnlineFeatures(tokens, make_target("qwen2_vl"), FEATURE_LAYERS)
    with pytest.raises(ValueError, match="feature layer"):
        OnlineFeatures(tokens, target, (target.num_layers - 1,))
    with pytest.raises(ValueError, match="names no feature layers"):
        dataclasses.replace(tokens_spec(target), feature_layers=(0,))


def test_training_on_online_features_resumes_exactly(target, prompts, tmp_path):
    """An interrupted run on online features continues with the losses of an uninterrupted one."""
    cache = write_cache(target, prompts[:6], tmp_path / "tokens", tokens_spec(target))
    data = OnlineFeatures(cache, target, FEATURE_LAYERS)
    config = TrainConfig(
        steps=4, batch_size=2, num_anchors=3, lr=3e-3, eval_every=0, save_every=2, log_every=1, chunk_tokens=8
    )
    Trainer(tiny_drafter(target), data, tmp_path / "straight", config).train()
    Trainer(tiny_drafter(target), data, tmp_path / "resumed", config).train(until=2)
    resumed = Trainer(tiny_drafter(target, seed=7), data, tmp_path / "resumed", config)
    resumed.train(resume_from=latest_checkpoint(tmp_path / "resumed"))

    def losses(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["split"] == "train"}

    expected, got = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
