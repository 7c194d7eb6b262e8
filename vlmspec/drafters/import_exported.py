"""Read exported drafters back: which layout a directory holds, its vlmspec config and its weights.

:mod:`vlmspec.drafters.export` writes them (and re-exports this module's public names).

Any of the three layouts (``FORMATS``) comes back as a vlmspec :class:`DSparkConfig` and state
dict (vlmspec-only fields from ``vlmspec.json`` where present, a learned MASK vector from
``mask_embedding.pt``), and :func:`import_drafter` ties them to a target again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from vlmspec.drafters.dspark.config import CONFIG_NAME, DSparkConfig
from vlmspec.drafters.dspark.model import WEIGHTS_NAME, DSparkDrafter
from vlmspec.drafters.export_layouts import FORMATS, MASK_EMBEDDING_NAME, VLMSPEC_META, vlmspec_name


def detect_format(directory: str | os.PathLike) -> str:
    """Which of ``FORMATS`` the ``config.json`` in ``directory`` is written in."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {directory}: not an exported drafter")
    data = json.loads(path.read_text())
    if data.get("speculators_model_type") == "dspark":
        return "speculators"
    if data.get("speculators_model_type"):
        raise ValueError(f"{path}: speculators algorithm {data['speculators_model_type']!r} is not a DSpark drafter")
    if "Qwen3DSparkModel" in data.get("architectures", []) or "markov_rank" in data:
        return "deepspec"
    if "dflash_config" in data:
        return "dflash"
    raise ValueError(f"{path} is neither a deepspec, speculators nor dflash drafter config; see {FORMATS}")


def read_exported(directory: str | os.PathLike) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """The vlmspec config and state dict of an exported drafter (no target needed)."""
    from safetensors.torch import load_file

    path = Path(directory)
    format = detect_format(path)
    data = json.loads((path / CONFIG_NAME).read_text())
    config = _config_from(format, data, _vlmspec_meta(path))
    state = _import_weights(config, load_file(str(path / WEIGHTS_NAME)), path)
    mask_file = path / MASK_EMBEDDING_NAME
    if mask_file.is_file():  # a learned MASK vector: the drafter owns it again, the row is only its export name
        mask = torch.load(mask_file, map_location="cpu", weights_only=True)
        if mask.get("mask_token_id") != config.mask_token_id:
            raise ValueError(
                f"{mask_file} names mask_token_id {mask.get('mask_token_id')} but {CONFIG_NAME} says "
                f"{config.mask_token_id}; the files come from different exports: export the drafter again"
            )
        config = dataclasses.replace(config, mask_token_id=None)
        state["mask_embedding"] = mask["embedding"]
    return config, state


def import_drafter(directory: str | os.PathLike, *, target: Any) -> DSparkDrafter:
    """Load an exported drafter (any of ``FORMATS``) as a :class:`DSparkDrafter` tied to ``target``."""
    config, state = read_exported(directory)
    return DSparkDrafter.from_state(config, state, target=target, source=str(directory))


def _vlmspec_meta(path: Path) -> dict[str, Any]:
    meta = path / VLMSPEC_META
    return json.loads(meta.read_text()).get("vlmspec_config", {}) if meta.is_file() else {}


def _config_from(format: str, data: dict[str, Any], meta: dict[str, Any]) -> DSparkConfig:
    """A DSparkConfig from an exported config (``meta``: vlmspec-only fields, when present)."""
    layer = data["transformer_layer_config"] if format == "speculators" else data
    rope = layer.get("rope_parameters") or {}
    if "mrope_section" in rope:
        raise ValueError("the exported config defines mrope_section; vlmspec drafters use 1-D RoPE")
    if format == "speculators":
        layer_ids = [i - 1 for i in data["aux_hidden_state_layer_ids"]]
    else:
        layer_ids = list(data["dflash_config"]["target_layer_ids"])
    mask = data.get("mask_token_id") if format == "speculators" else data["dflash_config"].get("mask_token_id")
    vocab = int(layer["vocab_size"])
    draft_vocab = int(data.get("draft_vocab_size") or vocab)
    rank = int(data.get("markov_rank", 0)) if format != "dflash" else 0
    fields: dict[str, Any] = {
        **{k: v for k, v in meta.items() if k in ("position_rule", "target_name", "init_std", "version")},
        "target_hidden_size": int(data.get("target_hidden_size") or layer["hidden_size"]),
        "target_vocab_size": vocab,
        "target_layer_ids": layer_ids,
        "hidden_size": int(layer["hidden_size"]),
        "num_layers": int(layer["num_hidden_layers"]),
        "num_heads": int(layer["num_attention_heads"]),
        "num_kv_heads": int(layer["num_key_value_heads"]),
        "head_dim": int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
        "intermediate_size": int(layer["intermediate_size"]),
        "rms_norm_eps": float(layer["rms_norm_eps"]),
        "rope_theta": float(rope.get("rope_theta", layer.get("rope_theta", 1_000_000.0))),
        "block_size": int(data["block_size"]),
        "mask_token_id": mask,
        "draft_vocab_size": None if draft_vocab >= vocab else draft_vocab,
        "head_kind": data.get("markov_head_type", "vanilla") if rank > 0 else "none",
        "head_rank": rank if rank > 0 else int(meta.get("head_rank", 256)),
        "confidence_head": bool(data.get("enable_confidence_head", False)) if format != "dflash" else False,
        "confidence_with_markov": bool(data.get("confidence_head_with_markov", False)) and rank > 0,
    }
    return DSparkConfig(**fields)


def _import_weights(config: DSparkConfig, exported: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name, tensor in exported.items():
        if name in ("lm_head.weight", "t2d", "embed_tokens.weight"):
            continue  # the target's own rows, re-tied at load
        if name == "d2t":
            state["draft_token_ids"] = tensor.long() + torch.arange(tensor.shape[0])
            continue
        new = vlmspec_name(name)
        if new is None:
            raise ValueError(f"{path}: unknown weight {name!r}; this is not a checkpoint vlmspec can import")
        state[new] = tensor
    if config.draft_vocab_size is not None and "draft_token_ids" not in state:
        raise ValueError(f"{path}: draft_vocab_size is {config.draft_vocab_size} but the checkpoint has no d2t map")
    return state


__all__ = ["detect_format", "import_drafter", "read_exported"]
