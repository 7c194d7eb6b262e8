"""Prompt sources (JSONL turns, JSONL messages with images, MMBench TSV) and regeneration with images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from training_helpers import FEATURE_LAYERS, GSM8K_MINI

from vlmspec.training import (
    GenerationConfig,
    load_prompt_sources,
    read_prompts,
    regenerate_item,
    regenerate_items,
    split_prompts,
)

MMBENCH = Path(__file__).parents[1] / "fixtures" / "mmbench_mini.tsv"


def test_turns_jsonl():
    items = read_prompts(GSM8K_MINI)
    assert len(items) == 48 and items[0].id == "gsm8k-mini:1"
    assert items[0].messages[0]["role"] == "user" and items[0].num_turns == 1
    assert "Janet" in items[0].messages[0]["content"][-1]["text"]


def test_messages_jsonl_with_images_and_multi_turn(tmp_path, astronaut):
    astronaut.resize((64, 64)).save(tmp_path / "astronaut.png")
    lines = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Who is this?"}]},
                {"role": "assistant", "content": "an old answer, regenerated"},
            ],
            "images": ["astronaut.png"],
        },
        {"turns": ["Name a colour.", "Now another one."]},
    ]
    (tmp_path / "mixed.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    first, second = read_prompts(tmp_path / "mixed.jsonl")
    assert [m["role"] for m in first.messages] == ["user"]  # the trailing assistant answer is dropped
    assert first.images == [str(tmp_path / "astronaut.png")]
    assert second.followups == ["Now another one."] and second.num_turns == 2


def test_mmbench_tsv(target):
    items = read_prompts(MMBENCH)
    assert items and all(len(item.images) == 1 and isinstance(item.images[0], bytes) for item in items)
    text = items[0].messages[0]["content"][-1]["text"]
    assert "Question:" in text and "A. " in text and text.endswith("directly.")
    inputs = target.build_inputs(items[0].images, messages=items[0].messages)
    assert inputs.num_images == 1


def test_an_unusable_mmbench_row_stops_with_its_line_and_reason(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("index\tquestion\tA\tB\timage\n1\tWhich?\tred\tblue\tnot base64!\n")
    with pytest.raises(ValueError, match="bad.tsv:2: row index 1: the image cell is not valid base64"):
        read_prompts(path)


def test_regeneration_with_an_image_and_a_second_turn(make_target, tmp_path, astronaut):
    target = make_target("qwen2_vl")
    astronaut.resize((64, 64)).save(tmp_path / "a.png")
    line = {"turns": ["Describe it.", "Shorter."], "images": ["a.png"]}
    (tmp_path / "p.jsonl").write_text(json.dumps(line) + "\n")
    (item,) = read_prompts(tmp_path / "p.jsonl")
    config = GenerationConfig(max_new_tokens=3, temperature=0.7, top_p=0.8, top_k=20, seed=1)
    first, second = regenerate_item(target, item, config, FEATURE_LAYERS, "interpolate")
    assert first.id.endswith("#0") and second.id.endswith("#1")
    for sequence in (first, second):
        assert sequence.features.shape == (sequence.length - 1, len(FEATURE_LAYERS) * target.hidden_size)
        assert sequence.last_hidden.shape[0] == sequence.length - 1 - sequence.answer_start
        assert bool((sequence.positions[1:] >= sequence.positions[:-1]).all())  # 1-D positions never decrease
    # image tokens share the M-RoPE span: the text stream is shorter than the token count
    assert int(first.positions[-1]) < first.length - 1
    # the second turn's prompt holds the first answer (as text) and the follow-up
    assert second.answer_start > first.length
    again = regenerate_item(target, item, config, FEATURE_LAYERS, "interpolate")
    assert torch.equal(again[1].input_ids, second.input_ids)  # seeded per prompt and turn: reproducible


def test_split_is_seeded_and_disjoint():
    items = load_prompt_sources([GSM8K_MINI])
    train, heldout = split_prompts(items, 10, 4, seed=3)
    assert len(train) == 10 and len(heldout) == 4
    assert not {i.id for i in train} & {i.id for i in heldout}
    assert [i.id for i in split_prompts(items, 10, 4, seed=3)[1]] == [i.id for i in heldout]
    with pytest.raises(ValueError, match="held out"):
        split_prompts(items[:3], None, 3, seed=0)


def test_bad_prompt_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"turns": ["ok"]}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
        read_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "odd.jsonl").write_text('{"question": "no turns"}\n')
    with pytest.raises(ValueError, match='needs "turns"'):
        read_prompts(tmp_path / "odd.jsonl")
    (tmp_path / "image.jsonl").write_text('{"turns": ["hi"], "images": ["nowhere.png"]}\n')
    with pytest.raises(ValueError, match="not found"):
        read_prompts(tmp_path / "image.jsonl")
    (tmp_path / "prompts.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="unknown prompt format"):
        read_prompts(tmp_path / "prompts.txt")
    with pytest.raises(ValueError, match="at least one --prompts"):
        load_prompt_sources([])


def test_batched_regeneration_equals_one_prompt_at_a_time(make_target, tmp_path, astronaut):
    """Every sequence of a batch (images, second turns, rows that end early) is the one regenerated alone."""
    target = make_target("qwen2_vl")
    astronaut.resize((64, 64)).save(tmp_path / "a.png")
    lines = [
        {"turns": ["Describe it.", "Shorter."], "images": ["a.png"]},
        {"turns": ["Hi"]},
        {"turns": ["Name a colour.", "Another."]},
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    items = read_prompts(tmp_path / "p.jsonl")
    config = GenerationConfig(max_new_tokens=5, temperature=0.7, top_p=0.8, top_k=20, seed=2)
    batched = regenerate_items(target, items, config, FEATURE_LAYERS, "interpolate")
    alone = [
        sequence for item in items for sequence in regenerate_item(target, item, config, FEATURE_LAYERS, "interpolate")
    ]
    assert [s.id for s in batched] == [s.id for s in alone] and len(batched) == 5
    for mine, theirs in zip(batched, alone):
        assert torch.equal(mine.input_ids, theirs.input_ids) and torch.equal(mine.positions, theirs.positions)
        torch.testing.assert_close(mine.features, theirs.features, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.last_hidden, theirs.last_hidden, atol=1e-4, rtol=1e-4)
