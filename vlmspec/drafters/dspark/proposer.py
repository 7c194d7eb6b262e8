"""DSparkProposer: a DSpark drafter behind the engine's Proposer protocol.

Per request the state is a :class:`DraftContextCache`. Each round ``propose`` appends
the projected context K/V of the newly committed span (its target features arrive in
the :class:`~vlmspec.types.ContextUpdate`), then drafts ``gamma`` tokens at positions
``anchor_position + [0 .. gamma - 1]`` from ``[anchor, MASK x (gamma - 1)]``.

The returned ``draft_probs`` are exactly the float32 distributions the tokens were drawn
from: ``softmax((U_k + B_k) / T)`` with the head's bias; top-k/top-p are not applied to
drafts (rejection sampling is lossless for any draft distribution). At temperature 0 the
drafts are the argmax and ``draft_probs`` is None (one-hot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmspec.drafters.dspark.cache import DraftContextCache
from vlmspec.drafters.dspark.model import DSparkDrafter
from vlmspec.types import ContextUpdate, DraftBlock, SamplingParams


@dataclass
class DSparkState:
    """Per-request drafter state: the projected context of the committed tokens."""

    cache: DraftContextCache = field(default_factory=DraftContextCache)


class DSparkProposer:
    """Implements :class:`vlmspec.drafters.base.Proposer` with a :class:`DSparkDrafter`."""

    def __init__(self, drafter: DSparkDrafter) -> None:
        self.drafter = drafter.eval()
        config = drafter.config
        self.max_draft_tokens: int = config.block_size
        self.feature_layers: tuple[int, ...] = config.target_layer_ids
        self.vocab_size: int | None = config.target_vocab_size
        self.position_rule: str = config.position_rule
        self._feature_width = len(config.target_layer_ids) * config.target_hidden_size

    def new_state(self) -> DSparkState:
        return DSparkState()

    @torch.inference_mode()
    def propose(
        self,
        state: DSparkState,
        update: ContextUpdate,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftBlock:
        """Append ``update``'s features to the request's draft cache and draft one block."""
        self._absorb(state, update)
        device = self.drafter.backbone.norm.weight.device
        sample = self.drafter.draft(
            anchors=torch.tensor([update.anchor], device=device),
            anchor_positions=torch.tensor([update.anchor_position], device=device),
            context=state.cache.layers(),
            temperature=params.temperature,
            generator=generator,
        )
        gamma = sample.tokens.shape[1]
        return DraftBlock(
            tokens=sample.tokens,
            num_tokens=torch.full((1,), gamma, dtype=torch.long, device=device),
            draft_probs=sample.probs,
            confidences=sample.confidences,
        )

    def _absorb(self, state: DSparkState, update: ContextUpdate) -> None:
        n = update.positions.shape[0]
        features = update.features
        if features is None:
            if n:
                raise ValueError(
                    f"DSparkProposer needs target features of layers {self.feature_layers} for the "
                    f"{n} committed tokens, but the update has none: hook proposer.feature_layers in the target"
                )
            features = torch.zeros(0, self._feature_width)  # an empty span still sets the cache's shapes
        if tuple(features.shape) != (n, self._feature_width):
            raise ValueError(
                f"update.features has shape {tuple(features.shape)}, expected ({n}, {self._feature_width}) = "
                f"(tokens, {len(self.feature_layers)} layers x target hidden size), "
                "concatenated in feature_layers order"
            )
        device = self.drafter.backbone.norm.weight.device
        span = self.drafter.context_kv(features[None].to(device), update.positions[None].to(device))
        state.cache.append(span)
