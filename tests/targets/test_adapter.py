"""The adapter drives the model like transformers does, one request at a time."""

import pytest
import torch

from vlmspec.targets import QwenVLTarget


def test_multi_token_verify_and_rollback_match_one_token_decoding(make_target, family, astronaut):
    target = make_target(family)
    inputs = target.build_inputs(astronaut, "Describe this picture.")
    reference = target.model.generate(**inputs.model_kwargs, max_new_tokens=8, do_sample=False)[0, inputs.length :]

    state, step = target.prefill(inputs, feature_layers=(0, 2))
    assert step.logits.shape == (1, target.vocab_size) and step.logits.dtype == torch.float32
    assert step.features.shape == (inputs.length, 2 * target.hidden_size)
    first = int(step.logits[-1].argmax())
    # Verify 6 of the reference tokens, keep 3, then verify 4 more from there.
    out = target.verify(state, reference[:6])
    target.rollback(state, keep=3)
    assert state.length == inputs.length + 3
    out2 = target.verify(state, reference[3:7])
    predicted = [first] + out.logits[:3].argmax(-1).tolist() + out2.logits.argmax(-1).tolist()
    assert predicted == reference.tolist()
    assert out2.positions.tolist() == list(
        range(inputs.length + 3 + state.rope_delta, inputs.length + 7 + state.rope_delta)
    )


def test_request_state_does_not_leak_through_the_models_rope_deltas(make_target, astronaut):
    target = make_target("qwen2_5_vl")
    image_inputs = target.build_inputs(astronaut, "What is this?")
    target.prefill(image_inputs)
    target.model.model.rope_deltas = torch.tensor([[-999]])  # a stale value must not matter
    text_inputs = target.build_inputs(None, "Tell me a joke.")
    state, step = target.prefill(text_inputs)
    assert state.rope_delta == 0
    reference = target.model.generate(**text_inputs.model_kwargs, max_new_tokens=3, do_sample=False)[
        0, text_inputs.length :
    ]
    out = target.verify(state, reference[:2])
    assert [int(step.logits[-1].argmax())] + out.logits.argmax(-1).tolist() == reference.tolist()


def test_hooked_features_equal_hidden_states(make_target):
    target = make_target("qwen3_vl")
    inputs = target.build_inputs(None, "Count to ten.")
    _, step = target.prefill(inputs, feature_layers=(1,))
    hidden = target.model(**inputs.model_kwargs, output_hidden_states=True).hidden_states
    torch.testing.assert_close(step.features, hidden[2][0], rtol=1e-5, atol=1e-5)


def test_forward_sequence_gives_final_norm_hidden_states(make_target):
    target = make_target("qwen2_vl")
    inputs = target.build_inputs(None, "Count to ten.")
    features, last_hidden, positions = target.forward_sequence(inputs, feature_layers=(0, 1))
    logits = target.model(**inputs.model_kwargs).logits[0]
    torch.testing.assert_close(target.output_head(last_hidden), logits, rtol=1e-4, atol=1e-4)
    assert features.shape == (inputs.length, 2 * target.hidden_size) and positions.tolist() == list(
        range(inputs.length)
    )


def test_final_layer_and_bad_layers_are_refused(make_target):
    target = make_target("qwen2_vl")
    with pytest.raises(ValueError, match="final norm"):
        target.check_feature_layers([target.num_layers - 1])
    with pytest.raises(ValueError, match="not allowed"):
        target.check_feature_layers([-1])


def test_other_architectures_are_refused(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=100)
    )
    with pytest.raises(ValueError, match="supports Qwen2-VL"):
        QwenVLTarget(llama, object())
    with pytest.raises(FileNotFoundError, match="config.json"):
        QwenVLTarget.from_pretrained("/nonexistent/model")


def test_from_pretrained_round_trip(tmp_path, make_target):
    target = make_target("qwen2_vl")
    target.save_pretrained(tmp_path)
    loaded = QwenVLTarget.from_pretrained(tmp_path)
    assert loaded.family == "qwen2_vl" and loaded.vocab_size == target.vocab_size
    inputs = loaded.build_inputs(None, "Hello")
    torch.testing.assert_close(loaded.prefill(inputs)[1].logits, target.prefill(inputs)[1].logits)
    with pytest.raises(ValueError, match="dtype"):
        QwenVLTarget.from_pretrained(tmp_path, dtype="float8")


def test_bfloat16_target_runs(make_target):
    bf16 = make_target("qwen2_vl", dtype=torch.bfloat16)  # its own model: never round the shared one's weights
    state, step = bf16.prefill(bf16.build_inputs(None, "Hello"), feature_layers=(1,))
    assert step.logits.dtype == torch.float32 and step.features.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("spec", "fix"),
    [
        ("refrence", "did you mean 'reference'"),
        ("tiny-qwen3_vl", "did you mean 'tiny:qwen3_vl'"),
        ("/no/such", "tiny:"),
    ],
)
def test_a_target_that_is_not_there_gets_the_closest_name_and_every_choice(spec, fix):
    from vlmspec.loading import load_target

    with pytest.raises(FileNotFoundError, match="there is no directory") as error:
        load_target(spec)
    assert fix in str(error.value) and "'reference' (the bundled reference target)" in str(error.value)
