"""Measure a Qwen-VL target's SPS curve (forward steps per second against tokens in flight)."""

from __future__ import annotations

import torch

from vlmspec.scheduling.profiling import SPSTable, profile_forward
from vlmspec.target.adapter import QwenVLTarget
from vlmspec.target.inputs import TargetInputs

FILLER = "The quick brown fox jumps over the lazy dog while the committee reviews the quarterly report. "


def profile_target(
    target: QwenVLTarget,
    *,
    max_tokens: int = 16,
    context_length: int = 256,
    warmup: int = 3,
    repeats: int = 10,
) -> SPSTable:
    """Time one verify forward of 1..``max_tokens`` tokens on top of ``context_length`` cached tokens.

    The cache is rolled back after every forward, so each timing sees the same context.
    """
    if not 1 <= context_length < target.max_context - max_tokens:
        raise ValueError(
            f"context_length must lie in [1, {target.max_context - max_tokens}) for this model, got {context_length}"
        )
    ids = filler_ids(target, context_length)
    state, _ = target.prefill(TargetInputs(ids, {"input_ids": ids}, num_images=0))
    probe = ids[0, :max_tokens].tolist()

    def forward(n: int) -> None:
        target.verify(state, probe[:n])
        target.rollback(state, keep=0)

    config = target.model.config.get_text_config()
    return profile_forward(
        forward,
        max_tokens,
        model=target.name,
        device=str(target.device),
        dtype=str(target.dtype).removeprefix("torch."),
        context_length=context_length,
        model_config={"family": target.family, "hidden_size": config.hidden_size,
                      "num_layers": target.num_layers, "vocab_size": target.vocab_size},  # fmt: skip
        warmup=warmup,
        repeats=repeats,
    )


def filler_ids(target: QwenVLTarget, length: int) -> torch.Tensor:  # -> [1, length] int64
    """Real-text token ids of exactly ``length`` tokens (the content does not affect timing)."""
    one = target.tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    repeated = (one * (length // len(one) + 1))[:length]
    return torch.tensor([repeated], dtype=torch.long, device=target.device)
