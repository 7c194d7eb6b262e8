"""Real pictures for benchmarks and training mixes: scikit-image's photographs, and their identity.

Pictures are told apart by their pixels, never by name (``skimage.data.cat`` and
``skimage.data.chelsea`` are one photograph): :func:`pixel_digest` hashes the decoded RGB
array, so two files or loaders that decode to the same picture have the same digest.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from PIL import Image


def skimage_image(name: str, max_side: int | None = None) -> Image.Image:
    """A real photograph shipped with scikit-image (``skimage.data.<name>``) as an RGB PIL image.

    Grey, boolean and RGBA images are converted to RGB; ``max_side`` shrinks the image
    (keeping its aspect ratio, never enlarging) so that CPU runs stay affordable.
    """
    try:
        import skimage.data
    except ImportError as err:
        raise ImportError("real benchmark images come from scikit-image: pip install scikit-image") from err
    loader = getattr(skimage.data, name, None)
    if not callable(loader):
        raise ValueError(f"skimage.data has no image {name!r}; try astronaut, coffee, chelsea, rocket, coins, page")
    array = np.asarray(loader())
    if array.dtype == bool:
        array = array.astype(np.uint8) * 255
    image = Image.fromarray(array).convert("RGB")
    return shrink_image(image, max_side)


def shrink_image(image: Image.Image, max_side: int | None) -> Image.Image:
    """``image`` scaled down so that its longer side is at most ``max_side`` (a copy; None keeps it as is)."""
    if max_side is None or max(image.size) <= max_side:
        return image
    if max_side < 1:
        raise ValueError(f"max_side must be a positive number of pixels, got {max_side}")
    image = image.copy()
    image.thumbnail((max_side, max_side))
    return image


def pixel_digest(image: Any) -> str:
    """SHA-256 of a picture's decoded RGB pixels and its size: the same for every copy of the same picture.

    ``image``: a PIL image or a path to an image file. Resizing changes the digest, so
    compare pictures at the resolution they were loaded at (full size for scikit-image's).
    """
    if isinstance(image, Image.Image):
        array = np.asarray(image.convert("RGB"))
    else:
        with Image.open(image) as opened:
            array = np.asarray(opened.convert("RGB"))
    digest = hashlib.sha256(f"{array.shape}".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()
