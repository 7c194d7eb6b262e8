"""Totals over a set of questions (identity, throughput, speedups, tau, acceptance, time split, accuracy), and the JSON of one question."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.common import safe_ratio, summarize
from benchmarks.spec.runs import QuestionResult, first_difference
from vlmspec.types import SpecStats


def aggregate_speedup(
    results: Sequence[QuestionResult], variant: str = "vlmspec", baseline: str = "target"
) -> float | None:
    """Total tokens per second of ``variant`` over that of ``baseline``, on the questions both ran."""
    both = [r for r in results if variant in r.runs and baseline in r.runs]
    return safe_ratio(_throughput(both, variant), _throughput(both, baseline))


def _throughput(results: Sequence[QuestionResult], variant: str) -> float | None:
    records = [r.runs[variant] for r in results if variant in r.runs]
    return safe_ratio(sum(x.new_tokens for x in records), sum(x.seconds for x in records)) if records else None


TIME_PARTS = ("prefill_s", "draft_s", "verify_s", "other_s")


def aggregate(results: Sequence[QuestionResult], variants: Sequence[str]) -> dict[str, Any]:
    """Every total for a set of questions: identity, throughput, speedups, tau, acceptance, time split, accuracy."""
    pooled = SpecStats.merge(r.runs["vlmspec"].stats for r in results if r.runs["vlmspec"].stats is not None)
    speedups = {
        "vlmspec_vs_target": aggregate_speedup(results),
        "vlmspec_vs_target_median_per_question": summarize(r.speedup() for r in results)["median"],
        "vlmspec_vs_hf_generate": aggregate_speedup(results, "vlmspec", "hf-generate"),
        "hf_prompt_lookup_vs_hf_generate": aggregate_speedup(results, "hf-prompt-lookup", "hf-generate"),
        "hf_assistant_vs_hf_generate": aggregate_speedup(results, "hf-assistant", "hf-generate"),
        "target_vs_hf_generate": aggregate_speedup(results, "target", "hf-generate"),
    }
    return {
        "questions": len(results),
        "identical": sum(r.identical for r in results),
        "differences": [r.task.qid for r in results if not r.identical],
        "variants": {v: _variant_totals(results, v) for v in variants},
        "speedup": speedups,
        "tau": pooled.tau if pooled.rounds else None,
        "mean_verified_length": pooled.mean_verified_length if pooled.rounds else None,
        "acceptance_by_position": pooled.acceptance_by_position,
        "verified_by_position": pooled.verified_by_position,
        "rounds_by_source": dict(sorted(pooled.rounds_by_source.items())),  # empty unless the proposer chooses
        "time_split_s": {v: _time_split(results, v) for v in ("target", "vlmspec")},
        "accuracy": {v: _accuracy(results, v) for v in variants},
        "identical_to_target": {v: _identical_count(results, v) for v in variants if v != "target"},
    }


def _variant_totals(results: Sequence[QuestionResult], variant: str) -> dict[str, Any]:
    records = [r.runs[variant] for r in results if variant in r.runs]
    return {
        "questions": len(records),
        "new_tokens": sum(x.new_tokens for x in records),
        "seconds": sum(x.seconds for x in records),
        "tokens_per_s": _throughput(results, variant),
        "tokens_per_s_per_question": summarize(x.tokens_per_s for x in records),
    }


def _time_split(results: Sequence[QuestionResult], variant: str) -> dict[str, float]:
    """Seconds summed over questions: the engine's own parts, plus input processing outside its loop."""
    records = [r.runs[variant] for r in results if variant in r.runs and r.runs[variant].stats is not None]
    split = {part: sum(getattr(x.stats, part) for x in records) for part in TIME_PARTS}
    split["inputs_s"] = sum(max(x.seconds - x.stats.total_s, 0.0) for x in records)
    split["wall_s"] = sum(x.seconds for x in records)
    return split


def _accuracy(results: Sequence[QuestionResult], variant: str) -> dict[str, Any]:
    scored = [r.correct[variant] for r in results if r.correct.get(variant) is not None]
    return {"correct": sum(scored), "scored": len(scored), "accuracy": safe_ratio(sum(scored), len(scored))}


def _identical_count(results: Sequence[QuestionResult], variant: str) -> dict[str, int]:
    both = [r for r in results if variant in r.runs]
    same = sum(first_difference(r.runs["target"].token_ids, r.runs[variant].token_ids) is None for r in both)
    return {"identical": same, "compared": len(both)}


def summarize_results(results: Sequence[QuestionResult], variants: Sequence[str]) -> dict[str, Any]:
    """Totals over all questions, per workload, and per (workload, group) where groups are finer.

    ``text`` pools the text-only workloads (the held-out text mix) when images are asked
    about too; None otherwise, where it would repeat ``all``.
    """
    by_workload: dict[str, list[QuestionResult]] = defaultdict(list)
    by_group: dict[str, list[QuestionResult]] = defaultdict(list)
    for r in results:
        by_workload[r.task.workload].append(r)
        if r.task.group != r.task.workload:
            by_group[f"{r.task.workload}/{r.task.group}"].append(r)
    text = [r for r in results if not r.task.images]
    return {
        "all": aggregate(results, variants),
        "text": aggregate(text, variants) if text and len(text) < len(results) else None,
        "by_workload": {k: aggregate(v, variants) for k, v in by_workload.items()},
        "by_group": {k: aggregate(v, variants) for k, v in sorted(by_group.items())},
    }


def workload_rows(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The rows of the per-workload tables: each workload, then the pooled text mix (if any), then all."""
    pooled = {"all text": summary["text"]} if summary.get("text") else {}
    return {**summary["by_workload"], **pooled, "all": summary["all"]}


def question_record(result: QuestionResult) -> dict[str, Any]:
    """One question in the JSON: its task, each variant's numbers and text, identity and scores."""
    task = result.task
    runs = {}
    for name, x in result.runs.items():
        runs[name] = {
            "seconds": x.seconds,
            "new_tokens": x.new_tokens,
            "tokens_per_s": x.tokens_per_s,
            "finish_reason": x.finish_reason,
            "text": x.text,
            "stats": None if x.stats is None else x.stats.as_dict(),
            "identical_to_target": first_difference(result.runs["target"].token_ids, x.token_ids) is None,
        }
    record = {
        "qid": task.qid,
        "workload": task.workload,
        "group": task.group,
        "prompt": task.prompt,
        "num_images": len(task.images),
        "answer": task.answer,
        "identical": result.identical,
        "first_difference": result.first_difference,
        "speedup": result.speedup(),
        "tau": result.tau,
        "predictions": result.predictions,
        "correct": result.correct,
        "runs": runs,
    }
    if not result.identical:
        record["token_ids"] = {"target": result.runs["target"].token_ids, "vlmspec": result.runs["vlmspec"].token_ids}
    return record
