"""DSparkProposer: a DSpark drafter behind the engine's Proposer protocol, for R requests at once.

Per request the state is a :class:`DraftContextCache`. Each step ``propose``:

1. appends to every request's cache the projected context K/V of its newly committed
   span (its target features arrive in the :class:`~vlmspec.types.ContextUpdate`); the
   spans of all requests go through the context projection as one packed sequence
   (it works token by token, so packing changes nothing);
2. drafts ``gamma`` tokens per request at positions ``anchor_position + [0 .. gamma - 1]``
   from ``[anchor, MASK x (gamma - 1)]`` in one backbone pass and one LM head GEMM for
   all requests. Contexts of different lengths are right-padded to the longest and
   masked, so every row sees exactly its own context (one request: no padding, no mask).
   The padded contexts are kept between calls: while the same requests come back in the
   same order (an engine's steps between joins and leaves), each call only writes the new
   spans into them; otherwise they are rebuilt from the requests' own caches;
3. runs the sequential head: greedy rows together, each sampled row on its own with its
   own temperature and generator, so a request's draws never depend on the others.

The returned ``draft_probs`` are exactly the float32 distributions the tokens were drawn
from: ``softmax((U_k + B_k) / T)`` with the head's bias, scattered onto the target's
vocabulary when the drafter uses a reduced one; top-k/top-p are not applied to drafts
(rejection sampling is lossless for any draft distribution). Greedy rows have the
one-hot of their argmax drafts (None when every row is greedy).

Steps 2-3 are :meth:`DSparkDrafter.draft` with a padding mask (``draft`` itself takes
none); they use the drafter's public pieces in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from vlmspec.drafters.base import check_batch
from vlmspec.drafters.dspark.backbone import ContextKV
from vlmspec.drafters.dspark.cache import DraftContextCache
from vlmspec.drafters.dspark.model import DSparkDrafter
from vlmspec.drafters.dspark.native import MAX_SPAN, NativeRound
from vlmspec.kernels.linear import FastLinears
from vlmspec.types import ContextUpdate, DraftBlock, SamplingParams


@dataclass
class DSparkState:
    """Per-request drafter state: the projected context of the committed tokens."""

    cache: DraftContextCache = field(default_factory=DraftContextCache)


@dataclass
class _PaddedContexts:
    """The right-padded contexts of the last batch of requests proposed for, row r = ``states[r]``."""

    states: tuple[DSparkState, ...]
    layers: ContextKV  # per layer [R, Hkv, capacity, hd]
    lengths: torch.Tensor  # [R] int64 context tokens per row (on the drafter's device)


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
        self._padded: _PaddedContexts | None = None
        self._fast_linears = FastLinears(drafter)  # the drafter's linears in the CPU kernels' layout (see propose)
        self._native = NativeRound(drafter)  # one request's whole round in one native call, where it applies

    def new_state(self) -> DSparkState:
        return DSparkState()

    @property
    def device(self) -> torch.device:
        return self.drafter.backbone.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the drafter drafts in (:attr:`DSparkDrafter.dtype`)."""
        return self.drafter.dtype

    @torch.inference_mode()
    def propose(
        self,
        states: Sequence[DSparkState],
        updates: Sequence[ContextUpdate],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> DraftBlock:
        """Append each update's features to its request's draft cache and draft one block per request.

        The drafter's linears run through the CPU kernels the target's runner uses (T_draft:
        a few rows each, where ATen reads the weights slowly); elsewhere as they are.
        """
        check_batch(states, updates, params, generators)
        features = [self._checked_features(update) for update in updates]  # every update, before any state changes
        if len(states) == 1 and self._native.available():
            with self._rolled_back_on_failure(states):
                return self._propose_native(states[0], updates[0], features[0], params[0], generators[0])
        with self._fast_linears, self._rolled_back_on_failure(states):
            spans = self._absorb(states, updates, features)
            anchors = torch.tensor([update.anchor for update in updates], device=self.device)  # [R]
            anchor_positions = torch.tensor([update.anchor_position for update in updates], device=self.device)  # [R]
            context, mask = self._context(states, spans, [update.positions.shape[0] for update in updates])
            drafter = self.drafter
            hidden = drafter.block_hidden(anchors[:, None], anchor_positions[:, None], context, mask)[:, 0]  # [R, G, d]
            base = drafter.base_logits(hidden)  # [R, G, N]
            tokens, probs = self._sample(hidden, base, anchors, params, generators)
            prev = torch.cat((anchors[:, None], tokens[:, :-1]), dim=1)  # [R, G]
            confidence = drafter.confidences(hidden, prev)
            gamma = tokens.shape[1]
            return DraftBlock(
                tokens=tokens,
                num_tokens=torch.full((len(states),), gamma, dtype=torch.long, device=self.device),
                draft_probs=probs,
                confidences=None if confidence is None else torch.sigmoid(confidence),
            )

    # ---------------------------------------------------------------- steps
    @contextlib.contextmanager
    def _rolled_back_on_failure(self, states: Sequence[DSparkState]) -> Iterator[None]:
        """The rollback contract: a propose that raises leaves every state as it was.

        The engine then proposes again (for each request alone) with the same updates; a cache
        that had kept them would hold the span twice and draft from a wrong context.
        """
        lengths = [len(state.cache) for state in states]
        try:
            yield
        except BaseException:
            for state, length in zip(states, lengths):
                state.cache.truncate(length)
            self._padded = None  # extended in place for these states: rebuilt from their caches next time
            raise

    def _propose_native(
        self,
        state: DSparkState,
        update: ContextUpdate,
        features: torch.Tensor,  # [n, m * d_target]
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftBlock:
        """One request's round in one native call (:class:`~vlmspec.drafters.dspark.native.NativeRound`)."""
        positions = update.positions
        if features.shape[0] > MAX_SPAN:  # a prompt: its context K/V through the PyTorch GEMMs first
            with self._fast_linears:
                self._absorb([state], [update], [features])
            features, positions = features[:0], positions[:0]
        temperature = 0.0 if params.greedy else params.temperature
        tokens, probs, confidences = self._native(
            state.cache, features, positions, update.anchor, update.anchor_position, temperature, generator
        )
        return DraftBlock(
            tokens=tokens[None],
            num_tokens=torch.full((1,), tokens.shape[0], dtype=torch.long),
            draft_probs=None if probs is None else self.drafter.scatter_to_target(probs)[None],
            confidences=None if confidences is None else confidences[None],
        )

    def _checked_features(self, update: ContextUpdate) -> torch.Tensor:  # -> [n, m * d_target]
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
        return features

    def _absorb(
        self, states: Sequence[DSparkState], updates: Sequence[ContextUpdate], features: list[torch.Tensor]
    ) -> ContextKV:
        """Project every request's new span in one packed pass and append each part to its own cache.

        Returns the packed spans, per layer [1, Hkv, sum n, hd] (request after request).
        """
        device = self.device
        packed_features = torch.cat([f.to(device) for f in features])[None]  # [1, sum n, m * d]
        packed_positions = torch.cat([u.positions.to(device) for u in updates])[None]  # [1, sum n]
        packed = self.drafter.context_kv(packed_features, packed_positions)  # per layer [1, Hkv, sum n, hd]
        start = 0
        for state, update in zip(states, updates):
            stop = start + update.positions.shape[0]
            state.cache.append([(k[:, :, start:stop], v[:, :, start:stop]) for k, v in packed])
            start = stop
        return packed

    def _context(
        self, states: Sequence[DSparkState], spans: ContextKV, span_lengths: list[int]
    ) -> tuple[ContextKV, torch.Tensor | None]:
        """The requests' contexts as per-layer [R, Hkv, Lmax, hd] and the mask [R, 1, G, Lmax + G] (None: no padding).

        spans: this call's packed new spans (per layer [1, Hkv, sum n, hd]); span_lengths: [R] their sizes.
        """
        if len(states) == 1:
            return states[0].cache.layers(), None
        padded = self._padded_contexts(states, spans, span_lengths)
        lengths = padded.lengths  # [R]
        longest = int(lengths.max())
        layers = [(k[:, :, :longest], v[:, :, :longest]) for k, v in padded.layers]
        if bool((lengths == longest).all()):
            return layers, None
        block = self.drafter.block_size
        visible = torch.arange(longest, device=self.device)[None, :] < lengths[:, None]  # [R, Lmax]
        mask = torch.cat((visible, visible.new_ones(len(states), block)), dim=1)  # [R, Lmax + G]
        return layers, mask[:, None, None, :].expand(-1, 1, block, -1)

    def _padded_contexts(
        self, states: Sequence[DSparkState], spans: ContextKV, span_lengths: list[int]
    ) -> _PaddedContexts:
        """The padded contexts of ``states`` after this call's spans: the kept ones extended, or rebuilt."""
        kept = self._padded
        lengths = torch.tensor([len(state.cache) for state in states], device=self.device)  # [R]
        sizes = torch.tensor(span_lengths, device=self.device)  # [R]
        same = kept is not None and len(kept.states) == len(states) and all(a is b for a, b in zip(kept.states, states))
        # Extend in place only if nothing reached these caches since (e.g. a request proposed for alone).
        if same and torch.equal(kept.lengths + sizes, lengths) and int(lengths.max()) <= kept.layers[0][0].shape[2]:
            rows = torch.repeat_interleave(torch.arange(len(states), device=self.device), sizes)  # [sum n]
            slots = (
                torch.arange(rows.shape[0], device=self.device)
                - (torch.cumsum(sizes, 0) - sizes)[rows]
                + kept.lengths[rows]
            )
            for (keys, values), (k, v) in zip(kept.layers, spans):
                keys[rows, :, slots] = k[0].transpose(0, 1)  # [sum n, Hkv, hd]
                values[rows, :, slots] = v[0].transpose(0, 1)
            kept.lengths = lengths
            return kept
        capacity = max(2 * int(lengths.max()), 64)  # room to grow before the next rebuild
        per_row = [state.cache.layers() for state in states]  # [R] lists of per-layer (k, v) [1, Hkv, L_r, hd]
        layers = []
        for layer, (first_k, _) in enumerate(per_row[0]):
            keys = first_k.new_zeros(len(states), first_k.shape[1], capacity, first_k.shape[3])
            values = torch.zeros_like(keys)
            for row, row_layers in enumerate(per_row):
                k, v = row_layers[layer]
                keys[row, :, : k.shape[2]] = k[0]
                values[row, :, : v.shape[2]] = v[0]
            layers.append((keys, values))
        self._padded = _PaddedContexts(tuple(states), layers, lengths)
        return self._padded

    def _sample(
        self,
        hidden: torch.Tensor,  # [R, G, d]
        base: torch.Tensor,  # [R, G, N] float32
        anchors: torch.Tensor,  # [R] int64
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [R, G] int64, probs [R, G, V] float32 or None
        """The sequential head: greedy rows in one call, each sampled row with its own temperature and generator."""
        drafter, head, ids = self.drafter, self.drafter.head, self.drafter.draft_token_ids
        greedy = [row for row, p in enumerate(params) if p.greedy]
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        tokens = anchors.new_zeros(len(params), drafter.block_size)
        if greedy:
            rows = torch.tensor(greedy, device=self.device)
            tokens[rows] = head.sample(hidden[rows], base[rows], anchors[rows], ids, 0.0, None).tokens
        if not sampled:
            return tokens, None
        probs = torch.zeros(len(params), drafter.block_size, drafter.config.target_vocab_size, device=self.device)
        for row in sampled:
            one = slice(row, row + 1)
            sample = head.sample(hidden[one], base[one], anchors[one], ids, params[row].temperature, generators[row])
            tokens[row] = sample.tokens[0]
            probs[row] = drafter.scatter_to_target(sample.probs)[0]
        for row in greedy:  # a greedy draft is its own one-hot distribution
            probs[row].scatter_(1, tokens[row, :, None], 1.0)
        return tokens, probs
