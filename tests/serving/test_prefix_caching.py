"""Prefix caching through the engine: a later turn reuses the earlier turns' KV and drafter context, and answers
exactly as a freshly started engine does (greedy, fp32), with the same drafts accepted."""

from __future__ import annotations

import pytest
import torch
from tiny_drafters import tiny_drafter

from vlmspec.drafters.dspark import DSparkProposer
from vlmspec.kernels import cpu_kernels
from vlmspec.serving import BatchEngine

QUESTIONS = ["What is in the picture?", "Describe the colours.", "What could happen next?"]


def turn_messages(history: list[dict], question: str, first: bool) -> list[dict]:
    content = ([{"type": "image"}] if first else []) + [{"type": "text", "text": question}]
    return [*history, {"role": "user", "content": content}]


def run_alone(engine: BatchEngine, picture, messages):
    (result,) = engine.generate_many([dict(images=[picture], messages=messages, max_new_tokens=10)])
    return result


def accepted_by_round(result) -> tuple:
    stats = result.stats
    return stats.rounds, stats.accepted, stats.verified_lengths, stats.accepted_by_position


def test_a_multi_turn_image_chat_reuses_its_prefix_and_answers_as_a_fresh_engine(make_target, family, astronaut):
    chat_answers_as_a_fresh_engine(make_target(family), astronaut)


def test_a_bfloat16_chat_answers_bit_for_bit_as_a_fresh_engine_by_default(make_target, family, astronaut):
    """In bfloat16 a decode step and a prompt's GEMM round a token's KV differently: batch invariance (on by default
    in bfloat16 where the packed kernels run) makes them one."""
    probe = torch.empty(16, 64, dtype=torch.bfloat16)
    if not (cpu_kernels.kernel_available() and cpu_kernels.packing_applies(probe)):
        pytest.skip("batch_invariant runs on the packed kernels, which need AVX-512 with AVX512-BF16")
    chat_answers_as_a_fresh_engine(make_target(family, dtype=torch.bfloat16), astronaut)


def chat_answers_as_a_fresh_engine(target, astronaut, **options) -> None:
    picture = astronaut.resize((64, 64))
    drafter = tiny_drafter(target)
    warm = BatchEngine(target, DSparkProposer(drafter), **options)
    history = []
    for turn, question in enumerate(QUESTIONS):
        messages = turn_messages(history, question, first=turn == 0)
        hit = run_alone(warm, picture, messages)
        cold = run_alone(BatchEngine(target, DSparkProposer(drafter), **options), picture, messages)
        assert hit.token_ids == cold.token_ids
        assert accepted_by_round(hit) == accepted_by_round(cold)  # the drafter had its whole context: same tau
        if turn:
            assert hit.cached_tokens >= hit.prompt_tokens // 2 and cold.cached_tokens == 0
        answer = target.tokenizer.decode(hit.token_ids, skip_special_tokens=True)
        history = [*messages, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    counters = warm.kv_cache
    assert counters["prefix_hit_tokens"] > 0 and counters["prefix_queried_tokens"] > counters["prefix_hit_tokens"]


def test_a_different_picture_of_the_same_size_is_not_taken_for_the_cached_one(make_target, astronaut):
    target = make_target("qwen2_5_vl")
    picture, other = astronaut.resize((64, 64)), astronaut.transpose(0).resize((64, 64))
    engine = BatchEngine(target)
    messages = turn_messages([], QUESTIONS[0], first=True)
    first = run_alone(engine, picture, messages)
    second = run_alone(engine, other, messages)
    fresh = run_alone(BatchEngine(target), other, messages)
    assert second.token_ids == fresh.token_ids
    assert second.cached_tokens < first.prompt_tokens // 2  # at most the text before the picture


def test_requests_behind_one_system_prompt_share_its_blocks_while_they_run(make_target):
    target = make_target("qwen2_vl")
    system = {"role": "system", "content": [{"type": "text", "text": "You are a careful assistant. " * 12}]}
    requests = [
        dict(messages=[system, {"role": "user", "content": [{"type": "text", "text": q}]}], max_new_tokens=8)
        for q in QUESTIONS
    ]
    engine = BatchEngine(target)
    warm = engine.generate_many(requests[:1]) + engine.generate_many(requests[1:])
    cold = BatchEngine(target, prefix_caching=False).generate_many(requests)
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    assert warm[0].cached_tokens == 0 and all(r.cached_tokens >= 16 * 5 for r in warm[1:])
    assert engine.kv_cache["blocks_used"] == 0  # every request returned its blocks; the cache keeps them idle
    assert engine.kv_cache["prefix_idle_blocks"] > 0


@pytest.mark.parametrize("budget_blocks", [12])
def test_a_full_budget_evicts_idle_cached_blocks_before_turning_anyone_away(make_target, budget_blocks):
    target = make_target("qwen2_vl")
    per_block = BatchEngine(target).kv_cache["bytes_per_block"]
    engine = BatchEngine(target, kv_cache_memory=budget_blocks * per_block)
    prompts = [f"Story number {i}: " + "once upon a time " * 8 for i in range(6)]  # about 4 blocks each
    results = engine.generate_many([dict(prompt=p, max_new_tokens=6) for p in prompts])
    fresh = BatchEngine(target, prefix_caching=False).generate_many([dict(prompt=p, max_new_tokens=6) for p in prompts])
    assert [r.token_ids for r in results] == [r.token_ids for r in fresh]
    kv = engine.kv_cache
    assert kv["blocks_allocated"] <= budget_blocks and kv["blocks_used"] == 0
