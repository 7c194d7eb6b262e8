"""The KV memory budget: its parsing, a request that can never fit, and admission by blocks.

Under a budget that holds two requests' blocks but not three, three requests all complete
with the outputs each gets alone, never more than two at once: the newcomer waits.
"""

from __future__ import annotations

import pytest

from vlmspec.serving import BatchEngine
from vlmspec.serving.memory import blocks_needed, kv_budget_bytes, parse_kv_cache_memory

PROMPTS = ["Describe the picture.", "Write a haiku about rain.", "Count from one to ten."]


def test_a_budget_is_bytes_with_a_unit_or_a_fraction_of_ram():
    assert parse_kv_cache_memory("268435456") == 268435456
    assert parse_kv_cache_memory("256MB") == 256 * 10**6
    assert parse_kv_cache_memory("2GiB") == 2 * 2**30
    assert parse_kv_cache_memory("0.25") == 0.25
    for bad in ("lots", "-3", "5 parsecs"):
        with pytest.raises(ValueError, match="kv-cache-memory"):
            parse_kv_cache_memory(bad)
    assert 0 < kv_budget_bytes(0.5) <= kv_budget_bytes(1.0)
    assert kv_budget_bytes(None) > 0  # half the RAM available now
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            kv_budget_bytes(bad)


def test_blocks_needed_counts_the_prompt_and_every_token_it_may_generate_within_the_context():
    assert blocks_needed(30, 2, max_context=4096, block_size=16) == 2
    assert blocks_needed(30, 3, max_context=4096, block_size=16) == 3
    assert blocks_needed(30, 1000, max_context=40, block_size=16) == 3  # the context ends it first


def per_block(target) -> int:
    return BatchEngine(target).kv_cache["bytes_per_block"]


def test_a_request_that_can_never_fit_is_refused_naming_the_limit_and_the_engine_keeps_working(make_target):
    target = make_target("qwen2_vl")
    engine = BatchEngine(target, kv_cache_memory=2 * per_block(target))  # 32 slots
    with pytest.raises(ValueError, match="KV cache memory limit"):
        engine.add_request(None, PROMPTS[0], max_new_tokens=200)
    assert not engine.has_unfinished
    engine.add_request(None, "Hi", max_new_tokens=4, request_id="small")
    while engine.has_unfinished:
        engine.step()
    assert engine.result("small").finish_reason in ("length", "eos")


@pytest.mark.parametrize("drafter", ["target-alone", "prompt-lookup", "dspark"])
def test_requests_short_of_blocks_are_preempted_then_resume_with_their_own_output(make_target, family, drafter):
    """A budget of about two requests' blocks, three requests admitted on their prompts: as they grow, the latest
    to join goes back to wait, recomputes its prompt and answer when room comes back, and ends as it does alone
    (DSpark's drafter reopens with the recomputed features)."""
    from tiny_drafters import tiny_drafter

    from vlmspec.drafters.dspark import DSparkProposer
    from vlmspec.drafters.prompt_lookup import PromptLookup

    target = make_target(family)
    proposer = {
        "target-alone": None,
        "prompt-lookup": PromptLookup(max_draft_tokens=3),
        "dspark": DSparkProposer(tiny_drafter(target)),
    }[drafter]
    options = {"max_new_tokens": 40}
    alone = [BatchEngine(target, proposer).generate_many([{"prompt": p, **options}])[0].token_ids for p in PROMPTS]
    lengths = [target.build_inputs(None, p).length for p in PROMPTS]
    size = 16
    blocks = sum(-(-(n + 40) // size) for n in lengths[:2]) + 1  # two requests' worst cases, not three
    engine = BatchEngine(target, proposer, kv_cache_memory=blocks * per_block(target), prefix_caching=False)
    ids = [engine.add_request(None, p, **options) for p in PROMPTS]
    most_running = 0
    while engine.has_unfinished:
        engine.step()
        most_running = max(most_running, engine.num_running)
        assert engine.kv_cache["blocks_used"] <= engine.kv_cache["blocks_limit"]
    assert most_running == 3  # admitted on their prompts' blocks
    assert engine.preemptions > 0
    assert [engine.result(i).token_ids for i in ids] == alone
    assert engine.kv_cache["blocks_used"] == 0  # every block came back
