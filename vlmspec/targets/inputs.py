"""Turn what a user passes (images, a prompt or chat messages) into Qwen-VL model inputs.

Images may be a PIL image, a file path, a numpy array (H x W x 3, uint8 or float in
[0, 1]), raw encoded bytes, a list of those, or None. Every problem is reported as an
error that says what to pass instead, before any model state is touched.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

ImageLike = Any  # PIL.Image.Image | str | os.PathLike | np.ndarray | bytes


@dataclass
class TargetInputs:
    """Processor output for one request, ready for a prefill."""

    input_ids: torch.Tensor  # [1, L] int64
    model_kwargs: dict[
        str, torch.Tensor
    ]  # input_ids, attention_mask, pixel_values, image_grid_thw, mm_token_type_ids ...
    num_images: int

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


def load_image(image: ImageLike) -> Image.Image:
    """One image as an RGB PIL image, with an error that says how to fix bad input."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise FileNotFoundError(
                f"image file not found: {str(path)!r}; pass an existing path, a PIL image or an array"
            )
        return _decode(path.read_bytes(), f"file {str(path)!r}")
    if isinstance(image, (bytes, bytearray)):
        return _decode(bytes(image), "the given bytes")
    if isinstance(image, np.ndarray):
        return _from_array(image)
    raise TypeError(
        f"unsupported image type {type(image).__name__}; pass a PIL image, a file path, "
        "a numpy array (H x W x 3) or encoded image bytes"
    )


def load_images(images: ImageLike | Sequence[ImageLike] | None) -> list[Image.Image]:
    """Zero, one or several images as a list of RGB PIL images."""
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return [load_image(image) for image in images]
    return [load_image(images)]


def chat_messages(prompt: str | None, num_images: int) -> list[dict]:
    """A single user turn with ``num_images`` image slots followed by the prompt text."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string (or pass messages=[...]), got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("prompt is empty; pass the question or instruction to answer")
    content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": prompt}]
    return [{"role": "user", "content": content}]


def count_image_slots(messages: list[dict]) -> int:
    """Number of image items in chat messages (content lists with {"type": "image"})."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError('messages must be a list of {"role": ..., "content": ...} dicts')
    slots = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            slots += sum(1 for item in content if isinstance(item, dict) and item.get("type") == "image")
    return slots


def _decode(data: bytes, what: str) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except UnidentifiedImageError:
        reason = f"{len(data):,} bytes in no image format Pillow reads"  # Pillow's own text names a BytesIO object
    except OSError as err:
        reason = str(err)
    raise ValueError(f"{what} is not a readable image ({reason}); pass a PNG/JPEG file, a PIL image or an array")


def _from_array(array: np.ndarray) -> Image.Image:
    if array.ndim == 2:
        array = np.stack([array] * 3, axis=-1)
    if array.ndim != 3 or array.shape[-1] not in (3, 4):
        raise ValueError(f"image array must be H x W x 3 (or 4, or H x W grey), got shape {array.shape}")
    if array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"image array must be uint8 or float in [0, 1], got dtype {array.dtype}")
        array = (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)
    return Image.fromarray(array[..., :3])
