"""The exported layouts' vocabulary: format names, file names, weight names and each format's ``config.json``.

What the formats are and how they differ is told in :mod:`vlmspec.drafters.export`'s docstring.
This module holds the tables both directions share: the weight-name map (vlmspec <->
exported, one to one) and the writers of each format's ``config.json``, which
:func:`vlmspec.drafters.export.export_drafter` calls and :mod:`vlmspec.drafters.import_exported`
reads back.
"""

from __future__ import annotations

import re
from typing import Any

from vlmspec.drafters.dspark.config import DSparkConfig

FORMATS = ("deepspec", "speculators", "dflash")
VLMSPEC_META = "vlmspec.json"  # vlmspec-only fields, ignored by the engines
MAX_POSITIONS = 32768
MASK_EMBEDDING_NAME = "mask_embedding.pt"  # a learned MASK vector, in the file llama.cpp's converter reads

#: vlmspec state-dict name prefix <-> exported prefix ({i}: a layer index); first match wins.
_NAME_PAIRS: tuple[tuple[str, str], ...] = (
    ("backbone.context_proj.", "fc."),
    ("backbone.context_norm.", "hidden_norm."),
    ("backbone.norm.", "norm."),
    ("backbone.layers.{i}.input_norm.", "layers.{i}.input_layernorm."),
    ("backbone.layers.{i}.mlp_norm.", "layers.{i}.post_attention_layernorm."),
    ("backbone.layers.{i}.attn.", "layers.{i}.self_attn."),
    ("backbone.layers.{i}.mlp.", "layers.{i}.mlp."),
    ("head.embed.", "markov_head.markov_w1."),
    ("head.out.", "markov_head.markov_w2."),
    ("head.gate.", "markov_head.gate_proj."),
    ("head.joint.", "markov_head.joint_proj."),
    ("confidence.proj.", "confidence_head.proj."),
)


def _rename_rules(pairs: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """(regex, replacement) rules that turn each pair's first prefix into its second."""
    index = re.escape("{i}")
    return tuple(
        ("^" + re.escape(source).replace(index, r"(\d+)"), target.replace("{i}", r"\1")) for source, target in pairs
    )


_RENAMES = _rename_rules(_NAME_PAIRS)  # vlmspec -> exported
_BACK = _rename_rules(tuple((exported, ours) for ours, exported in _NAME_PAIRS))  # exported -> vlmspec


# ---------------------------------------------------------------------------------- weight names
def exported_name(name: str) -> str | None:
    """The exported (DFlash / transformers-style) name of a drafter parameter, or None if it has none.

    Inside a decoder layer these are transformers' own names (``layers.0.self_attn.q_proj.weight``),
    which is what lets a warm start copy a target layer into a drafter layer.
    """
    return _rename(name, _RENAMES)


def vlmspec_name(name: str) -> str | None:
    """The vlmspec name of an exported weight (the inverse of :func:`exported_name`), or None if it has none."""
    return _rename(name, _BACK)


def _rename(name: str, rules: tuple[tuple[str, str], ...]) -> str | None:
    for pattern, replacement in rules:
        if re.match(pattern, name):
            return re.sub(pattern, replacement, name, count=1)
    return None


# ---------------------------------------------------------------------------------- configs
def format_config(
    format: str, config: DSparkConfig, num_target_layers: int, max_positions: int, verifier: str | None
) -> dict:
    """The ``config.json`` content of ``config`` in ``format`` (one of :data:`FORMATS`)."""
    writers = {"deepspec": _deepspec_config, "speculators": _speculators_config, "dflash": _dflash_config}
    return writers[format](config, num_target_layers, max_positions, verifier)


def _qwen3_fields(config: DSparkConfig, max_positions: int) -> dict[str, Any]:
    """The Hugging Face ``qwen3`` fields of the draft backbone, with 1-D RoPE."""
    return {
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.target_vocab_size,
        "max_position_embeddings": max_positions,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
    }


def _markov_fields(config: DSparkConfig) -> dict[str, Any]:
    has_head = config.head_kind != "none"
    return {
        "markov_rank": config.head_rank if has_head else 0,
        "markov_head_type": config.head_kind if has_head else "vanilla",
        "enable_confidence_head": config.confidence_head,
        "confidence_head_with_markov": bool(config.confidence_head and config.confidence_with_markov),
    }


def _deepspec_config(config: DSparkConfig, num_target_layers: int, max_positions: int, verifier: str | None) -> dict:
    markov = _markov_fields(config)
    return {
        **_qwen3_fields(config, max_positions),
        "architectures": ["Qwen3DSparkModel"],
        "block_size": config.block_size,
        "num_target_layers": num_target_layers,
        "target_hidden_size": config.target_hidden_size,
        "draft_vocab_size": config.num_draft_tokens,
        "sample_from_anchor": True,
        **markov,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),  # output of decoder layer i
            "projector_type": "dspark",
            "shift_label": True,  # slot j predicts the token after it (anchor slot included)
            "markov_rank": markov["markov_rank"],
            "markov_head_type": markov["markov_head_type"],
            "use_confidence_head": config.confidence_head,
        },
    }


def _speculators_config(config: DSparkConfig, num_target_layers: int, max_positions: int, verifier: str | None) -> dict:
    layer = _qwen3_fields(config, max_positions)
    return {
        "speculators_model_type": "dspark",
        "architectures": ["DSparkSpeculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": config.num_draft_tokens,
        "block_size": config.block_size,
        "target_hidden_size": config.target_hidden_size,
        # vLLM's aux hidden state i is the input of layer i = the output of layer i - 1.
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,
        **_markov_fields(config),
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
    }


def _dflash_config(config: DSparkConfig, num_target_layers: int, max_positions: int, verifier: str | None) -> dict:
    return {
        **_qwen3_fields(config, max_positions),
        "architectures": ["DFlashDraftModel"],
        "block_size": config.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),  # output of decoder layer i
        },
    }
