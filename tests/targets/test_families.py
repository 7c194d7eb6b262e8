"""Family specs: each family's facts agree with the transformers model they describe."""

import pytest
import torch

from vlmspec.targets.families import (
    FAMILY_SPECS,
    SUPPORTED_MODEL_TYPES,
    family_spec,
    language_model,
    model_spec,
    rope_components,
)
from vlmspec.targets.packed import check_fast_path
from vlmspec.targets.tiny import FAMILIES, tiny_config


def test_every_tiny_family_has_a_spec_and_every_spec_a_model_type():
    assert set(FAMILY_SPECS) == set(FAMILIES)
    assert {spec.name for spec in SUPPORTED_MODEL_TYPES.values()} == set(FAMILIES)
    assert not SUPPORTED_MODEL_TYPES["qwen3_vl_moe"].fast  # experts: decode="reference" only
    assert all(spec.fast for spec in FAMILY_SPECS.values())
    with pytest.raises(ValueError, match="qwen2_vl, qwen2_5_vl"):
        family_spec("llama")


def test_a_spec_describes_its_model(make_target, family):
    """Language model, MLP kind, q/k norms, deepstack, processor and patch size, read from the model itself."""
    target = make_target(family)
    spec = model_spec(target.model)
    assert spec is target.spec and spec.name == family == target.family
    text = language_model(target.model)
    assert text.layers is target.decoder_layers and text.norm is target.final_norm
    check_fast_path(target.model)  # a dense family runs on the fast path
    attention = text.layers[0].self_attn
    assert spec.qk_norm == hasattr(attention, "q_norm") == hasattr(attention, "k_norm")
    assert spec.mlp == "dense" and all(hasattr(layer.mlp, "gate_proj") for layer in text.layers)
    vision = target.model.config.vision_config
    assert spec.deepstack == bool(getattr(vision, "deepstack_visual_indexes", None))
    assert spec.patch_size == vision.patch_size
    assert type(target.processor).__name__ == spec.processor
    layout = "interleaved" if text.config.rope_parameters.get("mrope_interleaved") else "sectioned"
    assert spec.rope == layout


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_the_rope_layout_selects_what_transformers_recomposes(family, head_dim):
    """cos/sin of random M-RoPE positions, via the spec's components, equal the model's own rotary embedding."""
    config = tiny_config(family, hidden_size=head_dim * 2, num_heads=2).get_text_config()
    if family == "qwen3_vl" and head_dim == 128:  # the real model's sections (Qwen2/2.5-VL's come out as theirs)
        config.rope_parameters["mrope_section"] = [24, 20, 20]
    rotary = _rotary_class(family)(config)
    positions = torch.randint(0, 500, (3, 1, 37), generator=torch.Generator().manual_seed(head_dim))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, B, hd]
    components = rope_components(FAMILY_SPECS[family], list(rotary.mrope_section), head_dim // 2)
    freqs = positions[:, 0].T[:, components].float() * rotary.inv_freq[None]  # [B, hd / 2]
    angles = torch.cat((freqs, freqs), dim=-1)
    assert torch.equal(angles.cos(), cos[0]) and torch.equal(angles.sin(), sin[0])
    text_positions = positions[:1].expand(3, 1, -1)  # text: all three components equal -> plain RoPE
    cos, _ = rotary(torch.zeros(1), text_positions)
    plain = text_positions[0, 0].float()[:, None] * rotary.inv_freq[None]
    assert torch.equal(torch.cat((plain, plain), dim=-1).cos(), cos[0])


def test_the_packed_decoder_rotary_uses_the_family_layout(make_target, family):
    """PackedDecoder._rotary of [3, B] positions equals the model's rotary embedding (float32)."""
    target = make_target(family)
    decoder = target.packed_decoder()
    positions = torch.randint(0, 300, (3, 23), generator=torch.Generator().manual_seed(1))
    cos, signed_sin = decoder._rotary(positions, torch.float32)  # [B, 1, hd]
    expected_cos, expected_sin = language_model(target.model).rotary_emb(torch.zeros(1), positions[:, None])
    half = cos.shape[-1] // 2
    assert torch.equal(cos[:, 0], expected_cos[0])
    assert torch.equal(signed_sin[:, 0, half:], expected_sin[0, :, half:])
    assert torch.equal(signed_sin[:, 0, :half], -expected_sin[0, :, :half])


def _rotary_class(family: str):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    return {
        "qwen2_vl": Qwen2VLRotaryEmbedding,
        "qwen2_5_vl": Qwen2_5_VLRotaryEmbedding,
        "qwen3_vl": Qwen3VLTextRotaryEmbedding,
    }[family]
