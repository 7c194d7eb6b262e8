"""Statistical helpers shared by the end-to-end sampling tests.

A random tiny target spreads its probability over 151,669 tokens, where a random drafter
would never propose anything the target likes and a wrong ``draft_probs`` would go
unnoticed. :func:`confined_target` gives the LM head a bias that confines the target to
four ordinary tokens, so drafts are both accepted and rejected and the exact joint law of
the first generated tokens can be enumerated (:func:`exact_first_tokens`) and compared
with samples by a chi-square test (:func:`chi_square_p_value`).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmspec.sampling import target_probs
from vlmspec.targets import QwenVLTarget
from vlmspec.targets.tiny import tiny_model, tiny_processor
from vlmspec.types import SamplingParams

SUPPORT = (785, 8251, 5562, 14853)  # four ordinary word pieces; EOS is not among them
PROMPT = "Describe the image."


def confined_target(tokenizer) -> QwenVLTarget:
    """A tiny Qwen2.5-VL whose LM head has a bias of -40 outside ``SUPPORT`` (drafters share it)."""
    model = tiny_model("qwen2_5_vl", seed=3)
    head = model.lm_head
    biased = nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight * 10)  # logits of spread ~1.5 within the support
        biased.bias.fill_(-40.0)
        biased.bias[list(SUPPORT)] = 0.0
    model.lm_head = biased
    return QwenVLTarget(model, tiny_processor("qwen2_5_vl", tokenizer), name="tiny-qwen2_5_vl-confined")


def exact_first_tokens(target: QwenVLTarget, image, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3) over SUPPORT^3 under target-only sampling, from the target's own forwards."""
    state, step = target.prefill(target.build_inputs(image, PROMPT))
    p1 = target_probs(step.logits[-1], params).double()
    joint = {}
    for a in SUPPORT:
        for b in SUPPORT:
            logits = target.verify(state, [a, b]).logits  # row 0 predicts x2 after a, row 1 x3 after (a, b)
            target.rollback(state, keep=0)
            p2, p3 = target_probs(logits, params).double()
            for c in SUPPORT:
                joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return joint


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value, pooling cells expected below 5 into one."""
    small = expected < 5
    counts = torch.cat((counts[~small], counts[small].sum()[None]))
    expected = torch.cat((expected[~small], expected[small].sum()[None]))
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def sample_first_tokens(engine, image, runs: int, params: SamplingParams, joint: dict) -> tuple[torch.Tensor, dict]:
    """Counts of the first three generated tokens over ``runs`` seeded generations, and summed stats."""
    index = {seq: i for i, seq in enumerate(joint)}
    counts = torch.zeros(len(joint), dtype=torch.float64)
    totals = {"accepted": 0, "verified": 0, "drafted": 0}
    for seed in range(runs):
        result = engine.generate(
            image,
            PROMPT,
            max_new_tokens=3,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            logit_bias=params.logit_bias,
            seed=seed,
        )
        counts[index[tuple(result.token_ids)]] += 1
        for key in totals:
            totals[key] += getattr(result.stats, key)
    return counts, totals
