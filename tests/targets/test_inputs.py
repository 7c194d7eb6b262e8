import io

import numpy as np
import pytest
from image_helpers import bomb_png
from PIL import EpsImagePlugin, Image, ImageFile

from vlmspec.targets.inputs import (
    ImageLimits,
    ImageTooLarge,
    chat_messages,
    image_format,
    image_header,
    load_image,
    load_images,
)


def test_accepts_pil_path_array_and_bytes(tmp_path, astronaut, coffee):
    path = tmp_path / "a.png"
    astronaut.save(path)
    buffer = io.BytesIO()
    astronaut.save(buffer, format="JPEG")
    for image in (astronaut, path, str(path), coffee, buffer.getvalue(), coffee.astype(np.float32) / 255):
        assert load_image(image).mode == "RGB"
    assert load_images(None) == []
    assert len(load_images([astronaut, coffee])) == 2


def test_bad_images_say_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_image(tmp_path / "missing.png")
    not_image = tmp_path / "notes.png"
    not_image.write_bytes(b"these bytes are not an image")
    with pytest.raises(ValueError, match="not a readable image"):
        load_image(not_image)
    with pytest.raises(ValueError, match="not a readable image"):
        load_image(b"\x00\x01garbage")
    with pytest.raises(TypeError, match="unsupported image type"):
        load_image(12345)
    with pytest.raises(ValueError, match="H x W x 3"):
        load_image(np.zeros((4, 4, 7), dtype=np.uint8))


def test_prompt_validation():
    with pytest.raises(ValueError, match="empty"):
        chat_messages("   ", 0)
    with pytest.raises(TypeError, match="string"):
        chat_messages(None, 1)
    assert chat_messages("hi", 2)[0]["content"][:2] == [{"type": "image"}, {"type": "image"}]


def test_grey_image_is_converted():
    grey = Image.fromarray(np.zeros((8, 8), dtype=np.uint8), mode="L")
    assert load_image(grey).mode == "RGB"


def test_a_grey_array_is_accepted_as_the_readme_documents():
    """README: numpy arrays H x W x 3, H x W x 4 or H x W grey (uint8, or floats in [0, 1])."""
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    image = load_image(grey)
    assert image.mode == "RGB" and image.size == (4, 3)
    assert (np.asarray(image) == grey[..., None]).all()  # the grey level in every channel
    assert np.asarray(load_image(np.full((3, 4), 0.5))).max() == 128
    with pytest.raises(ValueError, match="H x W x 3 \\(or 4, or H x W grey\\), got shape \\(3, 4, 2\\)"):
        load_image(np.zeros((3, 4, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match="got shape \\(4,\\)"):
        load_image(np.zeros(4, dtype=np.uint8))


@pytest.fixture
def no_decoding(monkeypatch):
    """Fail any test that makes Pillow decompress pixels (the header may be read)."""

    def load(self):
        raise AssertionError("the pixels were decoded before the limits were checked")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def test_the_crafted_bomb_is_a_real_png():
    """The helper's PNGs decode (a small one here), so the limits below refuse real images."""
    image = load_image(bomb_png(64, 48))
    assert image.size == (64, 48) and image.getextrema() == ((0, 0), (0, 0), (0, 0))


def test_a_decompression_bomb_is_a_value_error_not_pillows_own(tmp_path, no_decoding):
    bomb = bomb_png(20_000, 20_000)  # 400 million pixels: over Pillow's own guard
    assert len(bomb) < 100_000
    path = tmp_path / "bomb.png"
    path.write_bytes(bomb)
    for image in (bomb, path):
        with pytest.raises(ImageTooLarge, match="decompression bomb.*ImageLimits.max_pixels=40,000,000"):
            load_image(image)


def test_pixels_over_the_limit_are_refused_before_decoding(tmp_path, no_decoding):
    bomb = bomb_png(8000, 6000)  # 48 megapixels: under Pillow's guard, over the default limit
    with pytest.raises(ValueError, match=r"48,000,000 pixels \(8000 x 6000\), over the limit ImageLimits.max_pixels"):
        load_image(bomb)
    with pytest.raises(ImageTooLarge, match=r"3,072 pixels .*\.max_pixels=3,071") as refused:
        load_images([bomb_png(64, 48)], ImageLimits(max_pixels=3071))
    assert (refused.value.limit, refused.value.allowed) == ("max_pixels", 3071)


def test_pixels_at_the_limit_are_accepted():
    assert load_image(bomb_png(64, 48), ImageLimits(max_pixels=64 * 48)).size == (64, 48)


def test_bytes_over_the_limit_are_refused_before_reading(tmp_path, monkeypatch):
    data = bomb_png(64, 48)
    path = tmp_path / "small.png"
    path.write_bytes(data)
    limits = ImageLimits(max_bytes=len(data) - 1)
    with pytest.raises(ImageTooLarge, match=f"{len(data)} bytes, over the limit ImageLimits.max_bytes={len(data) - 1}"):
        load_image(data, limits)
    monkeypatch.setattr(
        type(path), "read_bytes", lambda self: pytest.fail("the file was read before its size was checked")
    )
    with pytest.raises(ImageTooLarge, match="small.png.*max_bytes"):
        load_image(path, limits)


def test_in_memory_images_are_not_held_to_the_limits(astronaut):
    """A PIL image or an array is decoded already: the limits guard decoding, not the processor."""
    limits = ImageLimits(max_bytes=1, max_pixels=1)
    assert load_image(astronaut, limits).size == astronaut.size
    assert load_image(np.zeros((4, 4, 3), dtype=np.uint8), limits).size == (4, 4)


def test_a_broken_image_is_a_value_error(astronaut):
    buffer = io.BytesIO()
    astronaut.save(buffer, format="PNG")
    data = buffer.getvalue()
    with pytest.raises(ValueError, match="not a readable image"):
        load_image(data[: len(data) // 2])  # the header is whole, the pixel data cut short


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None])
def test_limits_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="ImageLimits.max_pixels must be a positive integer"):
        ImageLimits(max_pixels=bad)


def encoded(image: Image.Image, kind: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, kind, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP", "BMP"])
def test_the_allowed_formats_are_read(astronaut, kind):
    image = load_image(encoded(astronaut.resize((40, 30)), kind))
    assert image.size == (40, 30) and image.mode == "RGB"
    assert image_header(encoded(astronaut.resize((40, 30)), kind), "it") == (40, 30)


def test_a_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (16, 16), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    assert image_format(buffer.getvalue()) == "GIF"
    red, green, blue = load_image(buffer.getvalue()).getpixel((8, 8))
    assert red > 200 and blue < 50


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\n%%EndComments\nshowpage\n%%EOF\n"


@pytest.mark.parametrize("kind", ["EPS", "TIFF", "ICO", "PPM", "text"])
def test_other_formats_are_refused_from_their_first_bytes_before_any_plugin_runs(astronaut, kind, monkeypatch):
    """EPS would run Ghostscript: it, and every format outside the allow-list, is refused before Pillow sees it."""
    opened = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda self: opened.append("eps"))
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: opened.append("open"))
    data = {"EPS": EPS, "text": b"hello, not an image"}.get(kind) or encoded(astronaut.resize((32, 32)), kind)
    assert image_format(data) is None
    with pytest.raises(ValueError, match="not a readable image: .* in no image format read here"):
        load_image(data)
    with pytest.raises(ValueError, match="PNG, JPEG, WebP, GIF or BMP"):
        image_header(data, "it")
    assert not opened


def test_a_file_that_lies_about_its_format_is_opened_by_the_one_plugin_its_bytes_name(astronaut):
    """PNG bytes behind a JPEG's first bytes: Pillow is allowed JPEG alone, so the PNG plugin never reads it."""
    data = b"\xff\xd8\xff" + encoded(astronaut.resize((8, 8)), "PNG")
    assert image_format(data) == "JPEG"
    with pytest.raises(ValueError, match="not a readable"):
        load_image(data)
