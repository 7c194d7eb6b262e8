"""The concurrency benchmark runs end to end on a tiny target and writes its JSON, table and plots."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.concurrency import main

# A prompt set inside the repository: the default one lives beside the checkout (../shared).
MT_BENCH_MINI = Path(__file__).parents[1] / "fixtures" / "mt-bench-mini.jsonl"


def test_a_tiny_concurrency_run_writes_every_output_and_stays_lossless(tmp_path):
    out = tmp_path / "run"
    args = [
        "--target",
        "tiny:qwen2_vl",
        "--drafter",
        "untrained",
        "--concurrency",
        "1,2",
        "--modes",
        "greedy",
        "--variants",
        "alone,fixed,prefix",
        "--max-new-tokens",
        "4",
        "--profile-context",
        "16",
        "--profile-repeats",
        "1",
        "--prompt-set",
        str(MT_BENCH_MINI),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    report = json.loads((out / "concurrency.json").read_text())
    cells = report["cells"]
    assert {(c["concurrency"], c["variant"]) for c in cells} == {
        (n, v) for n in (1, 2) for v in ("alone", "fixed", "prefix")
    }
    assert all(c["identical"] and c["errors"] == 0 and c["new_tokens"] == 4 * c["concurrency"] for c in cells)
    assert all(0 < c["ttft_p50_s"] <= c["ttft_p90_s"] <= c["wall_s"] for c in cells)  # time to first token
    assert all(len(c["ttft_per_request_s"]) == c["concurrency"] for c in cells)
    assert report["sps_table"]["requests"] == [1, 2] and (out / "sps.json").is_file()
    assert "| greedy | 2 | prefix |" in (out / "concurrency.md").read_text()
    assert (out / "throughput_greedy.png").stat().st_size > 0
