"""What vlmspec knows about each Qwen-VL family, in one small spec per family.

Everything that differs between Qwen2-VL, Qwen2.5-VL and Qwen3-VL (and the MoE variant
of Qwen3-VL) is a field of a :class:`FamilySpec`: where the language model sits, its
MLP kind, whether attention normalises q and k per head, how M-RoPE lays the three position components over the rotary frequencies,
whether the vision tower feeds deepstack embeddings into the first decoder layers, and
the processor class. The rest of vlmspec reads the spec instead of checking
``model_type``, so a new family is one more entry here (and a tiny config in
:mod:`vlmspec.targets.tiny` to test it with).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
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
    qk_norm: bool  # attention RMS-normalises each head of q and k before RoPE (Qwen3-VL): no native step
    deepstack: bool  # the vision tower also returns per-layer embeddings added after the first decoder layers
    processor: str  # the transformers processor class
    patch_size: int  # the vision tower's patch size (tiny configs and processors)

    def __post_init__(self) -> None:
        assert self.rope in ROPE_LAYOUTS and self.mlp in ("dense", "moe"), self

    @property
    def fast(self) -> bool:
        """Whether the fast runner (:mod:`vlmspec.targets.packed`) can run this family."""
        return self.mlp == "dense"


QWEN2_VL = FamilySpec("qwen2_vl", "sectioned", "dense", False, False, "Qwen2VLProcessor", 14)
QWEN2_5_VL = FamilySpec("qwen2_5_vl", "sectioned", "dense", False, False, "Qwen2_5_VLProcessor", 14)
QWEN3_VL = FamilySpec("qwen3_vl", "interleaved", "dense", True, True, "Qwen3VLProcessor", 16)
QWEN3_VL_MOE = FamilySpec("qwen3_vl", "interleaved", "moe", True, True, "Qwen3VLProcessor", 16)

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


class VisionCache:
    """The vision tower's outputs for the last few prompts' images, keyed by the images' content.

    A multi-turn chat about one picture sends the same pixels at every turn; the tower's
    embeddings depend only on them (and the tower's weights), so a later turn takes the
    stored ones instead of running the encoder again. The key is a hash of the pixel values'
    bytes, their grid, dtype and device (a prompt's images as one set: the tower runs them
    together, so a set's embeddings are exactly what it computes for that set). Least
    recently used sets leave past ``max_entries``. A target whose vision weights change in
    place must :meth:`clear` it.
    """

    def __init__(self, max_entries: int = 8) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0 (0: no caching), got {max_entries}")
        self.max_entries = max_entries
        self.hits = self.misses = 0
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = OrderedDict()

    def embeddings(
        self, model: nn.Module, spec: FamilySpec, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # as image_embeddings: [n, d], deepstack [n, d] each
        """:func:`image_embeddings`, from the cache when these images were seen (callers must not modify them)."""
        key = image_key(pixel_values, image_grid_thw)
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]
        self.misses += 1
        value = image_embeddings(model, spec, pixel_values, image_grid_thw)
        if self.max_entries:
            self._entries[key] = value
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def image_key(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> bytes:
    """A digest of a prompt's images: their pixel values' bytes, grid, dtype and device."""
    digest = hashlib.blake2b(digest_size=20)
    for tensor in (pixel_values, image_grid_thw):
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype} {tensor.device};".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.digest()
