"""vlmspec's side of the benchmark: the engine, the generation settings, one timed run, one question's runs."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import Timer, safe_ratio
from benchmarks.spec.workloads import Task
from vlmspec.scheduling import Scheduler, build_scheduler


def parse_key_values(pairs: Sequence[str]) -> dict[str, Any]:
    """``["threshold=0.6", "name=x"]`` -> ``{"threshold": 0.6, "name": "x"}`` (values parsed as JSON when they can be)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--scheduler-arg {pair!r} must look like KEY=VALUE, e.g. threshold=0.6")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def make_scheduler(name: str, options: Mapping[str, Any]) -> Scheduler | None:
    """The scheduler called ``name`` (``vlmspec.scheduling.build_scheduler``); None for ``none``: verify every draft."""
    return None if name == "none" else build_scheduler(name, **options)


def load_engine(args: argparse.Namespace):
    """A SpecEngine for ``--target`` (a directory, ``tiny:FAMILY`` or ``small:FAMILY``) with ``--drafter`` and ``--scheduler``."""
    from vlmspec.drafters.prompt_lookup import PromptLookup
    from vlmspec.engine import SpecEngine
    from vlmspec.loading import load_proposer, load_target

    scheduler = make_scheduler(args.scheduler, parse_key_values(args.scheduler_arg))
    target = load_target(
        args.target, dtype=args.dtype, attn_implementation=args.attn_implementation, device=args.device
    )
    if args.drafter == "prompt-lookup":
        proposer = PromptLookup(
            max_draft_tokens=args.max_draft_tokens, max_ngram=args.max_ngram, min_ngram=args.min_ngram
        )
    else:
        proposer = load_proposer(args.drafter, target)
    return SpecEngine(target, proposer, scheduler)


@dataclass
class Settings:
    """Generation settings shared by every variant."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RunRecord:
    """One variant's answer to one question."""

    variant: str
    seconds: float  # wall clock from (images, prompt) to token ids, input processing included
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: Any = None  # vlmspec.types.SpecStats for the engine's runs; None for transformers' runs

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float | None:
        return safe_ratio(self.new_tokens, self.seconds)


def run_engine(engine, task: Task, settings: Settings, *, speculative: bool, seed: int) -> RunRecord:
    """``engine.generate`` on one task, timed; ``speculative=False`` is the target alone."""
    with Timer() as timer:
        result = engine.generate(
            task.image_arg,
            task.prompt,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            seed=seed,
            speculative=speculative,
        )
    return RunRecord(
        "vlmspec" if speculative else "target",
        timer.seconds,
        list(result.token_ids),
        result.text,
        result.finish_reason,
        result.stats,
    )


@dataclass
class QuestionResult:
    """Every variant's run of one task, and how they compare."""

    task: Task
    runs: dict[str, RunRecord]
    first_difference: int | None  # first token index where vlmspec differs from the target alone
    predictions: dict[str, str | None] = field(default_factory=dict)
    correct: dict[str, bool | None] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.first_difference is None

    @property
    def tau(self) -> float | None:
        stats = self.runs["vlmspec"].stats
        return None if stats is None else stats.tau

    def speedup(self, variant: str = "vlmspec", baseline: str = "target") -> float | None:
        if variant not in self.runs or baseline not in self.runs:
            return None
        return safe_ratio(self.runs[variant].tokens_per_s, self.runs[baseline].tokens_per_s)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
