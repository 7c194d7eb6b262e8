"""Prompts ready for the runner's prefill: token ids, M-RoPE positions and the vision tower's embeddings.

:meth:`vlmspec.targets.ragged.RaggedBatch.prefill` runs many prompts, with images or
without, in one packed forward of the fast runner. What it needs from a prompt is a
:class:`RowPrompt`, built by :func:`row_prompt` from the processor's inputs:

* the vision tower runs here, as the model's own module
  (:func:`vlmspec.targets.families.image_embeddings`); its embeddings replace the image
  placeholder tokens' embeddings in the forward (:class:`VisionEmbeds`), and Qwen3-VL's
  deepstack embeddings are added after its first decoder layers;
* the M-RoPE positions ``[3, L]`` and the row's ``rope_delta`` come from the model's own
  ``get_rope_index`` (text tokens sit at position i in all three components);
* the drafter's 1-D text-stream positions follow the request's position rule
  (:mod:`vlmspec.targets.positions`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from vlmspec.targets.families import FamilySpec, VisionCache, image_embeddings, image_key
from vlmspec.targets.inputs import TargetInputs
from vlmspec.targets.positions import check_position_rule, text_stream_positions


@dataclass
class VisionEmbeds:
    """Embeddings that replace some tokens' input embeddings (the image placeholders) in one forward."""

    index: torch.Tensor  # [n] int64 where the placeholder tokens sit (in the prompt, or in a packed forward)
    embeds: torch.Tensor  # [n, d] the vision tower's embedding of each, in order
    deepstack: tuple[torch.Tensor, ...] = ()  # Qwen3-VL: one [n, d] added after decoder layer 0, 1, ...; else ()
    image_keys: tuple[bytes, ...] = ()  # [n] the content digest of each placeholder's image (prefix-cache keys)

    def within(self, start: int, end: int) -> VisionEmbeds | None:
        """The placeholders at prompt indexes ``start .. end - 1``, indexed from ``start`` (None if there are none)."""
        keep = (self.index >= start) & (self.index < end)  # [n]; the index is sorted, so this is one run
        if not bool(keep.any()):
            return None
        first, last = (int(i) for i in torch.nonzero(keep).flatten()[[0, -1]])
        return VisionEmbeds(
            index=self.index[first : last + 1] - start,
            embeds=self.embeds[first : last + 1],
            deepstack=tuple(layer[first : last + 1] for layer in self.deepstack),
            image_keys=self.image_keys[first : last + 1],
        )


@dataclass
class RowPrompt:
    """One prompt for :meth:`RaggedBatch.prefill` (a plain ``[L]`` id tensor is a text prompt)."""

    ids: torch.Tensor  # [L] int64, image placeholders included
    mrope: torch.Tensor | None = None  # [3, L] int64 M-RoPE positions; None: text, position i in all three
    rope_delta: int = 0  # M-RoPE position minus cache index for every token after the prompt
    vision: VisionEmbeds | None = None  # the image placeholders' embeddings (index into ids), or None
    text_positions: torch.Tensor | None = field(default=None)  # [L] int64 the drafter's positions; None: the cache's
    start: int = 0  # the cache index of the first token: > 0 for a piece of a longer prompt (:meth:`piece`)

    @property
    def length(self) -> int:
        return self.ids.shape[0]

    @property
    def end(self) -> int:
        """The cache index after the last token."""
        return self.start + self.length

    def positions_3d(self) -> torch.Tensor:  # [3, L] int64 (CPU)
        if self.mrope is not None:
            return self.mrope.cpu()
        return torch.arange(self.start, self.end).expand(3, -1)

    def positions_1d(self) -> torch.Tensor:  # [L] int64 (CPU)
        return torch.arange(self.start, self.end) if self.text_positions is None else self.text_positions.cpu()

    def extended(self, tokens: Sequence[int]) -> RowPrompt:
        """This whole prompt followed by ``tokens`` (a request's answer so far), each at its cache index +
        rope_delta in all three M-RoPE components and in the drafter's positions: how decoding placed them."""
        if self.start != 0:
            raise ValueError("extended() takes a whole prompt, not a piece")
        after = torch.arange(self.length, self.length + len(tokens)) + self.rope_delta  # [n]
        return RowPrompt(
            ids=torch.cat((self.ids.cpu(), torch.as_tensor(list(tokens), dtype=torch.long))),
            mrope=None if self.mrope is None else torch.cat((self.mrope.cpu(), after.expand(3, -1)), dim=1),
            rope_delta=self.rope_delta,
            vision=self.vision,
            text_positions=None if self.text_positions is None else torch.cat((self.text_positions.cpu(), after)),
        )

    def piece(self, start: int, end: int | None = None) -> RowPrompt:
        """Tokens ``start .. end - 1`` of this prompt, with their positions and images: a prefix cache hit's
        suffix, or one chunk of a chunked prefill. Pieces run in order fill a row as the whole prompt does."""
        end = self.length if end is None else end
        if not 0 <= start < end <= self.length:
            raise ValueError(
                f"a piece must be a non-empty part of the prompt's {self.length} tokens, got {start}:{end}"
            )
        return RowPrompt(
            ids=self.ids[start:end],
            mrope=None if self.mrope is None else self.mrope[:, start:end],
            rope_delta=self.rope_delta,
            vision=None if self.vision is None else self.vision.within(start, end),
            text_positions=None if self.text_positions is None else self.text_positions[start:end],
            start=self.start + start,
        )


def as_row_prompt(prompt: RowPrompt | torch.Tensor) -> RowPrompt:
    """A :class:`RowPrompt` as it is; a token tensor (any shape holding L ids) as a text prompt."""
    if isinstance(prompt, RowPrompt):
        return prompt
    return RowPrompt(ids=torch.as_tensor(prompt, dtype=torch.long).reshape(-1).cpu())


def pack_vision(prompts: Sequence[RowPrompt]) -> VisionEmbeds | None:
    """The prompts' vision embeddings with indexes into their packed sequence (prompt after prompt), or None."""
    if all(prompt.vision is None for prompt in prompts):
        return None
    index, embeds, deepstack, start = [], [], [], 0
    for prompt in prompts:
        if prompt.vision is not None:
            index.append(prompt.vision.index.cpu() + start)
            embeds.append(prompt.vision.embeds)
            deepstack.append(prompt.vision.deepstack)
        start += prompt.length
    layers = {len(d) for d in deepstack}
    assert len(layers) == 1, "prompts of one target have the same deepstack layers"
    return VisionEmbeds(
        index=torch.cat(index),
        embeds=torch.cat(embeds),
        deepstack=tuple(torch.cat(per_layer) for per_layer in zip(*deepstack)),
        image_keys=tuple(itertools.chain.from_iterable(p.vision.image_keys for p in prompts if p.vision is not None)),
    )


def text_model_inputs(model: nn.Module, ids: torch.Tensor, vision: VisionEmbeds) -> dict:  # ids: [B] int64
    """Inputs of transformers' text model for packed ids [B] with images: what its multimodal forward passes it.

    ``inputs_embeds`` [1, B, d] with the vision tower's embeddings in place of the
    placeholders', and for a deepstack family (Qwen3-VL) ``visual_pos_masks`` [1, B] and
    ``deepstack_visual_embeds`` (one [n, d] per early layer). The reference forward's image path.
    """
    index = vision.index.to(ids.device)
    embeds = model.get_input_embeddings()(ids)  # [B, d]
    embeds[index] = vision.embeds.to(embeds.device, embeds.dtype)
    inputs = {"inputs_embeds": embeds[None]}
    if vision.deepstack:
        mask = torch.zeros(1, ids.shape[0], dtype=torch.bool, device=ids.device)
        mask[0, index] = True
        inputs |= {"visual_pos_masks": mask, "deepstack_visual_embeds": list(vision.deepstack)}
    return inputs


def prompt_positions(model: nn.Module, inputs: TargetInputs) -> tuple[torch.Tensor, int]:
    """M-RoPE ids [3, 1, L] of one prompt and its rope_delta, from the model's own ``get_rope_index``."""
    ids = inputs.input_ids
    if inputs.num_images == 0:
        return torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, 1, -1), 0
    kwargs = inputs.model_kwargs
    mrope, deltas = model.model.get_rope_index(
        ids,
        mm_token_type_ids=kwargs.get("mm_token_type_ids"),
        image_grid_thw=kwargs.get("image_grid_thw"),
        video_grid_thw=kwargs.get("video_grid_thw"),
    )
    return mrope.to(ids.device), int(deltas.flatten()[0])


def vision_token_ids(model: nn.Module) -> list[int]:
    """The placeholder token ids the vision tower's embeddings replace (images and videos)."""
    config = model.config
    return sorted({getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)} - {None})


def drafter_positions(model: nn.Module, inputs: TargetInputs, mrope: torch.Tensor, rule: str) -> torch.Tensor:
    """1-D text-stream positions [L] (CPU) of a prompt whose M-RoPE ids are ``mrope`` [3, 1, L]."""
    vision_mask = torch.isin(inputs.input_ids[0].cpu(), torch.tensor(vision_token_ids(model)))
    return text_stream_positions(mrope[:, 0].cpu(), vision_mask, rule)


@torch.no_grad()
def row_prompt(
    model: nn.Module,
    spec: FamilySpec,
    inputs: TargetInputs,
    position_rule: str,
    vision_cache: VisionCache | None = None,
) -> RowPrompt:
    """A processed prompt ready for :meth:`RaggedBatch.prefill`: its images through the vision tower.

    With ``vision_cache``, images seen before take the tower's stored outputs (:class:`VisionCache`).

    Raises ValueError when the prompt's placeholder tokens and its images' embeddings
    disagree (the inputs were not built by the target's processor for these images).
    """
    check_position_rule(position_rule)
    ids = inputs.input_ids[0]
    if inputs.num_images == 0:
        return RowPrompt(ids=ids.cpu())
    kwargs = inputs.model_kwargs
    index = torch.nonzero(ids == model.config.image_token_id).flatten()  # [n] the placeholders, in order
    expected = int(kwargs["image_grid_thw"].prod(-1).sum()) // model.model.visual.spatial_merge_size**2
    if index.numel() != expected:
        raise ValueError(
            f"the prompt has {index.numel()} image placeholder tokens but its images make {expected} "
            "embeddings: build the inputs with target.build_inputs (or sequence_inputs) for these images"
        )
    mrope, rope_delta = prompt_positions(model, inputs)
    pixels, grid = kwargs["pixel_values"], kwargs["image_grid_thw"]
    if vision_cache is None:
        embeds, deepstack = image_embeddings(model, spec, pixels, grid)
    else:
        embeds, deepstack = vision_cache.embeddings(model, spec, pixels, grid)
    assert embeds.shape[0] == expected, (embeds.shape, expected)
    tokens_per_image = (grid.prod(-1) // model.model.visual.spatial_merge_size**2).tolist()
    keys = tuple(
        itertools.chain.from_iterable(
            itertools.repeat(key, count) for key, count in zip(image_keys(pixels, grid), tokens_per_image, strict=True)
        )
    )
    return RowPrompt(
        ids=ids.cpu(),
        mrope=mrope[:, 0].cpu(),
        rope_delta=rope_delta,
        vision=VisionEmbeds(index=index.cpu(), embeds=embeds, deepstack=deepstack, image_keys=keys),
        text_positions=drafter_positions(model, inputs, mrope, position_rule),
    )


def image_keys(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[bytes]:
    """One content digest per image of a prompt: its own patches' bytes and its grid (:func:`image_key`).

    The processor concatenates the images' patches, ``t * h * w`` rows each, in order.
    """
    patches = image_grid_thw.prod(-1).tolist()
    starts = [sum(patches[:i]) for i in range(len(patches))]
    return [
        image_key(pixel_values[first : first + count], image_grid_thw[i : i + 1])
        for i, (first, count) in enumerate(zip(starts, patches, strict=True))
    ]
