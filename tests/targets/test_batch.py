"""Left-padded batched forwards give every row what it gets alone."""

import torch

from vlmspec.targets.batch import decode_batch, keep_rows, prefill_batch


def test_a_padded_batch_with_an_image_decodes_each_row_as_if_alone(make_target, family, astronaut):
    target = make_target(family)
    picture = astronaut.resize((64, 64))
    batch = [
        target.build_inputs(None, "Hi"),
        target.build_inputs(picture, "Describe it in detail."),
        target.build_inputs(None, "Name three colours of the rainbow."),
    ]
    layers = (0, 2)
    state, step = prefill_batch(target, batch, feature_layers=layers)
    alone = [target.prefill(inputs, feature_layers=layers) for inputs in batch]
    for row, (_, row_step) in enumerate(alone):
        torch.testing.assert_close(step.logits[row], row_step.logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(step.features[row], row_step.features, atol=1e-4, rtol=1e-4)
        assert torch.equal(step.positions[row], row_step.positions)
    tokens = step.logits.argmax(-1)
    for _ in range(3):  # greedy steps: each row follows its own one-request decoding
        step = decode_batch(target, state, tokens)
        for row, (row_state, _) in enumerate(alone):
            single = target.verify(row_state, [int(tokens[row])])
            target.rollback(row_state, keep=1)
            torch.testing.assert_close(step.logits[row], single.logits[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(step.features[row], single.features, atol=1e-4, rtol=1e-4)
            assert torch.equal(step.positions[row], single.positions)
        tokens = step.logits.argmax(-1)
    # The image row leaves; the others go on unchanged.
    keep_rows(state, torch.tensor([0, 2]))
    step = decode_batch(target, state, tokens[[0, 2]])
    for row, (row_state, _) in zip((0, 1), (alone[0], alone[2])):
        single = target.verify(row_state, [int(tokens[[0, 2]][row])])
        torch.testing.assert_close(step.logits[row], single.logits[0], atol=1e-4, rtol=1e-4)
        target.rollback(row_state, keep=1)
