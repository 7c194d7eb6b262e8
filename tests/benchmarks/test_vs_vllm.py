"""The vLLM comparison benchmark: a tiny run without vLLM writes its table and reports identity."""

from __future__ import annotations

import json

from benchmarks import vllm_peer, vs_vllm

PROMPTS = "tests/fixtures/mt-bench-mini.jsonl"


def test_a_tiny_run_without_vllm_writes_the_table_and_counts_identity(tmp_path):
    out = vs_vllm.main(
        ["--prompt-set", PROMPTS, "--num-questions", "1", "--max-new-tokens", "6", "--no-vllm", "--out", str(tmp_path)]
    )
    table = (out / "table.md").read_text()
    assert "transformers generate()" in table and "vlmspec target alone (fast runner)" in table
    results = json.loads((out / "results.json").read_text())["results"]
    for name, result in results.items():
        assert result["tok_per_s"] > 0, name
        identity = result["identity"]
        assert identity["identical"] + len(identity["divergences"]) == 1  # float32: identical, or a counted tie
    assert results["vlmspec target alone (reference forward)"]["identity"]["identical"] == 1


def test_vllm_runs_with_both_cores_bound_and_none_reserved():
    env = vllm_peer.vllm_environment(threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
