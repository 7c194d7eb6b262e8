"""Chat messages of the OpenAI API -> the messages and images a Qwen-VL target takes.

Images arrive as ``image_url`` parts. A ``data:`` URL carries the image itself (base64);
a local path (``file://...`` or a plain path) is read only when the server was started
with an allowed folder and the path lies inside it. Remote URLs are never fetched: the
server must not make requests on a client's behalf, and the answer says what to send.

Every image is held to the server's :class:`~vlmspec.targets.inputs.ImageLimits` before it
is decoded (a data URL's size is known from its base64 length, a file's from its size on
disk), and decoded by the one reader, :func:`~vlmspec.targets.inputs.load_image`.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image

from vlmspec.server.protocol import APIError, Message
from vlmspec.targets.inputs import DEFAULT_IMAGE_LIMITS, ImageLimits, ImageTooLarge, load_image

LIMIT_FLAGS = {"max_bytes": "--max-image-bytes", "max_pixels": "--max-image-pixels"}  # vlmspec serve's names


def engine_messages(
    messages: list[Message], allowed_media: Path | None = None, limits: ImageLimits = DEFAULT_IMAGE_LIMITS
) -> tuple[list[dict], list[Image.Image]]:
    """The Hugging Face chat messages (``{"type": "image"}`` slots) and the images in slot order.

    Raises :class:`APIError` (400) for an image that is unreadable, not allowed or over ``limits``.
    """
    converted, images = [], []
    for index, message in enumerate(messages):
        content = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else []
        if not isinstance(message.content, str):
            for part_index, part in enumerate(message.content):
                if part.type == "text":
                    content.append({"type": "text", "text": part.text})
                else:
                    param = f"messages[{index}].content[{part_index}].image_url.url"
                    images.append(read_image_url(part.image_url.url, allowed_media, param, limits))
                    content.append({"type": "image"})
        role = "system" if message.role == "developer" else message.role
        converted.append({"role": role, "content": content})
    if not any(part for m in converted if m["role"] == "user" for part in m["content"]):
        raise APIError(400, "the messages have no user content: send at least one user message", param="messages")
    return converted, images


def read_image_url(
    url: str, allowed_media: Path | None, param: str, limits: ImageLimits = DEFAULT_IMAGE_LIMITS
) -> Image.Image:
    """One image from a ``data:`` URL or an allowed local path, or a 400 that says what to send instead."""
    try:
        return load_image(_encoded_image(url, allowed_media, param, limits), limits)
    except ImageTooLarge as err:
        raise APIError(
            400,
            f"the image has {err.found}, over the server's limit of {err.allowed:,}; send a smaller image "
            f"(the limit is set by vlmspec serve {LIMIT_FLAGS[err.limit]})",
            param=param,
            code="image_too_large",
        ) from None
    except ValueError:  # Pillow's own words name Python objects: say what an HTTP client can change
        raise APIError(
            400,
            "the image is not readable: it is in no image format the server reads, or broken; "
            "send a PNG or JPEG file as a base64 data: URL (data:image/png;base64,...)",
            param=param,
        ) from None


def _encoded_image(url: str, allowed_media: Path | None, param: str, limits: ImageLimits) -> bytes | Path:
    """The encoded image a URL names: a data URL's bytes, or an allowed local file (read by load_image)."""
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        return _data_url_bytes(url, param, limits)
    if scheme in ("http", "https", "ftp"):
        raise APIError(
            400,
            f"remote image URLs are not fetched ({url[:80]!r}); send the image as a base64 data: URL "
            "(data:image/png;base64,...)",
            param=param,
            code="remote_url_not_allowed",
        )
    if scheme in ("file", ""):
        return _local_file(url, allowed_media, param)
    raise APIError(400, f"unsupported image URL scheme {scheme!r}; send a base64 data: URL", param=param)


def _data_url_bytes(url: str, param: str, limits: ImageLimits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise APIError(400, "image data URLs must be base64: data:image/png;base64,<data>", param=param)
    limits.check_bytes(_base64_size(payload), param)  # before decoding it
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "the image data URL is not valid base64", param=param) from None


def _base64_size(payload: str) -> int:
    """The number of bytes ``payload`` decodes to (4 characters carry 3 bytes, "=" pads the last group)."""
    return len(payload) * 3 // 4 - (len(payload) - len(payload.rstrip("=")))


def _local_file(url: str, allowed_media: Path | None, param: str) -> Path:
    if allowed_media is None:
        raise APIError(
            400,
            "local image paths are disabled; send a base64 data: URL, or start the server with "
            "--allowed-local-media-path FOLDER",
            param=param,
        )
    path = Path(unquote(urlparse(url).path) if url.startswith("file:") else url).resolve()
    if not path.is_relative_to(allowed_media.resolve()):
        raise APIError(400, f"image path {str(path)!r} is outside the allowed folder", param=param)
    if not path.is_file():
        raise APIError(400, f"image file not found: {str(path)!r}", param=param)
    return path
