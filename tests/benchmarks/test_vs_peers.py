"""The peers comparison benchmark: a tiny run without peers, the llama.cpp rows' logic, and (slow) the real rows.

The slow test runs ``llama-server`` plain, with its n-gram speculation and on Q8_0 weights, on the
reference target's own language model converted to GGUF; it needs a llama.cpp build
(``bash scripts/build_llama_cpp.sh`` into runs/llamacpp, or ``$LLAMA_CPP_DIR``; docs/llama-cpp.md) and
skips, naming that command, without one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import llama_cpp_peer, vllm_peer, vs_peers
from vlmspec.reference import reference_drafter_dir

PROMPTS = "tests/fixtures/mt-bench-mini.jsonl"


def test_a_tiny_run_without_peers_writes_the_table_and_counts_identity(tmp_path):
    argv = ["--prompt-set", PROMPTS, "--num-questions", "1", "--max-new-tokens", "6", "--no-vllm", "--no-llama-cpp"]
    previous = ["--previous-drafter", str(reference_drafter_dir("reference"))]  # before and after: the rows exist
    out = vs_peers.main([*argv, *previous, "--rounds", "2", "--out", str(tmp_path)])
    table = (out / "table.md").read_text()
    assert "run 2 times each" in table and "answered otherwise" not in table  # greedy answers repeat
    assert "transformers generate()" in table and "vlmspec target alone (fast runner)" in table
    assert f"{vs_peers.DEFAULTS} (previous drafter)" in table
    assert f"{vs_peers.DSPARK_EVERY_ROUND} (previous drafter)" in table
    assert vs_peers.DSPARK_ALONE in table  # what reference-dspark loads: DSpark under the drafting policy
    assert "vs best exact llama.cpp" in table and "## Provenance" in table
    results = json.loads((out / "results.json").read_text())["results"]
    for name, result in results.items():
        assert result["tok_per_s"] > 0, name
        identity = result["identity"]
        assert identity["identical"] + len(identity["divergences"]) == 1  # float32: identical, or a counted tie
    assert results["vlmspec target alone (reference forward)"]["identity"]["identical"] == 1


def test_vllm_runs_with_both_cores_bound_and_none_reserved():
    env = vllm_peer.vllm_environment(threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_a_missing_llama_cpp_skips_its_rows_with_the_build_command(tmp_path):
    args = vs_peers.parse_args(["--llama-cpp", str(tmp_path / "nowhere")])
    skipped: dict[str, str] = {}
    assert vs_peers.start_llama_servers(None, args, tmp_path, skipped) == []
    assert "build_llama_cpp.sh" in skipped["llama.cpp"]


def test_llama_cpp_rows_are_plain_each_ngram_type_and_a_lossy_q8_0(monkeypatch):
    monkeypatch.setattr(llama_cpp_peer, "spec_types", lambda server: {"none", "ngram-simple", "ngram-mod"})
    ggufs = {llama_cpp_peer.EXACT: Path("m-bf16.gguf"), llama_cpp_peer.QUANTIZED: Path("m-q8.gguf")}
    rows = llama_cpp_peer.peer_rows(ggufs, Path("llama-server"), threads=2)
    assert list(rows) == [
        "llama.cpp plain",
        "llama.cpp n-gram (ngram-simple)",
        "llama.cpp n-gram (ngram-mod)",
        llama_cpp_peer.LOSSY_ROW,
    ]
    assert rows["llama.cpp plain"] == ["-m", "m-bf16.gguf", "-t", "2", "-tb", "2", "-c", "4096"]
    assert rows["llama.cpp n-gram (ngram-mod)"][-2:] == ["--spec-type", "ngram-mod"]
    assert rows[llama_cpp_peer.LOSSY_ROW][1] == "m-q8.gguf" and "lossy" in llama_cpp_peer.LOSSY_ROW
    monkeypatch.setattr(llama_cpp_peer, "spec_types", lambda server: set())  # an older build: no n-gram rows
    assert list(llama_cpp_peer.peer_rows({llama_cpp_peer.EXACT: Path("m")}, Path("s"), 2)) == ["llama.cpp plain"]


def test_the_best_exact_llama_cpp_row_leaves_out_the_lossy_one():
    results = {
        "llama.cpp plain": {"tokens": [[1] * 10], "seconds": [1.0]},
        llama_cpp_peer.LOSSY_ROW: {"tokens": [[1] * 30], "seconds": [1.0]},
        "vLLM plain": {"tokens": [[1] * 20], "seconds": [1.0]},
    }
    exact = vs_peers.best_of(results, lambda n: n.startswith("llama.cpp") and n != llama_cpp_peer.LOSSY_ROW)
    assert exact == 10.0 and vs_peers.best_of(results, lambda n: n.startswith("vLLM")) == 20.0
    assert vs_peers.best_of(results, lambda n: n.startswith("nothing")) is None


def test_a_llama_server_answer_is_recorded_with_the_clients_wall_time():
    row = {"tokens": [], "seconds": [9.0], "tau": []}
    vs_peers.record(row, {"tokens": [5, 6], "timings": {"predicted_n": 2}, "wall_s": 0.5})
    assert row["tokens"] == [[5, 6]] and row["seconds"] == [0.5] and row["timings"] == [{"predicted_n": 2}]
    row = {"tokens": [], "seconds": [2.0], "tau": []}
    vs_peers.record(row, [1, 2, 3])  # transformers: token ids
    assert row == {"tokens": [[1, 2, 3]], "seconds": [2.0], "tau": []}


def test_a_questions_repeated_runs_pool_into_one_entry_and_count_other_answers():
    row = {"tokens": [], "seconds": [], "tau": []}
    runs = {"tokens": [[1, 2], [1, 2], [1, 3]], "seconds": [1.0, 2.0, 3.0], "tau": [1.5, 2.0, 2.5]}
    vs_peers.pool_runs(row, runs)
    assert row["tokens"] == [[1, 2]] and row["seconds"] == [2.0] and row["tau"] == [2.0]
    assert row["repeats_differ"] == 1 and vs_peers.tok_per_s(row) == 1.0  # 2 tokens a 2-second mean run


def test_rounds_below_one_are_refused():
    with pytest.raises(SystemExit):
        vs_peers.parse_args(["--rounds", "0"])


def test_completion_requests_are_greedy_uncached_token_prompts():
    body = llama_cpp_peer.completion_body([1, 2, 3], 16)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16 and body["temperature"] == 0.0
    assert body["cache_prompt"] is False and body["return_tokens"] is True and "ignore_eos" not in body
    multimodal = {"prompt": {"prompt_string": "a <m> b", "multimodal_data": ["..."]}}
    assert llama_cpp_peer.completion_body(multimodal, 4)["prompt"]["prompt_string"] == "a <m> b"


def test_sampled_completion_requests_turn_llama_cpps_other_samplers_off():
    body = llama_cpp_peer.completion_body([1, 2], 8, {"temperature": 0.7, "top_p": 0.8, "seed": 3})
    assert (body["temperature"], body["top_p"], body["seed"]) == (0.7, 0.8, 3)
    assert body["top_k"] == 0 and body["min_p"] == 0.0  # llama.cpp's defaults (top-k 40, min-p 0.05) would cut more


def test_a_sampled_run_times_every_row_against_the_greedy_target_alone(tmp_path):
    argv = ["--prompt-set", PROMPTS, "--num-questions", "2", "--max-new-tokens", "6", "--no-vllm", "--no-llama-cpp"]
    out = vs_peers.main([*argv, "--temperature", "0.7", "--top-p", "0.8", "--seed", "5", "--out", str(tmp_path)])
    table = (out / "table.md").read_text()
    assert "sampled (temperature 0.7, top-p 0.8)" in table
    assert vs_peers.GREEDY_ALONE in table and "transformers generate()" not in table  # generate() rows are greedy
    results = json.loads((out / "results.json").read_text())["results"]
    assert all(result["tok_per_s"] > 0 for result in results.values())
    assert vs_peers.sampling(vs_peers.parse_args(["--temperature", "0.7", "--seed", "5"]), 2)["seed"] == 7


@pytest.mark.slow
def test_llama_cpp_rows_answer_the_same_tokens_as_the_target_alone(tmp_path):
    root = Path(os.environ.get("LLAMA_CPP_DIR") or llama_cpp_peer.DEFAULT_LLAMA_CPP)
    if not any((root / d / "llama-server").is_file() for d in ("build/bin", "src/build/bin", "bin")):
        pytest.skip(
            f"no llama-server under {root}: build llama.cpp with `bash scripts/build_llama_cpp.sh` (docs/llama-cpp.md)"
        )
    argv = ["--prompt-set", PROMPTS, "--num-questions", "1", "--max-new-tokens", "8", "--no-vllm"]
    out = vs_peers.main([*argv, "--out", str(tmp_path)])
    results = json.loads((out / "results.json").read_text())["results"]
    assert {"llama.cpp plain", "llama.cpp n-gram (ngram-simple)", llama_cpp_peer.LOSSY_ROW} <= set(results)
    for name in ("llama.cpp plain", "llama.cpp n-gram (ngram-simple)"):
        own = results[name]["identity_to_target_alone"]
        assert own["identical"] + own["ties"] == 1, (name, own)  # float32: the same tokens, or a tie
        assert results[name]["tok_per_s"] > 0
