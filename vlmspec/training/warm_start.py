"""A drafter whose decoder layers start from the target's last ones (a lever of the reference run).

A fresh drafter starts from random layers and a random projection of the hooked target
features. The warm start gives it instead:

* the target's last ``num_layers`` decoder layers, copied into the drafter's layers in order
  (attention projections, SwiGLU, both norms) and the target's final norm as its own;
* a feature projection that passes the deepest hooked layer through, ``W_c = [0 ... 0 I]``,
  so the context the drafter's layers attend to starts as that layer's (normed) hidden state.

The copy is a starting point, not an equivalent layer: the drafter's attention reads keys
and values of the projected context and of its own block (bidirectional within the block),
not the target's cache; Qwen2-VL and Qwen2.5-VL's q/k/v biases have no slot in the
drafter's bias-free projections and are dropped; Qwen3-VL's q/k norms are copied, while
Qwen2-family targets have none and the drafter's stay at 1.

The drafter must have the target's layer shape: :func:`target_layer_shape` gives the
config fields that make it so (``DSparkConfig.for_target(target, **target_layer_shape(target))``).
"""

from __future__ import annotations

from typing import Any

import torch

from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter
from vlmspec.drafters.export import exported_name


def target_layer_shape(target: Any) -> dict[str, Any]:
    """The ``DSparkConfig`` fields that give a drafter's layers the target's decoder-layer shape."""
    text = target.text_config
    heads = text.num_attention_heads
    return {
        "hidden_size": text.hidden_size,
        "num_heads": heads,
        "num_kv_heads": text.num_key_value_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "intermediate_size": text.intermediate_size,
        "rms_norm_eps": float(text.rms_norm_eps),
        "rope_theta": float(target.rope_theta),
    }


def check_layer_shape(config: DSparkConfig, target: Any) -> None:
    """Refuse a drafter config whose layers cannot take the target's weights, naming the fields."""
    wanted = target_layer_shape(target)
    wrong = {name: (getattr(config, name), value) for name, value in wanted.items() if getattr(config, name) != value}
    if wrong:
        listed = ", ".join(f"{name}={have} (the target's: {want})" for name, (have, want) in wrong.items())
        raise ValueError(
            f"a warm start from the target's layers needs the target's layer shape, but the drafter has {listed}; "
            "build the config with DSparkConfig.for_target(target, **target_layer_shape(target)) "
            "(the recipe's --init-from-target does, unless --draft-hidden/--draft-heads/--draft-head-dim/"
            "--draft-intermediate override it)"
        )


@torch.no_grad()
def init_from_target_layers(drafter: DSparkDrafter, target: Any) -> tuple[int, ...]:
    """Copy the target's last decoder layers into ``drafter`` (see the module docstring).

    Returns the target layer each drafter layer came from, in drafter order.
    """
    config = drafter.config
    check_layer_shape(config, target)
    layers = target.decoder_layers
    sources = tuple(range(len(layers) - config.num_layers, len(layers)))
    theirs = [dict(layers[index].named_parameters()) for index in sources]
    for name, parameter in drafter.backbone.layers.named_parameters():  # "0.attn.q_proj.weight"
        # The export names of a drafter layer are transformers' own: "layers.0.self_attn.q_proj.weight".
        _, position, inner = exported_name(f"backbone.layers.{name}").split(".", 2)
        source = theirs[int(position)].get(inner)  # Qwen2 families have no q/k norm: those stay at 1
        if source is not None:
            parameter.copy_(source)
    drafter.backbone.norm.weight.copy_(target.final_norm.weight)
    _pass_deepest_feature(drafter)
    return sources


def _pass_deepest_feature(drafter: DSparkDrafter) -> None:
    """W_c = [0 ... 0 I ... 0]: the projected context is the deepest hooked layer's state."""
    config = drafter.config
    weight = drafter.backbone.context_proj.weight  # [d, m * d_target]
    deepest = max(range(len(config.target_layer_ids)), key=lambda i: config.target_layer_ids[i])
    width = config.target_hidden_size
    weight.zero_()
    weight[:, deepest * width : (deepest + 1) * width].copy_(torch.eye(width, dtype=weight.dtype))
