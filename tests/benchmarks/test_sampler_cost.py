"""benchmarks/sampler_cost.py runs end to end on a tiny target and writes its two tables."""

from __future__ import annotations

import json

import pytest

from vlmspec.kernels import cpu_kernels


@pytest.mark.skipif(not cpu_kernels.kernel_available(), reason="the native sampler needs vlmspec's CPU kernel")
def test_sampler_cost_writes_both_tables(tmp_path):
    from benchmarks.sampler_cost import MODES, main

    out = main(
        ["--target", "tiny:qwen2_vl", "--dtype", "float32", "--prompts", "1", "--max-new-tokens", "3"]
        + ["--rounds", "1", "--threads", "1", "--out", str(tmp_path)]
    )
    text = (out / "sampler_cost.md").read_text()
    assert all(f"| float32 | {mode} |" in text for mode in MODES)
    report = json.loads((out / "sampler_cost.json").read_text())
    costs = report["dtypes"]["float32"]["verify_one_token_s"]
    assert set(costs) == set(MODES) and all(seconds > 0 for seconds in costs.values())
