"""Chat messages of the OpenAI API -> the messages and images a Qwen-VL target takes.

Images arrive as ``image_url`` parts. A ``data:`` URL carries the image itself (base64);
a local path (``file://...`` or a plain path) is read only when the server was started
with an allowed folder and the path lies inside it. Remote URLs are never fetched: the
server must not make requests on a client's behalf, and the answer says what to send.

Nothing is decoded before every image of the request has passed its checks: the count
(``RequestLimits.max_images``), each one's encoded size (a data URL's from its base64
length, a file's from its size on disk), its format (from its first bytes: PNG, JPEG,
WebP, GIF, BMP) and its pixels (from its header), then the request's total pixels
(``RequestLimits.max_total_pixels``). Then :func:`~vlmspec.targets.inputs.load_image`,
the one reader, decodes them. No error message names a path on the server.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image

from vlmspec.server.limits import DEFAULT_REQUEST_LIMITS, FLAGS, RequestLimits
from vlmspec.server.protocol import APIError, Message
from vlmspec.targets.inputs import DEFAULT_IMAGE_LIMITS, ImageLimits, ImageTooLarge, image_header, load_image

LIMIT_FLAGS = {"max_bytes": "--max-image-bytes", "max_pixels": "--max-image-pixels"}  # vlmspec serve's names
LOW_DETAIL = (512, 512)  # detail "low": the image is scaled to fit this box, as OpenAI does


def engine_messages(
    messages: list[Message],
    allowed_media: Path | None = None,
    limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
    request_limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
) -> tuple[list[dict], list[Image.Image]]:
    """The Hugging Face chat messages (``{"type": "image"}`` slots) and the images in slot order.

    Raises :class:`APIError` (400) for an image that is unreadable, not allowed or over a
    limit, and for a request over ``request_limits``' image count or total pixels, before
    any image is decoded.
    """
    converted, parts = [], []  # parts: (image part, its param name) in slot order
    for index, message in enumerate(messages):
        content = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else []
        if not isinstance(message.content, str):
            for part_index, part in enumerate(message.content):
                if part.type == "text":
                    content.append({"type": "text", "text": part.text})
                else:
                    parts.append((part, f"messages[{index}].content[{part_index}].image_url.url"))
                    content.append({"type": "image"})
        role = "system" if message.role == "developer" else message.role
        converted.append({"role": role, "content": content})
    if not any(part for m in converted if m["role"] == "user" for part in m["content"]):
        raise APIError(400, "the messages have no user content: send at least one user message", param="messages")
    if len(parts) > request_limits.max_images:
        raise APIError(
            400,
            f"the request has {len(parts)} images, over the server's limit of {request_limits.max_images} "
            f"(vlmspec serve {FLAGS['max_images']})",
            param="messages",
            code="too_many_images",
        )
    encoded = [(_encoded_image(part.image_url.url, allowed_media, param, limits), param) for part, param in parts]
    pixels = sum(width * height for width, height in (_header(data, param, limits) for data, param in encoded))
    if pixels > request_limits.max_total_pixels:
        raise APIError(
            400,
            f"the request's images have {pixels:,} pixels together, over the server's limit of "
            f"{request_limits.max_total_pixels:,} (vlmspec serve {FLAGS['max_total_pixels']}); send fewer or "
            "smaller images",
            param="messages",
            code="image_too_large",
        )
    images = []
    for (part, _), (data, param) in zip(parts, encoded, strict=True):
        image = _read(lambda data=data: load_image(data, limits), param)
        if part.image_url.detail == "low":
            image.thumbnail(LOW_DETAIL)
        images.append(image)
    return converted, images


def read_image_url(
    url: str, allowed_media: Path | None, param: str, limits: ImageLimits = DEFAULT_IMAGE_LIMITS
) -> Image.Image:
    """One image from a ``data:`` URL or an allowed local path, or a 400 that says what to send instead."""
    data = _encoded_image(url, allowed_media, param, limits)
    return _read(lambda: load_image(data, limits), param)


def _header(data: bytes, param: str, limits: ImageLimits) -> tuple[int, int]:
    return _read(lambda: image_header(data, param, limits), param)


def _read(read, param: str):
    """``read()``, its failures answered with a 400 an HTTP client can act on."""
    try:
        return read()
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
            "the image is not readable: it is in no image format the server reads (PNG, JPEG, WebP, GIF, BMP), "
            "or broken; send one as a base64 data: URL (data:image/png;base64,...)",
            param=param,
            code="unsupported_image",
        ) from None


def _encoded_image(url: str, allowed_media: Path | None, param: str, limits: ImageLimits) -> bytes:
    """The encoded image a URL names: a data URL's bytes, or an allowed local file's (within the byte cap)."""
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        return _data_url_bytes(url, param, limits)
    if scheme in ("http", "https", "ftp"):
        raise APIError(
            400,
            "remote image URLs are not fetched; send the image as a base64 data: URL (data:image/png;base64,...)",
            param=param,
            code="remote_url_not_allowed",
        )
    if scheme in ("file", ""):
        path = _local_file(url, allowed_media, param)
        try:
            _read(lambda: limits.check_bytes(path.stat().st_size, param), param)  # before reading it
            return path.read_bytes()
        except OSError:
            raise APIError(400, "the image file at that path is not readable by the server", param=param) from None
    raise APIError(400, "unsupported image URL scheme; send a base64 data: URL", param=param)


def _data_url_bytes(url: str, param: str, limits: ImageLimits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise APIError(400, "image data URLs must be base64: data:image/png;base64,<data>", param=param)
    _read(lambda: limits.check_bytes(_base64_size(payload), param), param)  # before decoding it
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
        raise APIError(400, "the image path is outside the folder the server allows", param=param)
    if not path.is_file():
        raise APIError(400, "no image file at that path in the folder the server allows", param=param)
    return path
