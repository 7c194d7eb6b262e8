"""Build a small MMBench-format TSV from real photographs (scikit-image), for tests and the README.

MMBench itself is not on any package registry. This writes a file in its exact layout
(columns ``index, question, hint, A, B, C, D, E, answer, category, l2-category, split,
image``; the image is a base64-encoded PNG) with thirteen hand-written questions about
``skimage.data`` images, covering the shapes a reader must handle: a row with a hint,
a row with five options (E), rows with two options, and rows whose hint is empty.

Rebuild the checked-in fixture with::

    python -m benchmarks.make_mmbench_fixture --out tests/fixtures/mmbench_mini.tsv

The output is deterministic for a given scikit-image and Pillow version.
"""

from __future__ import annotations

import argparse
import base64
import csv
import io
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python benchmarks/x.py): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import skimage_image

#: Column order of an MMBench TSV (the E column is present; empty where a row has four options).
MMBENCH_COLUMNS = (
    "index",
    "question",
    "hint",
    "A",
    "B",
    "C",
    "D",
    "E",
    "answer",
    "category",
    "l2-category",
    "split",
    "image",
)

# (skimage image, question, hint, options, answer, category, l2-category). Categories and
# l2-categories use MMBench's own names.
FIXTURE_ROWS: tuple[tuple[str, str, str, tuple[str, ...], str, str, str], ...] = (
    (
        "astronaut",
        "What is the person in the image wearing?",
        "",
        ("A space suit", "A wedding dress", "A diving suit", "A chef's uniform"),
        "A",
        "attribute_recognition",
        "finegrained_perception (instance-level)",
    ),
    (
        "coffee",
        "What drink is served in the cup?",
        "",
        ("Orange juice", "Coffee", "Red wine", "Milk"),
        "B",
        "image_topic",
        "coarse_perception",
    ),
    (
        "chelsea",
        "Which animal is shown in the picture?",
        "",
        ("A dog", "A rabbit", "A cat", "A fox"),
        "C",
        "image_topic",
        "coarse_perception",
    ),
    (
        "rocket",
        "What is most likely to happen next in this scene?",
        "",
        (
            "The tower will be painted",
            "The rocket will be launched",
            "The rocket will sail away",
            "Nothing will change",
        ),
        "B",
        "future_prediction",
        "logic_reasoning",
    ),
    (
        "camera",
        "What is the man in the picture doing?",
        "",
        ("Playing golf", "Reading a newspaper", "Painting a fence", "Operating a camera on a tripod"),
        "D",
        "action_recognition",
        "finegrained_perception (cross-instance)",
    ),
    (
        "camera",
        "Is this photograph in color or in black and white?",
        "",
        ("In color", "In black and white"),
        "B",
        "image_style",
        "coarse_perception",
    ),
    (
        "coins",
        "How many rows of coins are there in the image?",
        "",
        ("Two", "Three", "Four", "Six"),
        "C",
        "object_localization",
        "finegrained_perception (instance-level)",
    ),
    (
        "page",
        "What is the title printed at the top of the page?",
        "",
        ("Edge detection", "Region-based segmentation", "Image denoising", "Histogram equalization"),
        "B",
        "ocr",
        "finegrained_perception (instance-level)",
    ),
    (
        "hubble_deep_field",
        "What does the image show?",
        "The picture was taken by a telescope in orbit around the Earth.",
        ("City lights at night", "Fireworks over a lake", "Galaxies in deep space", "Cells under a microscope"),
        "C",
        "image_topic",
        "coarse_perception",
    ),
    (
        "immunohistochemistry",
        "What kind of image is this most likely to be?",
        "",
        (
            "A satellite photo of farmland",
            "A stained tissue sample under a microscope",
            "An oil painting",
            "A weather radar map",
            "A photo of tree bark",
        ),
        "B",
        "image_style",
        "coarse_perception",
    ),
    (
        "colorwheel",
        "What is the shape of the colored region?",
        "",
        ("A square", "A triangle", "A circle", "A star"),
        "C",
        "attribute_recognition",
        "finegrained_perception (instance-level)",
    ),
    (
        "brick",
        "What is the wall in the image made of?",
        "",
        ("Glass", "Bricks", "Wood planks", "Sheet metal"),
        "B",
        "physical_property_reasoning",
        "attribute_reasoning",
    ),
    (
        "text",
        "What does the image mostly contain?",
        "",
        ("Handwritten mathematics", "A road sign"),
        "A",
        "ocr",
        "finegrained_perception (instance-level)",
    ),
)


# Text must stay legible, so these images keep twice the size limit.
_TEXT_IMAGES = frozenset({"page", "text"})


def encode_image_base64(image, image_format: str = "PNG") -> str:
    """``image`` (a PIL image) encoded as ``image_format`` bytes, then base64 text, as MMBench stores it."""
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, optimize=True)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def write_mmbench_tsv(
    rows: Iterable[Mapping[str, object]], path: str | os.PathLike, columns: Iterable[str] = MMBENCH_COLUMNS
) -> Path:
    """Write ``rows`` (dicts keyed by column name; missing keys become empty cells) as an MMBench TSV."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(columns)
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, delimiter="\t", lineterminator="\n", extrasaction="raise")
        writer.writeheader()
        for row in rows:
            writer.writerow({column: row.get(column, "") for column in columns})
    return path


def fixture_rows(max_side: int = 128) -> list[dict[str, object]]:
    """The fixture's rows as dicts (images encoded), in file order with indices 0, 1, 2, ..."""
    rows = []
    for index, (name, question, hint, options, answer, category, l2) in enumerate(FIXTURE_ROWS):
        row: dict[str, object] = {
            "index": index,
            "question": question,
            "hint": hint,
            "answer": answer,
            "category": category,
            "l2-category": l2,
            "split": "dev",
            "image": encode_image_base64(skimage_image(name, 2 * max_side if name in _TEXT_IMAGES else max_side)),
        }
        row.update(zip("ABCDE", options))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a small MMBench-format TSV built from scikit-image photographs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/mmbench_mini.tsv"), help="TSV file to write")
    parser.add_argument("--max-side", type=int, default=128, help="longest image side in pixels (keeps the file small)")
    args = parser.parse_args(argv)
    if args.max_side < 16:
        raise ValueError(f"--max-side {args.max_side} is too small for a Qwen-VL processor; use 56 or more")
    path = write_mmbench_tsv(fixture_rows(args.max_side), args.out)
    print(f"wrote {len(FIXTURE_ROWS)} rows to {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
