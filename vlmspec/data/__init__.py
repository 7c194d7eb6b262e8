"""Readers of public evaluation and prompt formats shared by training and the benchmarks.

* :mod:`vlmspec.data.mmbench`: MMBench TSV files (multiple-choice questions about one image).
* :mod:`vlmspec.data.prompt_sets`: ``{"turns": [...]}`` JSONL prompt sets (GSM8K, MT-Bench).
* :mod:`vlmspec.data.pictures`: scikit-image's photographs, and a picture's identity by its pixels.
* :mod:`vlmspec.data.heldout`: the held-out split, what the benchmarks measure and no drafter trains on.
"""

from vlmspec.data.heldout import held_out_prompts, is_held_out_picture, training_prompts
from vlmspec.data.mmbench import MMBenchFile, MMBenchQuestion, RowProblem, build_mmbench_prompt, read_mmbench_tsv
from vlmspec.data.pictures import pixel_digest, skimage_image
from vlmspec.data.prompt_sets import read_prompt_set

__all__ = [
    "MMBenchFile",
    "MMBenchQuestion",
    "RowProblem",
    "build_mmbench_prompt",
    "held_out_prompts",
    "is_held_out_picture",
    "pixel_digest",
    "read_mmbench_tsv",
    "read_prompt_set",
    "skimage_image",
    "training_prompts",
]
