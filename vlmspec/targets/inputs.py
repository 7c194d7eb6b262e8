"""Turn what a user passes (images, a prompt or chat messages) into Qwen-VL model inputs.

Images may be a PIL image, a file path, a numpy array (H x W x 3, uint8 or float in
[0, 1]), raw encoded bytes, a list of those, or None. Every problem is reported as an
error that says what to pass instead, before any model state is touched.

Encoded images (a file path, bytes) are checked against :class:`ImageLimits` before
they are decoded: their size in bytes before they are read, their pixels (width x
height, from the header Pillow reads lazily) before the pixels are decompressed. So a
decompression bomb, a few kilobytes of PNG that would decode to gigabytes, costs nothing.
PIL images and arrays are taken as they are: their memory is already spent.

Only the formats of :data:`IMAGE_FORMATS` are read (PNG, JPEG, WebP, GIF's first frame,
BMP): the format is told from the data's first bytes before Pillow sees it, and Pillow is
then allowed that one format, so no other plugin (EPS, which runs Ghostscript; TIFF, ICO
...) is ever reached.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

ImageLike = Any  # PIL.Image.Image | str | os.PathLike | np.ndarray | bytes


class ImageTooLarge(ValueError):
    """An encoded image over one of its :class:`ImageLimits` (a ValueError: bad input).

    ``limit`` names the field it is over (``"max_bytes"`` or ``"max_pixels"``), ``allowed``
    its value and ``found`` what the image has ("25,165,824 bytes"), so a host can word the
    fix in its own terms (the server names its command-line flag).
    """

    def __init__(self, what: str, found: str, limit: str, allowed: int) -> None:
        self.found, self.limit, self.allowed = found, limit, allowed
        super().__init__(
            f"{what}: {found}, over the limit ImageLimits.{limit}={allowed:,}; pass a smaller image, "
            f"or decode it under a raised limit and pass the PIL image: "
            f"vlmspec.targets.inputs.load_image(image, limits=ImageLimits({limit}=...))"
        )


@dataclass(frozen=True)
class ImageLimits:
    """Caps on one encoded image (a file, bytes, a data URL), checked before it is decoded.

    ``max_bytes`` is checked before the data is read or base64-decoded, ``max_pixels``
    (width x height) on the header before the pixels are decompressed, so neither a huge
    file nor a decompression bomb costs memory. The defaults, with their reasons:

    * ``max_pixels`` 40,000,000: a Qwen-VL processor scales every image down to at most
      12.8 megapixels (Qwen2/2.5-VL's largest shipped ``max_pixels``; Qwen3-VL's is 16.8),
      so more pixels buy nothing but decoding memory. 40 MP admits an 8K frame (33 MP) or a
      24 MP photo with room, and decodes to 120 MB of RGB.
    * ``max_bytes`` 20 MiB: holds such a photo as a high-quality JPEG, and is the per-image
      size OpenAI's API documents.

    Pillow's own decompression-bomb guard (about 179 MP by default) refuses larger images
    whatever ``max_pixels`` says.
    """

    max_bytes: int = 20 * 1024 * 1024  # encoded size of one image
    max_pixels: int = 40_000_000  # width * height of one image

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ImageLimits.{name} must be a positive integer, got {value!r}")

    def check_bytes(self, size: int, what: str) -> None:
        """Raise :class:`ImageTooLarge` if ``size`` encoded bytes are over ``max_bytes``."""
        if size > self.max_bytes:
            raise ImageTooLarge(what, f"{size:,} bytes", "max_bytes", self.max_bytes)

    def check_pixels(self, size: tuple[int, int], what: str) -> None:
        """Raise :class:`ImageTooLarge` if an image of ``size`` (width, height) is over ``max_pixels``."""
        width, height = size
        if width * height > self.max_pixels:
            raise ImageTooLarge(what, f"{width * height:,} pixels ({width} x {height})", "max_pixels", self.max_pixels)


DEFAULT_IMAGE_LIMITS = ImageLimits()

# The encoded formats read: Pillow's name -> the first bytes that mark it (WebP: RIFF, 4 size bytes, WEBP).
IMAGE_FORMATS = {
    "PNG": (b"\x89PNG\r\n\x1a\n",),
    "JPEG": (b"\xff\xd8\xff",),
    "GIF": (b"GIF87a", b"GIF89a"),
    "BMP": (b"BM",),
    "WEBP": (b"RIFF",),
}


def image_format(data: bytes) -> str | None:
    """The :data:`IMAGE_FORMATS` name of encoded image ``data``, from its first bytes; None if it is none of them."""
    for name, magics in IMAGE_FORMATS.items():
        if data.startswith(magics):
            return name if name != "WEBP" or data[8:12] == b"WEBP" else None
    return None


def image_header(data: bytes, what: str, limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> tuple[int, int]:
    """The (width, height) of encoded image ``data``, read from its header: nothing is decoded.

    Raises :class:`ImageTooLarge` over ``limits`` and ValueError for data in no format of
    :data:`IMAGE_FORMATS` or a header Pillow cannot read. A host that caps several images
    together reads every header first, then decodes (:func:`load_image`).
    """
    with _opened(data, what, limits) as image:
        return image.size


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


def load_image(image: ImageLike, limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> Image.Image:
    """One image as an RGB PIL image, with an error that says how to fix bad input.

    A file or encoded bytes over ``limits`` raise :class:`ImageTooLarge` (a ValueError)
    before they are decoded; data Pillow cannot decode raises ValueError. PIL images and
    arrays are not checked against ``limits``: they are decoded already.
    """
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise FileNotFoundError(
                f"image file not found: {str(path)!r}; pass an existing path, a PIL image or an array"
            )
        what = f"file {str(path)!r}"
        limits.check_bytes(path.stat().st_size, what)  # before reading it
        return _decode(path.read_bytes(), what, limits)
    if isinstance(image, (bytes, bytearray)):
        return _decode(bytes(image), "the given bytes", limits)
    if isinstance(image, np.ndarray):
        return _from_array(image)
    raise TypeError(
        f"unsupported image type {type(image).__name__}; pass a PIL image, a file path, "
        "a numpy array (H x W x 3) or encoded image bytes"
    )


def load_images(
    images: ImageLike | Sequence[ImageLike] | None, limits: ImageLimits = DEFAULT_IMAGE_LIMITS
) -> list[Image.Image]:
    """Zero, one or several images as a list of RGB PIL images (each checked as :func:`load_image` does)."""
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return [load_image(image, limits) for image in images]
    return [load_image(images, limits)]


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


def _decode(data: bytes, what: str, limits: ImageLimits) -> Image.Image:
    """The one image decoder: limits and the format first, then Pillow; every failure is a ValueError."""
    with _opened(data, what, limits) as image:
        try:
            return image.convert("RGB")  # a GIF's (or an animated WebP's) first frame
        except Exception as err:  # noqa: BLE001 - Pillow's plugins report broken data as OSError, SyntaxError ...
            raise ValueError(f"{what} is not a readable image ({type(err).__name__}: {err}); {_WHAT_TO_PASS}") from None


_WHAT_TO_PASS = "pass a PNG, JPEG, WebP, GIF or BMP file, a PIL image or an array"


@contextlib.contextmanager
def _opened(data: bytes, what: str, limits: ImageLimits) -> Iterator[Image.Image]:
    """``data`` opened by Pillow (its header read, its pixels not), after the byte, format and pixel checks."""
    limits.check_bytes(len(data), what)
    found = image_format(data)
    if found is None:
        raise ValueError(
            f"{what} is not a readable image: {len(data):,} bytes in no image format read here; {_WHAT_TO_PASS}"
        )
    try:
        image = Image.open(io.BytesIO(data), formats=[found])  # reads the header only, with that one plugin
    except Image.DecompressionBombError:  # Image.open applies Pillow's own guard before we see the size
        found = f"more than {2 * (Image.MAX_IMAGE_PIXELS or 0):,} pixels (Pillow refuses it as a decompression bomb)"
        raise ImageTooLarge(what, found, "max_pixels", limits.max_pixels) from None
    except UnidentifiedImageError:  # Pillow's own text names a BytesIO object
        raise ValueError(f"{what} is not a readable {found} image ({len(data):,} bytes); {_WHAT_TO_PASS}") from None
    except Exception as err:  # noqa: BLE001 - broken headers raise OSError, SyntaxError, EOFError, struct.error ...
        raise ValueError(f"{what} is not a readable image ({type(err).__name__}: {err}); {_WHAT_TO_PASS}") from None
    with image:
        limits.check_pixels(image.size, what)  # before the pixels are decompressed
        yield image


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
