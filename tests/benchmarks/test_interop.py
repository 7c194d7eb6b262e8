"""The llama.cpp interop benchmark: its counters and acceptance arithmetic, and (slow) the real run.

The slow test exports the bundled DSpark drafter to GGUF with llama.cpp's converter and runs
``llama-server`` alone and with ``--spec-type draft-dspark`` on three held-out prompts (32
tokens): greedy output equal to llama.cpp alone (or a first difference at a numerical tie),
drafts accepted, and acceptance by position within sampling noise of vlmspec's. It needs a
llama.cpp build (``bash scripts/build_llama_cpp.sh`` into runs/llamacpp, or ``$LLAMA_CPP_DIR``; see docs/llama-cpp.md)
and the converter's ``sentencepiece``; it skips, naming the command, without them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest

from benchmarks import interop, llama_cpp_peer

METRICS = """# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
llamacpp:spec_decode_num_draft_tokens_total 70
llamacpp:spec_decode_num_accepted_tokens_total 31
llamacpp:spec_decode_num_drafts_total 10
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 7
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 6
"""


def test_metrics_are_read_and_the_warm_up_is_taken_off():
    after = llama_cpp_peer.parse_metrics(METRICS)
    assert after["spec_decode_num_drafts_total"] == 10 and after["accepted_per_pos"] == [9, 7, 6]
    before = {"spec_decode_num_drafts_total": 1, "accepted_per_pos": [1]}
    delta = llama_cpp_peer.subtract_counters(after, before)
    assert delta["spec_decode_num_drafts_total"] == 9 and delta["accepted_per_pos"] == [8, 7, 6]
    assert llama_cpp_peer.parse_metrics("")["accepted_per_pos"] == []  # a server without drafts


def test_acceptance_shares_count_rounds_and_equal_counts_are_within_noise():
    vlmspec = {"drafting_rounds": 10, "accepted_by_position_counts": [9, 7, 6]}
    same = interop.compare_acceptance(vlmspec, {"spec_decode_num_drafts_total": 10, "accepted_per_pos": [9, 7, 6]})
    assert [p["vlmspec"] for p in same["positions"]] == [0.9, 0.7, 0.6]
    assert same["within_noise"] and same["max_abs_z"] == 0.0 and same["accepted_per_round"]["llama.cpp"] == 2.2
    # One position later: every share moves to the next position, which the z of position 1 shows.
    shifted = interop.compare_acceptance(
        {"drafting_rounds": 400, "accepted_by_position_counts": [360, 280, 240]},
        {"spec_decode_num_drafts_total": 400, "accepted_per_pos": [20, 10, 5]},
    )
    assert not shifted["within_noise"] and shifted["positions"][0]["z"] > 10


def test_two_proportion_z_is_zero_for_certain_shares_and_nan_without_rounds():
    assert interop.two_proportion_z(1.0, 5, 1.0, 7) == 0.0
    assert math.isnan(interop.two_proportion_z(0.5, 0, 0.5, 7))
    assert interop.two_proportion_z(0.6, 100, 0.5, 100) == pytest.approx(0.1 / math.sqrt(0.0049), rel=1e-6)


@pytest.mark.slow
def test_the_bundled_dspark_drafter_in_llama_server_keeps_greedy_output_and_acceptance(tmp_path):
    root = Path(os.environ.get("LLAMA_CPP_DIR") or llama_cpp_peer.DEFAULT_LLAMA_CPP)
    built = any((root / d / "llama-server").is_file() for d in ("build/bin", "src/build/bin", "bin"))
    if not built:
        pytest.skip(
            f"no llama-server under {root}: build llama.cpp with `bash scripts/build_llama_cpp.sh` (docs/llama-cpp.md)"
        )
    if importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama.cpp's converter needs sentencepiece for the Llama vocabulary: pip install sentencepiece")
    argv = ["--drafter", "reference-dspark", "--num-questions", "1", "--max-new-tokens", "32", "--out", str(tmp_path)]
    argv += ["--work-dir", str(tmp_path / "work")]
    out = interop.main(argv)
    data = json.loads((Path(out) / "results.json").read_text())
    name = "llama.cpp + reference-dspark (draft-dspark)"
    identity = data["identity"][name]
    assert identity["identical"] + identity["ties"] == 3, identity
    counters = data["results"][name]["counters"]
    assert counters["spec_decode_num_accepted_tokens_total"] > 0  # the drafter drafted and was accepted
    assert data["acceptance"][name]["within_noise"], data["acceptance"][name]
