"""Building a target cache: regenerate prompts through the target, keep what training reads, finalize.

:func:`build_cache` is resumable and may run in several processes (ranks); each writes its
own shards, and :func:`finalize_cache` writes the index once every prompt is in. The
layout and the reader are :mod:`vlmspec.training.cache`; :func:`estimate_cache_size`
says what a build will cost on disk before it runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from vlmspec.targets.adapter import QwenVLTarget
from vlmspec.training.cache import (
    INDEX,
    CacheSpec,
    ShardWriter,
    cached_prompt_ids,
    committed_shards,
    read_manifest,
    select_rows,
    write_manifest,
)
from vlmspec.training.prompts import PromptItem
from vlmspec.training.regenerate import RegeneratedSequence, regenerate_items, replay_items


@dataclass
class BuildReport:
    """What one process's build did."""

    prompts_done: int = 0  # prompts regenerated (or replayed) by this process in this run
    prompts_replayed: int = 0  # of those, prompts whose stored answers were replayed
    prompts_skipped: int = 0  # prompts found in committed shards
    sequences: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0


def build_cache(
    target: QwenVLTarget,
    items: Sequence[PromptItem],
    directory: str | Path,
    spec: CacheSpec,
    *,
    rank: int = 0,
    world_size: int = 1,
    shard_size: int = 64,
    batch_size: int = 1,
    show_progress: bool = True,
    on_item: Callable[[int], None] | None = None,
    answers: Mapping[str, Sequence[int]] | None = None,
) -> BuildReport:
    """Regenerate the answers to this process's share of ``items`` and write them as shards.

    Process ``rank`` takes items ``rank, rank + world_size, ...``; items already in a
    committed shard are skipped, so an interrupted build resumes where it stopped (at
    most ``shard_size`` prompts of work per process are redone). ``open_cache_dir`` must
    have been called (by the main process) before. ``on_item(i)`` runs after each item.

    The target's runner answers up to ``batch_size`` requests at a time, with continuous
    batching, a shard's prompts per call (:func:`regenerate_items`); prompts of similar
    size go together. A cache that stores features gets them from one forward over each
    finished sequence.

    ``answers`` (``"<prompt id>#<turn>"`` -> token ids, :func:`vlmspec.training.answers.load_answers`)
    are answers the target gave before, e.g. in an earlier session: a prompt with every
    turn in it is replayed (:func:`replay_items`: the same sequence, no generation) and only
    the others are regenerated.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    started = time.perf_counter()
    done = cached_prompt_ids(directory)
    mine = list(items[rank::world_size])
    todo = [item for item in mine if item.id not in done]
    report = BuildReport(prompts_skipped=len(mine) - len(todo))
    writer = ShardWriter(directory, f"r{rank}")
    empty: list[str] = []
    todo.sort(key=_size_hint)
    bar = tqdm(
        total=len(todo), desc=f"target cache [{rank}]", unit="prompt", disable=not show_progress, dynamic_ncols=True
    )
    chunk = max(batch_size, shard_size)
    for first in range(0, len(todo), chunk):
        batch = todo[first : first + chunk]
        by_item: dict[str, list[RegeneratedSequence]] = {}
        stored = [item for item in batch if _answered_before(item, spec, answers or {})]
        fresh = [item for item in batch if not _answered_before(item, spec, answers or {})]
        layers, rule = spec.feature_layers, spec.position_rule
        report.prompts_replayed += len(stored)
        regenerated = replay_items(target, stored, spec.generation, answers or {}, layers, rule) + regenerate_items(
            target, fresh, spec.generation, layers, rule, max_batch_size=batch_size
        )
        for sequence in regenerated:
            by_item.setdefault(sequence.id.rsplit("#", 1)[0], []).append(sequence)
        for number, item in enumerate(batch, start=first):
            for sequence in by_item.get(item.id, []):
                kept = select_rows(sequence, spec)
                if kept is None:
                    empty.append(item.id)
                    continue
                writer.add(kept)
                report.sequences += 1
                report.tokens += kept.length
                report.bytes += kept.num_bytes
            report.prompts_done += 1
            if len(writer) >= shard_size:
                _flush(writer, empty)
            if on_item is not None:
                on_item(number)
        bar.update(len(batch))
        bar.set_postfix(MB=f"{report.bytes / 2**20:.1f}", tokens=report.tokens)
    _flush(writer, empty)
    report.seconds = time.perf_counter() - started
    return report


def _answered_before(item: PromptItem, spec: CacheSpec, answers: Mapping[str, Sequence[int]]) -> bool:
    """Every turn the cache keeps of ``item`` has a stored answer."""
    turns = item.num_turns if spec.generation.all_turns else 1
    return all(f"{item.id}#{turn}" in answers for turn in range(turns))


def _size_hint(item: PromptItem) -> tuple[int, int]:
    """Images first, then prompt length in characters: a cheap proxy for the token count."""
    text = json.dumps(item.messages) + "".join(item.followups)
    return (-len(item.images), len(text))


def _flush(writer: ShardWriter, empty: list[str]) -> None:
    """Commit the shard; prompts that gave no usable sequence are recorded so a resume skips them."""
    shard = writer.flush()
    if empty and shard is not None:
        (shard / "skipped.json").write_text(json.dumps(sorted(set(empty))) + "\n")
        empty.clear()


def finalize_cache(directory: str | Path) -> dict[str, Any]:
    """Mark the cache complete, with counts and the index (main process, after every build finished)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    shards, sequences, tokens, total = [], 0, 0, 0
    for shard in committed_shards(directory):
        meta = json.loads((shard / "meta.json").read_text())
        entries = meta["sequences"]
        shard_tokens = sum(e["tokens"][1] - e["tokens"][0] for e in entries)
        shard_bytes = sum(e["bytes"] for e in entries)
        ids = [e["id"] for e in entries]
        shards.append({"name": shard.name, "ids": ids, "tokens": shard_tokens, "bytes": shard_bytes})
        sequences += len(entries)
        tokens += shard_tokens
        total += shard_bytes
    if sequences == 0:
        raise ValueError(f"the cache at {directory} holds no sequence; check the prompts and --max-new-tokens")
    (directory / INDEX).write_text(json.dumps({"shards": shards}) + "\n")
    manifest.update(
        complete=True,
        counts={
            "sequences": sequences,
            "tokens": tokens,
            "bytes": total,
            "bytes_per_sequence": total / sequences,
            "shards": len(shards),
        },
    )
    write_manifest(directory, manifest)
    return manifest


# ----------------------------------------------------------------------------- size estimate


@dataclass
class CacheEstimate:
    """An upper estimate of a cache's size, printed before a build starts."""

    sequences: int
    tokens: int  # upper estimate: every answer reaches max_new_tokens
    bytes_per_token: int
    bytes: int

    def describe(self) -> str:
        return (
            f"target cache estimate: {self.sequences} sequences, up to {self.tokens:,} tokens x "
            f"{self.bytes_per_token:,} B = at most {format_size(self.bytes)}"
        )


def format_size(num_bytes: int) -> str:
    """A byte count in the largest binary unit that keeps it at least 1 (``"3.4 MiB"``, never ``"0.00 GiB"``)."""
    size, unit = float(num_bytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"


def estimate_cache_size(
    target: QwenVLTarget, items: Sequence[PromptItem], spec: CacheSpec, *, sample_size: int = 16
) -> CacheEstimate:
    """Estimate from the prompt lengths of a sample of ``items`` and ``max_new_tokens`` per answer."""
    if not items:
        return CacheEstimate(0, 0, 0, 0)
    step = max(len(items) // sample_size, 1)
    sample = list(items[::step])[:sample_size]
    lengths = [target.build_inputs(item.images or None, messages=item.messages).length for item in sample]
    prompt = sum(lengths) / len(lengths)
    answer = spec.generation.max_new_tokens
    turns = sum(item.num_turns if spec.generation.all_turns else 1 for item in items)
    # turn t's prompt also holds t earlier answers and follow-ups (about 32 tokens each)
    extra = sum(t * (answer + 32) for item in items for t in range(item.num_turns if spec.generation.all_turns else 1))
    tokens = int(turns * (prompt + answer) + extra)
    feature_width = len(spec.feature_layers) * target.hidden_size
    ids_mask_positions = 4 + 1 + 4
    stored_states = 2 * feature_width + 2 * target.hidden_size + 4 + 4  # and their row indices
    per_token = ids_mask_positions + (stored_states if spec.stores_features else 0)
    stored = tokens * per_token
    if spec.window_mode and spec.context_window is not None:
        rows = spec.anchors_per_sequence * (spec.context_window + spec.block_size)
        stored = min(stored, turns * rows * per_token + tokens * 9)
    return CacheEstimate(turns, tokens, per_token, int(stored))
