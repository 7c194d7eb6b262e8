"""The fast decode/verify forward: the target's text decoder over fused linears.

A Hugging Face eager forward of a small model on a CPU spends most of a decode step in
its matrix-vector products, and ATen's ``F.linear`` reads an ``[N, K]`` weight at well
under the machine's memory bandwidth when it multiplies one or a few rows (the T_step
and T_verify terms of the performance model, docs/design.md §21). On x86 CPUs the
linears here run through vlmspec's own AVX2 kernel (:mod:`vlmspec.kernels.cpu_kernels`),
which reads float32 and bfloat16 weights as the model stores them near the memory
bandwidth; elsewhere through oneDNN's reordered weights or ATen
(``benchmarks/target_step.py`` measures each backend, term by term).

:class:`PackedDecoder` runs the language model's decoder layers itself, for prefills
(text and images) and for decode and verify steps:

* every linear layer goes through a :class:`PackedLinear` (q/k/v fused into one, gate
  and up into one), whose backend is chosen once per weight;
* the activation is the model's own module; the norms (and Qwen3-VL's q/k norms) run as
  one kernel call each where that computes what the model's module computes (checked on a
  probe when packing), else as the module;
* positions are 1-D wherever the three M-RoPE components are equal (text, and every token
  after the prompt): both M-RoPE layouts reduce to plain RoPE over the model's own
  ``inv_freq``. A prefill with images passes [3, B] positions: each rotary frequency turns
  by the component the family's layout gives it (:func:`vlmspec.targets.families.rope_components`);
* image tokens take the vision tower's embeddings instead of their placeholders', and
  Qwen3-VL's deepstack embeddings are added after its first layers (Python reference);
* keys and values go straight into the runner's block-paged KV pool, and attention reads
  only each row's valid slots through its block table
  (:func:`~vlmspec.kernels.cpu_kernels.paged_attention`, or
  :func:`vlmspec.targets.ragged.attend_rows` where the kernel does not apply);
* the layer sequence has one Python form, the reference, which runs every case
  (:meth:`PackedDecoder._reference_layers`), and one C++ form, the native step
  (``cpu_step.cpp``), which must equal it bit for bit. Where every step of a layer is one of vlmspec's kernels (no q/k
  norms, which the family's :class:`~vlmspec.targets.families.FamilySpec` says; the kernel's
  RMSNorm, RoPE and attention; every linear packed, which needs AVX-512; SiLU: Qwen2-VL and
  Qwen2.5-VL on such a CPU with the kernel built), all the layers run in one native call
  (:func:`vlmspec.kernels.cpu_kernels.decoder_layers`) over their named weights, built once
  when packing: the same kernels in the same order, so the same logits, features and KV bit
  for bit, without the dozen Python-level calls a layer costs (:attr:`PackedDecoder.native`).
  Everything else (Qwen3-VL, AVX2-only CPUs, no kernel, more tokens than the kernel's
  linears take, a prefill chunk's attention) runs the reference.

It computes what transformers computes up to float rounding (the products sum in another
order): greedy outputs agree except at numerical ties, which the benchmarks count. The
reference mode of the runner (``decode="reference"``) runs transformers' own forward.

What it does not know: the vision tower (its embeddings come in, computed by the model's
own module: :mod:`vlmspec.targets.prompts`), requests, scheduling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from vlmspec.kernels.cpu_kernels import (
    LAYER_LINEARS,
    LAYER_TENSORS,
    decoder_layers,
    decoder_weights,
    kernel_applies,
    kernel_max_rows,
    rms_norm,
    rope_write,
    silu_mul,
)
from vlmspec.kernels.linear import PackedLinear, fused_linear
from vlmspec.targets.families import FamilySpec, language_model, model_spec, rope_components
from vlmspec.targets.prompts import VisionEmbeds


class KVSlots(Protocol):
    """Where a packed forward's new keys and values go: the runner's KV pool, block tables and each token's slot.

    Row r's slot j lives in pool block ``tables[r, j // bs]`` at offset ``j % bs``
    (:mod:`vlmspec.targets.pool`); ``blocks`` and ``offsets`` are that, for each packed token.
    """

    tables: torch.Tensor  # [R, M] int64 each row's blocks
    rows: torch.Tensor  # [B] int64 row of each packed token
    slots: torch.Tensor  # [B] int64 its slot in that row (it attends slots 0 .. slots[b])
    blocks: torch.Tensor  # [B] int64 the pool block of that slot
    offsets: torch.Tensor  # [B] int64 the slot's offset in the block
    native_attention: bool  # whether the kernel's attention suits this forward's queries (else the runner's attend)
    features: torch.Tensor | None  # [N, bs, m * d] where hooked layers' outputs go beside their KV (None: returned)

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's key and value pools, [N, Hkv, bs, hd] each."""
        ...

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, hd] at (blocks, offsets); returns :meth:`buffers`."""
        ...


def fast_norm(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The kernel's one-call RMSNorm where it computes what ``module`` computes, else ``module`` itself.

    A module qualifies by its interface (an RMSNorm with ``weight`` and ``variance_epsilon``)
    and by agreeing with the kernel on a probe, so a norm with other arithmetic (an offset
    weight, another epsilon) keeps its own forward.
    """
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not type(module).__name__.endswith("RMSNorm") or weight is None or eps is None or weight.dim() != 1:
        return module
    if not kernel_applies(weight):
        return module
    weight = weight.detach()
    probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.no_grad():
        expected = module(probe).float()
    tolerance = 1e-5 if weight.dtype == torch.float32 else 1e-2
    if not torch.allclose(rms_norm(probe, weight, float(eps)).float(), expected, rtol=tolerance, atol=tolerance):
        return module
    return functools.partial(rms_norm, weight=weight, eps=float(eps))


class _Layer:
    """One decoder layer's fused linears and the model's own norms (or their one-call twins) and activation."""

    def __init__(self, layer: nn.Module, spec: FamilySpec) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = fast_norm(layer.input_layernorm), fast_norm(layer.post_attention_layernorm)
        self.qkv = fused_linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.out = fused_linear(attn.o_proj)
        self.gate_up = fused_linear(mlp.gate_proj, mlp.up_proj)
        self.down = fused_linear(mlp.down_proj)
        self.act = mlp.act_fn
        # SiLU(gate) * up as one kernel call where the activation is SiLU (the native step calls the same kernel).
        weight = mlp.down_proj.weight
        self.act_mul = silu_mul if kernel_applies(weight) and _is_silu(self.act, weight.dtype) else None
        # Qwen3-VL: per-head norms of q and k before RoPE
        self.q_norm = fast_norm(attn.q_norm) if spec.qk_norm else None
        self.k_norm = fast_norm(attn.k_norm) if spec.qk_norm else None
        self.split = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)


def check_fast_path(model: nn.Module) -> None:
    """Raise ValueError, naming ``decode='reference'``, where this forward cannot compute ``model``'s.

    The target checks it when it is loaded with ``decode='fast'``, so an unsupported model
    (default RoPE only; dense gated MLPs only, not Qwen3-VL-MoE's experts) is refused at
    once rather than at its first decode step.
    """
    text, spec = language_model(model), model_spec(model)
    rope = text.config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        problem = f"it implements default RoPE, not {rope.get('rope_type')!r}"
    elif not spec.fast:
        problem = f"it runs dense gated MLPs (gate/up/down), not {spec.mlp!r} ones (mixture of experts)"
    else:
        return
    raise ValueError(f"the fast decode path cannot run this target: {problem}; load it with decode='reference'")


class PackedDecoder:
    """The target's text decoder for packed decode/verify tokens (see the module docstring).

    ``native`` holds the one-call native step where it applies (decided here, when packing),
    else None; a caller that sets it to None gets the Python reference
    (:meth:`_reference_layers`), which the tests and ``benchmarks/target_step.py`` compare it with.
    """

    def __init__(self, model: nn.Module) -> None:
        check_fast_path(model)
        text = language_model(model)
        config = text.config
        # The packed weights are copies: remember what they were copied from, so that a weight
        # changed in place (loading, fine-tuning) or moved is noticed (see `matches`).
        self._sources = [*text.parameters(), *model.get_output_embeddings().parameters()]  # not the vision tower
        self._stamp = self._source_stamp()
        self.embed = text.embed_tokens
        self.norm = fast_norm(text.norm)
        self.spec = model_spec(model)  # what differs between families: read here, never probed on modules
        self.layers = [_Layer(layer, self.spec) for layer in text.layers]
        self.head = fused_linear(model.get_output_embeddings())
        self.inv_freq = text.rotary_emb.inv_freq.detach().float()  # [hd / 2]
        # M-RoPE (prefills with images): the position component that turns each frequency, in the family's layout
        sections = list(text.rotary_emb.mrope_section)
        self.rope_components = rope_components(self.spec, sections, self.inv_freq.shape[0]).to(self.inv_freq.device)
        self._rotary_tables: dict[torch.dtype, torch.Tensor] = {}  # dtype -> [2, P, 1, hd] (see _rotary_table)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        # The one-call RoPE + KV write reproduces the eager roundings; it needs the kernel here.
        self.fused_rope = kernel_applies(self.embed.weight)
        # All layers in one native call where the kernels cover every step, else None: the Python reference.
        self.native = _native_layers(self) if self.fused_rope else None

    def matches(self) -> bool:
        """Whether the model's weights are still the ones packed (same storage, unmodified since).

        In-place writes and new storage are noticed; new storage that happens to reuse the old
        address with a fresh version counter (``model.to(dtype)`` and back) is not: call
        :meth:`QwenVLTarget.to_device` (or build a new target) after such a conversion.
        """
        return self._source_stamp() == self._stamp

    def _source_stamp(self) -> list[tuple[int, int]]:
        return [(p.data_ptr(), p._version) for p in self._sources]

    @property
    def backend(self) -> str:
        """How the linears run: ``"packed"``, ``"kernel"``, ``"onednn"`` or ``"aten"`` (see :class:`PackedLinear`)."""
        return self.head.backend

    @torch.no_grad()
    def __call__(
        self,
        ids: torch.Tensor,  # [B] int64 packed input tokens
        positions: torch.Tensor,  # [B] int64 their (1-D = M-RoPE) positions, or [3, B] M-RoPE (t, h, w) positions
        kv: KVSlots,  # the runner's KV buffers and each packed token's slot
        attend,  # (q [B, H, hd], key buffer, value buffer, scaling) -> [B, H, hd]
        feature_layers: Sequence[int] = (),
        logits_at: torch.Tensor | None = None,  # [n] int64 packed tokens whose logits are wanted (None: all)
        vision: VisionEmbeds | None = None,  # image tokens' embeddings (index: packed), deepstack (Qwen3-VL)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [B or n, V] float32, features [B, m * d] or None
        """Logits (and hooked decoder-layer outputs) of the packed tokens; writes their K/V into ``kv``.

        The hooked outputs are written into ``kv.features`` beside each token's K/V when the runner keeps
        such a plane (features then come back None), else returned.

        A prefill wants only each prompt's last prediction: ``logits_at`` keeps the LM head
        (the largest linear) off the other tokens. The native step does not call ``attend``:
        it runs :func:`~vlmspec.kernels.cpu_kernels.paged_attention` with each token seeing
        its row's slots up to its own, which is the runner's ``attend`` wherever it applies.
        """
        hidden = self.embed(ids)  # [B, d]
        if vision is not None:  # the vision tower's embeddings replace the image placeholders' (as transformers)
            hidden[vision.index.to(hidden.device)] = vision.embeds.to(hidden.device, hidden.dtype)
        cos, sin = self._rotary(positions, hidden.dtype)
        deepstack = () if vision is None else vision.deepstack
        # Past kernel_max_rows the linears are ATen's GEMM; deepstack (Qwen3-VL) and a prefill chunk's attention
        # (one SDPA call a row, the runner's attend) run in the Python reference.
        wide = ids.shape[0] > kernel_max_rows(hidden.dtype)
        if self.native is not None and not wide and kv.native_attention and not deepstack:
            hidden, captured = self.native(hidden, cos[:, 0], sin[:, 0], kv, feature_layers)
        else:
            hidden, captured = self._reference_layers(hidden, cos, sin, kv, attend, feature_layers, vision)
        last = hidden if logits_at is None else hidden[logits_at]
        logits = self.head(self.norm(last)).float()
        features = torch.cat(captured, dim=-1) if captured else None  # [B, m * d]
        plane = kv.features if feature_layers else None
        if plane is not None and features is not None:  # the reference layers: beside the KV, as the native step does
            plane[kv.blocks, kv.offsets] = features
            features = None
        return logits, features

    def _reference_layers(
        self, hidden, cos, sin, kv: KVSlots, attend, feature_layers: Sequence[int], vision: VisionEmbeds | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # hidden [B, d] -> [B, d], one [B, d] per feature layer
        """The reference layer sequence, one Python-level call at a time: every case, and what the native step must equal.

        Qwen3-VL's deepstack embeddings are added to the image tokens' hidden states after
        the first layers, after the hooks' capture, as transformers' text model does.
        """
        deepstack = () if vision is None else vision.deepstack
        n = hidden.shape[0]
        captured = {}
        for index, layer in enumerate(self.layers):
            x = layer.input_norm(hidden)
            qkv = layer.qkv(x)
            if layer.q_norm is None and self.fused_rope:  # rotate q and k, write k and v: one kernel call
                keys, values = kv.buffers(index)
                q = rope_write(qkv, cos[:, 0], sin[:, 0], keys, values, kv.blocks, kv.offsets, self.heads)
                attended = attend(q, keys, values, self.scaling)  # [B, H, hd]
            else:
                attended = self._attention_eager(index, layer, qkv, cos, sin, kv, attend)
            hidden = hidden + layer.out(attended.reshape(n, -1))
            gate_up = layer.gate_up(layer.post_norm(hidden))
            if layer.act_mul is not None:
                product = layer.act_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                product = layer.act(gate) * up
            hidden = hidden + layer.down(product)
            if index in feature_layers:
                captured[index] = hidden
            if index < len(deepstack):  # out of place: the captured hidden state stays the layer's output
                hidden = hidden.clone()
                rows = vision.index.to(hidden.device)
                hidden[rows] = hidden[rows] + deepstack[index].to(hidden.device, hidden.dtype)
        return hidden, [captured[i] for i in feature_layers]

    def _attention_eager(self, index: int, layer: _Layer, qkv, cos, sin, kv: KVSlots, attend) -> torch.Tensor:
        """RoPE, the K/V write and attention as tensor ops (Qwen3-VL's q/k norms; CPUs without the kernel)."""
        n = qkv.shape[0]
        if layer.q_norm is None:  # q and k sit side by side in qkv: rotate them as one tensor
            qk = _rotate(qkv[:, : layer.split[0] + layer.split[1]].view(n, -1, self.head_dim), cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            v = qkv[:, layer.split[0] + layer.split[1] :]
        else:
            q, k, v = qkv.split(layer.split, dim=-1)
            q = layer.q_norm(q.view(n, self.heads, self.head_dim))
            k = layer.k_norm(k.view(n, self.kv_heads, self.head_dim))
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = kv.write(index, k, v.view(n, self.kv_heads, self.head_dim))
        return attend(q, keys, values, self.scaling)  # [B, H, hd]

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [B, 1, hd] of positions [B] or M-RoPE positions [3, B]: transformers' values.

        Computed in float32, then cast to the model's dtype. M-RoPE turns frequency j by the
        position component ``rope_components[j]`` (the family's layout), which selects the
        same angles transformers' ``recomposition_frequencies`` selects. The sin of the first
        half is negated once here, so that :func:`_rotate` needs no negation per layer:
        ``(-x2) * s == -(x2 * s)`` exactly, in any dtype.
        """
        positions = positions.to(self.inv_freq.device)
        if positions.dim() == 2:  # [3, B] M-RoPE: each frequency takes its own component's position
            return self._rotary_values(positions.float().T[:, self.rope_components] * self.inv_freq[None], dtype)
        lowest, highest = positions.aminmax() if positions.numel() else (positions.new_zeros(()),) * 2
        if int(lowest) < 0:  # not a table row
            return self._rotary_values(positions.float()[:, None] * self.inv_freq[None], dtype)
        cos, signed_sin = self._rotary_table(int(highest) + 1, dtype)[:, positions].unbind(0)  # text: one lookup
        return cos, signed_sin

    def _rotary_table(self, size: int, dtype: torch.dtype) -> torch.Tensor:  # -> [2, P >= size, 1, hd]
        """cos and signed sin of 1-D positions 0 .. P - 1, grown (doubling) to hold ``size`` positions.

        Each entry is the elementwise arithmetic of :meth:`_rotary_values` on its position alone,
        so a lookup gives what computing it in the step gives.
        """
        table = self._rotary_tables.get(dtype)
        if table is None or table.shape[1] < size:
            grown = max(size, 2 * (0 if table is None else table.shape[1]), 256)
            positions = torch.arange(grown, device=self.inv_freq.device).float()
            table = torch.stack(self._rotary_values(positions[:, None] * self.inv_freq[None], dtype))
            self._rotary_tables[dtype] = table
        return table

    @staticmethod
    def _rotary_values(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [B, 1, hd] in ``dtype`` of the angles ``freqs`` [B, hd / 2] (float32)."""
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, hd]
        sin = angles.sin().to(dtype)
        half = sin.shape[-1] // 2
        return angles.cos().to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:  # x: [B, heads, hd]
    """transformers' ``x * cos + rotate_half(x) * sin``, with rotate_half's negation folded into the sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class _NativeLayers:
    """Every decoder layer in one call to :func:`decoder_layers`, over the layers' named weights built once.

    The weights are those the kernel backend prepared (:class:`PackedLinear`'s packed copies,
    the norms' weights), by name (``cpu_layers.h``: DecoderWeights).
    """

    def __init__(self, layers: Sequence[_Layer], heads: int, head_dim: int, scaling: float, eps: float) -> None:
        self.weights = decoder_weights(
            [_named_tensors(layer) for layer in layers],
            [{name: getattr(layer, name).out_features for name in LAYER_LINEARS} for layer in layers],
            heads, head_dim, eps, scaling,
        )  # fmt: skip
        self.num_layers = len(layers)

    def __call__(
        self,
        hidden: torch.Tensor,  # [B, d]
        cos: torch.Tensor,  # [B, hd]
        signed_sin: torch.Tensor,  # [B, hd]
        kv: KVSlots,
        feature_layers: Sequence[int],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # hidden [B, d] after the last layer, one [B, d] per feature layer
        buffers = [kv.buffers(index) for index in range(self.num_layers)]
        keys, values = [k for k, _ in buffers], [v for _, v in buffers]
        plane = kv.features if feature_layers else None  # the kernel writes the hooked states there
        out = decoder_layers(
            self.weights, hidden, cos, signed_sin, keys, values, kv.tables, kv.rows, kv.slots, list(feature_layers),
            plane,
        )  # fmt: skip
        return out[0], out[1:]


def _native_layers(decoder: PackedDecoder) -> _NativeLayers | None:
    """The one-call layer sequence where every step of every layer is a kernel call, else None (the reference).

    The conditions are exactly those under which the Python reference makes only kernel calls
    (plus ATen's elementwise ones) and every linear is packed at its natural input width (the
    native step runs packed linears only), so the two compute the same thing.
    """
    layers = decoder.layers
    norms = [norm for layer in layers for norm in (layer.input_norm, layer.post_norm)]
    if not all(_is_kernel_norm(norm) for norm in norms) or len({norm.keywords["eps"] for norm in norms}) != 1:
        return None
    if decoder.spec.qk_norm:  # Qwen3-VL: per-head norms between q/k/v and RoPE
        return None
    if not all(_packed_natively(linear) for layer in layers for linear in _linears(layer)):
        return None
    if decoder.head_dim % 8 or any(layer.act_mul is None for layer in layers):
        return None  # the attention reads a head 8 lanes at a time; the sequence calls silu_mul
    return _NativeLayers(layers, decoder.heads, decoder.head_dim, decoder.scaling, norms[0].keywords["eps"])


def _linears(layer: _Layer) -> tuple[PackedLinear, ...]:
    return tuple(getattr(layer, name) for name in LAYER_LINEARS)


def _packed_natively(linear: PackedLinear) -> bool:
    """Whether the native step can run this linear: packed, at its natural input width, its bias readable as is."""
    if linear.backend != "packed" or linear.weight.shape[1] * linear.weight.shape[3] != linear.in_features:
        return False
    bias = linear.bias
    return bias is None or (bias.is_contiguous() and bias.dtype in (linear.dtype, torch.float32))


def _named_tensors(layer: _Layer) -> dict[str, torch.Tensor | None]:
    """One layer's tensors by the names of cpu_kernels.LAYER_TENSORS."""
    tensors = {"input_norm": layer.input_norm.keywords["weight"], "post_norm": layer.post_norm.keywords["weight"]}
    for name in LAYER_LINEARS:
        linear = getattr(layer, name)
        tensors[name], tensors[f"{name}_bias"] = linear.weight, linear.bias
    assert set(tensors) == set(LAYER_TENSORS), tensors.keys()
    return tensors


def _is_kernel_norm(norm: Callable) -> bool:
    """Whether :func:`fast_norm` chose the kernel's RMSNorm (else the module runs its own forward)."""
    return isinstance(norm, functools.partial) and norm.func is rms_norm


def _is_silu(act: Callable, dtype: torch.dtype) -> bool:
    """Whether the MLP's activation computes ``F.silu``, which the native step calls (checked on a probe)."""
    probe = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(dtype)
    return torch.equal(act(probe), F.silu(probe))
