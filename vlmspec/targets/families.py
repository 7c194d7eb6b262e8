"""What vlmspec knows about each Qwen-VL family, in one small spec per family.

Everything that differs between Qwen2-VL, Qwen2.5-VL and Qwen3-VL (and the MoE variant
of Qwen3-VL) is a field of a :class:`FamilySpec`: where the language model sits, its
MLP kind, how M-RoPE lays the three position components over the rotary frequencies,
whether the vision tower feeds deepstack embeddings into the first decoder layers, and
the processor class. The rest of vlmspec reads the spec instead of checking
``model_type``, so a new family is one more entry here (and a tiny config in
:mod:`vlmspec.targets.tiny` to test it with).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ROPE_LAYOUTS = ("sectioned", "interleaved")


@dataclass(frozen=True)
class FamilySpec:
    """One family's facts (see the module docstring)."""

    name: str  # the family name used across vlmspec (training caches, profiles, tiny:FAMILY)
    rope: str  # M-RoPE layout: "sectioned" (t | h | w blocks) or "interleaved" (t h w t h w ...)
    mlp: str  # "dense" (gate/up/down, the fast path runs it) or "moe" (experts: decode="reference" only)
    deepstack: bool  # the vision tower also returns per-layer embeddings added after the first decoder layers
    processor: str  # the transformers processor class
    patch_size: int  # the vision tower's patch size (tiny configs and processors)

    def __post_init__(self) -> None:
        assert self.rope in ROPE_LAYOUTS and self.mlp in ("dense", "moe"), self

    @property
    def fast(self) -> bool:
        """Whether the fast runner (:mod:`vlmspec.targets.packed`) can run this family."""
        return self.mlp == "dense"


QWEN2_VL = FamilySpec("qwen2_vl", "sectioned", "dense", False, "Qwen2VLProcessor", 14)
QWEN2_5_VL = FamilySpec("qwen2_5_vl", "sectioned", "dense", False, "Qwen2_5_VLProcessor", 14)
QWEN3_VL = FamilySpec("qwen3_vl", "interleaved", "dense", True, "Qwen3VLProcessor", 16)
QWEN3_VL_MOE = FamilySpec("qwen3_vl", "interleaved", "moe", True, "Qwen3VLProcessor", 16)

# model_type (config.json) -> its family's spec
SUPPORTED_MODEL_TYPES: dict[str, FamilySpec] = {
    "qwen2_vl": QWEN2_VL,
    "qwen2_5_vl": QWEN2_5_VL,
    "qwen3_vl": QWEN3_VL,
    "qwen3_vl_moe": QWEN3_VL_MOE,
}
FAMILY_SPECS: dict[str, FamilySpec] = {spec.name: spec for spec in (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)}


def family_spec(model_type: str | None) -> FamilySpec:
    """The spec of a ``config.model_type``; ValueError naming the supported ones for any other."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"vlmspec supports Qwen2-VL, Qwen2.5-VL and Qwen3-VL targets; got model_type {model_type!r}. "
            f"Load a model of one of: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    return SUPPORTED_MODEL_TYPES[model_type]


def model_spec(model: nn.Module) -> FamilySpec:
    """The spec of a loaded transformers model (by its config's ``model_type``)."""
    return family_spec(getattr(model.config, "model_type", None))


def language_model(model: nn.Module) -> nn.Module:
    """The text decoder (embeddings, layers, final norm, rotary embedding) of a ``*ForConditionalGeneration``.

    Every supported family keeps it at ``model.model.language_model`` in transformers 5.
    """
    return model.model.language_model


def rope_components(spec: FamilySpec, mrope_section: list[int], half: int) -> torch.Tensor:  # -> [hd / 2] int64
    """Which M-RoPE component (0 t, 1 h, 2 w) sets the angle of each of the ``half`` rotary frequencies.

    Reproduces transformers' ``recomposition_frequencies`` of the family's text rotary
    embedding as an index, so a packed forward builds M-RoPE's cos/sin as plain RoPE's:
    frequency j turns by ``positions[components[j]] * inv_freq[j]``.

    * sectioned (Qwen2-VL, Qwen2.5-VL): consecutive blocks of ``mrope_section`` sizes take
      components t, h, w (cycling if there are more blocks);
    * interleaved (Qwen3-VL): frequency j takes h where ``j % 3 == 1`` and
      ``j < 3 * mrope_section[1]``, w where ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, else t.
    """
    if spec.rope == "sectioned":
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim / 2 = {half}; fix the model config")
        blocks = [torch.full((size,), i % 3, dtype=torch.long) for i, size in enumerate(mrope_section)]
        return torch.cat(blocks)
    components = torch.zeros(half, dtype=torch.long)
    for component in (1, 2):
        components[component : mrope_section[component] * 3 : 3] = component
    return components


def image_embeddings(
    model: nn.Module, spec: FamilySpec, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # [n, d], one [n, d] per deepstack layer
    """The vision tower's embeddings of a prompt's images, run as the model's own module.

    Returns the embeddings that replace the ``n`` image placeholder tokens (in order) and,
    for a deepstack family, the embeddings added to those tokens' hidden states after
    decoder layer 0, 1, ... (empty otherwise), as the model's own forward computes them.
    """
    output = model.model.get_image_features(pixel_values, image_grid_thw, return_dict=True)
    embeds = torch.cat(output.pooler_output, dim=0)
    deepstack = ()
    if spec.deepstack:
        deepstack = tuple(torch.cat(features, dim=0) for features in output.deepstack_features)
    return embeds, deepstack
