"""The table maths of the prefix/TTFT peers and the long-prompt stall benchmark, and the servers' command lines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import long_prompt_stall, prefix_peers
from benchmarks.peer_process import SERVED_MODEL_NAME, Timing, llama_server_command, vlmspec_serve


def test_gaps_are_placed_before_while_and_after_the_prefill_window():
    chunks = [0.0, 0.1, 1.0, 3.5, 3.6, 5.0]  # the window is [0.9, 3.55]
    gaps = long_prompt_stall.phase_gaps(chunks, long_sent=0.9, long_first=3.55)
    assert gaps["before"] == pytest.approx([0.1])  # 0.0 -> 0.1 ends before the long prompt is sent
    assert gaps["while"] == pytest.approx([0.9, 2.5, 0.1])  # each overlaps the window, 3.5 -> 3.6 included
    assert gaps["after"] == pytest.approx([1.4])
    assert long_prompt_stall.phase_gaps([1.0], 0.0, 1.0) == {"before": [], "while": [], "after": []}


def test_a_gap_that_spans_the_whole_window_counts_as_while():
    assert long_prompt_stall.phase_gaps([0.0, 10.0], 2.0, 3.0)["while"] == [10.0]


def test_gap_summary_and_merge():
    summary = long_prompt_stall.summarize_gaps([0.1, 0.3, 0.2])
    assert summary["gaps"] == 3 and summary["max_s"] == 0.3 and summary["median_s"] == pytest.approx(0.2)
    assert long_prompt_stall.summarize_gaps([]) == {"gaps": 0, "median_s": None, "p99_s": None, "max_s": None}
    one, two = {"before": [1.0], "while": [], "after": [2.0]}, {"before": [], "while": [3.0], "after": []}
    assert long_prompt_stall.merge_phases([one, two]) == {"before": [1.0], "while": [3.0], "after": [2.0]}


def test_the_run_summary_uses_the_long_requests_window_and_keeps_errors():
    long = Timing(sent_s=1.0, first_s=2.0, done_s=2.5, prompt_tokens=6000)
    running = Timing(sent_s=0.0, chunk_s=[0.5, 0.9, 1.5, 2.2], first_s=0.5, done_s=2.2)
    failed = Timing(sent_s=0.0, error="boom")
    result = long_prompt_stall.summarize_run(long, [[running], [failed]])
    assert result["long"]["ttft_s"] == 1.0 and result["long"]["prompt_tokens"] == 6000
    assert result["phases"]["while"]["max_s"] == pytest.approx(0.7) and result["phases"]["before"]["gaps"] == 1
    assert result["errors"] == ["boom"] and result["requests"] == 2
    assert long_prompt_stall.verdict(result) == "longest wait while it prefilled 0.700 s: within the 1.0 s bar"
    result["phases"]["while"]["max_s"] = None
    assert long_prompt_stall.verdict(result).startswith("no gap fell in the prefill window")


def test_turn_rows_take_warm_over_cold_and_compare_answers():
    warm = Timing(sent_s=0.0, first_s=0.5, text="same")
    cold = Timing(sent_s=0.0, first_s=2.0, text="same")
    row = prefix_peers.turn_row(3, warm, cold)
    assert row == {"turn": 3, "warm": 0.5, "cold": 2.0, "ratio": 0.25, "same": True}
    differs = prefix_peers.turn_row(1, warm, Timing(sent_s=0.0, first_s=1.0, text="other"))
    assert differs["same"] is False and differs["ratio"] == 0.5
    failed = prefix_peers.turn_row(1, warm, Timing(sent_s=0.0, error="refused"))
    assert failed["ratio"] is None and failed["same"] is False and failed["error"] == "refused"


def test_system_rows_are_ratios_to_the_first_and_the_median_skips_it():
    rows = prefix_peers.system_rows([2.0, 0.5, 1.0, None], [None, None, None, "timeout"])
    assert [r["ratio_to_first"] for r in rows] == [1.0, 0.25, 0.5, None]
    assert rows[3]["error"] == "timeout"
    assert prefix_peers.median_later_ratio(rows) == pytest.approx(0.375)
    assert prefix_peers.median_later_ratio(rows[:1]) is None


def test_repeats_merge_into_medians_with_each_runs_own_ratio():
    runs = [
        [{"turn": 1, "warm": 1.0, "cold": 2.0, "ratio": 0.5, "same": True}],
        [{"turn": 1, "warm": 3.0, "cold": 3.0, "ratio": 1.0, "same": False}],
        [{"turn": 1, "warm": 2.0, "cold": 8.0, "ratio": 0.25, "same": True, "error": "late"}],
    ]
    (row,) = prefix_peers.median_of_repeats(runs)
    assert row == {"turn": 1, "warm": 2.0, "cold": 3.0, "ratio": 0.5, "same": False, "repeats": 3, "error": "late"}
    systems = [prefix_peers.system_rows([2.0, 0.5]), prefix_peers.system_rows([4.0, None], [None, "timeout"])]
    merged = prefix_peers.median_of_repeats(systems)
    assert [r["ttft"] for r in merged] == [3.0, 0.5] and merged[1]["ratio_to_first"] == 0.25
    assert merged[1]["error"] == "timeout" and merged[0]["request"] == 1


def test_tables_put_engines_side_by_side_and_fill_gaps():
    chat = {
        "a": [{"turn": 1, "warm": 1.0, "cold": 1.0, "ratio": 1.0, "same": True}],
        "b": [
            {"turn": 1, "warm": 0.2, "cold": 0.4, "ratio": 0.5, "same": False},
            {"turn": 2, "warm": 0.1, "cold": 0.4, "ratio": 0.25, "same": True},
        ],
    }
    headers, rows = prefix_peers.chat_table(chat)
    assert headers == ["turn", "a warm s", "a cold s", "a warm/cold", "b warm s", "b cold s", "b warm/cold"]
    assert rows[0] == [1, 1.0, 1.0, 1.0, 0.2, 0.4, "0.50 (answers differ)"]
    assert rows[1] == [2, None, None, None, 0.1, 0.4, 0.25]
    system = {"a": prefix_peers.system_rows([2.0, 1.0, 0.5]), "b": prefix_peers.system_rows([1.0, 1.0])}
    headers, rows = prefix_peers.system_table(system)
    assert headers == ["request", "a TTFT s", "a / first", "b TTFT s", "b / first"]
    assert rows[2] == [3, 0.5, 0.25, None, None]
    assert rows[-1] == ["median 2..3", None, pytest.approx(0.375), None, 1.0]


def test_every_server_is_asked_for_by_one_model_name():
    command = llama_server_command(Path("llama-server"), ["-m", "x.gguf"], port=1234, parallel=4)
    assert command[:3] == ["llama-server", "-m", "x.gguf"]
    assert command[command.index("-np") + 1] == "4" and command[command.index("--alias") + 1] == SERVED_MODEL_NAME
    server = vlmspec_serve("v", target="tiny:qwen2_vl", dtype="float32", log_dir=Path("/tmp"), extra=["--x", "1"])
    assert server.command[:4] == [sys.executable, "-m", "vlmspec.cli", "serve"] and "--drafter" not in server.command
    assert server.command[server.command.index("--port") + 1] == str(server.port)
    assert server.command[server.command.index("--served-model-name") + 1] == SERVED_MODEL_NAME
    assert server.log_path == Path("/tmp/v.log") and server.process is None  # made, not launched


def test_peers_refuse_a_target_other_than_the_reference(tmp_path):
    from types import SimpleNamespace

    args = SimpleNamespace(target="tiny:qwen2_vl")
    for name in ("llama-cpp", "vllm"):
        with pytest.raises(ValueError, match="--target reference"):
            prefix_peers.make_engine(name, args, tmp_path)
