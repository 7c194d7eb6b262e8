"""TextDeltas: pieces of a growing answer that never change once handed out."""

from __future__ import annotations

import pytest
import torch

from vlmspec.serving.text import TextDeltas


def pieces(tokenizer, token_ids, stop=(), step=1):
    deltas = TextDeltas(tokenizer, stop)
    out = [deltas.add(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]
    out.append(deltas.close())
    return out, deltas


def test_pieces_join_to_the_decoded_text_and_are_whole_characters(tokenizer):
    text = "Café ☕ und 東京タワー — naïve 🚀 emoji."
    token_ids = tokenizer.encode(text)
    out, deltas = pieces(tokenizer, token_ids)
    assert "".join(out) == deltas.text == tokenizer.decode(token_ids)
    assert not any("\ufffd" in piece for piece in out)  # multi-byte characters split over tokens wait whole


@pytest.mark.parametrize("step", [1, 3])
def test_the_answer_stops_before_a_stop_string_and_never_shows_part_of_it(tokenizer, step):
    text = "The answer is 42.\n\nSources: none."
    token_ids = tokenizer.encode(text)
    out, deltas = pieces(tokenizer, token_ids, stop=["\n\nSources", "never appears"], step=step)
    assert "".join(out) == deltas.text == "The answer is 42."
    shown = ""
    for piece in out:
        shown += piece
        assert "\n" not in shown  # the start of the stop string was held back, then dropped


def test_text_that_only_looked_like_a_stop_string_comes_out_at_the_end(tokenizer):
    token_ids = tokenizer.encode("Wait for it: STO")
    out, deltas = pieces(tokenizer, token_ids, stop=["STOP"])
    assert not out[-2].endswith("STO")  # held back while it could become "STOP"
    assert "".join(out) == deltas.text == "Wait for it: STO"
    assert len(deltas) == len(token_ids)


@pytest.mark.parametrize("step", [1, 5])
def test_incremental_decoding_equals_decoding_everything_at_once(tokenizer, step):
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, 151_000, (400,), generator=generator).tolist()  # byte tokens, CJK, emoji pieces...
    out, deltas = pieces(tokenizer, token_ids, step=step)
    assert "".join(out) == deltas.text == tokenizer.decode(token_ids)
