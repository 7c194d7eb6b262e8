"""DSparkConfig: everything needed to rebuild a DSpark drafter, saved as ``config.json``.

The config describes the drafter's own weights (backbone, sequential head, confidence
head) and the target it is tied to (hidden size, vocabulary, hooked layers). The target's
embedding and LM head are not part of the drafter: they are re-tied at load time, and
:meth:`DSparkConfig.check_target` refuses a target they do not fit.

Mask token. The block input is ``[anchor, MASK x (gamma - 1)]``. MASK is either a row of the
target's embedding named by ``mask_token_id`` (DFlash-style, what vLLM and SGLang load), or,
with ``mask_token_id=None``, a learned vector owned by the drafter (which no exported format
can carry). The id must be one no sequence contains: a padding row past the tokenizer (real
Qwen2.5-VL: 151,936 rows for 151,669 used ids) or, where there is none (tiny and reference
targets have exactly ``len(tokenizer)`` rows), the target's video placeholder, since vlmspec
never feeds videos (the target's ``unused_token_ids``). :meth:`DSparkConfig.for_target`
picks the first such id, so new drafters export exactly; ``mask_token_id=None`` still
builds the learned vector.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"

#: Sequential head kinds: "none" is plain DFlash (parallel only); see ``heads.py``.
HEAD_KINDS = ("none", "vanilla", "gated", "rnn")


@dataclass
class DSparkConfig:
    """Shape of a DSpark drafter and of the target it drafts for."""

    # The target the drafter is tied to.
    target_hidden_size: int
    target_vocab_size: int
    target_layer_ids: tuple[int, ...]  # hooked target decoder layers, in feature order; never the last
    # Backbone (Qwen3-style decoder layers).
    hidden_size: int
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    block_size: int = 7  # gamma: tokens drafted per round
    # None: a learned mask vector (see the module docstring); an int: an unused vocabulary id.
    mask_token_id: int | None = None
    # Reduced draft vocabulary (EAGLE-3's d2t map): the drafter's LM head and sequential head
    # cover only this many target ids, stored in the checkpoint; None: the whole vocabulary.
    draft_vocab_size: int | None = None
    # Sequential head: one of HEAD_KINDS, with its low rank r.
    head_kind: str = "vanilla"
    head_rank: int = 256
    # Confidence head: c_k = sigmoid(w . [h_k ; W1[x_{k-1}]]) (with_markov) or sigmoid(w . h_k).
    confidence_head: bool = True
    confidence_with_markov: bool = True
    # Rule mapping the target's M-RoPE positions to the drafter's 1-D positions (vlmspec.targets).
    position_rule: str = "interpolate"
    target_name: str = ""  # informative only: the target the drafter was built for
    init_std: float = 0.02
    version: int = 1  # config format version

    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Check the config on its own (the target is checked by :meth:`check_target`)."""
        positive = (
            "target_hidden_size",
            "target_vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "block_size",
            "head_rank",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DSparkConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                "for grouped-query attention; pick num_kv_heads among the divisors of num_heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: name at least one target decoder layer to hook, e.g. (1,)")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids) or min(self.target_layer_ids) < 0:
            raise ValueError(
                f"target_layer_ids must be distinct non-negative layer indices, got {self.target_layer_ids}"
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, {self.target_vocab_size}] (the target vocabulary) or None, "
                f"got {self.draft_vocab_size!r}"
            )
        if self.head_kind not in HEAD_KINDS:
            raise ValueError(f"head_kind must be one of {HEAD_KINDS}, got {self.head_kind!r}")
        if self.confidence_head and self.confidence_with_markov and self.head_kind == "none":
            raise ValueError(
                "confidence_with_markov needs a sequential head's token embedding W1, but head_kind is 'none'; "
                "set confidence_with_markov=False or choose head_kind 'vanilla', 'gated' or 'rnn'"
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.target_vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target vocabulary [0, {self.target_vocab_size}); "
                "use an unused id below the vocabulary size, or None for a learned mask vector"
            )
        if not isinstance(self.position_rule, str) or not self.position_rule:
            raise ValueError(f"position_rule must be a non-empty rule name, got {self.position_rule!r}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")

    def check_target(self, target: Any) -> None:
        """Refuse a target this drafter cannot be tied to, saying what does not match.

        ``target`` is duck-typed: it needs ``hidden_size``, ``vocab_size``, ``num_layers``
        and, when ``mask_token_id`` is set, ``tokenizer``.
        """
        name = getattr(target, "name", "the target")
        if target.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"drafter was built for target hidden size {self.target_hidden_size} "
                f"({self.target_name or 'unnamed target'}) but {name} has hidden size {target.hidden_size}; "
                "load a drafter trained for this target or build one with DSparkDrafter.from_target"
            )
        if target.vocab_size != self.target_vocab_size:
            raise ValueError(
                f"drafter was built for a vocabulary of {self.target_vocab_size} rows "
                f"({self.target_name or 'unnamed target'}) but {name} has {target.vocab_size}; "
                "load a drafter trained for this target or build one with DSparkDrafter.from_target"
            )
        last = target.num_layers - 1
        bad = [i for i in self.target_layer_ids if i >= last]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are not allowed for {name} with {target.num_layers} decoder layers: "
                f"use ids in [0, {last - 1}]. The last layer ({last}) is excluded because transformers "
                "reports it after the final norm, unlike the raw outputs hooked from the other layers"
            )
        if self.mask_token_id is not None and self.mask_token_id not in getattr(target, "unused_token_ids", ()):
            used = len(target.tokenizer)
            if not used <= self.mask_token_id < target.vocab_size:
                free = f"ids {used}..{target.vocab_size - 1} are free" if used < target.vocab_size else "no id is free"
                unused = tuple(getattr(target, "unused_token_ids", ()))[:4]
                spare = f"; the target's unused_token_ids start {list(unused)}" if unused else ""
                raise ValueError(
                    f"mask_token_id {self.mask_token_id} is not a reserved id: the tokenizer uses ids below {used} "
                    f"and the vocabulary has {target.vocab_size} rows ({free}{spare}). Pick one of those, leave "
                    "mask_token_id out (DSparkConfig.for_target picks one), or set it to None for a learned mask vector"
                )

    # ------------------------------------------------------------------ building
    @classmethod
    def for_target(cls, target: Any, **overrides: Any) -> DSparkConfig:
        """A config sized for ``target`` (duck-typed), with ``overrides`` applied.

        Defaults: the drafter's hidden size equals the target's; 2 layers; head_dim 128
        (64 below hidden 1024, 16 below 256); up to 5 hooked layers evenly spaced over
        ``[1, num_layers - 2]`` (DeepSpec uses [1, 9, 17, 25, 33] for 36 layers); MASK is the
        first of the target's ``unused_token_ids`` (a learned vector when it names none).
        """
        hidden = overrides.get("hidden_size", target.hidden_size)
        head_dim = overrides.get("head_dim", 128 if hidden >= 1024 else 64 if hidden >= 256 else 16)
        heads = overrides.get("num_heads", max(hidden // head_dim, 1))
        defaults = dict(
            target_hidden_size=target.hidden_size,
            target_vocab_size=target.vocab_size,
            target_layer_ids=default_layer_ids(target.num_layers),
            hidden_size=hidden,
            head_dim=head_dim,
            num_heads=heads,
            num_kv_heads=max(heads // 2, 1) if heads % 2 == 0 else heads,
            intermediate_size=3 * hidden,
            target_name=str(getattr(target, "name", "")),
            mask_token_id=next(iter(getattr(target, "unused_token_ids", ())), None),
        )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown DSparkConfig fields {sorted(unknown)}; see DSparkConfig for the valid names")
        return cls(**{**defaults, **overrides})

    # ------------------------------------------------------------------ io
    @property
    def num_draft_tokens(self) -> int:
        """Columns of the drafter's logits: the reduced draft vocabulary, or the whole target's."""
        return self.draft_vocab_size or self.target_vocab_size

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        return data

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory) / CONFIG_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> DSparkConfig:
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"no {CONFIG_NAME} in {directory}: not a saved DSpark drafter "
                "(save one with DSparkDrafter.save_pretrained)"
            )
        data = json.loads(path.read_text())
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path} has unknown fields {sorted(unknown)}: written by a newer vlmspec?")
        return cls(**data)


def default_layer_ids(num_layers: int, max_layers: int = 5) -> tuple[int, ...]:
    """Up to ``max_layers`` target layer ids evenly spaced over ``[1, num_layers - 2]``.

    The last layer is never chosen (see :meth:`DSparkConfig.check_target`).
    """
    if num_layers < 2:
        raise ValueError(f"a target needs at least 2 decoder layers to hook a non-final one, got {num_layers}")
    high = num_layers - 2
    low = min(1, high)
    count = min(max_layers, high - low + 1)
    if count == 1:
        return (low,)
    return tuple(sorted({round(low + (high - low) * i / (count - 1)) for i in range(count)}))
