"""Ragged batches: every row's logits, features and positions equal its request's own, step after step."""

import pytest
import torch

from vlmspec.targets.ragged import RaggedBatch

LAYERS = (0, 2)


def prompts(target, picture):
    return [
        target.build_inputs(None, "Hi"),
        target.build_inputs(picture, "Describe it in detail."),
        target.build_inputs(None, "Name three colours of the rainbow."),
    ]


def verified_features(batch, row: int, n: int) -> torch.Tensor:
    """The features the last verify wrote beside the KV for row ``row``'s n inputs (before advance)."""
    length = int(batch.lengths[row])
    return batch.features_of(row, length + n, length)


def check_rows(target, batch, step, alone, tokens, num_tokens, keep):
    """Compare each row of a ragged step with its request's one-request verify, then roll both back."""
    for row, state in enumerate(alone):
        n = int(num_tokens[row])
        if n == 0:
            continue
        single = target.verify(state, tokens[row, :n])
        target.rollback(state, keep=int(keep[row]))
        torch.testing.assert_close(step.logits[row, :n], single.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(verified_features(batch, row, n), single.features, atol=1e-4, rtol=1e-4)
        assert torch.equal(step.positions[row, :n], single.positions)


def random_step(generator, rows: int, vocab: int = 5000):
    num_tokens = torch.randint(0, 6, (rows,), generator=generator)
    tokens = torch.randint(0, vocab, (rows, max(int(num_tokens.max()), 1)), generator=generator)
    keep = torch.stack([torch.randint(0, int(n) + 1, (), generator=generator) for n in num_tokens])
    return tokens, num_tokens, keep


def test_rows_of_different_lengths_verify_and_roll_back_as_if_alone(make_target, family, astronaut):
    target = make_target(family)
    batch = RaggedBatch(target, feature_layers=LAYERS, initial_capacity=8)  # small: the buffers must grow
    alone = []
    for inputs in prompts(target, astronaut.resize((64, 64))):
        batch.add(target.prefill(inputs, feature_layers=LAYERS)[0])
        alone.append(target.prefill(inputs, feature_layers=LAYERS)[0])
    assert batch.lengths.tolist() == [state.length for state in alone]
    assert batch.rope_deltas.tolist() == [state.rope_delta for state in alone]
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):  # rows feed 0..5 tokens each and keep any prefix of them
        tokens, num_tokens, keep = random_step(generator, 3)
        step = batch.verify(tokens, num_tokens)
        check_rows(target, batch, step, alone, tokens, num_tokens, keep)
        batch.advance(keep)
        assert batch.lengths.tolist() == [state.length for state in alone]


def test_rows_leave_and_join_between_steps(make_target, astronaut):
    target = make_target("qwen2_5_vl")
    inputs = prompts(target, astronaut.resize((64, 64)))
    batch = RaggedBatch(target, feature_layers=LAYERS)
    alone = []
    for item in inputs:
        batch.add(target.prefill(item, feature_layers=LAYERS)[0])
        alone.append(target.prefill(item, feature_layers=LAYERS)[0])
    generator = torch.Generator().manual_seed(1)
    tokens, num_tokens, keep = random_step(generator, 3)
    check_rows(target, batch, batch.verify(tokens, num_tokens), alone, tokens, num_tokens, keep)
    batch.advance(keep)

    assert batch.remove(0) == 2  # the last row moved into row 0
    alone = [alone[2], alone[1]]
    assert batch.lengths.tolist() == [state.length for state in alone]
    assert batch.remove(1) is None  # removing the last row moves nothing
    alone = alone[:1]
    batch.add(target.prefill(inputs[0], feature_layers=LAYERS)[0])  # a new request joins
    alone.append(target.prefill(inputs[0], feature_layers=LAYERS)[0])
    for _ in range(2):
        tokens, num_tokens, keep = random_step(generator, 2)
        check_rows(target, batch, batch.verify(tokens, num_tokens), alone, tokens, num_tokens, keep)
        batch.advance(keep)


def test_rows_hold_the_blocks_their_slots_need_and_a_removed_row_frees_them_without_moving_kv(make_target, astronaut):
    target = make_target("qwen2_vl")
    batch = RaggedBatch(target, feature_layers=LAYERS, initial_capacity=16)  # one block: the pool must grow
    size = batch.pool.block_size
    steps = batch.prefill([target.row_prompt(item) for item in prompts(target, astronaut.resize((64, 64)))])
    assert len(steps) == 3
    held = [batch.blocks_of(row) for row in range(3)]
    assert [len(blocks) for blocks in held] == [-(-int(n) // size) for n in batch.lengths]
    assert len({block for blocks in held for block in blocks}) == batch.pool.num_used  # no block in two rows
    keys_before = [k.clone() for k in batch.pool.keys]
    free_before = batch.pool.num_free
    assert batch.remove(0) == 2
    assert batch.pool.num_free == free_before + len(held[0])  # freed at once
    assert batch.blocks_of(0) == held[2] and batch.blocks_of(1) == held[1]  # the last row's table moved, not its KV
    assert all(torch.equal(a, b) for a, b in zip(batch.pool.keys, keys_before, strict=True))
    # A verify that crosses into a new block takes one from the pool; rollback keeps the row's blocks.
    row_length = int(batch.lengths[0])
    width = size - row_length % size + 1  # one slot past the row's last block
    step = batch.verify(torch.ones(2, width, dtype=torch.long), torch.tensor([width, 1]))
    assert step.logits.shape[:2] == (2, width)
    assert len(batch.blocks_of(0)) == len(held[2]) + 1
    batch.advance([1, 1])
    assert len(batch.blocks_of(0)) == len(held[2]) + 1


def test_a_bounded_pool_refuses_a_forward_it_cannot_hold_and_leaves_the_rows_as_they_were(make_target):
    from vlmspec.targets.pool import KVPoolFull

    target = make_target("qwen2_vl")
    per_block = RaggedBatch(target).pool.bytes_per_block()
    batch = RaggedBatch(target, initial_capacity=16, kv_cache_bytes=3 * per_block + 1)  # 3 blocks: 48 slots
    ids = torch.arange(1, 31)  # 30 tokens: two blocks
    batch.prefill([ids])
    with pytest.raises(KVPoolFull, match="budget"):
        batch.prefill([ids])  # two more blocks: one is left
    assert batch.num_rows == 1 and batch.pool.num_used == 2
    with pytest.raises(KVPoolFull):
        batch.verify(torch.ones(1, 20, dtype=torch.long), torch.tensor([20]))  # 50 slots: a fourth block
    assert batch.lengths.tolist() == [30] and batch.pool.num_used == 2
    step = batch.verify(torch.ones(1, 2, dtype=torch.long), torch.tensor([2]))  # 32 slots: still two blocks
    assert torch.isfinite(step.logits).all()


def test_a_failed_forward_leaves_every_row_intact(make_target):
    target = make_target("qwen2_vl")
    inputs = target.build_inputs(None, "Count to ten.")
    batch = RaggedBatch(target, feature_layers=LAYERS)
    for _ in range(2):
        batch.add(target.prefill(inputs, feature_layers=LAYERS)[0])
    state = target.prefill(inputs, feature_layers=LAYERS)[0]

    def fail(hidden):
        raise RuntimeError("injected failure after the layers wrote their KV")

    # The fast forward's LM head runs after every layer wrote its KV, whichever layer loop ran
    # (the native one calls no Python per layer: there is nothing to hook inside it).
    decoder = target.packed_decoder()
    head, decoder.head = decoder.head, fail
    try:
        with pytest.raises(RuntimeError, match="injected"):
            batch.verify(torch.tensor([[9, 9, 9], [9, 9, 9]]), torch.tensor([3, 3]))
    finally:
        decoder.head = head
    step = batch.verify(torch.tensor([[5, 6], [7, 0]]), torch.tensor([2, 1]))
    single = target.verify(state, [5, 6])
    torch.testing.assert_close(step.logits[0], single.logits, atol=1e-4, rtol=1e-4)


def test_bad_calls_are_refused(make_target):
    target = make_target("qwen2_vl")
    batch = RaggedBatch(target)
    state, _ = target.prefill(target.build_inputs(None, "Hello."))
    batch.add(state)
    with pytest.raises(ValueError, match=r"\[R, W\]"):
        batch.verify(torch.tensor([1, 2]), torch.tensor([2]))
    with pytest.raises(ValueError, match="num_tokens"):
        batch.verify(torch.tensor([[1, 2]]), torch.tensor([3]))
    with pytest.raises(RuntimeError, match="verify"):
        batch.advance([1])
    batch.verify(torch.tensor([[1, 2]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="keep"):
        batch.advance([3])
    with pytest.raises(ValueError, match="feature_layers"):
        batch.add(target.prefill(target.build_inputs(None, "Hello."), feature_layers=(1,))[0])
    with pytest.raises(IndexError):
        batch.remove(4)


@pytest.mark.parametrize("decode", ["fast", "reference"])
def test_text_prompts_prefill_together_as_if_alone(make_target, family, astronaut, decode):
    """RaggedBatch.prefill: several text prompts in one forward, next to a row prefilled alone with an image."""
    target = make_target(family)
    target.decode = decode
    try:
        inputs = prompts(target, astronaut)
        text = [inputs[0], inputs[2]]
        batch = RaggedBatch(target, feature_layers=LAYERS)
        image_state, _ = target.prefill(inputs[1], feature_layers=LAYERS)
        batch.add(image_state)  # an earlier row, which the prefill forward must leave alone
        steps = batch.prefill([x.input_ids[0] for x in text])
        assert batch.num_rows == 3 and batch.lengths.tolist() == [inputs[1].length, text[0].length, text[1].length]
        alone = [target.prefill(x, feature_layers=LAYERS) for x in text]
        for step, (_, single) in zip(steps, alone):
            torch.testing.assert_close(step.logits, single.logits, atol=1e-4, rtol=1e-4)  # [1, V]: the last prediction
            torch.testing.assert_close(step.features, single.features, atol=1e-4, rtol=1e-4)
            assert torch.equal(step.positions, single.positions.cpu())
        # decoding goes on from the prefilled rows as from rows that joined after a one-request prefill
        states = [target.prefill(inputs[1], feature_layers=LAYERS)[0]] + [state for state, _ in alone]
        tokens, num_tokens = torch.tensor([[7, 8], [9, 10], [11, 0]]), torch.tensor([2, 2, 1])
        check_rows(target, batch, batch.verify(tokens, num_tokens), states, tokens, num_tokens, keep=num_tokens)
    finally:
        target.decode = "fast"


def test_a_failed_prefill_adds_no_row(make_target):
    target = make_target("qwen2_vl")
    batch = RaggedBatch(target)
    with pytest.raises(ValueError, match="context length"):
        batch.prefill([torch.tensor([1, 2]), torch.arange(target.max_context + 1) % 100])
    assert batch.num_rows == 0
    with pytest.raises(ValueError, match="at least one token"):
        batch.prefill([torch.tensor([], dtype=torch.long)])
    assert batch.prefill([]) == [] and batch.num_rows == 0


def image_prompts(target, astronaut, coffee):
    return [
        target.build_inputs(astronaut, "Describe it in detail."),
        target.build_inputs(None, "Name three colours of the rainbow."),
        target.build_inputs([astronaut.resize((64, 64)), coffee], "Compare the two pictures."),
    ]


@pytest.mark.parametrize("decode", ["fast", "reference"])
def test_image_and_text_prompts_prefill_together_as_if_alone(make_target, family, astronaut, coffee, decode):
    """RaggedBatch.prefill with images (vision tower, M-RoPE, deepstack) equals transformers' one-request prefill."""
    target = make_target(family)
    target.decode = decode
    try:
        inputs = image_prompts(target, astronaut, coffee)
        batch = RaggedBatch(target, feature_layers=LAYERS)
        batch.prefill([inputs[1].input_ids[0]])  # an earlier row, which the prefill forward must leave alone
        steps = batch.prefill([target.row_prompt(x) for x in inputs])
        alone = [target.prefill(x, feature_layers=LAYERS) for x in inputs]
        assert batch.lengths.tolist() == [inputs[1].length] + [x.length for x in inputs]
        assert batch.rope_deltas.tolist() == [0] + [state.rope_delta for state, _ in alone]
        assert alone[0][0].rope_delta != 0 and alone[2][0].rope_delta != 0
        for step, (_, single) in zip(steps, alone):
            torch.testing.assert_close(step.logits, single.logits, atol=1e-4, rtol=1e-4)  # [1, V]: the last prediction
            torch.testing.assert_close(step.features, single.features, atol=1e-4, rtol=1e-4)
            assert torch.equal(step.positions, single.positions.cpu())  # the drafter's 1-D positions
        # decoding goes on from the rows as from requests prefilled alone
        states = [target.prefill(inputs[1], feature_layers=LAYERS)[0]] + [state for state, _ in alone]
        tokens, num_tokens = torch.tensor([[7, 8], [9, 10], [11, 0], [12, 13]]), torch.tensor([2, 2, 1, 2])
        check_rows(target, batch, batch.verify(tokens, num_tokens), states, tokens, num_tokens, keep=num_tokens)
    finally:
        target.decode = "fast"


def test_an_image_prompt_in_narrow_pieces_runs_the_native_layer_loop(make_target, astronaut):
    """Pieces of at most KERNEL_ATTENTION_MAX_QUERIES tokens take the one-call layer loop where it applies, M-RoPE
    included (wider pieces attend with one SDPA call a row, in the Python loop)."""
    from vlmspec.targets.ragged import KERNEL_ATTENTION_MAX_QUERIES as WIDTH

    target = make_target("qwen2_5_vl")
    inputs = target.build_inputs(astronaut.resize((64, 64)), "What is it?")
    prompt = target.row_prompt(inputs)
    assert prompt.length > WIDTH
    _, single = target.prefill(inputs, feature_layers=LAYERS)
    decoder = target.packed_decoder()
    native = decoder.native
    results = []
    for loop in (native, None):  # the native loop if this machine has it, then the Python loop
        decoder.native = loop
        try:
            batch = RaggedBatch(target, feature_layers=LAYERS)
            batch.open([prompt])
            for start in range(0, prompt.length, WIDTH):
                (last,) = batch.extend([0], [prompt.piece(start, min(start + WIDTH, prompt.length))])
            results.append((last.logits, batch.features_of(0, prompt.length)))
        finally:
            decoder.native = native
    for logits, features in results:
        torch.testing.assert_close(logits, single.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(features, single.features, atol=1e-4, rtol=1e-4)
    if native is not None:
        assert torch.equal(results[0][0], results[1][0])  # the same kernels in the same order
        assert torch.equal(results[0][1], results[1][1])


def test_qwen3_vl_deepstack_embeddings_reach_the_prefill(make_target, astronaut):
    """Without its deepstack embeddings a Qwen3-VL image prefill differs: the test above checks them."""
    import dataclasses

    target = make_target("qwen3_vl")
    prompt = target.row_prompt(target.build_inputs(astronaut.resize((64, 64)), "What is it?"))
    assert len(prompt.vision.deepstack) == len(target.model.config.vision_config.deepstack_visual_indexes)
    flat = dataclasses.replace(prompt, vision=dataclasses.replace(prompt.vision, deepstack=()))
    with_deepstack, without = (RaggedBatch(target, feature_layers=LAYERS).prefill([p])[0] for p in (prompt, flat))
    assert not torch.allclose(with_deepstack.logits, without.logits, atol=1e-4)


def test_a_prompt_whose_images_do_not_match_its_placeholders_is_refused(make_target, astronaut):
    target = make_target("qwen2_vl")
    inputs = target.build_inputs(astronaut.resize((64, 64)), "What is it?")
    inputs.model_kwargs["image_grid_thw"] = inputs.model_kwargs["image_grid_thw"] * torch.tensor([[1, 2, 1]])
    with pytest.raises(ValueError, match="placeholder tokens"):
        target.row_prompt(inputs)


def test_a_batch_invariant_verify_of_many_rows_gives_each_row_its_bits_alone(make_target):
    """80 tokens in one verify would take the GEMM: batch_invariant runs them in forwards of at most 64."""
    from vlmspec.kernels import cpu_kernels

    if not (cpu_kernels.kernel_available() and cpu_kernels.packing_applies(torch.empty(16, 64, dtype=torch.bfloat16))):
        pytest.skip("batch_invariant runs on the packed kernels, which need AVX-512 with AVX512-BF16")
    target = make_target("qwen2_vl", dtype=torch.bfloat16, hidden_size=512)  # wide enough for the GEMM to block K
    questions = [f"Question {i}: what comes after {i}?" for i in range(10)]
    rows = [target.row_prompt(target.build_inputs(None, q)) for q in questions]
    tokens = torch.randint(100, 1000, (10, 8), generator=torch.Generator().manual_seed(0))
    together = RaggedBatch(target, feature_layers=LAYERS, batch_invariant=True)
    together.prefill(rows)
    step = together.verify(tokens, torch.full((10,), 8))  # 80 tokens
    alone = RaggedBatch(target, feature_layers=LAYERS, batch_invariant=True)
    alone.prefill(rows)
    for row in range(10):
        only = torch.zeros(10, dtype=torch.long)
        only[row] = 8
        own = alone.verify(tokens, only)
        own_features = verified_features(alone, row, 8)
        alone.advance(torch.zeros(10, dtype=torch.long))  # nothing kept: the next row sees the same KV
        assert torch.equal(step.logits[row], own.logits[row])
        assert torch.equal(verified_features(together, row, 8), own_features)
