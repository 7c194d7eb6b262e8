"""The whole drafting round of one request in one native call (``vlmspec/kernels/cpu_draft.cpp``).

Through PyTorch, a round of the reference drafter is about 150 operator calls (the
backbone's linears, norms, RoPE tables and attention, the LM head, then the sequential
head's small ops at every position); on a 2-core CPU their dispatch costs more than
reading the drafter's weights. :class:`NativeRound` holds the drafter's weights in the
native round's layout (packed linears, q/k/v and gate/up fused, every layer's context
k/v fused into one linear), named in a dict built once and again whenever a weight changes,
and runs :func:`torch.ops.vlmspec.dspark_round`: the newly committed span into the draft
context cache, the block through the backbone, the LM head over the draft vocabulary, the
head's left-to-right loop with its draws, and the confidence head.

It computes what :meth:`DSparkDrafter.draft` computes: the linears bit for bit (the
same packed kernels the Python path's ``FastLinears`` use), norms, RoPE, attention and
softmax with the modules' roundings but their own float32 summation order, so outputs
agree within a few float32 ulps before the dtype's rounding
(``tests/drafters/test_dspark_native.py`` states the tolerances). Draws use the same
float64 uniforms, drawn from the request's generator before the round (one per position,
the same numbers the Python loop draws one at a time).

It applies (:meth:`NativeRound.applies`) on a CPU whose kernels pack the drafter's dtype
(AVX-512 for float32, AVX512-BF16 for bfloat16), to a drafter whose width is the target's
(no embedding bridges) with even widths and a head dim that is a multiple of 8;
elsewhere the proposer runs the PyTorch path.
"""

from __future__ import annotations

import torch

from vlmspec.drafters.dspark.cache import DraftContextCache
from vlmspec.drafters.dspark.model import DSparkDrafter
from vlmspec.kernels.cpu_kernels import MAX_ROWS, pack_weight, packing_applies

#: The order of the ints of the drafter's shape the native round takes (cpu_draft.h: struct Shape).
SHAPE_FIELDS = (
    "layers",
    "heads",
    "kv_heads",
    "head_dim",
    "block",
    "head_kind",
    "rank",
    "vocab",
    "intermediate",
    "hidden",
    "confidence",
)
HEAD_KIND_CODES = {"none": 0, "vanilla": 1, "gated": 2, "rnn": 3}

#: Most span tokens one native round absorbs; a longer span (a prompt) goes through the PyTorch
#: context projection first, whose GEMM is the better tool for many rows.
MAX_SPAN = MAX_ROWS
_NO_UNIFORMS = torch.empty(0, dtype=torch.float64)  # a greedy round draws nothing (never written)


class NativeRound:
    """One request's drafting round through the native kernel (see the module docstring)."""

    def __init__(self, drafter: DSparkDrafter) -> None:
        self.drafter = drafter
        self._stamp: tuple | None = None
        self._weights: dict[str, torch.Tensor] | None = None
        self._tensors: tuple[torch.Tensor, ...] | None = None
        config = drafter.config
        confidence = 0 if config.confidence_head is False else 2 if config.confidence_with_markov else 1
        self.shape = [
            config.num_layers,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.block_size,
            HEAD_KIND_CODES[config.head_kind],
            config.head_rank,
            config.num_draft_tokens,
            config.intermediate_size,
            config.hidden_size,
            confidence,
        ]

    @staticmethod
    def applies(drafter: DSparkDrafter) -> bool:
        """Whether the native round can run this drafter here (see the module docstring)."""
        config = drafter.config
        weight = drafter.backbone.norm.weight
        widths = (
            config.hidden_size,
            config.num_heads * config.head_dim,
            config.intermediate_size,
            len(config.target_layer_ids) * config.target_hidden_size,
            config.head_rank,
        )
        return (
            config.hidden_size == config.target_hidden_size
            and config.head_dim % 8 == 0
            and config.head_dim <= 512
            and all(w % 2 == 0 for w in widths)
            # The anchor's row is read from the target's own table: in the drafter's dtype, or float32 (rounded)
            and drafter.vocabulary.embedding.weight.dtype in (weight.dtype, torch.float32)
            and packing_applies(weight)
        )

    @torch.inference_mode()
    def __call__(
        self,
        cache: DraftContextCache,
        features: torch.Tensor,  # [n, m * d_target] the new span's target features (n <= MAX_SPAN)
        positions: torch.Tensor,  # [n] int64 their 1-D positions
        anchor: int,
        anchor_position: int,
        temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Absorb the span into ``cache`` and draft one block (after :meth:`available` said yes this round).

        Returns the drafted target ids [G] int64, the float32 distributions they were drawn
        from over the draft vocabulary [G, N] (None when greedy) and the confidences [G]
        float32 (None without a confidence head).
        """
        config = self.drafter.config
        weights = self._weights  # as available() left them
        if weights is None:
            raise RuntimeError("the native drafting round does not apply here; check NativeRound.available() first")
        dtype = weights["norm"].dtype
        span = features.shape[0]
        if span > MAX_SPAN:
            raise ValueError(f"a native round absorbs at most {MAX_SPAN} tokens; absorb longer spans with context_kv")
        keys, values = cache.reserve(
            config.num_layers,
            (1, config.num_kv_heads, config.head_dim),
            dtype,
            len(cache) + span + config.block_size,
        )
        uniforms = _NO_UNIFORMS
        if temperature > 0:  # the Python loop's G draws of one uniform each, in one call
            uniforms = torch.rand(config.block_size, generator=generator, dtype=torch.float64)
        tokens, probs, confidences = torch.ops.vlmspec.dspark_round(
            weights,
            self.shape,
            config.rms_norm_eps,
            config.rope_theta,
            int(anchor),
            int(anchor_position),
            features.to(dtype).contiguous(),
            positions.to(torch.long),
            keys,
            values,
            len(cache),
            float(temperature),
            uniforms,
        )
        cache.advance(span)
        return tokens, (probs if temperature > 0 else None), (confidences if confidences.numel() else None)

    def available(self) -> bool:
        """Whether the round runs natively now; the weights are built (again) when a drafter or tied weight changed."""
        return self.weights() is not None

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The named weights of the native round (None where it does not apply), rebuilt when a weight changed."""
        stamp = self._current_stamp()
        if stamp != self._stamp:
            self._weights = self._build() if self.applies(self.drafter) else None
            self._stamp = stamp
        return self._weights

    def _current_stamp(self) -> tuple:
        # Where and which version of every tensor the weights are built from: an in-place update (training,
        # load_state_dict) bumps a version, a move (drafter.to) changes an address. The list itself is cached:
        # walking the modules every round would cost more than the stamp.
        tensors = self._tensors
        if tensors is None:
            drafter = self.drafter
            tensors = self._tensors = (
                *drafter.parameters(),
                drafter.draft_token_ids,
                drafter.vocabulary.embedding.weight,
                drafter.vocabulary.lm_head.weight,
            )
        return tuple((t.data_ptr(), t._version) for t in tensors)

    @torch.no_grad()
    def _build(self) -> dict[str, torch.Tensor]:
        drafter, config, backbone = self.drafter, self.drafter.config, self.drafter.backbone
        plain = lambda t: t.detach().contiguous()  # noqa: E731
        packed = lambda *ws: pack_weight(torch.cat([w.detach() for w in ws]))  # noqa: E731
        weights = {
            "embedding": plain(drafter.vocabulary.embedding.weight),
            "mask": plain(_mask_vector(drafter).to(drafter.dtype)),
            "context_proj": packed(backbone.context_proj.weight),
            "context_norm": plain(backbone.context_norm.weight),
            "context_kv": packed(*(w for layer in backbone.layers for w in _kv_weights(layer))),
            "norm": plain(backbone.norm.weight),
        }
        for index, layer in enumerate(backbone.layers):
            attn, mlp = layer.attn, layer.mlp
            prefix = f"layers.{index}."
            weights[prefix + "input_norm"] = plain(layer.input_norm.weight)
            weights[prefix + "qkv"] = packed(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
            weights[prefix + "q_norm"] = plain(attn.q_norm.weight)
            weights[prefix + "k_norm"] = plain(attn.k_norm.weight)
            weights[prefix + "o"] = packed(attn.o_proj.weight)
            weights[prefix + "mlp_norm"] = plain(layer.mlp_norm.weight)
            weights[prefix + "gate_up"] = packed(mlp.gate_proj.weight, mlp.up_proj.weight)
            weights[prefix + "down"] = packed(mlp.down_proj.weight)
        rows, bias, _ = drafter._draft_rows()
        weights["lm_head"] = pack_weight(rows)
        if bias is not None:
            weights["lm_head.bias"] = plain(bias.to(rows.dtype))
        weights["token_ids"] = plain(drafter.draft_token_ids)
        head = drafter.head
        if config.head_kind != "none":
            weights["head.embed"] = plain(head.embed.weight)
            weights["head.out"] = packed(head.out.weight)
        for name in ("gate", "joint"):
            module = getattr(head, name, None)
            if module is not None:
                weights[f"head.{name}"] = packed(module.weight)
                weights[f"head.{name}.bias"] = plain(module.bias)
        if drafter.confidence is not None:
            weights["confidence"] = packed(drafter.confidence.proj.weight)
            weights["confidence.bias"] = plain(drafter.confidence.proj.bias)
        return weights


def _kv_weights(layer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.attn.k_proj.weight, layer.attn.v_proj.weight


def _mask_vector(drafter: DSparkDrafter) -> torch.Tensor:  # [d] the MASK input of the block
    if drafter.config.mask_token_id is None:
        return drafter.mask_embedding.to(drafter.vocabulary.embedding.weight.dtype)
    return drafter.vocabulary.embedding.weight[drafter.config.mask_token_id]
