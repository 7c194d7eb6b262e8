"""DSparkDrafter: backbone + sequential head + confidence head, tied to a target's vocabulary.

The drafter owns only its own weights. The target's input embedding and LM head are
borrowed (frozen, never registered as submodules), so ``state_dict()`` and a saved
checkpoint hold the drafter alone and ``drafter.to(...)`` never touches the target.
A checkpoint is re-tied to a target at load; a target whose hidden size or vocabulary
differ is refused.

Draft vocabulary. With ``config.draft_vocab_size = N`` the drafter's logits cover only N
target ids (``draft_token_ids``, the most frequent ones in the training data, stored in
the checkpoint; EAGLE-3's d2t map): the LM head GEMM shrinks from V to N rows and so does
the sequential head's W2. Drafted tokens are always target ids, and ``draft()`` scatters
its distributions back onto the whole vocabulary (zero outside the draft set), so
rejection sampling stays exactly lossless.

The target is duck-typed (drafters never import ``vlmspec.targets``): it must expose
``input_embeddings`` (nn.Embedding), ``output_head`` (nn.Linear [V, d]),
``hidden_size``, ``vocab_size``, ``num_layers``, ``tokenizer``, ``dtype``, ``device``
and ``name``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmspec.drafters.dspark.backbone import ContextKV, DSparkBackbone, RMSNorm, anchor_block_mask
from vlmspec.drafters.dspark.confidence import ConfidenceHead
from vlmspec.drafters.dspark.config import DSparkConfig
from vlmspec.drafters.dspark.heads import HeadSample, build_head
from vlmspec.kernels.cpu_kernels import kernel_applies
from vlmspec.kernels.linear import PackedLinear

WEIGHTS_NAME = "model.safetensors"


class TiedVocabulary:
    """The target's frozen embedding and LM head, held by reference (not as submodules)."""

    def __init__(self, embedding: nn.Embedding, lm_head: nn.Linear) -> None:
        self.embedding = embedding
        self.lm_head = lm_head

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., d_target]
        return self.embedding(tokens)


@dataclass
class DraftOutput:
    """Teacher-forced outputs for a batch of blocks (training and tests)."""

    hidden: torch.Tensor  # [B, A, G, d] backbone states
    base_logits: torch.Tensor  # [B, A, G, N] float32 over the draft vocabulary, LM head only
    logits: torch.Tensor  # [B, A, G, N] float32, after the sequential head
    confidence_logits: torch.Tensor | None  # [B, A, G] float32 pre-sigmoid, None without a confidence head


@dataclass
class DraftSample:
    """One drafted block per row."""

    tokens: torch.Tensor  # [B, G] int64 target ids
    logits: torch.Tensor  # [B, G, N] float32 corrected logits over the draft vocabulary (before temperature)
    probs: (
        torch.Tensor | None
    )  # [B, G, V] float32 distributions drawn from, over the whole vocabulary; None when greedy
    confidences: torch.Tensor | None  # [B, G] float32 conditional survival probabilities


class DSparkDrafter(nn.Module):
    """A DSpark drafter (see ``config.py`` for its shape, ``backbone.py`` and ``heads.py`` for its parts)."""

    def __init__(self, config: DSparkConfig, vocabulary: TiedVocabulary) -> None:
        super().__init__()
        self.config = config
        self.vocabulary = vocabulary
        d, d_target = config.hidden_size, config.target_hidden_size
        # Bridges between the target's embedding width and the drafter's (identity when equal).
        self.embed_proj = nn.Identity() if d == d_target else nn.Linear(d_target, d, bias=False)
        self.head_proj = nn.Identity() if d == d_target else nn.Linear(d, d_target, bias=False)
        if config.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.zeros(d_target))
        # Target id of each logit column. A reduced vocabulary is part of the checkpoint; the
        # whole vocabulary is the identity and is not stored.
        columns = torch.arange(config.num_draft_tokens)
        self.register_buffer("draft_token_ids", columns, persistent=config.draft_vocab_size is not None)
        self._head_rows: tuple | None = None  # cached (key, W[ids], b[ids], column of every id), see _draft_rows
        self.backbone = DSparkBackbone(config)
        self.head = build_head(config)
        self.confidence = (
            ConfidenceHead(config, self.head.token_dim if config.confidence_with_markov else 0)
            if config.confidence_head
            else None
        )

    # ------------------------------------------------------------------ building and io
    @classmethod
    def from_target(cls, target: Any, config: DSparkConfig | None = None, **overrides: Any) -> DSparkDrafter:
        """A fresh, randomly initialised drafter for ``target``.

        ``config`` defaults to ``DSparkConfig.for_target(target, **overrides)``. The
        drafter lives on the target's device in the target's dtype.
        """
        if config is None:
            config = DSparkConfig.for_target(target, **overrides)
        elif overrides:
            raise ValueError("pass either a config or keyword overrides to from_target, not both")
        config.check_target(target)
        drafter = cls(config, _tie(target))
        drafter.reset_parameters()
        return drafter.to(device=target.device, dtype=target.dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random init: linears and embeddings ~ N(0, init_std), norms 1, biases 0.

        The learned mask vector starts at the scale of the target's embedding rows.
        """
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        if self.config.mask_token_id is None:
            rows = self.vocabulary.embedding.weight
            row_std = rows[:: max(rows.shape[0] // 4096, 1)].float().std().item()  # a sample of rows suffices
            self.mask_embedding.normal_(0.0, row_std)

    def save_pretrained(self, directory: str | os.PathLike, *, dtype: torch.dtype | None = None) -> None:
        """Write ``config.json`` and ``model.safetensors`` (the drafter's own weights only).

        ``dtype`` (e.g. ``torch.float16``) stores floating-point weights in that precision to
        halve a checkpoint that ships with a package; :meth:`from_pretrained` casts them back
        to the target's dtype.
        """
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path)
        state = {name: _stored(tensor, dtype) for name, tensor in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt", "target": self.config.target_name})

    @classmethod
    def from_pretrained(
        cls, directory: str | os.PathLike, *, target: Any, dtype: torch.dtype | None = None
    ) -> DSparkDrafter:
        """Load a drafter saved by :meth:`save_pretrained` and tie it to ``target``.

        ``dtype``: the drafter's own weights in that dtype (default: the target's); see :attr:`dtype`.
        """
        from safetensors.torch import load_file

        path = Path(directory)
        if not path.is_dir():
            raise FileNotFoundError(f"no drafter directory at {path}; save one with DSparkDrafter.save_pretrained")
        config = DSparkConfig.load(path)
        weights = path / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(
                f"{path} has a config.json but no {WEIGHTS_NAME}: the save was incomplete; "
                "save the drafter again with DSparkDrafter.save_pretrained"
            )
        return cls.from_state(config, load_file(str(weights)), target=target, source=str(weights), dtype=dtype)

    @classmethod
    def from_state(
        cls,
        config: DSparkConfig,
        state: dict[str, torch.Tensor],
        *,
        target: Any,
        source: str = "the checkpoint",
        dtype: torch.dtype | None = None,
    ) -> DSparkDrafter:
        """A drafter with ``config`` and the weights ``state`` (its own, as ``state_dict()`` names them), tied
        to ``target`` and moved to its device and to ``dtype`` (default: the target's): the one load path of
        saved and imported drafters.

        ``source`` names where ``state`` came from in the error raised when its names do not match ``config``.
        """
        config.check_target(target)
        drafter = cls(config, _tie(target))
        expected = set(drafter.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(
                f"{source} does not match its config (missing {missing[:5]}, unexpected {unexpected[:5]}); "
                "the weights and the config come from different drafters: save or export the drafter again"
            )
        drafter.load_state_dict(state)
        return drafter.to(device=target.device, dtype=dtype or target.dtype)

    @torch.no_grad()
    def set_draft_vocabulary(self, token_ids: torch.Tensor) -> None:
        """Use ``token_ids`` ([N] distinct target ids, N = ``config.draft_vocab_size``) as the draft vocabulary.

        Typically the N most frequent tokens of the target's own answers
        (``vlmspec.training.draft_vocabulary``).
        """
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        expected = self.config.num_draft_tokens
        if self.config.draft_vocab_size is None:
            raise ValueError("this drafter drafts over the whole vocabulary; build it with draft_vocab_size=N first")
        if token_ids.shape[0] != expected or token_ids.unique().shape[0] != expected:
            raise ValueError(f"need {expected} distinct token ids (config.draft_vocab_size), got {token_ids.shape[0]}")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.target_vocab_size:
            raise ValueError(f"draft token ids must lie in [0, {self.config.target_vocab_size}), the target vocabulary")
        self.draft_token_ids.copy_(token_ids.to(self.draft_token_ids.device))

    # ------------------------------------------------------------------ pieces
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the drafter computes in: its own weights'. The target's tied embedding and LM head rows
        are read in it too, so a float32 target may draft with a bfloat16 drafter (half the bytes a round
        reads; drafts only propose, so the output stays the target's either way)."""
        return self.backbone.norm.weight.dtype

    def context_kv(
        self,
        features: torch.Tensor,  # [B, L, m * d_target]
        positions: torch.Tensor,  # [B, L] int64
    ) -> ContextKV:
        """Per-layer keys/values of a context span (what the draft context cache stores)."""
        return self.backbone.context_kv(features, positions)

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., G, d]
        """Input embeddings ``[anchor, MASK x (G - 1)]`` of one block per anchor."""
        anchor = self.vocabulary.embed(anchors).to(self.dtype)  # [..., d_target]
        if self.config.mask_token_id is None:
            mask = self.mask_embedding.to(anchor.dtype)
        else:
            mask = self.vocabulary.embed(torch.tensor(self.config.mask_token_id, device=anchors.device)).to(self.dtype)
        masks = mask.expand(*anchors.shape, self.block_size - 1, mask.shape[-1])
        return self.embed_proj(torch.cat((anchor[..., None, :], masks), dim=-2))

    def block_positions(self, anchor_positions: torch.Tensor) -> torch.Tensor:  # [...] -> [..., G] int64
        """Positions ``anchor_position + [0 .. G - 1]`` of each block."""
        return anchor_positions[..., None] + torch.arange(self.block_size, device=anchor_positions.device)

    def block_hidden(
        self,
        anchors: torch.Tensor,  # [B, A] int64
        anchor_positions: torch.Tensor,  # [B, A] int64
        context: ContextKV,  # per layer [B, Hkv, Lc, hd]
        mask: torch.Tensor | None = None,  # [B, 1, A*G, Lc + A*G] bool; None: one block seeing all context
    ) -> torch.Tensor:  # [B, A, G, d]
        """Backbone states of ``A`` blocks per row in one pass."""
        batch, anchors_per_row = anchors.shape
        block = self.block_inputs(anchors).flatten(1, 2)  # [B, A*G, d]
        positions = self.block_positions(anchor_positions).flatten(1, 2)  # [B, A*G]
        hidden = self.backbone(block, positions, context, mask)
        return hidden.view(batch, anchors_per_row, self.block_size, -1)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., N] float32
        """The target's LM head rows of the draft vocabulary over backbone states: once for all positions."""
        return self.target_logits(self.head_proj(hidden))

    def target_logits(self, target_hidden: torch.Tensor) -> torch.Tensor:  # [..., d_target] -> [..., N] float32
        """The frozen LM head over the draft vocabulary (a softmax of these is the target's
        distribution conditioned on the draft vocabulary)."""
        weight, bias, _ = self._draft_rows()
        x = target_hidden.to(weight.dtype)
        fast = self._head_rows[4]  # the rows in the CPU kernels' layout, when drafting (inference) on a CPU
        if fast is not None:
            return fast(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], fast.out_features).float()
        return torch.nn.functional.linear(x, weight, bias).float()

    def draft_columns(self, tokens: torch.Tensor) -> torch.Tensor:  # [...] target ids -> [...] int64, -1 outside
        """Draft-vocabulary column of each target id (-1 for ids outside the draft vocabulary)."""
        return self._draft_rows()[2][tokens]

    def scatter_to_target(self, probs: torch.Tensor) -> torch.Tensor:  # [..., N] -> [..., V]
        """Draft-vocabulary distributions on the whole target vocabulary (zero outside the draft set)."""
        if self.config.draft_vocab_size is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.config.target_vocab_size)
        return full.index_copy_(-1, self.draft_token_ids, probs)

    def _draft_rows(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """LM head rows [N, d_target] and bias [N] (or None) of the draft vocabulary in the drafter's dtype, and
        the column of every target id [V]; cached until the ids, the target's weights or the dtype change."""
        head, ids = self.vocabulary.lm_head, self.draft_token_ids
        weight, bias, dtype = head.weight, head.bias, self.dtype
        # Inference-mode tensors cannot enter autograd: rows cut while drafting are cut again for training.
        key = (
            ids.data_ptr(),
            ids._version,
            weight.data_ptr(),
            weight.dtype,
            weight.device,
            dtype,
            torch.is_inference_mode_enabled(),
        )
        if self._head_rows is None or self._head_rows[0] != key:
            full = self.config.draft_vocab_size is None
            rows = (weight if full else weight[ids]).to(dtype)
            rows_bias = None if bias is None else (bias if full else bias[ids]).to(dtype)
            columns = torch.full((self.config.target_vocab_size,), -1, dtype=torch.long, device=ids.device)
            columns[ids] = torch.arange(ids.shape[0], device=ids.device)
            rows, rows_bias = rows.detach(), None if rows_bias is None else rows_bias.detach()
            # Drafting reads these rows once per round for a few positions: through the CPU kernels where they apply.
            fast = PackedLinear([rows], [rows_bias]) if key[-1] and kernel_applies(rows) else None
            self._head_rows = (key, rows, rows_bias, columns, fast)
        return self._head_rows[1:4]

    def confidences(
        self,
        hidden: torch.Tensor,  # [B, G, d]
        prev_tokens: torch.Tensor,  # [B, G] int64 [anchor, x_1 .. x_{G-1}]
    ) -> torch.Tensor | None:  # [B, G] float32 logits of c_k, None without a confidence head
        if self.confidence is None:
            return None
        features = self.head.token_features(prev_tokens) if self.config.confidence_with_markov else None
        return self.confidence.logits(hidden, features)

    # ------------------------------------------------------------------ the two uses
    def forward(
        self,
        context_features: torch.Tensor,  # [B, L, m * d_target]
        context_positions: torch.Tensor,  # [B, L] int64
        anchors: torch.Tensor,  # [B, A] int64
        anchor_positions: torch.Tensor,  # [B, A] int64
        prev_tokens: torch.Tensor,  # [B, A, G] int64 teacher-forced [anchor, ground_truth[:-1]]
        anchor_index: torch.Tensor | None = None,  # [B, A] int64: block a sees context[:anchor_index]
    ) -> DraftOutput:
        """Teacher-forced draft of ``A`` blocks per row over a whole context (training form).

        With ``anchor_index=None`` every block sees the whole context (one forward from
        scratch); otherwise blocks are packed in one row with :func:`anchor_block_mask`.
        """
        batch, anchors_per_row = anchors.shape
        context = self.context_kv(context_features, context_positions)
        mask = None
        if anchor_index is not None:
            mask = anchor_block_mask(anchor_index, context_features.shape[1], self.block_size)
        hidden = self.block_hidden(anchors, anchor_positions, context, mask)  # [B, A, G, d]
        flat_hidden = hidden.flatten(0, 1)  # [B*A, G, d]
        flat_prev = prev_tokens.flatten(0, 1)  # [B*A, G]
        base = self.base_logits(flat_hidden)
        logits = self.head.teacher_forced(flat_hidden, base, flat_prev)
        confidence = self.confidences(flat_hidden, flat_prev)
        shape = (batch, anchors_per_row, self.block_size)
        return DraftOutput(
            hidden=hidden,
            base_logits=base.view(*shape, -1),
            logits=logits.view(*shape, -1),
            confidence_logits=None if confidence is None else confidence.view(shape),
        )

    @torch.inference_mode()
    def draft(
        self,
        anchors: torch.Tensor,  # [B] int64
        anchor_positions: torch.Tensor,  # [B] int64
        context: ContextKV,  # per layer [B, Hkv, Lc, hd], e.g. DraftContextCache.layers()
        temperature: float,
        generator: torch.Generator | None,
    ) -> DraftSample:
        """Draft one block per row: one backbone pass, one LM head GEMM, then the head's loop."""
        hidden = self.block_hidden(anchors[:, None], anchor_positions[:, None], context)[:, 0]  # [B, G, d]
        base = self.base_logits(hidden)  # [B, G, V]
        sample: HeadSample = self.head.sample(hidden, base, anchors, self.draft_token_ids, temperature, generator)
        prev = torch.cat((anchors[:, None], sample.tokens[:, :-1]), dim=1)  # [B, G]
        confidence = self.confidences(hidden, prev)
        return DraftSample(
            tokens=sample.tokens,
            logits=sample.logits,
            probs=None if sample.probs is None else self.scatter_to_target(sample.probs),
            confidences=None if confidence is None else torch.sigmoid(confidence),
        )


def _tie(target: Any) -> TiedVocabulary:
    """The target's embedding and LM head, checked for the shapes the drafter needs, and frozen.

    Freezing (``requires_grad=False``) keeps a drafter's training from updating weights it
    shares with the target; the target itself only ever runs under inference mode.
    """
    embedding, head = target.input_embeddings, target.output_head
    if tuple(head.weight.shape) != (target.vocab_size, target.hidden_size):
        raise ValueError(
            f"{getattr(target, 'name', 'target')}.output_head has shape {tuple(head.weight.shape)}, expected "
            f"(vocab_size, hidden_size) = ({target.vocab_size}, {target.hidden_size})"
        )
    if embedding.weight.shape[-1] != target.hidden_size:
        raise ValueError(
            f"{getattr(target, 'name', 'target')}.input_embeddings has width {embedding.weight.shape[-1]}, "
            f"expected hidden_size {target.hidden_size}"
        )
    for parameter in (*embedding.parameters(), *head.parameters()):
        parameter.requires_grad_(False)
    return TiedVocabulary(embedding, head)


def _stored(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as it is written to disk: on the CPU, floating point cast to ``dtype`` when given."""
    tensor = tensor.detach().contiguous().cpu()
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
