"""The held-out split: the prompts and pictures the benchmarks measure, which no drafter trains on.

One definition for both sides of the split:

* **prompt sets**: of each set the training mix reads, the first ``HELD_OUT_PROMPTS[name]``
  entries are the benchmarks' and the rest may be trained on. A set the split does not
  name belongs to the benchmarks entirely (``benchmarks/data/code-maths.jsonl``, a test's
  fixture): :func:`training_prompts` refuses it until its held-out range is added here.
* **pictures**: every scikit-image picture a benchmark asks about (``BENCHMARK_PICTURES``)
  and easy-vqa's test split, told apart by their pixels
  (:func:`~vlmspec.data.pictures.pixel_digest`), so that a picture is held out under any
  name or file: ``skimage.data.cat`` is ``chelsea``.

The benchmarks take their prompts through :func:`held_out_prompts`; the reference prompt mix
(``recipes/reference_prompts.py``) takes its prompts through :func:`training_prompts` and
drops every picture for which :func:`is_held_out_picture` holds.
``tests/benchmarks/test_heldout_split.py`` checks every benchmark's default selection
against what the mix trains on, by content (prompt text and pixel digest).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from vlmspec.data.pictures import pixel_digest, skimage_image
from vlmspec.data.prompt_sets import prompt_set_name, read_prompt_set

# Prompt set name (file stem) -> how many of its first entries are held out: GSM8K 0-99, MT-Bench 0-23.
HELD_OUT_PROMPTS: dict[str, int] = {"gsm8k": 100, "mt-bench": 24}

# scikit-image pictures the benchmarks ask about: the open questions of benchmarks/spec/workloads.py
# and the MMBench fixture of benchmarks/make_mmbench_fixture.py. Held out by their pixels.
BENCHMARK_PICTURES: tuple[str, ...] = (
    "astronaut",
    "brick",
    "camera",
    "chelsea",
    "coffee",
    "coins",
    "colorwheel",
    "hubble_deep_field",
    "immunohistochemistry",
    "page",
    "rocket",
    "text",
)


def held_out_prompts(path: str | Path, count: int | None = None) -> list[str]:
    """The first ``count`` held-out first turns of a prompt set (all of them for None): what a benchmark may ask.

    Raises ValueError when ``count`` reaches into the entries the drafter trains on; a set
    the split does not name is held out entirely and simply ends where the file ends.
    """
    prompts = read_prompt_set(path)
    name = prompt_set_name(path)
    held_out = prompts[: HELD_OUT_PROMPTS.get(name, len(prompts))]
    trained_on = len(prompts) - len(held_out)
    if count is not None and count > len(held_out) and trained_on:
        raise ValueError(
            f"{path}: asked for {count} prompts, but only the first {len(held_out)} of {name!r} are held out "
            f"(the drafter trains on the rest, see vlmspec/data/heldout.py); ask for at most {len(held_out)} "
            "or add another prompt set"
        )
    return held_out if count is None else held_out[:count]


def training_prompts(path: str | Path, count: int) -> list[str]:
    """``count`` first turns of a prompt set from past its held-out entries on: what a drafter may train on."""
    name = prompt_set_name(path)
    if name not in HELD_OUT_PROMPTS:
        raise ValueError(
            f"{path}: the held-out split does not name the prompt set {name!r}; add how many of its first "
            "entries the benchmarks keep to HELD_OUT_PROMPTS in vlmspec/data/heldout.py before training on it"
        )
    prompts = read_prompt_set(path)[HELD_OUT_PROMPTS[name] :]
    if count > len(prompts):
        raise ValueError(
            f"{path} has {len(prompts)} entries past the {HELD_OUT_PROMPTS[name]} held out; ask for at most that many"
        )
    return prompts[:count]


@lru_cache(maxsize=1)
def held_out_picture_digests() -> frozenset[str]:
    """Pixel digests of every picture a benchmark uses: ``BENCHMARK_PICTURES`` and easy-vqa's test split."""
    digests = {pixel_digest(skimage_image(name)) for name in BENCHMARK_PICTURES}
    try:
        import easy_vqa
    except ImportError:  # without easy-vqa neither the benchmarks nor the mix can use its pictures
        return frozenset(digests)
    digests |= {pixel_digest(path) for path in easy_vqa.get_test_image_paths().values()}
    return frozenset(digests)


def is_held_out_picture(image: Any) -> bool:
    """Whether a picture (PIL image or file path, at the resolution it was loaded at) is one a benchmark uses."""
    return pixel_digest(image) in held_out_picture_digests()
