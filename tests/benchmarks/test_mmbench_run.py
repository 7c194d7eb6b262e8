"""The benchmark loop and its report: a stub engine for the bookkeeping, a tiny Qwen-VL end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from benchmarks.mmbench_spec import main
from benchmarks.spec.aggregate import summarize_results
from benchmarks.spec.loop import Benchmark
from benchmarks.spec.peers import Peer
from benchmarks.spec.report import render_markdown, verdict
from benchmarks.spec.runs import Settings, make_scheduler
from benchmarks.spec.workloads import Task
from vlmspec.types import GenerationResult, SpecStats

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


class _StubTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


class _StubInputs:
    length = 3
    model_kwargs = {"input_ids": torch.tensor([[1, 2, 3]])}


class _StubModel:
    def generate(self, **kwargs):
        if "prompt_lookup_num_tokens" in kwargs:
            raise ValueError("prompt lookup is not supported for this model\nsecond line")
        return torch.tensor([[1, 2, 3, 7, 8, 9]])


class _StubTarget:
    eos_token_ids = (0,)
    tokenizer = _StubTokenizer()
    model = _StubModel()

    def build_inputs(self, images, prompt):
        return _StubInputs()


class _StubEngine:
    """Answers 7 8 9; the speculative run of the prompt "diverge" answers 7 5 9 instead."""

    target = _StubTarget()

    def generate(self, images, prompt, *, max_new_tokens, temperature, top_k, top_p, seed, speculative):
        tokens = [7, 5, 9] if speculative and prompt == "diverge" else [7, 8, 9]
        stats = SpecStats(new_tokens=3, total_s=1e-3)
        if speculative:
            stats.record_round(drafted=2, verified=2, accepted=1)
        else:
            stats.record_round(drafted=0, verified=0, accepted=0)
            stats.record_round(drafted=0, verified=0, accepted=0)
        return GenerationResult(" ".join(map(str, tokens)), tokens, stats, "length")


def test_differences_are_counted_printed_and_fail_the_greedy_check(capsys):
    peers = [Peer("hf-generate", "plain"), Peer("hf-prompt-lookup", "lookup", {"prompt_lookup_num_tokens": 4})]
    bench = Benchmark(_StubEngine(), Settings(max_new_tokens=3), peers, show_progress=False)
    tasks = [Task("text", "text-0", "text", "same"), Task("text", "text-1", "text", "diverge")]
    bench.warm_up(tasks[0], 1)
    results = bench.run(tasks)

    assert peers[1].status == "refused"
    assert peers[1].detail == "ValueError: prompt lookup is not supported for this model (during warm-up)"
    assert [r.identical for r in results] == [True, False] and results[1].first_difference == 1
    assert set(results[0].runs) == {"target", "vlmspec", "hf-generate"}
    assert "DIFFERENCE in text-1" in capsys.readouterr().err

    summary = summarize_results(results, ["target", "vlmspec", "hf-generate"])
    total = summary["all"]
    assert total["differences"] == ["text-1"] and total["identical"] == 1
    assert total["tau"] == pytest.approx(2.0)  # one accepted draft + 1 per round
    assert total["acceptance_by_position"] == [1.0, 0.0] and total["verified_by_position"] == [2, 2]
    assert total["identical_to_target"]["hf-generate"] == {"identical": 2, "compared": 2}
    outcome = verdict(summary, Settings())
    assert outcome["lossless_check"] == "FAILED" and outcome["differences"] == 1
    assert verdict(summary, Settings(temperature=1.0))["lossless_check"] == "not applicable"

    report = {
        "settings": {
            "target": "stub",
            "drafter": "stub",
            "scheduler": "none",
            "temperature": 0.0,
            "max_new_tokens": 3,
            "seed": 0,
        },
        "environment": {},
        "verdict": outcome,
        "summary": summary,
        "problems": [],
    }
    markdown = render_markdown(report, results, peers)
    assert "## Differences from the target alone" in markdown and "text-1" in markdown
    assert "refused" in markdown and "1/2 (FAILED)" in markdown


def test_scheduler_none_is_verify_all_and_others_are_built_or_refused_with_the_fix():
    assert make_scheduler("none", {}) is None
    assert hasattr(make_scheduler("threshold", {"threshold": 0.5}), "schedule")
    with pytest.raises(ValueError, match="choose one of"):
        make_scheduler("fastest", {})


def test_command_line_errors_name_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", "tiny:qwen2_vl", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "no workload chosen: pass --mmbench" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--target", "tiny:qwen2_vl", "--out", str(tmp_path), "--vqa", "--max-new-tokens", "0"])
    assert "--max-new-tokens must be at least 1" in capsys.readouterr().err


def test_tiny_end_to_end_run_writes_json_table_plots_and_shows_zero_greedy_differences(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(
        [
            "--target",
            "tiny:qwen2_vl",
            "--mmbench",
            str(FIXTURES / "mmbench_mini.tsv"),
            "--prompt-set",
            str(FIXTURES / "mt-bench-mini.jsonl"),
            "--num-questions",
            "2",
            "--max-new-tokens",
            "10",
            "--warmup",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    printed = capsys.readouterr().out
    assert status == 0
    report = json.loads((out / "results.json").read_text())
    assert report["verdict"]["lossless_check"] == "passed" and report["verdict"]["differences"] == 0
    assert [q["qid"] for q in report["questions"]] == ["mmbench-0", "mmbench-1", "mt-bench-mini-0", "mt-bench-mini-1"]
    assert all(q["identical"] and q["runs"]["vlmspec"]["new_tokens"] > 0 for q in report["questions"])
    total = report["summary"]["all"]
    assert total["variants"]["vlmspec"]["tokens_per_s"] > 0 and total["speedup"]["vlmspec_vs_target"] > 0
    assert set(total["time_split_s"]["vlmspec"]) >= {"prefill_s", "draft_s", "verify_s", "other_s", "inputs_s"}
    assert total["accuracy"]["target"] == total["accuracy"]["vlmspec"]  # lossless: same answers, same score
    assert total["accuracy"]["target"]["scored"] == 2  # the two MMBench questions
    peers = {p["name"]: p for p in report["peers"]}
    assert set(peers) == {"hf-generate", "hf-prompt-lookup", "hf-assistant"}
    assert peers["hf-generate"]["status"] == "ok"
    assert total["identical_to_target"]["hf-generate"]["identical"] == 4  # transformers agrees with the target alone
    for peer in peers.values():  # anything transformers refused is reported with its reason
        assert peer["status"] == "ok" or peer["detail"]

    markdown = (out / "results.md").read_text()
    assert "greedy outputs identical to the target alone: 4/4 (passed)" in markdown
    assert (
        "| mmbench | 2 | 2/2 |" in markdown
        and "| mmbench/image_topic | 1 | 1/1 |" in markdown
        and "## Acceptance by draft position" in markdown
    )
    assert "4/4 (passed)" in printed and "| workload | n | identical | tau |" in printed
    for name in ("acceptance_by_position", "speedup", "tokens_per_s", "time_split"):
        with Image.open(out / f"{name}.png") as image:
            assert image.format == "PNG"


class _ChoosingEngine(_StubEngine):
    """Like _StubEngine, with a proposer that chose a source per round (text: n-gram then none; images: model)."""

    def generate(self, images, prompt, **kwargs):
        result = super().generate(images, prompt, **kwargs)
        if kwargs["speculative"]:
            result.stats.rounds_by_source = {"model": 1} if images else {"ngram": 1, "none": 3}
        return result


def test_the_text_mix_is_pooled_and_the_policy_decisions_are_tabled_per_workload():
    bench = Benchmark(_ChoosingEngine(), Settings(max_new_tokens=3), [], show_progress=False)
    picture = Image.new("RGB", (8, 8))
    tasks = [
        Task("gsm8k", "gsm8k-0", "gsm8k", "same"),
        Task("mt-bench", "mt-bench-0", "mt-bench", "same"),
        Task("photos", "photos-0", "photos", "same", images=(picture,)),
    ]
    summary = summarize_results(bench.run(tasks), ["target", "vlmspec"])
    assert summary["text"]["questions"] == 2 and summary["all"]["questions"] == 3
    assert summary["text"]["rounds_by_source"] == {"ngram": 2, "none": 6}
    assert summary["all"]["rounds_by_source"] == {"model": 1, "ngram": 2, "none": 6}
    report = {
        "settings": {"target": "stub", "drafter": "stub", "scheduler": "none", "temperature": 0.0},
        "environment": {},
        "verdict": verdict(summary, Settings()),
        "summary": summary,
        "problems": [],
    }
    report["settings"].update(max_new_tokens=3, seed=0)
    markdown = render_markdown(report, [], [])
    assert "| all text | 2 |" in markdown
    assert "## Drafting decisions" in markdown and "| photos | 1 | 100% | 0% | 0% |" in markdown
    assert "| all text | 8 | 0% | 25% | 75% |" in markdown


def test_a_text_only_run_has_no_separate_text_row():
    bench = Benchmark(_StubEngine(), Settings(max_new_tokens=3), [], show_progress=False)
    summary = summarize_results(bench.run([Task("gsm8k", "gsm8k-0", "gsm8k", "same")]), ["target", "vlmspec"])
    assert summary["text"] is None and summary["all"]["rounds_by_source"] == {}
