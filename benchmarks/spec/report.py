"""The report: the verdict in words, markdown tables, ``results.json``, ``results.md`` and PNG plots."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    environment_info,
    markdown_table,
    plot_grouped_bars,
    plot_lines,
    plot_stacked_bars,
    safe_ratio,
    write_json,
    write_text,
)
from benchmarks.spec.aggregate import TIME_PARTS, question_record, summarize_results, workload_rows
from benchmarks.spec.loop import Benchmark, describe_difference
from benchmarks.spec.peers import Peer
from benchmarks.spec.runs import QuestionResult, Settings, parse_key_values
from vlmspec.data.mmbench import RowProblem


def verdict(summary: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
    """The two answers the benchmark exists for, in words and numbers."""
    total = summary["all"]
    differences = len(total["differences"])
    if settings.greedy:
        check = "passed" if differences == 0 else "FAILED"
        text = f"greedy outputs identical to the target alone: {total['identical']}/{total['questions']} ({check})"
    else:
        check = "not applicable"
        text = (
            f"sampling (temperature {settings.temperature}): token identity is not expected; "
            f"{total['identical']}/{total['questions']} outputs happen to match"
        )
    speedup = total["speedup"]["vlmspec_vs_target"]
    acc_target, acc_spec = total["accuracy"]["target"], total["accuracy"]["vlmspec"]
    if acc_target["scored"]:
        same = "equal" if acc_target["correct"] == acc_spec["correct"] else "NOT equal"
        answers = (
            f"correct against the reference answers: target {acc_target['correct']}/{acc_target['scored']}, "
            f"vlmspec {acc_spec['correct']}/{acc_spec['scored']} ({same})"
        )
    else:
        answers = "no reference answers in these workloads"
    return {
        "lossless_check": check,
        "differences": differences,
        "identity": text,
        "answers": answers,
        "speedup_vs_target": speedup,
        "speedup_vs_hf_generate": total["speedup"]["vlmspec_vs_hf_generate"],
    }


def speed_sentence(v: Mapping[str, Any]) -> str:
    """The headline speed numbers in words."""
    if v["speedup_vs_target"] is None:
        return "not measured"
    text = f"vlmspec {v['speedup_vs_target']:.2f}x the target alone (tokens/s, interleaved in one run)"
    if v["speedup_vs_hf_generate"] is not None:
        text += f"; {v['speedup_vs_hf_generate']:.2f}x transformers generate()"
    return text


def _speed_cell(totals: Mapping[str, Any], variant: str, ratio: float | None) -> str:
    tps = totals["variants"].get(variant, {}).get("tokens_per_s")
    if tps is None:
        return "–"
    return f"{tps:.1f} ({ratio:.2f}x)" if ratio is not None else f"{tps:.1f}"


def _accuracy_cell(totals: Mapping[str, Any], variant: str) -> str:
    acc = totals["accuracy"].get(variant, {})
    return f"{acc['correct']}/{acc['scored']}" if acc.get("scored") else "–"


def summary_table(rows: Mapping[str, Mapping[str, Any]], label: str) -> str:
    """One line per workload (or group): identity, tau, tokens/s of every variant with its ratio, accuracy."""
    headers = [
        label,
        "n",
        "identical",
        "tau",
        "target tok/s",
        "vlmspec tok/s (vs target)",
        "hf-generate tok/s",
        "hf-prompt-lookup tok/s (vs hf)",
        "hf-assistant tok/s (vs hf)",
        "acc target",
        "acc vlmspec",
    ]
    lines = []
    for name, t in rows.items():
        s = t["speedup"]
        lines.append(
            [
                name,
                t["questions"],
                f"{t['identical']}/{t['questions']}",
                t["tau"],
                _speed_cell(t, "target", None),
                _speed_cell(t, "vlmspec", s["vlmspec_vs_target"]),
                _speed_cell(t, "hf-generate", None),
                _speed_cell(t, "hf-prompt-lookup", s["hf_prompt_lookup_vs_hf_generate"]),
                _speed_cell(t, "hf-assistant", s["hf_assistant_vs_hf_generate"]),
                _accuracy_cell(t, "target"),
                _accuracy_cell(t, "vlmspec"),
            ]
        )
    return markdown_table(headers, lines)


def acceptance_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    width = max((len(t["acceptance_by_position"]) for t in rows.values()), default=0)
    headers = ["workload", "tau", "mean verified"] + [f"pos {k + 1}" for k in range(width)]
    lines = []
    for name, t in rows.items():
        rates = list(t["acceptance_by_position"]) + [None] * (width - len(t["acceptance_by_position"]))
        lines.append([name, t["tau"], t["mean_verified_length"], *rates])
    return markdown_table(headers, lines)


def sources_table(rows: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The drafting policy's decisions: the share of vlmspec's rounds per draft source ("none": no drafts)."""
    sources = sorted({source for t in rows.values() for source in t["rounds_by_source"]})
    if not sources:
        return None  # the proposer drafts every round from one source
    lines = []
    for name, t in rows.items():
        counts = t["rounds_by_source"]
        total = sum(counts.values())
        lines.append([name, total, *(f"{counts.get(s, 0) / total:.0%}" if total else "–" for s in sources)])
    return markdown_table(["workload", "rounds", *sources], lines)


def time_split_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    headers = ["workload", "run", "prefill s", "draft s", "verify s", "engine s", "inputs s", "wall s", "ms / token"]
    lines = []
    for name, t in rows.items():
        for variant in ("target", "vlmspec"):
            split = t["time_split_s"][variant]
            tokens = t["variants"][variant]["new_tokens"]
            per_token = safe_ratio(1000 * split["wall_s"], tokens)
            lines.append(
                [name, variant, *(split[p] for p in TIME_PARTS), split["inputs_s"], split["wall_s"], per_token]
            )
    return markdown_table(headers, lines, digits=3)


def peers_table(peers: Sequence[Peer], totals: Mapping[str, Any]) -> str:
    """Each transformers configuration: what ran, whether transformers accepted it, and how its output compares."""
    lines = []
    for p in peers:
        same = totals["identical_to_target"].get(p.name)
        identical = f"{same['identical']}/{same['compared']}" if same and same["compared"] else "–"
        lines.append([p.name, p.description, p.status, identical, p.detail or ""])
    return markdown_table(["peer", "configuration", "status", "output = target alone", "detail"], lines)


def questions_table(results: Sequence[QuestionResult]) -> str:
    headers = [
        "question",
        "workload",
        "tokens",
        "identical",
        "tau",
        "target tok/s",
        "vlmspec tok/s",
        "speedup",
        "answer",
        "target said",
        "vlmspec said",
    ]
    lines = []
    for r in results:
        target, spec = r.runs["target"], r.runs["vlmspec"]
        lines.append(
            [
                r.task.qid,
                r.task.workload,
                spec.new_tokens,
                "yes" if r.identical else f"NO (token {r.first_difference})",
                r.tau,
                target.tokens_per_s,
                spec.tokens_per_s,
                r.speedup(),
                r.task.answer or "–",
                r.predictions.get("target") or "–",
                r.predictions.get("vlmspec") or "–",
            ]
        )
    return markdown_table(headers, lines)


def render_markdown(report: Mapping[str, Any], results: Sequence[QuestionResult], peers: Sequence[Peer]) -> str:
    """The whole report as markdown: verdict, summary, breakdowns, peers, differences, every question."""
    s, v, summary = report["settings"], report["verdict"], report["summary"]
    rows = workload_rows(summary)
    parts = [
        "# Speculative decoding benchmark",
        f"target `{s['target']}` · drafter `{s['drafter']}` · scheduler `{s['scheduler']}` · "
        f"temperature {s['temperature']} · max new tokens {s['max_new_tokens']} · seed {s['seed']} · "
        f"torch {report['environment'].get('torch')} / transformers {report['environment'].get('transformers')}",
        f"- **Lossless:** {v['identity']}\n- **Answers:** {v['answers']}\n- **Speed:** {speed_sentence(v)}",
        "## Summary by workload",
        summary_table(rows, "workload"),
    ]
    if summary["by_group"]:
        parts += ["## By category", summary_table(summary["by_group"], "category")]
    parts += [
        "## Acceptance by draft position",
        "Rate at which draft position k survived verification, over the rounds that verified it; tau = accepted + 1 per round.",
        acceptance_table(rows),
    ]
    if decisions := sources_table(rows):
        parts += [
            "## Drafting decisions",
            "Share of vlmspec's rounds by draft source, as the drafting policy chose them (none: the target alone).",
            decisions,
        ]
    parts += [
        "## Time split (seconds summed over questions)",
        "engine = the loop's own overhead outside the two models; inputs = image and prompt processing before the loop.",
        time_split_table(rows),
        "## transformers peers (same model, same inputs, same run)",
        peers_table(peers, summary["all"]),
    ]
    differing = [r for r in results if not r.identical]
    if differing:
        parts += [
            "## Differences from the target alone",
            *("```\n" + describe_difference(r) + "\n```" for r in differing),
        ]
    if report["problems"]:
        parts += [
            "## Skipped MMBench rows",
            markdown_table(["index", "line", "problem"], [[p.index, p.line, p.message] for p in report["problems"]]),
        ]
    parts += ["## Every question", questions_table(results)]
    return "\n\n".join(parts) + "\n"


def write_plots(summary: Mapping[str, Any], out: Path) -> list[Path]:
    """acceptance_by_position.png, speedup.png (by workload and category), tokens_per_s.png, time_split.png."""
    workloads = workload_rows(summary)
    paths = [
        plot_lines(
            out / "acceptance_by_position.png",
            {
                name: (list(range(1, len(t["acceptance_by_position"]) + 1)), t["acceptance_by_position"])
                for name, t in workloads.items()
            },
            title="Acceptance by draft position",
            xlabel="draft position",
            ylabel="acceptance rate",
            ylim=(0, 1.05),
        ),
    ]
    groups = {**workloads, **summary["by_group"]}
    paths.append(
        plot_grouped_bars(
            out / "speedup.png",
            list(groups),
            {
                "vlmspec vs target": [t["speedup"]["vlmspec_vs_target"] for t in groups.values()],
                "hf prompt lookup vs hf generate": [
                    t["speedup"]["hf_prompt_lookup_vs_hf_generate"] for t in groups.values()
                ],
                "hf assistant vs hf generate": [t["speedup"]["hf_assistant_vs_hf_generate"] for t in groups.values()],
            },
            title="Speedup (tokens/s ratio, same run)",
            ylabel="speedup (x)",
            reference=1.0,
        )
    )
    variants = list(summary["all"]["variants"])
    paths.append(
        plot_grouped_bars(
            out / "tokens_per_s.png",
            list(workloads),
            {v: [t["variants"][v]["tokens_per_s"] for t in workloads.values()] for v in variants},
            title="Throughput by variant",
            ylabel="tokens / s",
        )
    )
    labels, parts = [], {p: [] for p in (*TIME_PARTS, "inputs_s")}
    for name, t in workloads.items():
        for variant in ("target", "vlmspec"):
            split = t["time_split_s"][variant]
            tokens = t["variants"][variant]["new_tokens"]
            labels.append(f"{name}\n{variant}")
            for p in parts:
                parts[p].append(safe_ratio(1000 * split[p], tokens))
    names = {
        "prefill_s": "prefill",
        "draft_s": "draft",
        "verify_s": "verify",
        "other_s": "engine",
        "inputs_s": "inputs",
    }
    paths.append(
        plot_stacked_bars(
            out / "time_split.png",
            labels,
            {names[p]: v for p, v in parts.items()},
            title="Time per generated token",
            ylabel="ms / token",
        )
    )
    return paths


def build_report(
    args: argparse.Namespace, settings: Settings, bench: Benchmark, problems: Sequence[RowProblem]
) -> dict[str, Any]:
    variants = ["target", "vlmspec"] + [p.name for p in bench.peers if any(p.name in r.runs for r in bench.results)]
    summary = summarize_results(bench.results, variants)
    settings_record = {
        "target": args.target,
        "drafter": args.drafter,
        "scheduler": args.scheduler,
        "scheduler_args": parse_key_values(args.scheduler_arg),
        "max_draft_tokens": args.max_draft_tokens,
        "max_ngram": args.max_ngram,
        "min_ngram": args.min_ngram,
        "dtype": args.dtype,
        "device": args.device,
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "top_k": settings.top_k,
        "top_p": settings.top_p,
        "seed": settings.seed,
        "num_questions": args.num_questions,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "image_max_side": args.image_max_side,
        "order": "interleaved, order rotated and reversed per question (run_order)",
    }
    return {
        "settings": settings_record,
        "environment": environment_info(),
        "verdict": verdict(summary, settings),
        "peers": [
            {"name": p.name, "configuration": p.description, "status": p.status, "detail": p.detail}
            for p in bench.peers
        ],
        "summary": summary,
        "problems": [vars(p) for p in problems],
        "questions": [question_record(r) for r in bench.results],
    }


def write_report(
    report: Mapping[str, Any], results: Sequence[QuestionResult], peers: Sequence[Peer], out: Path
) -> list[Path]:
    """results.json, results.md and the plots in ``out``."""
    paths = [
        write_json(out / "results.json", report),
        write_text(out / "results.md", render_markdown(report, results, peers)),
    ]
    return paths + write_plots(report["summary"], out)


def render_summary(report: Mapping[str, Any], peers: Sequence[Peer]) -> str:
    """What the console shows at the end: the verdict, the workload table and the peers."""
    v, summary = report["verdict"], report["summary"]
    lines = [f"lossless: {v['identity']}", f"answers: {v['answers']}", f"speed: {speed_sentence(v)}"]
    lines += [
        "",
        summary_table(workload_rows(summary), "workload"),
        "",
        peers_table(peers, summary["all"]),
    ]
    return "\n".join(lines)
