"""The warm start of a drafter from the target's last decoder layers (--init-from-target)."""

from __future__ import annotations

import pytest
import torch
from test_train_recipe import load_recipe

from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter
from vlmspec.training.warm_start import init_from_target_layers, target_layer_shape

HOOKS = (2, 0, 1)  # out of order on purpose: "deepest" means the highest layer id, not the last feature


def warm_drafter(target, **overrides) -> tuple[DSparkDrafter, tuple[int, ...]]:
    shape = {**target_layer_shape(target), "target_layer_ids": HOOKS, "block_size": 4, "head_rank": 8}
    config = DSparkConfig.for_target(target, **{**shape, **overrides})
    drafter = DSparkDrafter.from_target(target, config).float()
    return drafter, init_from_target_layers(drafter, target)


def test_the_last_target_layers_are_copied_in_order(family, make_target):
    target = make_target(family)
    drafter, sources = warm_drafter(target)
    last = target.num_layers
    assert sources == (last - 2, last - 1)
    for mine, index in zip(drafter.backbone.layers, sources, strict=True):
        theirs = target.decoder_layers[index]
        pairs = [
            (mine.attn.q_proj, theirs.self_attn.q_proj),
            (mine.attn.k_proj, theirs.self_attn.k_proj),
            (mine.attn.v_proj, theirs.self_attn.v_proj),
            (mine.attn.o_proj, theirs.self_attn.o_proj),
            (mine.mlp.gate_proj, theirs.mlp.gate_proj),
            (mine.mlp.down_proj, theirs.mlp.down_proj),
            (mine.input_norm, theirs.input_layernorm),
            (mine.mlp_norm, theirs.post_attention_layernorm),
        ]
        for drafter_part, target_part in pairs:
            torch.testing.assert_close(drafter_part.weight, target_part.weight.float())
        if hasattr(theirs.self_attn, "q_norm"):  # Qwen3-VL: copied; Qwen2 families have none
            torch.testing.assert_close(mine.attn.q_norm.weight, theirs.self_attn.q_norm.weight.float())
        else:
            assert torch.equal(mine.attn.q_norm.weight, torch.ones_like(mine.attn.q_norm.weight))
    torch.testing.assert_close(drafter.backbone.norm.weight, target.final_norm.weight.float())


def test_the_feature_projection_passes_the_deepest_hooked_layer_through(make_target):
    target = make_target("qwen2_5_vl")
    drafter, _ = warm_drafter(target)
    width = target.hidden_size
    features = torch.randn(1, 3, len(HOOKS) * width, generator=torch.Generator().manual_seed(0))
    deepest = HOOKS.index(max(HOOKS))
    projected = drafter.backbone.context_proj(features)
    torch.testing.assert_close(projected, features[..., deepest * width : (deepest + 1) * width])


def test_a_drafter_of_another_layer_shape_is_refused_by_name(make_target):
    target = make_target("qwen2_vl")
    wrong = target_layer_shape(target)["intermediate_size"] + 8
    with pytest.raises(ValueError, match=rf"intermediate_size={wrong}.*--init-from-target"):
        warm_drafter(target, intermediate_size=wrong)


def test_the_recipe_flag_gives_the_target_shape_and_the_warm_layers(make_target, tmp_path):
    target = make_target("qwen3_vl")
    recipe = load_recipe()
    base = ["--target", "tiny:qwen3_vl", "--prompts", "p.jsonl", "--out", str(tmp_path), "--feature-layers", "0,2"]
    args = recipe.parse_args([*base, "--draft-layers", "1", "--head-rank", "8", "--init-from-target"])
    config = recipe.drafter_config(args, target)
    assert {name: getattr(config, name) for name in target_layer_shape(target)} == target_layer_shape(target)
    drafter = recipe.new_drafter(target, config, seed=0, from_target_layers=args.init_from_target)
    torch.testing.assert_close(
        drafter.backbone.layers[0].mlp.up_proj.weight, target.decoder_layers[-1].mlp.up_proj.weight
    )
    cold = recipe.new_drafter(target, config, seed=0)
    assert not torch.equal(cold.backbone.layers[0].mlp.up_proj.weight, drafter.backbone.layers[0].mlp.up_proj.weight)
