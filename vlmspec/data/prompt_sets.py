"""Prompt sets: ``{"turns": ["first user turn", ...]}`` JSONL files such as ``../shared/data/prompts/gsm8k.jsonl``.

The one reader of the format for the benchmarks and the reference prompt mix; which entries
each side may take is :mod:`vlmspec.data.heldout`'s business. (Training reads whole
conversations, images included, through :mod:`vlmspec.training.prompts`.)
"""

from __future__ import annotations

import json
from pathlib import Path


def prompt_set_name(path: str | Path) -> str:
    """The name a prompt set goes by in results and in the held-out split: its file stem (``mt-bench``)."""
    return Path(path).stem


def read_prompt_set(path: str | Path) -> list[str]:
    """First user turn of every line of a ``{"turns": [...]}`` JSONL prompt set."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"prompt set {str(path)!r} does not exist; pass a .jsonl file such as ../shared/data/prompts/mt-bench.jsonl"
        )
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f'{path}:{number}: not valid JSON ({err.msg}); each line must be {{"turns": ["..."]}}'
            ) from None
        turns = entry.get("turns") if isinstance(entry, dict) else None
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip()):
            raise ValueError(
                f'{path}:{number}: expected {{"turns": ["first user turn", ...]}} with a non-empty first turn'
            )
        prompts.append(turns[0])
    return prompts
