"""Crafted image files for the tests of image limits: decompression bombs built without decoding them."""

from __future__ import annotations

import functools
import struct
import zlib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@functools.lru_cache(maxsize=8)
def bomb_png(width: int, height: int) -> bytes:
    """A valid, all-black 1-bit PNG of ``width`` x ``height``: kilobytes on disk, ``width * height`` pixels decoded.

    Built scanline by scanline with zlib, so making it never holds the decoded image
    (Pillow's ``Image.new`` would allocate every pixel first).
    """
    scanline = b"\x00" * (1 + (width + 7) // 8)  # filter type 0, then 8 pixels a byte
    compressor = zlib.compressobj(9)
    pixels = b"".join(compressor.compress(scanline) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # bit depth 1, greyscale, no interlace
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", pixels) + _chunk(b"IEND", b"")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
