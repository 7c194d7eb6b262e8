"""Names to objects: what a user may type for a target or a drafter, and what it loads.

* targets: ``"reference"`` (SmolLM2-135M's real weights in a Qwen2-VL, :mod:`vlmspec.reference`),
  ``"tiny:FAMILY"`` / ``"small:FAMILY"`` (random-init Qwen-VL models for tests and
  benchmarks of the mechanics), or the directory of a saved Qwen-VL model;
* drafters: None (the target alone), ``"prompt-lookup"``, ``"reference"`` /
  ``"reference-dflash"`` (the drafters trained for the reference target), the directory of
  a saved DSpark drafter, or any object that implements the Proposer protocol.

This module sits on top: ``targets/`` and ``drafters/`` know nothing of these names.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import torch

from vlmspec.drafters.base import NoDraft, Proposer
from vlmspec.targets.adapter import QwenVLTarget, check_decode_mode, resolve_dtype

RANDOM_TARGET_SIZES = {"tiny": {}, "small": {"hidden_size": 512, "num_layers": 8}}
REFERENCE_SPEC = "reference"


def load_target(
    spec: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
    decode: str = "fast",
) -> QwenVLTarget:
    """A target from a local model directory, the reference model, or a random-init Qwen-VL.

    ``reference`` is SmolLM2-135M-Instruct's real weights in a Qwen2-VL with a small
    trained vision tower (:mod:`vlmspec.reference`; assembled on first use). ``tiny:FAMILY``
    is hidden 64 / 4 layers (tests); ``small:FAMILY`` is hidden 512 / 8 layers (benchmarks
    of the mechanics). Both use the real Qwen tokenizer and full vocabulary; random weights
    say nothing about acceptance.
    """
    if str(spec) == REFERENCE_SPEC:
        from vlmspec.reference import reference_target_dir

        spec = reference_target_dir()
    kind, _, family = str(spec).partition(":")
    if kind in RANDOM_TARGET_SIZES and family:
        from vlmspec.targets.tiny import tiny_target

        target = tiny_target(family, dtype=resolve_dtype(dtype), **RANDOM_TARGET_SIZES[kind])
        target.decode = check_decode_mode(decode)
        return target.to_device(device)
    if not Path(spec).exists():
        raise FileNotFoundError(_unknown_target_message(str(spec)))
    return QwenVLTarget.from_pretrained(
        spec, dtype=dtype, attn_implementation=attn_implementation, device=device, decode=decode
    )


def _unknown_target_message(spec: str) -> str:
    """What to pass instead of a target that is neither a directory nor a built-in name (closest name first)."""
    from vlmspec.targets.tiny import FAMILIES

    names = [REFERENCE_SPEC, *(f"{kind}:{family}" for kind in RANDOM_TARGET_SIZES for family in FAMILIES)]
    close = difflib.get_close_matches(spec, names, n=1, cutoff=0.6)
    guess = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"no model directory {spec!r}; {guess}pass the directory of a saved Qwen-VL model, {REFERENCE_SPEC!r} "
        f"(the bundled reference target) or tiny:FAMILY for a random test model ({', '.join(FAMILIES)})"
    )


def load_proposer(drafter: str | os.PathLike | Proposer | None, target: QwenVLTarget) -> Proposer:
    """A proposer from a name, a saved drafter directory, or an object that already is one."""
    if drafter is None:
        return NoDraft()
    if isinstance(drafter, Proposer):
        return drafter
    if str(drafter) == "prompt-lookup":
        from vlmspec.drafters.prompt_lookup import PromptLookup

        return PromptLookup()
    from vlmspec.reference import REFERENCE_DRAFTERS, reference_drafter_dir

    path = reference_drafter_dir(str(drafter)) if str(drafter) in REFERENCE_DRAFTERS else Path(drafter)
    if not path.is_dir():
        raise FileNotFoundError(
            f"drafter {str(drafter)!r} is neither 'prompt-lookup', {' nor '.join(map(repr, REFERENCE_DRAFTERS))}, "
            "nor a directory with a saved drafter"
        )
    from vlmspec.drafters.dspark import DSparkDrafter

    proposer = DSparkDrafter.from_pretrained(path, target=target).proposer()
    return reference_hybrid(proposer, target) if str(drafter) == "reference" else proposer


def reference_hybrid(model: Proposer, target: QwenVLTarget) -> Proposer:
    """The reference pair's default proposer: n-gram copies and ``model`` under the drafting policy.

    Its costs are the reference target's SPS curve for the target's dtype and the measured
    drafting cost of the reference drafter (:data:`vlmspec.reference.REFERENCE_DRAFT_STEPS`).
    """
    from vlmspec.drafters.hybrid import HybridProposer
    from vlmspec.drafters.prompt_lookup import PromptLookup
    from vlmspec.reference import REFERENCE_DRAFT_STEPS, reference_sps_table
    from vlmspec.scheduling.policy import DraftCosts, DraftingPolicy
    from vlmspec.scheduling.tables import load_sps_table

    dtype = "bfloat16" if target.dtype == torch.bfloat16 else "float32"
    costs = DraftCosts.from_table(load_sps_table(reference_sps_table(dtype)), REFERENCE_DRAFT_STEPS[dtype])
    ngram = PromptLookup(max_draft_tokens=model.max_draft_tokens, max_ngram=4, min_ngram=2)
    return HybridProposer(model, DraftingPolicy(costs, priors={"model": 0.8, "ngram": 0.6}), ngram=ngram)
