"""The target's regenerated answers as a small file that can be committed: token ids only.

Regeneration is the expensive part of a cache (hours for the reference mix on a CPU); what
it produces that cannot be recomputed cheaply is the answer tokens. Everything else a
tokens-only cache holds follows from them: the prompt is rebuilt from the prompt file by
the chat template (a later turn after the decoded earlier answer, as regeneration did it),
positions from the tokens, features online. So a run that outlasts one machine keeps its
answers in files like these (``recipes/data/``), and
:func:`~vlmspec.training.cache_build.build_cache` replays them instead of regenerating.

One file per regeneration shard, each written once: git keeps every version of a binary
file, so appending to one file would store it again with every shard.

Format (``numpy.savez_compressed``): ``format`` (the string :data:`ANSWERS_FORMAT`),
``ids`` (``"<prompt id>#<turn>"``, str), ``lengths`` (int32, tokens per answer),
``tokens`` (all answers back to back: uint16 when every id fits, else int32), and
``meta`` (JSON: the target's fingerprint and the generation settings that produced them).
0.64 bytes an answer token (measured on the 264,510 answer tokens of the reference pair's
``corpus.npz``: the 10x mix's ~32,000 answers of ~134 tokens come to about 3 MB).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vlmspec.training.cache import CacheSpec

ANSWERS_FORMAT = "vlmspec-answers-v1"
# Fingerprint fields that do not change the answers: the name is a path on some machines.
_IGNORED_TARGET_FIELDS = ("name",)


def answers_meta(spec: CacheSpec) -> dict[str, Any]:
    """What decides the answers: the target (fingerprint) and the generation settings of ``spec``."""
    target = {k: v for k, v in spec.target.items() if k not in _IGNORED_TARGET_FIELDS}
    return {"target": target, "generation": spec.to_dict()["generation"]}


def cached_answers(cache) -> dict[str, list[int]]:
    """``"<prompt id>#<turn>"`` -> answer token ids of every sequence of a cache (a TargetCache)."""
    answers = {}
    for index in range(len(cache)):
        sequence = cache[index]
        answers[sequence.id] = sequence.input_ids[sequence.loss_mask].tolist()
    return answers


def save_answers(path: str | os.PathLike, answers: Mapping[str, Sequence[int]], meta: dict[str, Any]) -> Path:
    """Write ``answers`` (in id order) with ``meta`` (:func:`answers_meta`); returns the path."""
    if not answers:
        raise ValueError("no answers to save: regenerate some prompts first")
    ids = sorted(answers)
    tokens = np.concatenate([np.asarray(answers[i], dtype=np.int64) for i in ids])
    dtype = np.uint16 if tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < 2**16) else np.int32
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:  # savez would append ".npz" to a name without it
        np.savez_compressed(
            handle,
            format=np.array(ANSWERS_FORMAT),
            ids=np.array(ids),
            lengths=np.array([len(answers[i]) for i in ids], dtype=np.int32),
            tokens=tokens.astype(dtype),
            meta=np.array(json.dumps(meta, sort_keys=True)),
        )
    return path


def load_answers(paths: Iterable[str | os.PathLike], meta: dict[str, Any] | None = None) -> dict[str, list[int]]:
    """The answers of every file in ``paths``, merged; with ``meta``, files from other settings are refused."""
    answers: dict[str, list[int]] = {}
    for path in paths:
        path = Path(path)
        with np.load(path) as data:
            if "format" not in data or str(data["format"]) != ANSWERS_FORMAT:
                raise ValueError(f"{path} is not an answers file (written by vlmspec.training.answers.save_answers)")
            stored = json.loads(str(data["meta"]))
            if meta is not None and stored != json.loads(json.dumps(meta, sort_keys=True)):
                changed = sorted(k for k in {**stored, **meta} if stored.get(k) != meta.get(k))
                raise ValueError(
                    f"{path} holds answers of another target or other generation settings (differs in {changed}); "
                    "regenerate with these settings or use the settings the file records"
                )
            offsets = np.concatenate(([0], np.cumsum(data["lengths"], dtype=np.int64)))
            tokens = data["tokens"].astype(np.int64)
            for i, sequence_id in enumerate(data["ids"].tolist()):
                answers[sequence_id] = tokens[offsets[i] : offsets[i + 1]].tolist()
    return answers


def answer_files(directory: str | os.PathLike) -> list[Path]:
    """The answers files of a directory (``answers-*.npz``), in shard order."""
    return sorted(Path(directory).glob("answers-*.npz"))
