import io

import numpy as np
import pytest
from PIL import Image

from vlmspec.targets.inputs import chat_messages, load_image, load_images


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
