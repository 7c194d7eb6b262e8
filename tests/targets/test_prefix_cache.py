"""Prefix caching and pieces of prompts in the runner: a hit or a chunked prefill gives what a whole cold prefill gives."""

import pytest
import torch

from vlmspec.kernels import cpu_kernels
from vlmspec.targets import QwenVLTarget
from vlmspec.targets.prefix_keys import RowContent
from vlmspec.targets.ragged import RaggedBatch

LAYERS = (0, 2)
SIZE = 16  # the pool's block size


def image_prompt(target, picture, question="Describe the picture in detail, please."):
    return target.row_prompt(target.build_inputs(picture, question))


def follow_up(target, picture, first, second):
    """A second turn: the first question, an answer and a new question about the same picture."""
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": first}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A person in a white suit stands there."}]},
        {"role": "user", "content": [{"type": "text", "text": second}]},
    ]
    return target.row_prompt(target.build_inputs(picture, messages=messages))


def assert_same_step(warm, cold):
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(warm.features, cold.features, atol=1e-4, rtol=1e-4)
    assert torch.equal(warm.positions, cold.positions)


def test_block_keys_follow_tokens_positions_and_image_content(make_target, astronaut):
    target = make_target("qwen2_5_vl")
    picture = astronaut.resize((64, 64))
    other = astronaut.transpose(0).resize((64, 64))  # mirrored: same size, same placeholders, other pixels
    prompt, same, different = (image_prompt(target, p) for p in (picture, picture, other))
    assert torch.equal(prompt.ids, different.ids) and torch.equal(prompt.mrope, different.mrope)
    keys = [RowContent(p, SIZE).keys_within(p.length) for p in (prompt, same, different)]
    assert keys[0] == keys[1]
    first_image_block = int(prompt.vision.index[0]) // SIZE
    assert keys[0][:first_image_block] == keys[2][:first_image_block]  # the text before the picture
    assert all(a != b for a, b in zip(keys[0][first_image_block:], keys[2][first_image_block:], strict=True))


def test_generated_tokens_key_their_blocks_at_their_positions(make_target):
    target = make_target("qwen2_vl")
    prompt = target.row_prompt(target.build_inputs(None, "Count from one to twenty."))
    generated = list(range(100, 100 + 3 * SIZE))
    content = RowContent(prompt, SIZE)
    content.extend(generated)
    whole = torch.cat((prompt.ids, torch.tensor(generated)))
    as_prompt = RowContent(target.row_prompt(target.build_inputs(None, "Count from one to twenty.")), SIZE)
    as_prompt._ids = whole.numpy()  # the same tokens, all given as a prompt (text: position i everywhere)
    as_prompt._positions = torch.arange(whole.numel()).expand(3, -1).numpy()
    as_prompt._prompt_length = whole.numel()
    assert content.keys_within(content.length) == as_prompt.keys_within(whole.numel())


def test_a_follow_up_turn_reuses_the_first_turns_blocks(make_target, family, astronaut):
    """Turn two computes only what turn one did not: same logits and features as a cold prefill, images included."""
    target = make_target(family)
    picture = astronaut.resize((64, 64))
    first = follow_up(target, picture, "What is it?", "And the colours?")
    turn_one = image_prompt(target, picture, "What is it?")
    warm_batch = RaggedBatch(target, feature_layers=LAYERS, prefix_caching=True)
    warm_batch.prefill([turn_one])
    warm_batch.remove(0)  # its blocks stay cached, idle
    assert warm_batch.pool.num_used == 0 and warm_batch.prefix_cache["idle_blocks"] == turn_one.length // SIZE
    (warm,) = warm_batch.prefill([first])
    (cold,) = RaggedBatch(target, feature_layers=LAYERS).prefill([first])
    assert_same_step(warm, cold)
    shared = min(turn_one.length, first.length - 1) // SIZE  # turn two starts with turn one's tokens
    assert warm_batch.prefix_cache["hit_tokens"] >= shared * SIZE > 0


def test_a_different_picture_of_the_same_size_misses(make_target, astronaut):
    target = make_target("qwen2_5_vl")
    picture = astronaut.resize((64, 64))
    other = astronaut.transpose(0).resize((64, 64))
    batch = RaggedBatch(target, feature_layers=LAYERS, prefix_caching=True)
    batch.prefill([image_prompt(target, picture)])
    prompt = image_prompt(target, other)
    (start,) = batch.open([prompt])
    assert start == int(prompt.vision.index[0]) // SIZE * SIZE  # only the blocks before the picture
    (warm,) = batch.extend([1], [prompt.piece(start)])
    (cold,) = RaggedBatch(target, feature_layers=LAYERS).prefill([prompt])
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batch.features_of(1, prompt.length), cold.features, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [5, SIZE, 23])
def test_a_prompt_prefilled_in_chunks_equals_it_prefilled_whole(make_target, family, astronaut, chunk):
    """Chunks cut anywhere, through the picture's placeholders too, beside another row's own chunks."""
    target = make_target(family)
    prompts = [image_prompt(target, astronaut.resize((64, 64))), target.row_prompt(target.build_inputs(None, "Hi"))]
    colds = RaggedBatch(target, feature_layers=LAYERS).prefill(prompts)
    batch = RaggedBatch(target, feature_layers=LAYERS)
    assert batch.open(prompts) == [0, 0]
    done, last = [0, 0], [None, None]
    while any(d < p.length for d, p in zip(done, prompts, strict=True)):
        rows = [r for r in range(2) if done[r] < prompts[r].length]
        pieces = [prompts[r].piece(done[r], min(done[r] + chunk, prompts[r].length)) for r in rows]
        for row, step in zip(rows, batch.extend(rows, pieces), strict=True):
            done[row], last[row] = done[row] + chunk, step
    for row, cold in enumerate(colds):
        torch.testing.assert_close(last[row].logits, cold.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(batch.features_of(row, prompts[row].length), cold.features, atol=1e-4, rtol=1e-4)
    assert batch.lengths.tolist() == [p.length for p in prompts]


def test_features_of_reads_any_span_of_a_row_across_its_blocks(make_target):
    target = make_target("qwen2_vl")
    batch = RaggedBatch(target, feature_layers=LAYERS)
    (step,) = batch.prefill([torch.arange(3, 43)])  # 40 tokens: blocks of 16, 16 and 8
    whole = batch.features_of(0, 40)
    torch.testing.assert_close(whole, step.features, atol=0, rtol=0)
    for start, end in ((0, 1), (15, 17), (16, 32), (20, 40), (39, 40), (7, 7)):
        torch.testing.assert_close(batch.features_of(0, end, start), whole[start:end], atol=0, rtol=0)
    with pytest.raises(ValueError, match="holds 40 tokens"):
        batch.features_of(0, 41, 30)


def test_a_shared_block_lives_while_a_row_holds_it_then_idles_then_is_evicted(make_target):
    target = make_target("qwen2_vl")
    text = "Tell me a long story about a lighthouse keeper and the sea, with many details."
    prompt = target.row_prompt(target.build_inputs(None, text))
    per_block = RaggedBatch(target).pool.bytes_per_block()
    blocks_each = -(-prompt.length // SIZE)
    batch = RaggedBatch(target, prefix_caching=True, kv_cache_bytes=(blocks_each + 1) * per_block, initial_capacity=16)
    batch.prefill([prompt])
    batch.prefill([prompt])  # the second row shares the first one's full blocks
    shared = (prompt.length - 1) // SIZE
    assert batch.blocks_of(0)[:shared] == batch.blocks_of(1)[:shared]
    assert all(batch.pool.holders(b) == 2 for b in batch.blocks_of(0)[:shared])
    batch.remove(0)
    assert all(batch.pool.holders(b) == 1 for b in batch.blocks_of(0)[:shared])
    batch.remove(0)
    assert batch.pool.num_used == 0 and batch.prefix_cache["idle_blocks"] == prompt.length // SIZE
    other = target.row_prompt(target.build_inputs(None, "Something else entirely, and at length: " + text))
    batch.prefill([other])  # needs the idle blocks back: the least recently used are evicted
    assert batch.prefix_cache["idle_blocks"] < prompt.length // SIZE


def test_generated_tokens_are_cached_for_the_next_turn(make_target):
    target = make_target("qwen2_vl")
    prompt = target.row_prompt(target.build_inputs(None, "Count from one to twenty."))
    batch = RaggedBatch(target, feature_layers=LAYERS, prefix_caching=True)
    batch.prefill([prompt])
    generated = torch.arange(200, 200 + 2 * SIZE)
    for step in range(0, generated.numel(), 4):  # four tokens a verify, all kept
        batch.verify(generated[None, step : step + 4], torch.tensor([4]))
        batch.advance(torch.tensor([4]))
    batch.remove(0)
    turn = torch.cat((prompt.ids, generated, torch.tensor([7, 8, 9])))
    (start,) = batch.open([turn])
    assert start == (turn.numel() - 1) // SIZE * SIZE and start > prompt.length
    (warm,) = batch.extend([0], [batch_prompt_piece(turn, start)])
    (cold,) = RaggedBatch(target, feature_layers=LAYERS).prefill([turn])
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batch.features_of(0, turn.numel()), cold.features, atol=1e-4, rtol=1e-4)


def batch_prompt_piece(ids, start):
    from vlmspec.targets.prompts import as_row_prompt

    return as_row_prompt(ids).piece(start)


@pytest.fixture
def packed_kernels(make_target):
    probe = torch.empty(16, 64, dtype=torch.bfloat16)
    if not (cpu_kernels.kernel_available() and cpu_kernels.packing_applies(probe)):
        pytest.skip("batch_invariant runs on the packed kernels, which need AVX-512 with AVX512-BF16")


@pytest.mark.usefixtures("packed_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_batch_invariant_prefill_gives_a_hit_the_bits_of_a_cold_prefill(make_target, family, astronaut, dtype):
    """The earlier answer's KV comes from decode steps; a cold prefill computes it again: the same bits either way."""
    target = make_target(family, dtype=dtype)
    first = image_prompt(target, astronaut.resize((64, 64)))
    batch = RaggedBatch(target, feature_layers=LAYERS, prefix_caching=True, batch_invariant=True)
    (step,) = batch.prefill([first])
    logits, answer = step.logits[-1], []
    for _ in range(2 * SIZE + 3):  # greedy decode steps, one token each: their blocks are cached as they fill
        answer.append(int(logits.argmax()))
        logits = batch.verify(torch.tensor([answer[-1:]]), torch.tensor([1])).logits[0, 0]
        batch.advance(torch.tensor([1]))
    batch.remove(0)
    prompt = first.extended([*answer, 7, 8, 9])  # the next turn: the image, the answer as decoded, more text
    (start,) = batch.open([prompt])
    assert start > first.length  # the hit reaches into the decoded answer
    (warm,) = batch.extend([0], [prompt.piece(start)])
    cold = RaggedBatch(target, feature_layers=LAYERS, batch_invariant=True)
    (cold_step,) = cold.prefill([prompt])
    assert torch.equal(warm.logits, cold_step.logits)
    assert torch.equal(batch.features_of(0, prompt.length), cold_step.features)


@pytest.mark.usefixtures("packed_kernels")
def test_a_batch_invariant_extend_that_fails_leaves_every_row_as_it_was(make_target, monkeypatch):
    target = make_target("qwen2_vl")
    prompt = target.row_prompt(target.build_inputs(None, "Count from one to twenty, slowly, please, and back."))
    batch = RaggedBatch(target, feature_layers=LAYERS, batch_invariant=True)
    assert batch.open([prompt]) == [0]
    forwards, once = [], batch._extend_once

    def fail_on_the_second(rows, pieces):
        forwards.append([p.length for p in pieces])
        if len(forwards) == 2:
            raise RuntimeError("injected")
        return once(rows, pieces)

    monkeypatch.setattr(batch, "_extend_once", fail_on_the_second)
    with pytest.raises(RuntimeError, match="injected"):
        batch.extend([0], [prompt.piece(0)])
    assert forwards[0] == [16] and batch.lengths.tolist() == [0]


def test_batch_invariance_is_refused_where_the_packed_kernels_do_not_run(make_target):
    tiny = make_target("qwen2_vl")
    reference = QwenVLTarget(tiny.model, tiny.processor, decode="reference")
    with pytest.raises(ValueError, match="leave batch_invariant off"):
        RaggedBatch(reference, batch_invariant=True)


@pytest.mark.usefixtures("packed_kernels")
def test_batch_invariance_is_on_by_default_in_bfloat16_only(make_target):
    on = RaggedBatch(make_target("qwen2_vl", dtype=torch.bfloat16)).batch_invariant
    assert on == (cpu_kernels.kernel_max_rows(torch.bfloat16) == cpu_kernels.MAX_ROWS)  # not where AMX tiles prefill
    assert not RaggedBatch(make_target("qwen2_vl")).batch_invariant  # float32
    assert not RaggedBatch(make_target("qwen2_vl", dtype=torch.bfloat16), batch_invariant=False).batch_invariant


def test_blocks_of_the_other_forward_are_not_hit_after_decode_changes(make_target):
    """The fast and the reference forwards round differently: a prompt after a switch is computed, not hit."""
    tiny = make_target("qwen2_vl")
    target = QwenVLTarget(tiny.model, tiny.processor)  # its own decode setting, switched below
    prompt = target.row_prompt(target.build_inputs(None, "Count from one to twenty, slowly, please, and back."))
    batch = RaggedBatch(target, prefix_caching=True)
    target.decode = "reference"
    batch.prefill([prompt])
    batch.remove(0)
    assert batch.open([prompt]) == [(prompt.length - 1) // SIZE * SIZE]  # the same forward: its blocks are hit
    batch.remove(0)
    target.decode = "fast"
    assert batch.open([prompt]) == [0]
