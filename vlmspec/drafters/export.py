"""Export DSpark drafters to the checkpoint layouts that serving engines load, and import them back.

Formats (``FORMATS``):

* ``"deepspec"``: DeepSpec's ``Qwen3DSparkModel`` layout (e.g. deepseek-ai/dspark_qwen3_8b_block7),
  read by vLLM's ``qwen3_dspark.py`` (``method="dspark"``) and SGLang's ``DSPARK``. A Hugging
  Face ``qwen3`` config plus ``dflash_config.{mask_token_id, target_layer_ids}``, ``block_size``,
  ``num_target_layers``, ``markov_rank``, ``enable_confidence_head``, ``confidence_head_with_markov``,
  ``draft_vocab_size``; target layer ids mean "output of decoder layer i"; the anchor slot predicts
  the first draft token (``sample_from_anchor`` / ``shift_label``). Vanilla Markov head only.
* ``"speculators"``: vLLM's training library (``speculators.models.dspark.DSparkDraftModel``,
  ``speculators_model_type="dspark"``): a ``transformer_layer_config`` plus DSpark fields. Its
  ``aux_hidden_state_layer_ids`` count the *input* of layer i (vLLM's aux-hidden-state hook), so
  they are vlmspec's ids + 1. Carries vanilla, gated and RNN heads; ``sample_from_anchor=true``.
* ``"dflash"``: z-lab's ``DFlashDraftModel`` (``dflash/model.py``; vLLM ``method="dflash"``,
  SGLang ``DFLASH``): ``dflash_config.{mask_token_id, target_layer_ids}``, ``block_size``,
  ``num_target_layers``; weights ``fc``, ``hidden_norm``, ``layers.*``, ``norm``. No Markov or
  confidence head, no draft vocabulary map, and its mask slots sit AT the predicted position
  (slot k of ``[anchor, MASK...]`` predicts the token at anchor + k; the anchor slot is unused),
  whereas a vlmspec drafter's slot k predicts the token at anchor + k + 1. The backbone computes
  the same hidden states; the engine reads them one slot later. That difference is refused
  unless ``strict=False``.

Shared by all three: the target's input embedding and LM head (not stored; with a reduced draft
vocabulary the deepspec and speculators layouts store the LM head rows and a ``d2t`` offset map,
sorted by target id), 1-D RoPE (``rope_type="default"``, never ``mrope_section``), context keys
and values that are each draft layer's own k/v projections of ``hidden_norm(fc(features))``
with q/k RMS norms, and a mask token that is a row of the target's embedding
(``mask_token_id``). vlmspec-only fields (``position_rule``, ``head_rank`` ...) ride along in
``vlmspec.json``, which engines ignore.

A learned MASK vector (``mask_token_id=None``) is written beside the weights as
``mask_embedding.pt`` (``{"mask_token_id": N, "embedding": [d] float32}``), the file llama.cpp's
``convert_hf_to_gguf.py`` reads: it copies the target's embedding into the draft GGUF and puts
the vector into row N of that copy, so the draft sees exactly vlmspec's MASK while the target's
own row N is untouched. N (``mask_token_id=`` of :func:`export_drafter`; default the last row,
``target_vocab_size - 1``: a padding row on Qwen-VL targets, the video placeholder on the
reference target) must be an id that is never an anchor, i.e. never generated. vLLM's
``Qwen3DSparkModel`` reads a MASK vector only through a full ``embed_tokens.weight`` in the
checkpoint (it ignores ``mask_embedding``); speculators' ``DSparkDraftModel`` and SGLang take
row N of the target's embedding and ignore the file. Those engines draft with another MASK:
the report's notes say so.

Weight names map one to one (vlmspec -> exported): ``backbone.context_proj`` -> ``fc``,
``backbone.context_norm`` -> ``hidden_norm``, ``backbone.layers.i.input_norm`` ->
``layers.i.input_layernorm``, ``.attn.`` -> ``.self_attn.``, ``.mlp_norm`` ->
``.post_attention_layernorm``, ``backbone.norm`` -> ``norm``, ``head.embed`` / ``head.out`` /
``head.gate`` / ``head.joint`` -> ``markov_head.markov_w1`` / ``markov_w2`` / ``gate_proj`` /
``joint_proj``, ``confidence.proj`` -> ``confidence_head.proj``.

This module owns the export itself (what each format can express, the weights it ships, the
files it writes). The name map and each format's ``config.json`` live in
:mod:`vlmspec.drafters.export_layouts`; reading an export back (:func:`detect_format`,
:func:`read_exported`, :func:`import_drafter`) in :mod:`vlmspec.drafters.import_exported`.
Both are importable from here as before.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlmspec.drafters.dspark.config import CONFIG_NAME, DSparkConfig
from vlmspec.drafters.dspark.model import WEIGHTS_NAME, DSparkDrafter
from vlmspec.drafters.export_layouts import (
    FORMATS,
    MASK_EMBEDDING_NAME,
    MAX_POSITIONS,
    VLMSPEC_META,
    exported_name,
    format_config,
)
from vlmspec.drafters.import_exported import detect_format, import_drafter, read_exported


@dataclass
class ExportReport:
    """What an export wrote and what it could not carry."""

    format: str
    directory: Path
    dropped: list[str] = field(default_factory=list)  # parts of the drafter the format has no place for
    inexact: list[str] = field(default_factory=list)  # where the format's model computes something else
    notes: list[str] = field(default_factory=list)  # engine-specific caveats worth knowing

    def summary(self) -> str:
        lines = [f"wrote {self.format} drafter to {self.directory}"]
        lines += [f"  dropped: {item}" for item in self.dropped]
        lines += [f"  NOT EXACT: {item}" for item in self.inexact]
        lines += [f"  note: {item}" for item in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------- export
def export_drafter(
    drafter_or_dir: DSparkDrafter | str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str,
    *,
    target: Any = None,
    strict: bool = True,
    verifier: str | None = None,
    max_position_embeddings: int = MAX_POSITIONS,
    mask_token_id: int | None = None,
) -> ExportReport:
    """Write ``drafter_or_dir`` (a drafter, or a directory saved by ``save_pretrained``) in ``format``.

    ``target`` (duck-typed: ``output_head``, ``num_layers``) supplies the LM head rows that
    a reduced draft vocabulary must ship and the target's layer count (``num_target_layers``);
    a drafter object brings its own tied head. ``verifier`` is the target's path or hub id,
    recorded where the format has a field for it. With ``strict=False`` a computational
    difference between vlmspec and the format (see the module docstring) is written anyway
    and listed in ``report.inexact``; refusals of what cannot be written at all stay errors.
    ``mask_token_id`` is the row a learned MASK vector is exported as (see the module docstring;
    default ``target_vocab_size - 1``); a drafter whose MASK is already a row keeps its own.
    Raises ``ValueError`` with the fix for anything the format cannot express.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {FORMATS}")
    config, state, head_weight = _drafter_parts(drafter_or_dir, target)
    report = ExportReport(format, Path(out_dir))
    _check_expressible(config, format, strict, report)
    mask = _learned_mask(config, state, mask_token_id, report)
    weights = _export_weights(config, state, format, report)
    if config.draft_vocab_size is not None:
        weights.update(_vocab_map(config, state, head_weight, weights))
    num_target_layers = getattr(target, "num_layers", None) or max(config.target_layer_ids) + 2
    row_config = config if mask is None else dataclasses.replace(config, mask_token_id=mask["mask_token_id"])
    exported = format_config(format, row_config, num_target_layers, max_position_embeddings, verifier)
    _write(report.directory, exported, weights, config, mask)
    for message in report.dropped + report.inexact:
        warnings.warn(f"export to {format}: {message}", stacklevel=2)
    return report


def _drafter_parts(
    drafter_or_dir: DSparkDrafter | str | os.PathLike, target: Any
) -> tuple[DSparkConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """Config, own weights (on the CPU) and the target LM head weight [V, d] (None when unknown)."""
    if isinstance(drafter_or_dir, DSparkDrafter):
        state = {name: t.detach().cpu() for name, t in drafter_or_dir.state_dict().items()}
        return drafter_or_dir.config, state, drafter_or_dir.vocabulary.lm_head.weight.detach().cpu()
    from safetensors.torch import load_file

    path = Path(drafter_or_dir)
    config = DSparkConfig.load(path)
    if not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{path} has no {WEIGHTS_NAME}; save the drafter with DSparkDrafter.save_pretrained")
    head = None if target is None else target.output_head.weight.detach().cpu()
    return config, load_file(str(path / WEIGHTS_NAME)), head


def _check_expressible(config: DSparkConfig, format: str, strict: bool, report: ExportReport) -> None:
    """Refuse what ``format`` cannot express; record what it drops or computes differently."""
    if config.hidden_size != config.target_hidden_size:
        raise ValueError(
            f"drafter hidden size {config.hidden_size} differs from the target's {config.target_hidden_size}; "
            f"{format} shares the target's embedding and LM head directly and has no embed_proj/head_proj. "
            "Build the drafter with hidden_size equal to the target's"
        )
    if format == "deepspec" and config.head_kind != "vanilla":
        raise ValueError(
            f"the deepspec layout (vLLM Qwen3DSparkModel) carries only the vanilla Markov head, not "
            f"head_kind={config.head_kind!r}; export with format='speculators' (vanilla, gated, rnn and none) "
            "or train a vanilla head"
        )
    if format == "dflash":
        _check_dflash(config, strict, report)
    elif config.head_kind in ("gated", "rnn"):
        report.notes.append(
            f"head_kind={config.head_kind!r}: speculators' DSparkDraftModel loads it, but vLLM's Qwen3DSparkModel "
            "and TensorRT-LLM implement only the vanilla Markov head"
        )
    report.notes.append(
        f"positions: vlmspec's drafter was trained with position_rule={config.position_rule!r} for image tokens; "
        "an engine that feeds the drafter other 1-D positions for image prompts drafts differently there "
        "(text-only prompts agree: all M-RoPE rows are equal for text)"
    )


def _learned_mask(
    config: DSparkConfig, state: dict[str, torch.Tensor], mask_token_id: int | None, report: ExportReport
) -> dict[str, Any] | None:
    """The ``mask_embedding.pt`` content of a learned MASK vector (None when MASK is a row already)."""
    if config.mask_token_id is not None:
        return None
    row = config.target_vocab_size - 1 if mask_token_id is None else int(mask_token_id)
    if not 0 <= row < config.target_vocab_size:
        raise ValueError(
            f"mask_token_id {row} is outside the target vocabulary [0, {config.target_vocab_size}); pass an id "
            "the target never generates (a padding row past the tokenizer, or the video placeholder)"
        )
    report.notes.append(
        f"learned MASK vector: written to {MASK_EMBEDDING_NAME} as row {row}; llama.cpp's convert_hf_to_gguf.py "
        "puts it into the draft's own embedding table (exact). vLLM, speculators and SGLang read MASK as row "
        f"{row} of the target's embedding and ignore {MASK_EMBEDDING_NAME}: there they draft with another MASK"
    )
    return {"mask_token_id": row, "embedding": state["mask_embedding"].detach().float().cpu().contiguous()}


def _check_dflash(config: DSparkConfig, strict: bool, report: ExportReport) -> None:
    if config.draft_vocab_size is not None:
        raise ValueError(
            f"z-lab's DFlash layout has no draft vocabulary map (d2t), but this drafter drafts over "
            f"{config.draft_vocab_size} ids; export with format='speculators' or 'deepspec', or train with "
            "draft_vocab_size=None"
        )
    if config.head_kind != "none":
        report.dropped.append(f"the {config.head_kind} Markov head (DFlash drafts every position in parallel)")
    if config.confidence_head:
        report.dropped.append("the confidence head (DFlash has none; confidence schedulers cannot use it)")
    slot = (
        "slot semantics: DFlash reads draft k from the mask slot at anchor + k (a block of block_size slots "
        "gives block_size - 1 drafts, the anchor slot unused); vlmspec's slot k (anchor slot included) "
        "predicts the token at anchor + k + 1. The weights load and the backbone's hidden states agree, but "
        "the engine reads them one slot later, so drafts are off by one position"
    )
    if strict:
        raise ValueError(
            f"the dflash format cannot express this drafter exactly: {slot}. Export with format='speculators' "
            "or 'deepspec' (sample_from_anchor=true), or pass strict=False (CLI: --allow-inexact) to write it anyway"
        )
    report.inexact.append(slot)


def _export_weights(
    config: DSparkConfig, state: dict[str, torch.Tensor], format: str, report: ExportReport
) -> dict[str, torch.Tensor]:
    """The drafter's own weights under the format's names (heads dropped where the format has none)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in ("draft_token_ids", "mask_embedding"):
            continue  # the vocabulary map and a learned mask vector are written separately
        new = exported_name(name)
        if new is None:
            raise ValueError(f"no {format} name for drafter weight {name!r}; this vlmspec version cannot export it")
        if format == "dflash" and new.startswith(("markov_head.", "confidence_head.")):
            continue
        out[new] = tensor.detach().contiguous()
    return out


def _vocab_map(
    config: DSparkConfig,
    state: dict[str, torch.Tensor],
    head_weight: torch.Tensor | None,
    weights: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """``lm_head`` rows, ``d2t`` offsets and ``t2d`` mask of the draft vocabulary, columns sorted by target id.

    Sorting permutes draft columns (and ``markov_w2`` rows, in ``weights``, in place); the
    distribution over target ids is unchanged. speculators rebuilds ``lm_head`` from ``t2d``
    in ascending id order, so unsorted columns would not line up there.
    """
    if head_weight is None:
        raise ValueError(
            f"this drafter drafts over a reduced vocabulary ({config.draft_vocab_size} ids): the export must ship "
            "the target's LM head rows for them. Pass target= (CLI: --target) or a DSparkDrafter object"
        )
    ids = state["draft_token_ids"].long()
    order = torch.argsort(ids)
    ids = ids[order]
    if "markov_head.markov_w2.weight" in weights:
        weights["markov_head.markov_w2.weight"] = weights["markov_head.markov_w2.weight"][order].contiguous()
    t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {
        "lm_head.weight": head_weight[ids].to(weights["fc.weight"].dtype).contiguous(),
        "d2t": ids - torch.arange(ids.shape[0]),
        "t2d": t2d,
    }


def _write(
    directory: Path,
    exported: dict,
    weights: dict[str, torch.Tensor],
    config: DSparkConfig,
    mask: dict[str, Any] | None,
) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(exported, indent=2) + "\n")
    meta = {"vlmspec_config": config.to_dict()}
    (directory / VLMSPEC_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    mask_file = directory / MASK_EMBEDDING_NAME
    if mask is not None:
        torch.save(mask, mask_file)
    elif mask_file.exists():  # a stale vector from an earlier export into the same directory would be read
        mask_file.unlink()


__all__ = ["FORMATS", "ExportReport", "detect_format", "export_drafter", "import_drafter", "read_exported"]
