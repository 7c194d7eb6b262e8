"""The fast decode forward (prepacked weights) against transformers' own forward, for every family."""

import pytest
import torch

from vlmspec import SpecEngine
from vlmspec.drafters.prompt_lookup import PromptLookup
from vlmspec.kernels.linear import PackedLinear
from vlmspec.targets.adapter import QwenVLTarget
from vlmspec.targets.ragged import RaggedBatch

LAYERS = (0, 2)


def ragged_steps(target: QwenVLTarget, decode: str, inputs, steps):
    """Each of a few ragged steps over the prefilled prompts, in one decode mode, with its rows' features."""
    target.decode = decode
    try:
        batch = RaggedBatch(target, feature_layers=LAYERS, initial_capacity=8)
        for prompt in inputs:
            batch.add(target.prefill(prompt, feature_layers=LAYERS)[0])
        out = []
        for tokens, num_tokens, keep in steps:
            step = batch.verify(tokens, num_tokens)
            lengths = batch.lengths.tolist()  # the verified inputs' features sit beside their KV, after these
            features = [batch.features_of(row, n + lengths[row], lengths[row]) for row, n in enumerate(num_tokens)]
            out.append((step, features))
            batch.advance(keep)
        return out
    finally:
        target.decode = "fast"


def test_fast_forward_equals_transformers_forward_with_images_and_ragged_rows(make_target, family, astronaut):
    target = make_target(family)
    inputs = [
        target.build_inputs(astronaut.resize((64, 64)), "Describe it."),  # rope_delta != 0 after the image
        target.build_inputs(None, "Name three colours of the rainbow."),
    ]
    steps = [
        (torch.tensor([[11, 12, 13], [14, 0, 0]]), torch.tensor([3, 1]), torch.tensor([2, 1])),
        (torch.tensor([[15, 16], [17, 18]]), torch.tensor([1, 2]), torch.tensor([1, 0])),
        (torch.tensor([[19, 20, 21, 22]] * 2), torch.tensor([4, 4]), torch.tensor([4, 3])),
    ]
    fast = ragged_steps(target, "fast", inputs, steps)
    reference = ragged_steps(target, "reference", inputs, steps)
    for (f, f_features), (r, r_features), (_, num_tokens, _) in zip(fast, reference, steps):
        for row, n in enumerate(num_tokens.tolist()):
            torch.testing.assert_close(f.logits[row, :n], r.logits[row, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(f_features[row], r_features[row], atol=1e-4, rtol=1e-4)
        assert torch.equal(f.positions, r.positions)


def test_greedy_output_is_the_same_in_both_decode_modes(make_target, family, astronaut):
    target = make_target(family)
    engine = SpecEngine(target, PromptLookup())
    outputs = {}
    for decode in ("fast", "reference"):
        target.decode = decode
        outputs[decode] = engine.generate(astronaut.resize((64, 64)), "Describe it.", max_new_tokens=24).token_ids
    target.decode = "fast"
    assert outputs["fast"] == outputs["reference"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_computes_the_fused_linear(dtype):
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 32, generator=generator).to(dtype) for n in (48, 16)]
    biases = [torch.randn(48, generator=generator).to(dtype), None]
    linear = PackedLinear(weights, biases)
    assert linear.out_features == 64
    assert linear.backend in ("packed", "kernel", "onednn", "aten")
    for rows in (1, 2, 3, 5, 8, 9, 65):  # both tiles of the kernel, and past its rows (ATen's GEMM)
        x = torch.randn(rows, 32, generator=generator).to(dtype)
        expected = torch.cat(
            [x.float() @ weights[0].float().T + biases[0].float(), x.float() @ weights[1].float().T], 1
        )
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(linear(x).float(), expected, atol=tolerance, rtol=tolerance)


def test_an_unknown_decode_mode_is_refused(make_target):
    target = make_target("qwen2_vl")
    with pytest.raises(ValueError, match="'fast', 'reference'"):
        QwenVLTarget(target.model, target.processor, decode="compiled")


def test_weights_changed_in_place_are_repacked(make_target):
    target = make_target("qwen2_vl", hidden_size=64)  # its own copy: the weights are edited below
    first = target.packed_decoder()
    assert target.packed_decoder() is first
    with torch.no_grad():
        target.model.lm_head.weight.mul_(1.0)  # any in-place write counts
    assert target.packed_decoder() is not first


def test_a_norm_with_other_arithmetic_keeps_its_own_forward():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm

    from vlmspec.targets.packed import fast_norm

    class OffsetRMSNorm(Qwen2VLRMSNorm):  # Gemma-style (1 + weight): an RMSNorm by name, not by arithmetic
        def forward(self, hidden_states):
            return super().forward(hidden_states) + hidden_states.new_tensor(1.0) * hidden_states

    plain, offset, layer_norm = Qwen2VLRMSNorm(32), OffsetRMSNorm(32), torch.nn.LayerNorm(32)
    assert fast_norm(offset) is offset and fast_norm(layer_norm) is layer_norm
    x = torch.randn(2, 32)
    torch.testing.assert_close(fast_norm(plain)(x), plain(x), rtol=1e-6, atol=1e-6)


def tiny_qwen3_vl_moe():
    """A random Qwen3-VL-MoE model (4 experts, every layer sparse) on the tiny Qwen3-VL shape."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from vlmspec.targets.tiny import tiny_config, tiny_processor

    dense = tiny_config("qwen3_vl")
    text = {**dense.text_config.to_dict(), "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    ids = {name: getattr(dense, name) for name in ("image_token_id", "video_token_id", "vision_start_token_id")}
    config = Qwen3VLMoeConfig(text_config=text, vision_config=dense.vision_config.to_dict(), **ids)
    torch.manual_seed(0)
    return Qwen3VLMoeForConditionalGeneration(config).eval(), tiny_processor("qwen3_vl")


def test_a_mixture_of_experts_target_is_refused_by_the_fast_path_and_runs_in_reference_mode():
    model, processor = tiny_qwen3_vl_moe()
    with pytest.raises(ValueError, match="decode='reference'") as refusal:
        QwenVLTarget(model, processor)
    assert "mixture of experts" in str(refusal.value)
    engine = SpecEngine(QwenVLTarget(model, processor, decode="reference"), PromptLookup())
    spec = engine.generate(None, "Hello, world", max_new_tokens=8)
    alone = engine.generate(None, "Hello, world", max_new_tokens=8, speculative=False)
    assert spec.token_ids == alone.token_ids and len(alone.token_ids) > 0


def test_a_mixture_of_experts_image_prompt_prefills_in_reference_mode_as_transformers_does(astronaut):
    """decode="reference" runs the runner's image prefill through transformers' own text model (deepstack too)."""
    model, processor = tiny_qwen3_vl_moe()
    target = QwenVLTarget(model, processor, decode="reference")
    inputs = target.build_inputs(astronaut.resize((64, 64)), "What is it?")
    step = RaggedBatch(target, feature_layers=LAYERS).prefill([target.row_prompt(inputs)])[0]
    _, single = target.prefill(inputs, feature_layers=LAYERS)
    torch.testing.assert_close(step.logits, single.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.features, single.features, atol=1e-5, rtol=1e-5)
    engine = SpecEngine(target, PromptLookup())
    spec = engine.generate(astronaut.resize((64, 64)), "What is it?", max_new_tokens=8).token_ids
    assert spec == target.generate_greedy(inputs, 8)
