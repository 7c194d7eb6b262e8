"""The target cache: regenerated sequences with the target's features, in memory-mapped shards.

Layout of a cache directory::

    manifest.json            format, version, the spec (target fingerprint, layers, dtype,
                             generation settings, window options), complete flag and counts
    index.json               written when complete: every shard with its sequence ids and sizes
    shards/r<rank>-<n>/      one shard, written by one process, committed by an atomic rename
        meta.json            per sequence: id, offsets into the arrays below, valid anchors
        input_ids.npy        [T] int32     all tokens of the shard's sequences, concatenated
        loss_mask.npy        [T] uint8     1 on the target's answer
        positions.npy        [T] int32     1-D text-stream positions (the drafter's positions)
        features.npy         [Tf, m*d] int16-coded fp16/bf16  hooked target features
        feature_index.npy    [Tf] int32    token index of each stored feature row
        last_hidden.npy      [Th, d] int16-coded fp16/bf16    final-norm hidden (before the LM head)
        hidden_index.npy     [Th] int32    token index of each stored hidden row
        anchors.npy          [Ta] int32    anchors fixed at cache time (window mode only)

Feature rows are stored with their token index so that a cache may keep only what
training reads. Full mode keeps features of every token but the last and final-norm
states of the answer. *Window mode* (``anchors_per_sequence``) fixes the anchors when the
cache is written and keeps only the feature rows of their context windows (the last
``context_window`` tokens before each anchor, or everything before the last anchor) and
the hidden rows of their blocks; with a context window this bounds the cache per
sequence by ``anchors x (window + gamma)`` rows whatever the sequence length.

Interrupted builds resume: committed shards stay, unfinished temporary shards are
removed, and the prompts already in a shard are skipped. A cache whose manifest does not
match the target and settings is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from vlmspec.target.adapter import QwenVLTarget
from vlmspec.training.anchors import sample_anchors, valid_anchor_mask
from vlmspec.training.prompts import PromptItem
from vlmspec.training.regenerate import GenerationConfig, RegeneratedSequence, regenerate_item, sequence_seed

CACHE_FORMAT = "vlmspec.target_cache"
CACHE_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.json"
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_ARRAYS = ("input_ids", "loss_mask", "positions", "features", "feature_index", "last_hidden", "hidden_index", "anchors")


# ----------------------------------------------------------------------------- the spec


def target_fingerprint(target: QwenVLTarget) -> dict[str, Any]:
    """Shape of the target plus a small sample of its LM head (tells apart same-shaped targets)."""
    weight = target.output_head.weight
    rows = torch.linspace(0, weight.shape[0] - 1, 8).long().to(weight.device)
    sample = weight.detach()[rows, :4].float().flatten().cpu()
    return {
        "name": target.name,
        "family": target.family,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "num_layers": target.num_layers,
        "lm_head_sample": [round(float(x), 6) for x in sample],
    }


@dataclass(frozen=True)
class CacheSpec:
    """Everything that decides what a cache holds; a cache is reused only under an equal spec."""

    target: dict[str, Any]  # target_fingerprint(target)
    feature_layers: tuple[int, ...]  # hooked target layers, in feature order (never the last)
    position_rule: str
    dtype: str = "bfloat16"  # storage dtype of features and hidden states: bfloat16 or float16
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    anchors_per_sequence: int | None = None  # window mode: anchors fixed at cache time (None: full mode)
    context_window: int | None = None  # context tokens kept before each anchor (None: all)
    block_size: int | None = None  # gamma the hidden windows are kept for (window mode only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"cache dtype must be one of {', '.join(STORAGE_DTYPES)}, got {self.dtype!r}")
        if not self.feature_layers:
            raise ValueError("feature_layers is empty: name the target layers the drafter reads (its target_layer_ids)")
        if self.anchors_per_sequence is not None and (self.anchors_per_sequence < 1 or not self.block_size):
            raise ValueError("window mode needs anchors_per_sequence >= 1 and the drafter's block_size (gamma)")
        if self.context_window is not None and self.context_window < 1:
            raise ValueError(f"context_window must be >= 1 token or None (all), got {self.context_window}")

    @property
    def storage_dtype(self) -> torch.dtype:
        return STORAGE_DTYPES[self.dtype]

    @property
    def window_mode(self) -> bool:
        return self.anchors_per_sequence is not None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["feature_layers"] = list(self.feature_layers)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CacheSpec":
        return cls(**{**data, "generation": GenerationConfig(**data["generation"])})

    def differences(self, other: "CacheSpec") -> list[str]:
        """Human-readable mismatches between two specs (empty when compatible)."""
        problems = []
        mine, theirs = self.to_dict(), other.to_dict()
        for key in ("family", "hidden_size", "vocab_size", "num_layers"):
            if mine["target"][key] != theirs["target"][key]:
                problems.append(f"target {key}: cache {mine['target'][key]!r}, now {theirs['target'][key]!r}")
        samples = mine["target"]["lm_head_sample"], theirs["target"]["lm_head_sample"]
        if not problems and not np.allclose(*samples, rtol=2e-2, atol=1e-3):  # tolerant of bf16 vs fp32 loads
            names = mine["target"]["name"], theirs["target"]["name"]
            problems.append(f"target weights differ (cache built with {names[0]!r}, now {names[1]!r})")
        settings = ("feature_layers", "position_rule", "dtype", "generation", "anchors_per_sequence", "context_window",
                    "block_size")  # fmt: skip
        for key in settings:
            if mine[key] != theirs[key]:
                problems.append(f"{key}: cache {mine[key]!r}, now {theirs[key]!r}")
        return problems


# ----------------------------------------------------------------------------- sequences


@dataclass
class CachedSequence:
    """One stored sequence (what a shard holds per sequence, as torch tensors)."""

    id: str
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool, the answer
    positions: torch.Tensor  # [L] int64
    features: torch.Tensor  # [Lf, m * d] storage dtype
    feature_index: torch.Tensor  # [Lf] int64 increasing token indices
    last_hidden: torch.Tensor  # [Lh, d] storage dtype
    hidden_index: torch.Tensor  # [Lh] int64 increasing token indices
    anchors: torch.Tensor  # [A0] int64 fixed anchors (window mode), empty in full mode

    @property
    def length(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_bytes(self) -> int:
        return sum(getattr(self, name).numel() * _stored_itemsize(name) for name in _ARRAYS)


def _stored_itemsize(name: str) -> int:
    return {"loss_mask": 1, "features": 2, "last_hidden": 2}.get(name, 4)


def select_rows(sequence: RegeneratedSequence, spec: CacheSpec) -> CachedSequence | None:
    """What the cache keeps of a regenerated sequence; None when window mode finds no anchor."""
    length, start = sequence.length, sequence.answer_start
    loss_mask = sequence.loss_mask
    feature_index = torch.arange(length - 1)
    hidden_index = torch.arange(start, length - 1)
    anchors = torch.zeros(0, dtype=torch.long)
    if spec.window_mode:
        generator = torch.Generator().manual_seed(sequence_seed(spec.generation.seed, sequence.id, -1))
        anchors = sample_anchors(loss_mask, spec.anchors_per_sequence, generator)
        if anchors.numel() == 0:
            return None
        feature_index = _windows(anchors, spec.context_window, length - 1)
        hidden_index = _label_windows(anchors, spec.block_size, length - 1)
    dtype = spec.storage_dtype
    return CachedSequence(
        id=sequence.id,
        input_ids=sequence.input_ids,
        loss_mask=loss_mask,
        positions=sequence.positions,
        features=sequence.features[feature_index].to(dtype),
        feature_index=feature_index,
        last_hidden=sequence.last_hidden[hidden_index - start].to(dtype),
        hidden_index=hidden_index,
        anchors=anchors,
    )


def _windows(anchors: torch.Tensor, window: int | None, limit: int) -> torch.Tensor:  # [A] -> [n] sorted
    """Token indices in the union of ``[anchor - window, anchor)`` (``[0, max anchor)`` without a window)."""
    keep = torch.zeros(limit, dtype=torch.bool)
    if window is None:
        keep[: int(anchors.max())] = True
    for a in anchors.tolist():
        if window is not None:
            keep[max(0, a - window) : a] = True
    return keep.nonzero().flatten()


def _label_windows(anchors: torch.Tensor, block_size: int, limit: int) -> torch.Tensor:  # [A] -> [n] sorted
    """Token indices ``anchor .. anchor + gamma - 1`` (the rows predicting each block's labels)."""
    keep = torch.zeros(limit, dtype=torch.bool)
    for a in anchors.tolist():
        keep[a : min(a + block_size, limit)] = True
    return keep.nonzero().flatten()


# ----------------------------------------------------------------------------- writing


def _to_numpy(name: str, tensor: torch.Tensor) -> np.ndarray:
    if name in ("features", "last_hidden"):
        return tensor.contiguous().view(torch.int16).numpy()  # fp16/bf16 bits; numpy has no bfloat16
    if name == "loss_mask":
        return tensor.to(torch.uint8).numpy()
    return tensor.to(torch.int32).numpy()


class ShardWriter:
    """Collects sequences in memory and writes them as one shard, committed by an atomic rename."""

    def __init__(self, directory: str | Path, prefix: str) -> None:
        self.root = Path(directory) / "shards"
        self.prefix = prefix
        self.sequences: list[CachedSequence] = []
        self.written: list[Path] = []

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, sequence: CachedSequence) -> None:
        self.sequences.append(sequence)

    def flush(self) -> Path | None:
        """Write the collected sequences as the next shard of this writer; returns its path."""
        if not self.sequences:
            return None
        final = self._next_name()
        temporary = final.with_name(f".tmp-{final.name}")
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        for name in _ARRAYS:
            arrays = [_to_numpy(name, getattr(s, name)) for s in self.sequences]
            np.save(temporary / f"{name}.npy", np.concatenate(arrays) if arrays else np.zeros(0, np.int32))
        (temporary / "meta.json").write_text(json.dumps(self._meta()) + "\n")
        os.replace(temporary, final)
        self.written.append(final)
        self.sequences = []
        return final

    def _next_name(self) -> Path:
        taken = {p.name for p in self.root.glob(f"{self.prefix}-*")}
        number = 0
        while f"{self.prefix}-{number:05d}" in taken:
            number += 1
        return self.root / f"{self.prefix}-{number:05d}"

    def _meta(self) -> dict[str, Any]:
        entries, offsets = [], dict.fromkeys(("tokens", "features", "hidden", "anchors"), 0)
        for s in self.sequences:
            sizes = {"tokens": s.length, "features": s.features.shape[0], "hidden": s.last_hidden.shape[0],
                     "anchors": s.anchors.numel()}  # fmt: skip
            entry = {"id": s.id, "bytes": s.num_bytes}
            for key, size in sizes.items():
                entry[key] = [offsets[key], offsets[key] + size]
                offsets[key] += size
            entry["valid_anchors"] = int(s.anchors.numel() or valid_anchor_mask(s.loss_mask).sum())
            entries.append(entry)
        first = self.sequences[0]
        widths = {"feature_width": first.features.shape[1], "hidden_size": first.last_hidden.shape[1]}
        return {**widths, "sequences": entries}


# ----------------------------------------------------------------------------- reading


class TargetCache:
    """Read access to a cache directory: ``cache[i]`` is a :class:`CachedSequence` (memory-mapped)."""

    def __init__(self, directory: str | Path, *, require_complete: bool = True) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        if require_complete and not self.manifest.get("complete"):
            raise ValueError(
                f"the cache at {self.directory} is incomplete (its build was interrupted); run the same command "
                "again to resume it before training"
            )
        self.spec = CacheSpec.from_dict(self.manifest["spec"])
        self._entries: list[tuple[Path, dict[str, Any]]] = []
        for shard in committed_shards(self.directory):
            meta = json.loads((shard / "meta.json").read_text())
            self._entries += [(shard, entry) for entry in meta["sequences"]]
        self._arrays: dict[Path, dict[str, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def ids(self) -> list[str]:
        return [entry["id"] for _, entry in self._entries]

    def num_valid_anchors(self, index: int) -> int:
        return self._entries[index][1]["valid_anchors"]

    def num_bytes(self, index: int) -> int:
        return self._entries[index][1]["bytes"]

    def __getitem__(self, index: int) -> CachedSequence:
        shard, entry = self._entries[index]
        arrays = self._shard_arrays(shard)
        dtype = self.spec.storage_dtype

        def take(name: str, key: str) -> torch.Tensor:
            start, end = entry[key]
            values = torch.from_numpy(np.array(arrays[name][start:end]))  # a copy: memmaps are read-only
            if name in ("features", "last_hidden"):
                return values.view(dtype)
            return values.bool() if name == "loss_mask" else values.long()

        return CachedSequence(
            id=entry["id"],
            input_ids=take("input_ids", "tokens"),
            loss_mask=take("loss_mask", "tokens"),
            positions=take("positions", "tokens"),
            features=take("features", "features"),
            feature_index=take("feature_index", "features"),
            last_hidden=take("last_hidden", "hidden"),
            hidden_index=take("hidden_index", "hidden"),
            anchors=take("anchors", "anchors"),
        )

    def _shard_arrays(self, shard: Path) -> dict[str, np.ndarray]:
        if shard not in self._arrays:
            self._arrays[shard] = {name: np.load(shard / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
        return self._arrays[shard]


def committed_shards(directory: str | Path) -> list[Path]:
    """Finished shards of a cache, in name order (temporary ones are not committed)."""
    root = Path(directory) / "shards"
    return sorted(p for p in root.glob("r*-*") if (p / "meta.json").is_file()) if root.is_dir() else []


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ValueError(f"no {MANIFEST} in {directory}: not a vlmspec target cache (build one with build_cache)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != CACHE_FORMAT or manifest.get("version") != CACHE_VERSION:
        raise ValueError(f"{path} is not a {CACHE_FORMAT!r} version {CACHE_VERSION} manifest; rebuild the cache")
    return manifest


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    temporary = directory / f".{MANIFEST}.tmp"
    temporary.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(temporary, directory / MANIFEST)


# ----------------------------------------------------------------------------- building


def open_cache_dir(directory: str | Path, spec: CacheSpec) -> bool:
    """Create the cache directory, or check an existing one against ``spec`` (main process only).

    Returns True when an earlier build left work to resume or reuse. A cache built for
    another target or with other settings is refused with the differences listed.
    """
    directory = Path(directory)
    if (directory / MANIFEST).is_file():
        existing = CacheSpec.from_dict(read_manifest(directory)["spec"])
        problems = existing.differences(spec)
        if problems:
            raise ValueError(
                f"the cache at {directory} was built with other settings and cannot be reused: "
                + "; ".join(problems)
                + ". Pass another --cache directory (or delete this one) to build a new cache."
            )
        for leftover in (directory / "shards").glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)  # a shard that an interruption left unfinished
        return True
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} exists, is not empty and is not a target cache; pass an empty or new directory")
    (directory / "shards").mkdir(parents=True, exist_ok=True)
    manifest = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "spec": spec.to_dict(), "complete": False}
    _write_manifest(directory, manifest)
    return False


def cached_prompt_ids(directory: str | Path) -> set[str]:
    """Prompt ids whose sequences are already committed (sequence ids are '<prompt id>#<turn>')."""
    ids = set()
    for shard in committed_shards(directory):
        for entry in json.loads((shard / "meta.json").read_text())["sequences"]:
            ids.add(entry["id"].rsplit("#", 1)[0])
    for marker in (Path(directory) / "shards").glob("r*-*/skipped.json"):
        ids.update(json.loads(marker.read_text()))
    return ids


@dataclass
class BuildReport:
    """What one process's build did."""

    prompts_done: int = 0  # prompts regenerated by this process in this run
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
    show_progress: bool = True,
    on_item: Callable[[int], None] | None = None,
) -> BuildReport:
    """Regenerate the answers to this process's share of ``items`` and write them as shards.

    Process ``rank`` takes items ``rank, rank + world_size, ...``; items already in a
    committed shard are skipped, so an interrupted build resumes where it stopped (at
    most ``shard_size`` prompts of work per process are redone). ``open_cache_dir`` must
    have been called (by the main process) before. ``on_item(i)`` runs after each item.
    """
    started = time.perf_counter()
    done = cached_prompt_ids(directory)
    mine = list(items[rank::world_size])
    todo = [item for item in mine if item.id not in done]
    report = BuildReport(prompts_skipped=len(mine) - len(todo))
    writer = ShardWriter(directory, f"r{rank}")
    empty: list[str] = []
    bar = tqdm(todo, desc=f"target cache [{rank}]", unit="prompt", disable=not show_progress, dynamic_ncols=True)
    for number, item in enumerate(bar):
        for sequence in regenerate_item(target, item, spec.generation, spec.feature_layers, spec.position_rule):
            kept = select_rows(sequence, spec)
            if kept is None:
                empty.append(item.id)
                continue
            writer.add(kept)
            report.sequences += 1
            report.tokens += kept.length
            report.bytes += kept.num_bytes
        report.prompts_done += 1
        bar.set_postfix(MB=f"{report.bytes / 2**20:.1f}", tokens=report.tokens)
        if len(writer) >= shard_size:
            _flush(writer, empty)
        if on_item is not None:
            on_item(number)
    _flush(writer, empty)
    report.seconds = time.perf_counter() - started
    return report


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
        counts={"sequences": sequences, "tokens": tokens, "bytes": total, "bytes_per_sequence": total / sequences,
                "shards": len(shards)},
    )  # fmt: skip
    _write_manifest(directory, manifest)
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
            f"{self.bytes_per_token:,} B = at most {self.bytes / 2**30:.2f} GiB"
        )


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
    per_token = 2 * feature_width + 2 * target.hidden_size + 4 + 1 + 4 + 4 + 4
    stored = tokens * per_token
    if spec.window_mode and spec.context_window is not None:
        rows = spec.anchors_per_sequence * (spec.context_window + spec.block_size)
        stored = min(stored, turns * rows * per_token + tokens * 9)
    return CacheEstimate(turns, tokens, per_token, int(stored))

