"""Names to objects: what a user may type for a target or a drafter, and what it loads.

* targets: ``"reference"`` (SmolLM2-135M's real weights in a Qwen2-VL, :mod:`vlmspec.reference`),
  ``"tiny:FAMILY"`` / ``"small:FAMILY"`` (random-init Qwen-VL models for tests and
  benchmarks of the mechanics), or the directory of a saved Qwen-VL model;
* drafters: None or ``"none"`` (the target alone), ``"prompt-lookup"``, ``"reference"`` /
  ``"reference-dspark"`` / ``"reference-dflash"`` (the drafters trained for the reference
  target), the directory of a saved DSpark drafter, or any object that implements the
  Proposer protocol.

A name that is none of these gets an error saying whether the path is missing or lacks a
``config.json``, with the closest built-in name (``refrence`` -> ``reference``).

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
PROMPT_LOOKUP = "prompt-lookup"
REFERENCE_DSPARK = "reference-dspark"  # the reference DSpark drafter alone, under the drafting policy
NO_DRAFTER = "none"  # the target alone, as None


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
        from vlmspec.targets.tiny import FAMILIES, tiny_target

        if family not in FAMILIES:
            raise ValueError(
                f"unknown Qwen-VL family in {str(spec)!r}; {did_you_mean(str(spec), target_names())}"
                f"write {kind}:FAMILY with FAMILY one of {', '.join(FAMILIES)}"
            )

        target = tiny_target(family, dtype=resolve_dtype(dtype), **RANDOM_TARGET_SIZES[kind])
        target.decode = check_decode_mode(decode)
        return target.to_device(device)
    if not (Path(spec) / "config.json").is_file():
        raise FileNotFoundError(_unknown_target_message(str(spec)))
    return QwenVLTarget.from_pretrained(
        spec, dtype=dtype, attn_implementation=attn_implementation, device=device, decode=decode
    )


def target_names() -> list[str]:
    """The built-in target names: ``reference`` and ``tiny:FAMILY`` / ``small:FAMILY`` for every family."""
    from vlmspec.targets.tiny import FAMILIES

    return [REFERENCE_SPEC, *(f"{kind}:{family}" for kind in RANDOM_TARGET_SIZES for family in FAMILIES)]


def _unknown_target_message(spec: str) -> str:
    """Why ``spec`` is no target (no such path, a file, or a folder without config.json) and what to pass instead."""
    from vlmspec.targets.tiny import FAMILIES

    path = Path(spec)
    if path.is_dir():
        problem = f"the folder {spec!r} has no config.json, so it holds no saved model"
    elif path.exists():
        problem = f"{spec!r} is a file, not a model directory"
    else:
        problem = f"there is no directory {spec!r}"
    return (
        f"{problem}; {did_you_mean(spec, target_names())}pass the directory of a saved Qwen-VL model (the one "
        f"holding config.json), {REFERENCE_SPEC!r} (the bundled reference target) or tiny:FAMILY for a random "
        f"test model ({', '.join(FAMILIES)})"
    )


def did_you_mean(spec: str, names: list[str]) -> str:
    """``"did you mean 'reference'? "`` for the closest of ``names`` to a mistyped ``spec``, or ``""``."""
    close = difflib.get_close_matches(spec, names, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def load_proposer(
    drafter: str | os.PathLike | Proposer | None,
    target: QwenVLTarget,
    *,
    drafter_dtype: str | torch.dtype | None = None,
) -> Proposer:
    """A proposer from a name, a saved drafter directory, or an object that already is one.

    ``drafter_dtype``: the dtype a DSpark drafter drafts in (``"float32"``, ``"bfloat16"``; None:
    :func:`drafting_dtype`'s measured default).
    """
    if drafter is None or str(drafter) == NO_DRAFTER:
        return NoDraft()
    if isinstance(drafter, Proposer):
        return drafter
    if str(drafter) == PROMPT_LOOKUP:
        from vlmspec.drafters.prompt_lookup import PromptLookup

        return PromptLookup()
    proposer = model_proposer(drafter, target, dtype=drafter_dtype)
    if str(drafter) == "reference":
        return reference_hybrid(proposer, target)
    if str(drafter) == REFERENCE_DSPARK:
        return reference_alone(proposer, target)
    return proposer


def model_proposer(
    drafter: str | os.PathLike, target: QwenVLTarget, *, dtype: str | torch.dtype | None = None
) -> Proposer:
    """The DSpark proposer of a reference drafter name or a saved drafter directory, on its own (no policy),
    drafting in ``dtype`` (None: :func:`drafting_dtype`'s default for ``target``)."""
    from vlmspec.reference import REFERENCE_DRAFTERS, reference_drafter_dir

    path = reference_drafter_dir(str(drafter)) if str(drafter) in REFERENCE_DRAFTERS else Path(drafter)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(_unknown_drafter_message(str(drafter)))
    from vlmspec.drafters.dspark import DSparkDrafter, DSparkProposer

    return DSparkProposer(DSparkDrafter.from_pretrained(path, target=target, dtype=drafting_dtype(target, dtype)))


def drafting_dtype(target: QwenVLTarget, requested: str | torch.dtype | None = None) -> torch.dtype:
    """The dtype a DSpark drafter drafts in beside ``target``: ``requested``, else the measured default.

    The default is the target's dtype, except for a float32 target on a CPU whose kernels pack
    bfloat16 (AVX512-BF16): its drafter drafts in bfloat16. A drafting round reads the drafter's
    weights from memory once, so it takes about half the time: on the reference pair, T_draft
    0.19-0.24 -> 0.11-0.15 T(1), with the same tau on dev prompts (docs/design.md §21.3). Drafts only
    propose, so the output is the target's either way.
    """
    if requested is not None:
        dtype = resolve_dtype(requested)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"a drafter drafts in float32, bfloat16 or float16, got {requested!r}")
        return dtype
    from vlmspec.kernels.cpu_kernels import packing_applies

    bfloat16 = torch.empty(0, dtype=torch.bfloat16, device=target.device)
    return torch.bfloat16 if target.dtype == torch.float32 and packing_applies(bfloat16) else target.dtype


def drafter_names() -> list[str]:
    """The built-in drafter names: the reference drafters, ``prompt-lookup`` and ``none`` (the target alone)."""
    from vlmspec.reference import REFERENCE_DRAFTERS

    return [*REFERENCE_DRAFTERS, PROMPT_LOOKUP, NO_DRAFTER]


def _unknown_drafter_message(spec: str) -> str:
    """Why ``spec`` is no drafter (no such folder, or one without a saved drafter) and what to pass instead."""
    path = Path(spec)
    if path.is_dir():
        problem = f"the folder {spec!r} has no config.json, so it holds no saved drafter"
    elif path.exists():
        problem = f"{spec!r} is a file, not a drafter directory"
    else:
        problem = f"there is no drafter directory {spec!r}"
    names = ", ".join(map(repr, drafter_names()))
    return (
        f"{problem}; {did_you_mean(spec, drafter_names())}pass one of {names} or the directory of a DSpark "
        "drafter saved with save_pretrained (the one holding config.json)"
    )


def reference_hybrid(model: Proposer, target: QwenVLTarget, *, drafter: str = REFERENCE_DSPARK) -> Proposer:
    """The reference pair's default proposer: n-gram and corpus copies and ``model`` under the drafting policy.

    Its costs are measured (:func:`reference_costs`; ``drafter`` names the model drafter they
    are for); the corpus is the target's own answers to training prompts
    (:func:`vlmspec.reference.reference_corpus_path`).
    """
    from vlmspec.drafters.corpus_lookup import CorpusLookup, TokenCorpus
    from vlmspec.drafters.hybrid import HybridProposer
    from vlmspec.drafters.prompt_lookup import PromptLookup
    from vlmspec.reference import reference_corpus_path
    from vlmspec.scheduling.policy import DraftingPolicy

    ngram = PromptLookup(max_draft_tokens=model.max_draft_tokens, max_ngram=4, min_ngram=2)
    corpus = CorpusLookup(TokenCorpus.load(reference_corpus_path()), max_draft_tokens=model.max_draft_tokens)
    policy = DraftingPolicy(reference_costs(model, target, drafter), priors={"model": 0.8, "ngram": 0.6, "corpus": 0.6})
    return HybridProposer(model, policy, ngram=ngram, corpus=corpus)


def reference_alone(model: Proposer, target: QwenVLTarget, *, drafter: str = REFERENCE_DSPARK) -> Proposer:
    """The reference DSpark drafter on its own, under the drafting policy: each round it drafts only where its
    recent rounds say that pays (decided before the round's drafts exist), else the target runs alone.
    """
    from vlmspec.drafters.hybrid import HybridProposer
    from vlmspec.scheduling.policy import DraftingPolicy

    # A round costs about a fifth of a step and pays from about a quarter of an accepted draft, against a mean
    # of 0.5-0.7, so the evidence is the request's mean (the prior counting as 4 rounds), not a short exponential
    # average that a few unlucky rounds push below the break-even; idle, it is probed every 4 rounds (at most 16).
    # On 24 dev questions replayed deterministically, with 6 where drafting never pays (docs/design.md §21.5):
    # 1.218 tokens per target step, against 1.189 for the short average and 1.192 for drafting every round.
    policy = DraftingPolicy(
        reference_costs(model, target, drafter),
        priors={"model": 0.8},
        prior_rounds=4,
        smoothing=0.03,
        probe_every=4,
        max_probe_every=16,
    )
    return HybridProposer(model, policy)


def reference_costs(model: Proposer, target: QwenVLTarget, drafter: str = REFERENCE_DSPARK):
    """The drafting policy's costs for ``model`` on the reference target, in the target's dtype: measured.

    ``T_verify(n) / T(1)`` is the reference SPS curve on this machine (:func:`vlmspec.reference.machine_sps_table`:
    the shipped one where it was measured on this CPU and a spot check agrees, else measured now).
    ``T_draft / T(1)`` is the round the table carries (``vlmspec profile --drafter``) when it was
    timed for ``drafter`` drafting in ``model``'s dtype; otherwise (a table profiled without it, or another drafter) it is
    timed now, a second or so beside the target's step
    (:func:`vlmspec.targets.profile.profile_draft_round`). The copy sources cost 0: their
    lookups run every round before the choice (a sunk cost), so choosing one adds nothing.
    """
    from vlmspec.drafters.hybrid import CORPUS, NGRAM
    from vlmspec.reference import machine_sps_table
    from vlmspec.scheduling.policy import DraftCosts
    from vlmspec.targets.profile import profile_draft_round

    table = machine_sps_table(target)
    timing = table.for_requests(1).drafting
    target_dtype = str(target.dtype).removeprefix("torch.")
    drafts_in = str(getattr(model, "dtype", target.dtype)).removeprefix("torch.")
    if timing is None or timing.drafter != drafter or timing.drafted_in(target_dtype) != drafts_in:
        timing = profile_draft_round(target, model, drafter=drafter, warmup=2, repeats=9)
    return DraftCosts.from_table(table, {**timing.steps(), NGRAM: 0.0, CORPUS: 0.0})
