"""Ragged batches: many requests verify different numbers of tokens in one target forward.

Speculative decoding over R concurrent requests feeds request r its anchor plus its own
number of scheduled drafts, ``n_r = 1 + l_r`` tokens, and keeps its own number of them
afterwards. A :class:`RaggedBatch` holds such rows:

* **A block-paged KV pool** (:class:`~vlmspec.targets.pool.KVPool`): per decoder layer
  ``[N, Hkv, bs, hd]`` blocks of ``bs`` slots. Row r owns a block table; its committed
  tokens are its slots ``0 .. length[r] - 1``, slot j in block ``table[r][j // bs]`` at
  offset ``j % bs``. A forward first gives each row the blocks its new tokens need; a
  removed row's blocks return to the pool at once. Rollback is free, as in vLLM: the next
  forward writes at ``length[r]`` and overwrites rejected slots (the row keeps its blocks).
* **A packed forward.** The ``B = sum_r n_r`` new tokens run as one sequence ``[1, B]``:
  every linear layer (projections, MLP, LM head) costs B tokens, not ``R x max n_r``,
  so the forward's cost follows the total the hardware-aware schedulers budget for.
  Only attention is padded: a small attention function (registered with transformers as
  ``vlmspec_ragged`` and switched on for this forward only) scatters each row's queries
  into ``[R, H, W, hd]`` (``W = max n_r``) and attends over that row's slots (gathered
  through its block table) with the mask ``slot <= length[r] + i``: its committed tokens,
  then its new ones causally. The fast forward reads the pool through the tables directly
  (:func:`~vlmspec.kernels.cpu_kernels.paged_attention`).
* **Per-row positions.** New token i of row r sits at M-RoPE position
  ``length[r] + i + rope_delta[r]`` in all three components (the rule one-request
  decoding uses), which is also its 1-D text-stream position for a drafter.

A failed forward writes only at or beyond each row's committed length, so every row's
committed state survives it: the caller may retry (the engine does, request by request).

Requests enter through :meth:`RaggedBatch.prefill`: many prompts, with images or without,
in one packed forward that writes their KV straight into new rows. A prompt with images
comes as a :class:`~vlmspec.targets.prompts.RowPrompt` (:meth:`QwenVLTarget.row_prompt`:
the vision tower's embeddings, its M-RoPE positions [3, L] and rope_delta). A request
prefilled alone (:meth:`QwenVLTarget.prefill`) can also join: :meth:`RaggedBatch.add`
copies its KV into new blocks. A finished request leaves with :meth:`RaggedBatch.remove`,
which frees its blocks and moves the last row's block table into the hole (rows stay
dense, no KV is copied). Rows therefore change index: ``remove`` says which.

Every row's logits and features equal what its request gets alone (float rounding
apart: the attention sums over a few extra masked slots); tests/targets/test_ragged.py
checks it for every family.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlmspec.kernels.cpu_kernels import MAX_ROWS, attention_applies, kernel_max_rows, packing_applies, paged_attention
from vlmspec.targets.adapter import QwenVLTarget, RequestState, TargetStep
from vlmspec.targets.families import language_model
from vlmspec.targets.pool import DEFAULT_BLOCK_SIZE, KVPool, block_bytes
from vlmspec.targets.prefix_keys import RowContent
from vlmspec.targets.prompts import RowPrompt, VisionEmbeds, as_row_prompt, pack_vision, text_model_inputs

RAGGED_ATTENTION = "vlmspec_ragged"

# The most queries of one row the kernel's attention (paged_attention) takes in a forward. It reads a
# row's keys once per query: fine for a decode or verify step, but a 64-token prefill chunk after 6,000
# tokens read them 64 times (47 ms a layer in float32 on the 2-core EPYC, 11 in bfloat16). Wider pieces
# run attend_rows, one SDPA call a row, which reads each key once for all of the row's queries (6 and 4
# ms; SDPA is ahead from 8 queries in float32, from about 32 in bfloat16).
KERNEL_ATTENTION_MAX_QUERIES = 16


@dataclass
class RaggedStep:
    """What one ragged verification forward returns, padded to ``W = max n_r`` per row."""

    logits: torch.Tensor  # [R, W, V] float32; row r's first num_tokens[r] entries are real
    positions: torch.Tensor  # [R, W] int64 1-D text-stream positions of the inputs (CPU)


@dataclass
class _Layout:
    """Where the B packed tokens of one forward live: the attention function's metadata."""

    rows: torch.Tensor  # [B] int64 row of each packed token
    offsets: torch.Tensor  # [B] int64 its index i among its row's inputs
    slots: torch.Tensor  # [B] int64 its slot in its row, length[row] + i
    tables: torch.Tensor  # [R, M] int64 each row's blocks (entries past a row's blocks: 0, never read)
    blocks: torch.Tensor  # [B] int64 the pool block of its slot, tables[row, slot // bs]
    block_offsets: torch.Tensor  # [B] int64 the slot's offset in that block, slot % bs
    padded: torch.Tensor  # [B] int64 its index in the flattened [R, W] padding
    num_rows: int  # R
    width: int  # W = max n_r
    keys: int  # S = max(length + n): key slots the attention reads
    committed: torch.Tensor  # [R] int64 each row's committed length before this forward
    device: torch.device  # where the attention runs

    @property
    def dense(self) -> bool:
        """Whether every row runs all W inputs (B = R * W): then packed token b is padded slot b."""
        return self.rows.shape[0] == self.num_rows * self.width

    @functools.cached_property
    def mask(self) -> torch.Tensor:  # [R, 1, W, S] bool, True where query (r, i) may attend slot j
        """SDPA's mask, built on first use: the native step's attention reads rows and slots instead."""
        last_visible = self.committed[:, None] + torch.arange(self.width)  # [R, W]
        mask = torch.arange(self.keys)[None, None, :] <= last_visible[:, :, None]  # [R, W, S]
        return mask[:, None].to(self.device)


class RaggedBatch:
    """The rows of a ragged batch: the KV pool, each row's block table, length and rope_delta.

    >>> batch = RaggedBatch(target, feature_layers=(1, 2))
    >>> steps = batch.prefill([target.row_prompt(inputs)])  # new rows (images or not): first predictions
    >>> step = batch.verify(tokens, num_tokens)          # [R, W] inputs, [R] real counts
    >>> batch.advance(keep)                              # [R]: keep the first keep[r] inputs
    """

    def __init__(
        self,
        target: QwenVLTarget,
        *,
        feature_layers: Sequence[int] = (),
        initial_capacity: int = 256,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_cache_bytes: int | None = None,
        prefix_caching: bool = False,
        batch_invariant: bool | None = None,
    ):
        """``initial_capacity``: token slots the pool starts with (it grows on demand); ``block_size``: slots a
        block; ``kv_cache_bytes``: the most bytes of KV the pool may hold (None: unbounded; see :class:`KVPool`);
        ``prefix_caching``: rows that start as an earlier row did share its full blocks (see :meth:`open`);
        ``batch_invariant``: prompt pieces run through the decode step's kernels (:meth:`extend`), so a token's
        KV and logits have the same bits however it was computed: a prefix hit answers as a cold prefill does
        (None: :func:`batch_invariance_default`)."""
        _check_attention(target)
        if batch_invariant is None:
            batch_invariant = batch_invariance_default(target)
        elif batch_invariant and not _packed_kernels_run(target):
            raise ValueError(
                f"batch_invariant needs the fast decode path on vlmspec's packed CPU kernels (AVX-512, and AVX512-BF16 "
                f"for bfloat16), which this {target.dtype} target on {target.device} (decode={target.decode!r}) does "
                "not run on here: leave batch_invariant off (float32 answers still agree with a cold prefill)"
            )
        self.target = target
        self.batch_invariant = batch_invariant
        self.feature_layers = target.check_feature_layers(feature_layers)
        self.lengths = torch.zeros(0, dtype=torch.long)  # [R] committed tokens per row
        self.rope_deltas = torch.zeros(0, dtype=torch.long)  # [R]
        config = target.model.config.get_text_config()
        shape = {
            "num_layers": config.num_hidden_layers,
            "kv_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            "dtype": target.dtype,
            "block_size": block_size,
        }
        # The hooked features of every slot's token live beside its KV: a row that starts from cached blocks,
        # or prefills in chunks, hands its drafter the features of its whole prompt all the same.
        feature_width = len(self.feature_layers) * config.hidden_size
        per_block = (
            block_bytes(**shape) + block_size * feature_width * torch.tensor([], dtype=target.dtype).element_size()
        )
        max_blocks = None
        if kv_cache_bytes is not None:
            max_blocks = kv_cache_bytes // per_block
            if max_blocks < 1:
                raise ValueError(
                    f"a KV memory budget of {kv_cache_bytes:,} bytes holds no block of {block_size} tokens "
                    f"({per_block:,} bytes for this target): raise it"
                )
        initial_blocks = -(-initial_capacity // block_size)
        self.pool = KVPool(
            **shape,
            device=target.device,
            initial_blocks=initial_blocks,
            max_blocks=max_blocks,
            feature_width=feature_width,
            prefix_caching=prefix_caching,
        )
        self._blocks: list[list[int]] = []  # [R] each row's block ids, in order
        self._tables = torch.zeros(4, 4, dtype=torch.long)  # [R_cap, M_cap]: _blocks as a tensor, row r in row r
        self._contents: list[RowContent | None] = []  # [R] what each row holds, to key its full blocks (or None)
        self._pending: torch.Tensor | None = None  # [R] tokens of the last verify not yet confirmed
        self._pending_tokens: torch.Tensor | None = None  # [R, W] the inputs of that verify (CPU)
        # The fast forward's packed weights. Re-checked against the model (a weight changed in place is
        # repacked) whenever a request joins: the check reads every parameter, 0.7 ms on the reference target.
        self._decoder = None
        self._weights_cached = None  # the packed decoder the prefix cache's blocks were computed with
        self._decode_cached = target.decode  # the forward ("fast" / "reference") that computed the cached blocks

    # ----------------------------------------------------------------- rows
    @property
    def num_rows(self) -> int:
        return self.lengths.shape[0]

    def add(self, state: RequestState) -> int:
        """Copy a prefilled request's cache into a new last row; returns the row index.

        ``state`` must come from ``target.prefill`` with this batch's feature layers (or
        any one-request state with nothing left to roll back); it is not used afterwards.
        """
        if state.broken or state.uncommitted:
            raise ValueError("add() takes a request state after prefill/rollback, not one mid-verify or broken")
        if state.feature_layers != self.feature_layers:
            raise ValueError(
                f"the request hooks layers {state.feature_layers} but the batch hooks {self.feature_layers}; "
                "prefill with feature_layers=batch.feature_layers"
            )
        layers = state.cache.layers
        row = self.num_rows
        self._open_rows(1)  # its content is not known here: its blocks are never cached
        try:
            self._reserve_slots([state.length], first=row)
        except Exception:
            self._close_rows(row)
            raise
        blocks = torch.tensor(self._blocks[row], device=self.target.device)  # [m]
        size, n = self.pool.block_size, state.length
        for pool_k, pool_v, layer in zip(self.pool.keys, self.pool.values, layers, strict=True):
            for pool, cached in ((pool_k, layer.keys), (pool_v, layer.values)):
                padded = F.pad(cached[0, :, :n], (0, 0, 0, blocks.numel() * size - n))  # [Hkv, m * bs, hd]
                pool[blocks] = padded.unflatten(1, (blocks.numel(), size)).transpose(0, 1).to(pool.dtype)
        self.lengths[row], self.rope_deltas[row] = state.length, state.rope_delta
        self._pending = None
        self._decoder = None
        return row

    def remove(self, row: int) -> int | None:
        """Drop ``row`` and free its blocks; the last row moves into its place (its block table, not its KV).

        Returns the moved row's old index (None if none moved).
        """
        last = self.num_rows - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} is not in this batch of {self.num_rows}")
        self.pool.free(self._blocks[row])
        if row != last:
            self._blocks[row] = self._blocks[last]
            self._contents[row] = self._contents[last]
            self._tables[row] = self._tables[last]
            self.lengths[row] = self.lengths[last]
            self.rope_deltas[row] = self.rope_deltas[last]
        del self._blocks[last]
        del self._contents[last]
        self.lengths, self.rope_deltas = self.lengths[:last], self.rope_deltas[:last]
        self._pending = None
        return last if row != last else None

    def blocks_of(self, row: int) -> list[int]:
        """The pool blocks row ``row`` holds, in order (its block table)."""
        return list(self._blocks[row])

    def blocks_to_grow(self, rows: Sequence[int], slots: int) -> int:
        """New blocks the rows would take to hold ``slots`` more slots each (within the context)."""
        size, context = self.pool.block_size, self.target.max_context
        wanted = 0
        for row in rows:
            held = min(int(self.lengths[row]) + slots, context)
            wanted += max(0, -(-held // size) - len(self._blocks[row]))
        return wanted

    def features_of(self, row: int, end: int, start: int = 0) -> torch.Tensor | None:  # -> [end - start, m * d]
        """The hooked features of row ``row``'s tokens ``start`` to ``end``, read from beside its KV (None: no layers).

        Every forward writes its tokens' features there, so this reads the committed tokens and, until
        :meth:`advance`, the inputs of the last :meth:`verify` after them (slots ``lengths[row]`` on).
        """
        if self.pool.features is None:
            return None
        written = int(self.lengths[row]) + (0 if self._pending is None else int(self._pending[row]))
        if not 0 <= start <= end <= written:
            raise ValueError(f"row {row} holds {written} tokens with features; features {start}:{end} asked for")
        size = self.pool.block_size
        first = start // size
        blocks = torch.tensor(self._blocks[row][first : -(-end // size)], device=self.pool.features.device)
        return self.pool.features[blocks].flatten(0, 1)[start - first * size : end - first * size]

    def clear_prefix_cache(self) -> None:
        """Forget every cached block (done on its own when the fast path sees new weights or the target's ``decode``
        changes; call it after changing a model's weights in place under ``decode="reference"``). Rows keep the
        blocks they hold."""
        if self.pool.prefix is not None:
            self.pool.free_idle(self.pool.prefix.clear())

    @property
    def prefix_cache(self) -> dict[str, int] | None:
        """The prefix cache's counters: blocks it keeps, idle ones, prompt tokens looked up and hit (None: off)."""
        index = self.pool.prefix
        if index is None:
            return None
        return {
            "blocks": len(index),
            "idle_blocks": len(index.idle),
            "queried_tokens": index.queried_tokens,
            "hit_tokens": index.hit_tokens,
        }

    # ------------------------------------------------------------- forwards
    @torch.no_grad()
    def verify(
        self,
        tokens: torch.Tensor,  # [R, W] int64, row r's inputs first
        num_tokens: torch.Tensor,  # [R] int64 in 0..W, the real inputs of each row
    ) -> RaggedStep:
        """One forward over row r's first ``num_tokens[r]`` of ``tokens[r]``, appended after its committed tokens.

        tokens: [R, W] int64 (entries beyond num_tokens[r] are ignored); num_tokens: [R]
        int64 in 0..W. Returns logits for every input (entry i predicts the token after
        input i). Call :meth:`advance` afterwards to keep an accepted prefix per row.
        """
        num_tokens = self._check_inputs(tokens, num_tokens)
        width = tokens.shape[1]
        starts = [length + delta for length, delta in zip(self.lengths.tolist(), self.rope_deltas.tolist())]
        positions = torch.tensor([[start + i for i in range(width)] for start in starts], dtype=torch.long)
        positions = positions.view(self.num_rows, width)  # [R, W] (view: a batch without rows)
        layout = self._layout(num_tokens, width)
        if layout.rows.numel() == 0:  # nothing to run: every row sits this step out
            self._pending, self._pending_tokens = num_tokens, None
            return RaggedStep(torch.zeros(self.num_rows, width, self.target.vocab_size), positions)
        self._pending_tokens = tokens.cpu() if self.pool.prefix is not None else None
        packed_logits = self._verify_forward(tokens, positions, num_tokens, layout)  # features: beside the KV
        if not layout.dense:  # some rows verify fewer tokens: pad them
            packed_logits = packed_logits[_padding_gather(layout, self.target.device)]  # [R * W, V]
        self._pending = num_tokens
        return RaggedStep(logits=packed_logits.view(self.num_rows, width, -1), positions=positions)

    def _verify_forward(self, tokens, positions, num_tokens, layout: _Layout):
        """:meth:`verify`'s packed logits [B, V] (features go beside the KV): one forward, or with ``batch_invariant``
        one per run of consecutive rows holding at most ``kernel_max_rows`` tokens, so that no step takes the
        GEMM and a row's logits have the bits they would have if it ran alone (outputs stay in packed order)."""
        limit = kernel_max_rows(self.target.dtype)
        if not self.batch_invariant or layout.rows.numel() <= limit:
            return self._forward(tokens, positions, num_tokens, layout)
        parts = []
        for rows in _rows_within(num_tokens.tolist(), limit):
            part = torch.zeros_like(num_tokens)
            part[rows] = num_tokens[rows]
            parts.append(self._forward(tokens, positions, part, self._layout(part, tokens.shape[1])))
        return torch.cat(parts)

    @torch.no_grad()
    def prefill(self, prompts: Sequence[RowPrompt | torch.Tensor]) -> list[TargetStep]:  # tensors: [L_i] int64
        """Open one row per prompt and run all of them in one packed forward, writing their KV into the new rows.

        A prompt is a :class:`RowPrompt` (:meth:`QwenVLTarget.row_prompt`: images, M-RoPE
        positions, rope_delta) or, for text, just its ids ([L] int64: position i in all three
        M-RoPE components, rope_delta 0). Rows are appended in order. Returns, per prompt,
        the prediction after its last token (logits [1, V] float32), the hooked features of
        all its tokens ([L_i, m * d], or None) and their 1-D text-stream positions ([L_i]).
        With prefix caching, a prompt's cached blocks are not computed again (:meth:`open`).
        If the forward fails, no row is added.
        """
        if not prompts:
            return []
        prompts = [as_row_prompt(p) for p in prompts]
        first = self.num_rows
        starts = self.open(prompts)
        rows = list(range(first, self.num_rows))
        try:
            steps = self.extend(rows, [p.piece(start) for p, start in zip(prompts, starts, strict=True)])
        except Exception:
            self._close_rows(first)
            raise
        return [
            TargetStep(logits=step.logits, features=self.features_of(row, p.length), positions=p.positions_1d())
            for row, p, step in zip(rows, prompts, steps, strict=True)
        ]

    def open(self, prompts: Sequence[RowPrompt | torch.Tensor]) -> list[int]:
        """New last rows for whole prompts, each holding what the prefix cache has of its prompt; how much each has.

        Row i starts with the cached blocks of the longest run of its prompt's full blocks
        that an earlier row committed (same tokens, positions and images: see
        :mod:`vlmspec.targets.prefix_keys`), shared with any row that holds them, and its
        length is what they hold: fill the rest with :meth:`extend` (``prompt.piece(start)``).
        At least the last token is always left to compute (its logits start the request).
        Without prefix caching every row starts empty (0). Nothing runs here, but every
        block the prompts need is taken now (:class:`KVPoolFull` if they do not fit: no row opens).
        """
        prompts = [as_row_prompt(p) for p in prompts]
        if any(p.length < 1 or p.start != 0 for p in prompts):
            raise ValueError("open() takes whole prompts of at least one token")
        self._forget_blocks_of_another_forward()
        first = self.num_rows
        self._open_rows(len(prompts))
        size, index = self.pool.block_size, self.pool.prefix
        starts = []
        for row, prompt in enumerate(prompts, start=first):
            self.rope_deltas[row] = prompt.rope_delta
            if index is None:
                starts.append(0)
                continue
            content = self._contents[row] = RowContent(prompt, size)
            hits = index.match(content.keys_within(prompt.length - 1), size, prompt.length)
            self.pool.share(hits)
            self._blocks[row] = list(hits)
            self._ensure_table_width(len(hits))
            self._tables[row, : len(hits)] = torch.tensor(hits, dtype=torch.long)
            content.cached_blocks = len(hits)
            self.lengths[row] = len(hits) * size
            starts.append(len(hits) * size)
        try:  # every block the prompts need, now: their pieces never meet a full pool
            self._reserve_slots([p.length for p in prompts], first=first)
        except Exception:
            self._close_rows(first)
            raise
        self._pending = None
        self._decoder = None  # a request joins: the packed weights are re-checked once, as in add()
        return starts

    @torch.no_grad()
    def extend(self, rows: Sequence[int], pieces: Sequence[RowPrompt]) -> list[TargetStep]:
        """Run prompt pieces after their rows' committed tokens, in one packed forward: a chunk, or a hit's suffix.

        Piece i continues row ``rows[i]``, whose length must be ``pieces[i].start``
        (:meth:`RowPrompt.piece`). Every other row sits this forward out. Returns, per piece,
        the prediction after its last token (logits [1, V] float32) and its tokens' 1-D
        positions ([n_i]); their hooked features are written beside their KV, where
        :meth:`features_of` reads a row's whole prompt (``features`` is None: a copy per piece,
        kept until its prompt is whole, cost a server fresh memory, page faults, for every
        prompt token). If the forward fails, no row's length changes (it wrote only past them).

        With ``batch_invariant`` the pieces run as a decode step runs, in as many forwards as
        that takes (:meth:`_extend_decode_sized`); a failure then leaves every row as it was too.
        """
        if len(rows) != len(pieces) or len(set(rows)) != len(rows):
            raise ValueError("extend() takes one piece for each of distinct rows")
        for row, piece in zip(rows, pieces, strict=True):
            if not 0 <= row < self.num_rows or int(self.lengths[row]) != piece.start:
                raise ValueError(f"row {row} holds {int(self.lengths[row])} tokens, the piece starts at {piece.start}")
        if self.batch_invariant:
            return self._extend_decode_sized(rows, pieces)
        return self._extend_once(rows, pieces)

    def _extend_decode_sized(self, rows: Sequence[int], pieces: Sequence[RowPrompt]) -> list[TargetStep]:
        """:meth:`extend` in forwards no wider than a decode step may be, so the same kernels compute every token.

        The native step's linears give each token the same bits in any batch of up to
        ``kernel_max_rows`` tokens, and its attention computes each query alone over its row's
        slots, but a wider forward takes ATen's GEMM and a row of more than
        ``KERNEL_ATTENTION_MAX_QUERIES`` queries takes SDPA, which round differently. So each
        forward takes at most that many tokens of a row and that many in all: a prompt's
        tokens then get the bits a decode step would give them, and a later turn that reuses
        the answer's cached KV answers as a cold prefill of the same conversation does.
        """
        lengths = self.lengths.clone()
        most = kernel_max_rows(self.target.dtype)  # tokens a forward may hold
        per_row = min(KERNEL_ATTENTION_MAX_QUERIES, most)
        done = [0] * len(pieces)  # tokens of each piece already run
        logits: list[torch.Tensor | None] = [None] * len(pieces)  # [1, V] after each piece's last token so far
        try:
            while any(n < p.length for n, p in zip(done, pieces)):
                chosen, parts, total = [], [], 0
                for i, piece in enumerate(pieces):
                    take = min(per_row, piece.length - done[i], most - total)
                    if take > 0:
                        chosen.append(i)
                        parts.append(piece.piece(done[i], done[i] + take))
                        total += take
                steps = self._extend_once([rows[i] for i in chosen], parts)
                for i, part, step in zip(chosen, parts, steps, strict=True):
                    done[i] += part.length
                    logits[i] = step.logits
        except Exception:
            self.lengths = lengths  # the rows as they were; what was written past them is unused
            raise
        return [
            TargetStep(logits=last, features=None, positions=piece.positions_1d())
            for piece, last in zip(pieces, logits, strict=True)
        ]

    def _extend_once(self, rows: Sequence[int], pieces: Sequence[RowPrompt]) -> list[TargetStep]:
        """:meth:`extend`'s one packed forward (its inputs checked)."""
        order = sorted(range(len(rows)), key=lambda i: rows[i])  # the packed forward takes rows in order
        ordered = [pieces[i] for i in order]
        width = max(p.length for p in pieces)
        tokens = torch.zeros(self.num_rows, width, dtype=torch.long)  # [R, W]: only these rows have inputs
        num_tokens = torch.zeros(self.num_rows, dtype=torch.long)  # [R]
        for i in order:
            tokens[rows[i], : pieces[i].length] = pieces[i].ids.cpu()
            num_tokens[rows[i]] = pieces[i].length
        num_tokens = self._check_inputs(tokens, num_tokens)
        # With images the positions are M-RoPE's [3, B] (packed order: row after row); text alone keeps the 1-D
        # path: cache index i in all three components.
        three_d = any(p.mrope is not None for p in ordered)
        mrope = torch.cat([p.positions_3d() for p in ordered], dim=1) if three_d else None
        layout = self._layout(num_tokens, width)
        ends = torch.cumsum(torch.tensor([p.length for p in ordered]), 0)  # [P] packed end of each piece
        positions = self.lengths[:, None] + torch.arange(width)  # [R, W]: a text piece continues its row
        logits = self._forward(tokens, positions, num_tokens, layout, ends - 1, mrope, pack_vision(ordered))
        self.lengths = self.lengths + num_tokens
        self._pending = None
        self._cache_full_blocks([rows[i] for i in order])
        steps = [None] * len(pieces)
        for k, i in enumerate(order):
            steps[i] = TargetStep(logits=logits[k : k + 1], features=None, positions=ordered[k].positions_1d())
        return steps

    def advance(self, keep: torch.Tensor | Sequence[int]) -> None:  # keep: [R] int64
        """Keep the first ``keep[r]`` inputs of row r's last verify ([R] int64); the rest are rolled back."""
        keep = torch.as_tensor(keep, dtype=torch.long).cpu()
        if self._pending is None:
            raise RuntimeError("advance() needs a verify() first (and no rows added or removed in between)")
        counts, pending = keep.tolist() if keep.dim() == 1 else None, self._pending.tolist()
        if counts is None or len(counts) != len(pending) or not all(0 <= k <= n for k, n in zip(counts, pending)):
            raise ValueError(
                f"keep must be [R] with 0 <= keep[r] <= num_tokens[r] = {self._pending.tolist()}, got {keep.tolist()}"
            )
        self.lengths = self.lengths + keep
        self._pending = None
        if self.pool.prefix is not None and self._pending_tokens is not None:
            for row in torch.nonzero(keep).flatten().tolist():
                if self._contents[row] is not None:
                    self._contents[row].extend(self._pending_tokens[row, : int(keep[row])].tolist())
            self._cache_full_blocks(range(self.num_rows))
        self._pending_tokens = None

    # ------------------------------------------------------------ internals
    def _forward(self, tokens, positions, num_tokens, layout: _Layout, logits_at=None, mrope=None, vision=None):
        """The packed forward over the real inputs of ``tokens`` [R, W]: logits [B or n, V] float32.

        Every token's hooked features go into the pool's plane beside its KV (:meth:`features_of` reads them):
        the packed decoder writes them there itself, transformers' forward hands them back to be written.
        Images: packed M-RoPE ``mrope`` [3, B] replaces ``positions``; ``vision`` is indexed in packed order.
        """
        device = self.target.device
        if layout.dense:  # every row runs all W inputs: packed order is the rows' own
            packed_ids, packed_positions = tokens.reshape(-1).to(device), positions.reshape(-1).to(device)  # [B]
        else:
            packed_ids = tokens.cpu()[layout.rows, layout.offsets].to(device)  # [B]
            packed_positions = positions[layout.rows, layout.offsets].to(device)  # [B], all three M-RoPE components
        if mrope is not None:
            packed_positions = mrope.to(device)  # [3, B]
        self._forget_blocks_of_another_forward()
        forward = self._fast_forward if self.target.decode == "fast" else self._reference_forward
        logits_at = None if logits_at is None else logits_at.to(device)
        logits, features = forward(packed_ids, packed_positions, layout, logits_at, vision)
        if features is not None:  # transformers' forward (decode="reference"): the drafter's context, beside the KV
            blocks, offsets = layout.blocks.to(device), layout.block_offsets.to(device)
            self.pool.features[blocks, offsets] = features.to(self.pool.features.dtype)
        return logits

    def _fast_forward(self, ids: torch.Tensor, positions: torch.Tensor, layout: _Layout, logits_at=None, vision=None):
        """vlmspec's packed decoder (fused linears): logits [B, V] float32; it writes the features beside the KV."""
        cache = _RaggedCache(self.pool, layout)
        if self._decoder is None:  # checked against the model's weights once per request joining, not per step
            self._decoder = self.target.packed_decoder()
            if self._decoder is not self._weights_cached:  # new weights: KV computed with the old ones is stale
                self.clear_prefix_cache()
                self._weights_cached = self._decoder
        decoder = self._decoder
        if cache.native_attention and attention_applies(self.pool.keys[0], decoder.head_dim):
            tables, rows, visible = cache.tables, cache.rows, cache.slots + 1  # [R, M], [B], [B] on the pool's device

            def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
                return paged_attention(q, keys, values, tables, rows, visible, scaling)  # [B, H, hd]
        else:

            def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
                return attend_rows(q, keys, values, layout, scaling)  # [B, H, hd]

        return decoder(ids, positions, cache, attend, self.feature_layers, logits_at, vision)

    def _reference_forward(self, ids, positions, layout: _Layout, logits_at=None, vision: VisionEmbeds | None = None):
        """transformers' own forward with the ragged attention: logits [B, V] float32, features [B, m * d] or None.

        ids [B]; positions [B] or [3, B]. With images: transformers' text model on the embeddings, images' in place.
        """
        mrope = positions.view(1, 1, -1).expand(3, 1, -1) if positions.dim() == 1 else positions[:, None]  # [3, 1, B]
        model, cache = self.target.model, _RaggedCache(self.pool, layout)
        arguments = {"position_ids": mrope, self.target._cache_kwarg: cache, "use_cache": True}
        with self.target._capture(self.feature_layers) as captured, _ragged_attention(self.target, layout):
            if vision is None:
                logits = model(input_ids=ids[None], **arguments).logits[0]
            else:
                arguments |= text_model_inputs(model, ids, vision)  # embeddings with the images', deepstack
                hidden = language_model(model)(**arguments).last_hidden_state[0]  # [B, d]
                logits = model.get_output_embeddings()(hidden if logits_at is None else hidden[logits_at])
                logits_at = None  # applied
        features = None
        if self.feature_layers:
            features = torch.cat([captured[i][0] for i in self.feature_layers], dim=-1)
        logits = logits if logits_at is None else logits[logits_at]
        return logits.float(), features

    def _check_inputs(self, tokens: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:  # [R, W], [R] -> [R] CPU
        if tokens.dim() != 2 or tokens.shape[0] != self.num_rows or tokens.dtype.is_floating_point:
            raise ValueError(
                f"tokens must be an integer tensor [R, W] with R = {self.num_rows} rows, got "
                f"{tuple(tokens.shape)} {tokens.dtype}"
            )
        num_tokens = torch.as_tensor(num_tokens, dtype=torch.long).cpu()
        counts = num_tokens.tolist() if num_tokens.dim() == 1 else None
        if counts is None or len(counts) != self.num_rows or not all(0 <= n <= tokens.shape[1] for n in counts):
            raise ValueError(
                f"num_tokens must be [R] = [{self.num_rows}] counts in 0..{tokens.shape[1]}, got {num_tokens.tolist()}"
            )
        limit = self.target.max_context
        rows = [row for row, (length, n) in enumerate(zip(self.lengths.tolist(), counts)) if length + n > limit]
        if rows:
            raise ValueError(f"rows {rows} would pass the model's context length ({limit} tokens)")
        return num_tokens

    def _layout(self, num_tokens: torch.Tensor, width: int) -> _Layout:  # num_tokens: [R] int64 (CPU)
        """Where the packed tokens go; first gives every row the blocks its new tokens need.

        Built from Python ints and turned into tensors in one call: a decode step packs a few
        tokens, where a dozen tensor ops would cost more than the arithmetic.
        """
        counts, lengths = num_tokens.tolist(), self.lengths.tolist()
        ends = [length + n for length, n in zip(lengths, counts)]
        self._reserve_slots(ends)
        size = self.pool.block_size
        rows = [row for row, n in enumerate(counts) for _ in range(n)]  # [B] row of each packed token
        offsets = [i for n in counts for i in range(n)]  # [B] i within the row
        slots = [lengths[row] + i for row, i in zip(rows, offsets)]  # [B]
        columns = torch.tensor(
            [
                rows,
                offsets,
                slots,
                [self._blocks[row][slot // size] for row, slot in zip(rows, slots)],
                [slot % size for slot in slots],
                [row * width + i for row, i in zip(rows, offsets)],
            ],
            dtype=torch.long,
        ).view(6, len(rows))  # [6, B] (view: an empty step has B = 0)
        rows_t, offsets_t, slots_t, blocks, block_offsets, padded = columns.unbind(0)
        return _Layout(
            rows=rows_t,
            offsets=offsets_t,
            slots=slots_t,
            tables=self._tables[: self.num_rows],  # [R, M_cap] contiguous: the kernel reads it in place
            blocks=blocks,
            block_offsets=block_offsets,
            padded=padded,
            num_rows=self.num_rows,
            width=width,
            keys=max(ends, default=0),
            committed=self.lengths,
            device=self.target.device,
        )

    def _forget_blocks_of_another_forward(self) -> None:
        """Clear the prefix cache when the target's ``decode`` changed since its blocks were computed: the fast and
        the reference forwards round differently, so a hit on the other's blocks would not answer as a cold prompt."""
        if self.target.decode != self._decode_cached:
            self.clear_prefix_cache()
            self._decode_cached = self.target.decode

    def _open_rows(self, count: int) -> None:
        """Append ``count`` empty rows (length 0, rope_delta 0, no blocks)."""
        self.lengths = torch.cat((self.lengths, torch.zeros(count, dtype=torch.long)))
        self.rope_deltas = torch.cat((self.rope_deltas, torch.zeros(count, dtype=torch.long)))
        self._blocks.extend([] for _ in range(count))
        self._contents.extend(None for _ in range(count))
        if self.num_rows > self._tables.shape[0]:
            self._tables = _grown(self._tables, rows=max(self.num_rows, 2 * self._tables.shape[0]))

    def _close_rows(self, first: int) -> None:
        """Drop the rows from ``first`` on (the last ones), freeing their blocks."""
        for blocks in self._blocks[first:]:
            self.pool.free(blocks)
        del self._blocks[first:]
        del self._contents[first:]
        self.lengths, self.rope_deltas = self.lengths[:first], self.rope_deltas[:first]

    def _reserve_slots(self, slots: Sequence[int], first: int = 0) -> None:  # slots: [R - first]
        """Give rows ``first ..`` the blocks that hold ``slots[r]`` slots each (rows keep the blocks they have)."""
        size = self.pool.block_size
        needed = [-(-int(n) // size) - len(self._blocks[first + i]) for i, n in enumerate(slots)]
        total = sum(max(0, n) for n in needed)
        if total == 0:
            return
        fresh = self.pool.allocate(total)  # all or none: a full pool leaves every row as it was
        self._ensure_table_width(max(len(self._blocks[first + i]) + max(0, n) for i, n in enumerate(needed)))
        for i, n in enumerate(needed):
            if n > 0:
                row, have = first + i, len(self._blocks[first + i])
                taken, fresh = fresh[:n], fresh[n:]
                self._blocks[row].extend(taken)
                self._tables[row, have : have + n] = torch.tensor(taken)

    def _ensure_table_width(self, blocks: int) -> None:
        """Make the block tables hold ``blocks`` entries a row."""
        if blocks > self._tables.shape[1]:
            self._tables = _grown(self._tables, width=max(blocks, 2 * self._tables.shape[1]))

    def _cache_full_blocks(self, rows: Sequence[int]) -> None:
        """Give the prefix index the rows' blocks that filled up: their slots are committed, never written again."""
        if self.pool.prefix is None:
            return
        size = self.pool.block_size
        for row in rows:
            content = self._contents[row]
            if content is None:
                continue
            full = int(self.lengths[row]) // size
            if full > content.cached_blocks:
                keys = content.keys_within(full * size)
                for block in range(content.cached_blocks, full):
                    self.pool.prefix.add(keys[block], self._blocks[row][block])
                content.cached_blocks = full


def _grown(tables: torch.Tensor, rows: int | None = None, width: int | None = None) -> torch.Tensor:
    """``tables`` [R_cap, M_cap] copied into a larger zeroed [rows, width]."""
    new = tables.new_zeros(rows or tables.shape[0], width or tables.shape[1])
    new[: tables.shape[0], : tables.shape[1]] = tables
    return new


def _rows_within(counts: Sequence[int], limit: int) -> list[list[int]]:
    """Runs of consecutive rows whose counts sum to at most ``limit`` each (a row over it alone); empty rows left out."""
    runs, run, total = [], [], 0
    for row, count in enumerate(counts):
        if not count:
            continue
        if run and total + count > limit:
            runs.append(run)
            run, total = [], 0
        run.append(row)
        total += count
    return [*runs, run] if run else runs


def _check_attention(target: QwenVLTarget) -> None:
    config = target.model.config.get_text_config()
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
        raise ValueError("ragged batches do not support sliding-window attention; load the target without it")


def batch_invariance_default(target: QwenVLTarget) -> bool:
    """Whether prompts run batch-invariant unless told: where that was measured to cost nothing.

    On for bfloat16 on the packed kernels: on the 2-core EPYC, prefills of 1,500-6,000 tokens
    took as long either way (docs/design.md §21.4), and without it a cached answer's KV rounds
    differently from a cold prefill's often enough to change a bfloat16 answer at a near-tie.
    Off in float32, where a 6,000-token prefill took 2.1x as long and the answers agree anyway,
    and where ATen's GEMM runs bfloat16 on AMX tiles (the kernel then takes only 16 rows a
    forward, against the tiles' fast prefill).
    """
    return target.dtype == torch.bfloat16 and _packed_kernels_run(target) and kernel_max_rows(target.dtype) == MAX_ROWS


def _packed_kernels_run(target: QwenVLTarget) -> bool:
    """Whether the decode step's linears are the packed kernel's, whose bits for a token do not depend on the
    batch (ATen's and oneDNN's GEMMs pick their blocking by the batch's size)."""
    probe = torch.empty(16, target.model.config.get_text_config().hidden_size, dtype=target.dtype, device=target.device)
    return target.decode == "fast" and packing_applies(probe)


def _padding_gather(layout: _Layout, device: torch.device) -> torch.Tensor:  # -> [R * W] int64
    """Packed index feeding each slot of the [R, W] padding (padding slots repeat packed token 0)."""
    gather = torch.zeros(layout.num_rows * layout.width, dtype=torch.long)
    gather[layout.padded] = torch.arange(layout.rows.shape[0])
    return gather.to(device)


class _RaggedCache:
    """Stands in for a transformers Cache during one packed forward: writes each new token into its block's slot.

    It is also the packed decoder's :class:`~vlmspec.targets.packed.KVSlots`: the pool, the
    block tables, and each packed token's row, slot, block and offset in the block.
    """

    def __init__(self, pool: KVPool, layout: _Layout) -> None:
        self._pool, self._layout = pool, layout
        device = pool.keys[0].device
        self.rows, self.slots = layout.rows.to(device), layout.slots.to(device)  # [B], [B]
        self.tables = layout.tables.to(device)  # [R, M]
        self.blocks, self.offsets = layout.blocks.to(device), layout.block_offsets.to(device)  # [B], [B]
        # Decode and verify steps (a few queries a row) suit the kernel's attention; a prefill chunk does not.
        self.native_attention = layout.width <= KERNEL_ATTENTION_MAX_QUERIES
        self.features = pool.features  # [N, bs, m * d] or None: the hooked layers' outputs go beside their KV

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states: [1, Hkv, B, hd] of the packed tokens; returns this layer's whole pools."""
        keys, values = self.buffers(layer_idx)
        keys[self.blocks, :, self.offsets] = key_states[0].transpose(0, 1).to(keys.dtype)  # [B, Hkv, hd]
        values[self.blocks, :, self.offsets] = value_states[0].transpose(0, 1).to(values.dtype)
        return keys, values

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # [N, Hkv, bs, hd] each
        """This layer's key and value pools (the packed decoder's :class:`KVSlots`)."""
        return self._pool.keys[layer], self._pool.values[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, hd] of the packed tokens into their slots; returns :meth:`buffers`."""
        return self.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], layer)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._layout.keys


# The layout of the packed forward in progress. Forwards of one process run one at a time here
# (the engines are single-threaded); the attention function reads the innermost one.
_current_layout: list[_Layout] = []


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, B, hd] packed, rotated queries
    key: torch.Tensor,  # [N, Hkv, bs, hd] this layer's key pool
    value: torch.Tensor,  # [N, Hkv, bs, hd]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # [1, B, H, hd]
    """Attention of packed ragged rows: each row's queries over its own slots, padded to [R, H, W, hd]."""
    attended = attend_rows(query[0].transpose(0, 1), key, value, _current_layout[-1], scaling)  # [B, H, hd]
    return attended[None], None


def attend_rows(
    query: torch.Tensor,  # [B, H, hd] packed, rotated queries
    key: torch.Tensor,  # [N, Hkv, bs, hd] one layer's key pool (new keys written)
    value: torch.Tensor,  # [N, Hkv, bs, hd]
    layout: _Layout,
    scaling: float | None,
) -> torch.Tensor:  # [B, H, hd]
    """Each row's queries over its own valid slots (gathered through its block table), padded for one SDPA call.

    Past ``KERNEL_ATTENTION_MAX_QUERIES`` queries a row (a prefill), one call a row with queries
    instead: the padding would hold every row to the longest piece and the longest row.
    """
    heads, dim = query.shape[1], query.shape[2]
    rows, width = layout.num_rows, layout.width
    if width > KERNEL_ATTENTION_MAX_QUERIES:
        return _attend_each_row(query, key, value, layout, scaling)
    key, value = _row_slots(key, layout), _row_slots(value, layout)  # [R, Hkv, S, hd]
    if rows == 1:
        # One row: its packed tokens are already its padded ones, and a lone query sees every slot.
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],  # [1, H, B, hd]
            key,
            value,
            attn_mask=None if width == 1 else layout.mask,
            scale=scaling,
            enable_gqa=heads != key.shape[1],
        )  # [1, H, B, hd]
        return out[0].transpose(0, 1)
    padded_index = layout.padded.to(query.device)
    padded = query.new_zeros(rows * width, heads, dim)
    padded[padded_index] = query
    padded = padded.view(rows, width, heads, dim).transpose(1, 2)  # [R, H, W, hd]
    out = F.scaled_dot_product_attention(
        padded, key, value, attn_mask=layout.mask, scale=scaling, enable_gqa=heads != key.shape[1]
    )  # [R, H, W, hd]
    return out.transpose(1, 2).reshape(rows * width, heads, dim)[padded_index]


def _attend_each_row(
    query: torch.Tensor,  # [B, H, hd] packed, rotated queries (row after row)
    key: torch.Tensor,  # [N, Hkv, bs, hd] one layer's key pool (new keys written)
    value: torch.Tensor,  # [N, Hkv, bs, hd]
    layout: _Layout,
    scaling: float | None,
) -> torch.Tensor:  # [B, H, hd]
    """One SDPA call for each row with queries: its piece over its slots up to the piece's last one."""
    size, device = key.shape[2], query.device
    out = torch.empty_like(query)
    rows, counts = torch.unique_consecutive(layout.rows, return_counts=True)
    first = 0
    for row, count in zip(rows.tolist(), counts.tolist(), strict=True):
        piece = slice(first, first + count)
        visible = layout.slots[piece] + 1  # [n] each query sees its row's slots before its own, and its own
        seen = int(visible[-1])  # a piece's slots increase: the last query sees the most
        blocks = layout.tables[row, : -(-seen // size)].to(device)  # [m] the row's blocks holding them
        row_keys, row_values = _slots(key, blocks, seen), _slots(value, blocks, seen)  # [Hkv, S, hd] each
        mask = (torch.arange(seen) < visible[:, None]).to(device)  # [n, S]
        out[piece] = F.scaled_dot_product_attention(
            query[piece].transpose(0, 1)[None],  # [1, H, n, hd]
            row_keys[None],
            row_values[None],
            attn_mask=mask,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )[0].transpose(0, 1)
        first += count
    return out


def _row_slots(pool: torch.Tensor, layout: _Layout) -> torch.Tensor:  # [N, Hkv, bs, hd] -> [R, Hkv, S, hd]
    """Each row's first S = layout.keys slots, read through its block table into one padded tensor."""
    size = pool.shape[2]
    blocks = layout.tables[: layout.num_rows, : -(-layout.keys // size)].to(pool.device)  # [R, m]
    return _slots(pool, blocks, layout.keys)


def _slots(pool: torch.Tensor, blocks: torch.Tensor, count: int) -> torch.Tensor:  # [..., m] -> [..., Hkv, S, hd]
    """The first ``count`` slots held by ``blocks`` (a row's blocks in order; rows of them), gathered from ``pool``."""
    gathered = pool[blocks]  # [..., m, Hkv, bs, hd]
    return gathered.transpose(-4, -3).flatten(-3, -2)[..., :count, :]


@contextmanager
def _ragged_attention(target: QwenVLTarget, layout: _Layout):
    """Route the language model's attention through :func:`ragged_attention` for one forward."""
    from transformers import AttentionInterface

    if RAGGED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
    config = target.model.config.get_text_config()
    saved = config._attn_implementation
    config._attn_implementation = RAGGED_ATTENTION
    _current_layout.append(layout)
    try:
        yield
    finally:
        _current_layout.pop()
        config._attn_implementation = saved
