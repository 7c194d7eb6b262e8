"""Greedy outputs against a reference: how many are identical, and whether each first difference is a numerical tie.

The rule of every peer table (``benchmarks/vs_peers.py``, ``image_peers.py``, ``interop.py``): an
answer equals the reference token for token, or its first difference sits where the target's own
top-2 logit margin is below the run's tie margin (two engines' rounding may pick either token there).
"""

from __future__ import annotations

from typing import Any

import torch


def identity_report(target, inputs, reference: list[list[int]], tokens: list[list[int]], margin: float) -> dict:
    """Outputs equal to ``reference``; for the others, the first difference and whether it sits at a tie."""
    identical, ties, divergences = 0, 0, []
    for x, ref, got in zip(inputs, reference, tokens):
        if ref == got:
            identical += 1
            continue
        at = first_difference(ref, got)
        top2 = top2_margin(target, x, ref[:at])
        ties += int(top2 < margin)
        divergences.append({"position": at, "top2_margin": top2})
    return {"identical": identical, "ties": ties, "divergences": divergences}


def first_difference(expected: list[int], got: list[int]) -> int:
    """The first position where two token lists differ (the shorter one's length if one extends the other)."""
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))


def top2_margin(target, x, prefix: list[int]) -> float:
    """The target's own top-2 logit margin after the prompt ``x`` and ``prefix`` (transformers' forward)."""
    best, second = top2_logits(target, x, prefix)
    return best - second


@torch.inference_mode()
def top2_logits(target, x, prefix: list[int]) -> tuple[float, float]:
    """The target's own two best logits after the prompt ``x`` and ``prefix`` (transformers' forward).

    ``x`` is the target's ``TargetInputs``: a text prompt or one with images (its pixels and grids
    go into the forward as they are).
    """
    kwargs: dict[str, Any] = dict(x.model_kwargs)
    length = x.input_ids.shape[1]
    extra = torch.tensor([prefix], dtype=x.input_ids.dtype)
    for key, value in kwargs.items():  # the [1, L] tensors grow by the prefix: ids, an all-ones mask, text type ids
        if torch.is_tensor(value) and value.dim() == 2 and value.shape == (1, length):
            tail = extra if key == "input_ids" else torch.full_like(extra, 1 if key == "attention_mask" else 0)
            kwargs[key] = torch.cat([value, tail.to(device=value.device, dtype=value.dtype)], dim=1)
    logits = target.model(**kwargs, logits_to_keep=1).logits[0, -1].float()
    best, second = torch.topk(logits, 2).values.tolist()
    return best, second
