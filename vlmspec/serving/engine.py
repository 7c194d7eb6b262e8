"""BatchEngine: continuous batching of speculative requests, built only from the step API.

The host-engine shape of nano-vllm (``add_request`` / ``step`` / ``abort``), with
vlmspec's own target forward as the "model runner": a :class:`~vlmspec.targets.ragged.RaggedBatch`
that verifies every request's anchor plus its scheduled drafts in one packed forward.
Each :meth:`BatchEngine.step`:

1. admits waiting requests while fewer than ``max_batch_size`` run and their prompts' KV
   blocks fit (:mod:`vlmspec.serving.memory`): their images go through the vision tower
   (:meth:`QwenVLTarget.row_prompt`), each new row starts from what the prefix cache holds of
   its prompt (:meth:`RaggedBatch.open`), and the prompts' next pieces, text and images
   alike, run in one packed forward that writes their KV straight into their rows
   (:meth:`RaggedBatch.extend`): chunks within the step's prefill budget while requests decode,
   within ``IDLE_PREFILL_TOKENS`` when none does (:mod:`vlmspec.serving.admission`); a prompt now complete draws
   its first token;
2. runs one step of the step API for all running requests: one drafter call
   (``decoder.propose``), one scheduler call on the [R, gamma] confidences
   (``decoder.plan``), one target forward (``RaggedBatch.verify``), ``decoder.verify``
   and the per-row rollback (``RaggedBatch.advance``), then ``decoder.commit``;
3. retires finished requests (EOS, stop string, length, abort, error): their rows leave
   the batch, their results wait in :meth:`BatchEngine.result`.

Each request keeps its own rope_delta, committed length and rollback (in its batch row),
its own 1-D drafter positions and drafter state, its own sampling params and seeded
generator: its output is the one it gets alone, greedy token for token and sampled with
the same seed (float rounding apart, see ``tests/serving``).

Failures stay with their request. Bad input to :meth:`add_request` raises before
anything is queued. A prefill that fails ends that request with ``finish_reason
"error"``. A decode step runs in two phases. The compute phase (drafting, scheduling, the
target forward, verification and the rows' KV lengths, set all at once) commits no
request's output (the ragged batch only ever writes past each row's committed length),
so when it raises the engine reruns it one request at a time, with the drafts already
made (or, if drafting itself failed, drafting each request alone): a request that fails
alone ends with ``"error"`` (``result(id).error`` says why), the others go on. Before
each rerun a sampled request's generator is put back where it was before the failed
attempt drew from it, so a seeded request still draws exactly what it draws alone. The
commit phase runs once per request and is never rerun: a failure in one request's commit
ends only that request. If every request succeeds alone, the failure was the batch's
(e.g. an SPS table too small for R requests): the step still completes, with a
RuntimeWarning that says why.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmspec.drafters.base import Proposer
from vlmspec.loading import load_proposer, load_target
from vlmspec.scheduling.base import Scheduler
from vlmspec.serving.admission import (
    DEFAULT_PREFILL_STEP_S,
    PrefillBudget,
    chunk_cost,
    chunk_sizes,
    largest_chunk,
)
from vlmspec.serving.memory import blocks_needed, kv_budget_bytes
from vlmspec.serving.requests import (
    GeneratorStates,
    StepOutput,
    check_positive,
    context_room,
    end_at_context,
    new_request,
    prepare_prompt,
    start_request,
)
from vlmspec.serving.steps import SpecDecoder, SpecRequest, VerifyPlan
from vlmspec.targets.adapter import QwenVLTarget, TargetStep
from vlmspec.targets.inputs import ImageLike, TargetInputs
from vlmspec.targets.prompts import RowPrompt
from vlmspec.targets.ragged import RaggedBatch
from vlmspec.types import DraftBlock, GenerationResult, PrefillOutput, RequestOptions, VerifyResult


@dataclass
class _Verified:
    """The compute phase of a step for some rows, done: what their commit needs (nothing is committed yet)."""

    rows: list[int]  # the ragged rows that took part
    plan: VerifyPlan  # their verification inputs: input_ids [R', 1 + w]
    result: VerifyResult  # num_accepted [R'], next_tokens [R']
    draft_s: float  # drafting and scheduling
    verify_s: float  # the target forward and verification


@dataclass
class _Entry:
    """A request inside the engine: its step-API request, its inputs until prefilled, its timing."""

    request_id: str
    request: SpecRequest
    inputs: TargetInputs | None
    added_s: float  # perf_counter() at add_request
    prompt_tokens: int  # the prompt's length in tokens (vision tokens included)
    prompt: RowPrompt | None = None  # while its row prefills: what it prefills (after a preemption, with its answer)
    prefilled: int = 0  # prompt tokens in its row so far (cached ones included)
    cached_tokens: int = 0  # prompt tokens its row found in the prefix cache
    prefill_s: float = 0.0  # its vision tower's seconds and those of every prefill forward it took part in
    whole: RowPrompt | None = None  # its prompt through the vision tower, kept to recompute it after a preemption
    joined: int = 0  # when it (last) took a row: the latest to join is preempted first

    @property
    def prefilling(self) -> bool:
        """It holds a row whose prompt is not all in the KV yet (it decodes once it is)."""
        return self.prompt is not None


class BatchEngine:
    """Many concurrent requests, speculative decoding in shared drafter and target forwards.

    >>> engine = BatchEngine.from_pretrained("reference", drafter="reference", max_batch_size=16)
    >>> ids = [engine.add_request(None, q, max_new_tokens=64) for q in questions]
    >>> while engine.has_unfinished:
    ...     for out in engine.step():
    ...         print(out.request_id, out.tokens)
    >>> engine.result(ids[0]).text

    ``generate_many`` does the loop for a list of requests. Without a proposer the engine
    batches the target alone (one token per request per step) through the same code.
    While requests run, one step prefills as much prompt as ``prefill_step_s`` seconds allow at
    the prefill speed the engine measures on its own forwards, or ``max_prefill_tokens`` tokens
    when that is given (both None: no bound, not even on an idle step), so prefills interleave
    with decode steps instead of stalling them (:mod:`vlmspec.serving.admission`).
    ``kv_cache_memory`` bounds the runner's KV pool: bytes, a fraction of RAM, or None (half
    the RAM available at start); a request is admitted when its prompt's KV blocks fit, a running
    one that runs short is preempted and recomputed later (see :mod:`vlmspec.serving.memory`), and
    one that could never fit is refused by ``add_request``. ``prefix_caching`` reuses the KV of
    earlier prompts' full blocks (:meth:`admit`). ``batch_invariant`` runs prompts through the
    decode step's kernels, at most 16 tokens of a row a forward, so that a prefix hit (whose
    cached blocks include the earlier answer, computed by decode steps) answers bit for bit as
    a cold prefill of the same conversation does. None (the default) turns it on where it was
    measured to cost nothing, bfloat16 on the packed AVX-512 kernels, and off in float32, where
    long prefills take up to twice as long and the answers agree without it
    (:func:`~vlmspec.targets.ragged.batch_invariance_default`, docs/design.md §21.4).
    """

    def __init__(
        self,
        target: QwenVLTarget,
        proposer: Proposer | None = None,
        scheduler: Scheduler | None = None,
        *,
        max_batch_size: int = 32,
        speculate_up_to: int | None = None,
        prefill_step_s: float | None = DEFAULT_PREFILL_STEP_S,
        max_prefill_tokens: int | None = None,
        kv_cache_memory: int | float | None = None,
        prefix_caching: bool = True,
        batch_invariant: bool | None = None,
    ) -> None:
        check_positive("max_batch_size", max_batch_size)
        for name, value in (("speculate_up_to", speculate_up_to), ("max_prefill_tokens", max_prefill_tokens)):
            if value is not None:
                check_positive(name, value)
        if prefill_step_s is not None and not (isinstance(prefill_step_s, (int, float)) and 0 < prefill_step_s < 1e6):
            raise ValueError(f"prefill_step_s must be a number of seconds > 0 (or None), got {prefill_step_s!r}")
        self.target = target
        self.decoder = SpecDecoder(proposer, scheduler, vocab_size=target.vocab_size)
        self.max_batch_size = max_batch_size
        # Draft only while at most this many requests run (None: always). Above it a step verifies the anchors
        # alone: on a compute-bound machine a big batch has no spare compute for drafts.
        self.speculate_up_to = speculate_up_to
        self.prefill_budget = PrefillBudget(step_s=prefill_step_s, tokens=max_prefill_tokens)
        self._batch = RaggedBatch(
            target,
            feature_layers=self.decoder.proposer.feature_layers,
            kv_cache_bytes=kv_budget_bytes(kv_cache_memory),
            prefix_caching=prefix_caching,
            batch_invariant=batch_invariant,
        )
        self._waiting: deque[_Entry] = deque()
        self._running: list[_Entry] = []  # _running[row] holds the request in ragged row `row`
        self._results: dict[str, GenerationResult] = {}
        self._ids = itertools.count()
        self._joins = itertools.count()
        self.preemptions = 0  # requests put back to wait (their KV freed, recomputed when they resume)

    @classmethod
    def from_pretrained(
        cls,
        target_dir: str | os.PathLike,
        drafter: str | os.PathLike | Proposer | None = None,
        *,
        scheduler: Scheduler | None = None,
        max_batch_size: int = 32,
        speculate_up_to: int | None = None,
        prefill_step_s: float | None = DEFAULT_PREFILL_STEP_S,
        max_prefill_tokens: int | None = None,
        kv_cache_memory: int | float | None = None,
        prefix_caching: bool = True,
        batch_invariant: bool | None = None,
        dtype: str | torch.dtype = "float32",
        attn_implementation: str = "sdpa",
        device: str | torch.device = "cpu",
        decode: str = "fast",
        drafter_dtype: str | torch.dtype | None = None,
    ) -> BatchEngine:
        """A target (directory, ``"reference"``, ``tiny:FAMILY``) and a drafter, as for ``SpecEngine.from_pretrained``.

        ``attn_implementation`` applies to prefills; decode steps use the ragged batch's own attention.
        ``drafter_dtype``: what a DSpark drafter drafts in (None: :func:`vlmspec.loading.drafting_dtype`).
        """
        target = load_target(
            target_dir, dtype=dtype, attn_implementation=attn_implementation, device=device, decode=decode
        )
        proposer = load_proposer(drafter, target, drafter_dtype=drafter_dtype)
        return cls(
            target,
            proposer,
            scheduler,
            max_batch_size=max_batch_size,
            speculate_up_to=speculate_up_to,
            prefill_step_s=prefill_step_s,
            max_prefill_tokens=max_prefill_tokens,
            kv_cache_memory=kv_cache_memory,
            prefix_caching=prefix_caching,
            batch_invariant=batch_invariant,
        )

    @property
    def proposer(self) -> Proposer:
        return self.decoder.proposer

    @property
    def scheduler(self) -> Scheduler:
        return self.decoder.scheduler

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        images: ImageLike | Sequence[ImageLike] | None = None,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        options: RequestOptions | None = None,
        request_id: str | None = None,
        inputs: TargetInputs | None = None,
        **overrides: Any,
    ) -> str:
        """Queue a request (arguments as for ``SpecEngine.generate``); returns its id.

        ``inputs`` instead of images and a prompt: the request's processed inputs, built by
        ``engine.target.build_inputs(...)`` beforehand (a server tokenises and decodes images off
        the thread that runs the engine, so a long prompt never stalls the running requests).

        ``options`` is a :class:`~vlmspec.types.RequestOptions`; request options given by
        name (``max_new_tokens=64, temperature=0.7, seed=1, stop=...``) replace its fields
        (:meth:`RequestOptions.build`). Everything is validated here, before the request is
        queued, so bad input raises a clear error and the running requests never notice.
        """
        options = RequestOptions.build(options, **overrides)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if self._known(request_id):
            raise ValueError(f"request id {request_id!r} is already in use; pick another or let the engine choose")
        request, inputs = new_request(
            self.target, self.decoder, images, prompt, messages=messages, options=options, inputs=inputs
        )
        self._check_fits(inputs.length, request.max_new_tokens)
        self._waiting.append(_Entry(request_id, request, inputs, time.perf_counter(), inputs.length))
        return request_id

    def request_options(self, request_id: str) -> RequestOptions:
        """The options an unfinished request runs with (validated, its stop strings a tuple)."""
        for entry in itertools.chain(self._waiting, self._running):
            if entry.request_id == request_id:
                return entry.request.options
        raise KeyError(f"request {request_id!r} is not unfinished here; options are kept while a request runs")

    def abort(self, request_id: str) -> bool:
        """End a waiting or running request now (``finish_reason "abort"``); False if it is not unfinished here."""
        for entry in itertools.chain(self._waiting, self._running):
            if entry.request_id == request_id:
                entry.request.finish("abort")
                self._retire()
                return True
        return False

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        """Requests in the batch (prefilled, decoding)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a free row of the batch."""
        return len(self._waiting)

    @property
    def num_results(self) -> int:
        """Finished requests whose result has not been popped (``result(id, pop=True)``)."""
        return len(self._results)

    def result(self, request_id: str, *, pop: bool = False) -> GenerationResult:
        """The result of a finished request (``pop=True`` also forgets it)."""
        if request_id not in self._results:
            state = "still unfinished" if self._known(request_id) else "unknown"
            raise KeyError(f"request {request_id!r} is {state}; results exist once a request has finished")
        return self._results.pop(request_id) if pop else self._results[request_id]

    def pop_result(self, request_id: str) -> GenerationResult | None:
        """The result of a finished request, forgotten here; None if there is none (unknown or unfinished)."""
        return self._results.pop(request_id, None)

    def generate_many(self, requests: Iterable[Mapping[str, Any]]) -> list[GenerationResult]:
        """Run every request (each a dict of :meth:`add_request` arguments) to the end; results in order.

        All requests are validated before any runs: a bad one raises and queues none.
        Other requests already in the engine run alongside and keep their results.
        """
        ids = []
        try:
            for arguments in requests:
                ids.append(self.add_request(**arguments))
        except Exception:
            for request_id in ids:
                self.abort(request_id)
                self._results.pop(request_id, None)
            raise
        while any(request_id not in self._results for request_id in ids):
            self.step()
        return [self._results.pop(request_id) for request_id in ids]

    # ---------------------------------------------------------------- steps
    def step(self) -> list[StepOutput]:
        """Admit waiting requests, run one speculative step for all running ones, retire the finished.

        The same as calling :meth:`admit`, then :meth:`decode` (a host that streams calls
        them itself, to hand out the first tokens as soon as their prefill is done).
        """
        return self.admit() + self.decode()

    def admit(self, limit: int | None = None) -> list[StepOutput]:
        """Prefill the next pieces of the prompts in the batch and of up to ``limit`` waiting requests; first tokens.

        While requests decode, one call prefills what ``prefill_step_s`` allows at the measured
        prefill speed, or ``max_prefill_tokens`` (chunked prefill): prompts are taken in order,
        a long one in chunks over several calls, so the decoding requests never wait for a whole
        long prompt. With nothing decoding there is nothing to stall: a call prefills up to
        ``IDLE_PREFILL_TOKENS``, which bounds one forward's activations
        (:class:`~vlmspec.serving.admission.PrefillBudget`). A waiting
        request joins (takes a row) when the batch has room, its KV fits the budget and
        some of this call's tokens are left for it; its prompt starts from whatever the prefix
        cache holds of it. All pieces of a call share one packed forward of the runner.
        Returns a :class:`StepOutput` for each request whose prompt is complete now (its
        first token) or whose prefill failed.
        """
        budget = self.prefill_budget.for_step(decoding=any(not e.prefilling for e in self._running))
        chunks = self._next_chunks(budget)
        left = None
        if budget is not None:
            left = budget - sum(chunk_cost(n, self._running[row].prefilled) for row, n in chunks.items())
        outputs = self._join_waiting(limit, left, chunks)
        outputs += self._prefill(chunks)
        self._retire()  # a request can end with its first token
        return outputs

    def _next_chunks(self, budget: int | None) -> dict[int, int]:
        """Tokens the next piece of each prefilling row takes (rows in order; ``budget`` None: all that is left)."""
        rows = [row for row, entry in enumerate(self._running) if entry.prefilling]
        entries = [self._running[row] for row in rows]
        sizes = chunk_sizes([e.prompt.length - e.prefilled for e in entries], budget, [e.prefilled for e in entries])
        return dict(zip(rows, sizes, strict=True))

    def _join_waiting(self, limit: int | None, left: float | None, chunks: dict[int, int]) -> list[StepOutput]:
        """Give waiting requests rows, in order, while they fit (rows, KV blocks, ``left`` of the prefill budget);
        their first chunks join ``chunks``. A request whose images fail ends here: its output is returned."""
        outputs, joined = [], 0
        while self._waiting and len(self._running) < self.max_batch_size and (limit is None or joined < limit):
            if (left is not None and left <= 0) or not self._fits_now(self._waiting[0]):
                break
            entry = self._waiting.popleft()
            if entry.whole is None:
                try:
                    entry.whole, entry.prefill_s = prepare_prompt(
                        self.target, self.decoder, entry.request, entry.inputs
                    )
                except Exception as err:  # noqa: BLE001 - only this request's images failed
                    entry.request.finish("error", err)
                    self._store(entry)
                    outputs.append(StepOutput(entry.request_id, [], "error", None))
                    continue
            # A preempted request recomputes its prompt and its answer but the last token (the anchor).
            entry.prompt = entry.whole.extended(entry.request.tokens[:-1]) if entry.request.tokens else entry.whole
            (start,) = self._batch.open([entry.prompt])
            entry.prefilled = start
            if not entry.request.tokens:  # a resume finds its own blocks: not counted as the prompt's hits
                entry.cached_tokens = start
            entry.joined = next(self._joins)
            self._running.append(entry)
            joined += 1
            n = entry.prompt.length - start
            chunk = n if left is None else largest_chunk(n, start, left)
            chunks[len(self._running) - 1] = chunk
            left = None if left is None else (left - chunk_cost(chunk, start) if chunk else 0)  # 0: the budget is spent
        return outputs

    def _fits_now(self, entry: _Entry) -> bool:
        """Whether the blocks of ``entry``'s prompt (and answer so far) fit beside what the decoding rows' next
        step may take (admission on the prompt, as vLLM: a request that later runs short is preempted)."""
        pool = self._batch.pool
        if pool.max_blocks is None:
            return True
        tokens = entry.prompt_tokens + max(0, len(entry.request.tokens) - 1)
        return pool.blocks_for(tokens) + self._blocks_for_next_step() <= pool.available()

    def _blocks_for_next_step(self) -> int:
        """New blocks the decoding rows may take in their next step (the anchor and the most drafts each)."""
        rows = [row for row, entry in enumerate(self._running) if not entry.prefilling]
        return self._batch.blocks_to_grow(rows, 1 + self.decoder.proposer.max_draft_tokens)

    def _preempt_for_next_step(self) -> None:
        """Put the latest requests to join back to wait until the decoding rows' next step fits the KV budget.

        A preempted request's blocks go back (its full ones stay in the prefix cache while room allows);
        it waits at the head of the queue and, when it fits again, recomputes its prompt and answer and
        goes on from its last token: its output is the one it gets alone (recompute, as vLLM does).
        """
        pool = self._batch.pool
        while pool.max_blocks is not None and len(self._running) > 1:
            if self._blocks_for_next_step() <= pool.available():
                return
            row = max(range(len(self._running)), key=lambda r: self._running[r].joined)
            entry = self._running[row]
            self._remove_row(row)
            entry.prompt, entry.prefilled = None, 0
            self._waiting.appendleft(entry)
            self.preemptions += 1

    @property
    def kv_cache(self) -> dict[str, int | None]:
        """The KV pool now: blocks in use, blocks it holds, its bound (None: none), block size, bytes per block,
        and the prefix cache's blocks (idle ones: kept for hits, no request holds them) and token counters."""
        pool = self._batch.pool
        prefix = self._batch.prefix_cache or {}
        return {
            "blocks_used": pool.num_used,
            "blocks_allocated": pool.num_blocks,
            "blocks_limit": pool.max_blocks,
            "block_size": pool.block_size,
            "bytes_per_block": pool.bytes_per_block(),
            "prefix_blocks": prefix.get("blocks", 0),
            "prefix_idle_blocks": prefix.get("idle_blocks", 0),
            "prefix_queried_tokens": prefix.get("queried_tokens", 0),
            "prefix_hit_tokens": prefix.get("hit_tokens", 0),
            "preemptions": self.preemptions,
        }

    def _check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse a request whose KV could never fit the budget, even alone (ValueError naming the limit)."""
        pool = self._batch.pool
        if pool.max_blocks is None:
            return
        needed = blocks_needed(prompt_tokens, max_new_tokens, self.target.max_context, pool.block_size)
        if needed > pool.max_blocks:
            mib = 2**20
            raise ValueError(
                f"the request needs up to {needed * pool.bytes_per_block() / mib:.1f} MiB of KV cache "
                f"({prompt_tokens} prompt tokens + max_new_tokens={max_new_tokens}) but the KV cache memory limit is "
                f"{pool.max_blocks * pool.bytes_per_block() / mib:.1f} MiB: shorten the prompt, lower max_new_tokens "
                "or raise the limit (--kv-cache-memory / kv_cache_memory)"
            )

    def admit_next(self) -> StepOutput | None:
        """Prefill the next waiting request if there is room in the batch; its first token (None: nothing admitted)."""
        admitted = self.admit(limit=1)
        return admitted[0] if admitted else None

    def _prefill(self, chunks: dict[int, int]) -> list[StepOutput]:
        """The next ``chunks[row]`` prompt tokens of each such row, in one runner forward; first tokens of the
        prompts now complete. If the shared forward fails, each row runs alone, so a failure stays with its request."""
        chunks = {row: n for row, n in chunks.items() if n > 0}
        if not chunks:
            return []
        outputs = []
        try:
            steps = self._prefill_rows(list(chunks), chunks)
        except Exception:  # noqa: BLE001 - the shared forward failed (no row grew): find whose piece it was
            steps = {}
            for row in chunks:
                try:
                    steps |= self._prefill_rows([row], chunks)
                except Exception as err:  # noqa: BLE001 - only this request's own prefill failed
                    entry = self._running[row]
                    entry.request.finish("error", err)
                    outputs.append(StepOutput(entry.request_id, [], "error", None))
        for row, step in steps.items():
            entry = self._running[row]
            if entry.prefilled == entry.prompt.length:
                resuming = bool(entry.request.tokens)  # its tokens went out before its preemption
                self._start(row, entry, step)
                if not resuming:
                    tokens = list(entry.request.tokens)
                    outputs.append(StepOutput(entry.request_id, tokens, entry.request.finish_reason, None))
        return outputs

    def _prefill_rows(self, rows: list[int], chunks: dict[int, int]) -> dict[int, TargetStep]:
        """One forward over the next piece of each row's prompt; each row's step (logits at its piece's end)."""
        entries = [self._running[row] for row in rows]
        pieces = [e.prompt.piece(e.prefilled, e.prefilled + chunks[row]) for row, e in zip(rows, entries, strict=True)]
        tick = time.perf_counter()
        steps = self._batch.extend(rows, pieces)
        seconds = time.perf_counter() - tick  # every request of the forward waited for all of it
        self.prefill_budget.record(sum(chunk_cost(p.length, e.prefilled) for p, e in zip(pieces, entries)), seconds)
        for entry, piece in zip(entries, pieces, strict=True):
            entry.prefilled += piece.length
            entry.prefill_s += seconds
        return dict(zip(rows, steps, strict=True))

    def _start(self, row: int, entry: _Entry, last: TargetStep) -> None:
        """The request's prompt is all in its row: draw its first token and open its drafter state (after a
        preemption: reopen the drafter's state, nothing is drawn).

        The prompt's features stay beside its KV: the drafter reads them when it first drafts for the
        request (:meth:`_context_features`), so a request that never drafts never copies them."""
        prompt, entry.prompt = entry.prompt, None
        if entry.request.tokens:
            after = prompt.end + prompt.rope_delta  # the anchor's 1-D position
            self.decoder.resume(
                entry.request, PrefillOutput(prompt.ids, prompt.positions_1d(), None, last.logits[-1], after)
            )
            return
        step = TargetStep(logits=last.logits, features=None, positions=prompt.positions_1d())
        start_request(self.target, self.decoder, entry.request, entry.inputs, step, entry.prefill_s, prompt.rope_delta)
        entry.inputs = None  # the processor outputs (pixels) are not needed any more

    def decode(self) -> list[StepOutput]:
        """One speculative step for every running request (none: nothing); if it fails, once for each request alone.

        The compute phase (:meth:`_verify`) may be rerun request by request; the commit
        phase (:meth:`_commit`) runs once for each request that got through it.
        """
        self._preempt_for_next_step()
        rows = [row for row, entry in enumerate(self._running) if not entry.prefilling]  # rows prefilling sit out
        if not rows:
            return []
        requests = [self._running[row].request for row in rows]
        undrafted = GeneratorStates(requests)
        tick = time.perf_counter()
        try:
            drafting = self.speculate_up_to is None or len(requests) <= self.speculate_up_to
            if drafting:
                drafts = self.decoder.propose(requests, self._context_features(rows))
            else:
                drafts = self.decoder.skip_drafting(requests)
        except Exception as batch_error:  # noqa: BLE001 - nothing was committed: find the request that fails
            outputs = self._isolate(rows, None, undrafted, batch_error)
        else:
            draft_s = time.perf_counter() - tick
            drafted = GeneratorStates(requests)
            try:
                verified = self._verify(rows, drafts, draft_s)
            except Exception as batch_error:  # noqa: BLE001 - nothing was committed: find the request that fails
                outputs = self._isolate(rows, drafts, drafted, batch_error)
            else:
                outputs = self._commit(verified)
        self._retire()
        return outputs

    def _context_features(self, rows: list[int]) -> Callable[[int, int], torch.Tensor]:
        """The step API's reader of drafter context: request i (of ``rows``)'s last n committed tokens' features.

        The runner keeps every token's hooked features beside its KV, so requests start and commit
        without them and the drafter reads only the spans it absorbs, when it drafts: a request
        that never drafts (under load the defaults draft for no one) never copies its features.
        Its pending spans end at its row's length: the anchor drawn last is not in the KV yet.
        """

        def read(i: int, n: int) -> torch.Tensor:
            end = int(self._batch.lengths[rows[i]])
            return self._batch.features_of(rows[i], end, end - n)

        return read

    def _isolate(
        self, rows: list[int], drafts: DraftBlock | None, generators: GeneratorStates, batch_error: Exception
    ) -> list[StepOutput]:
        """Rerun a failed compute phase request by request (with the drafts already made, if drafting succeeded).

        ``generators`` holds each request's generator state from before the failed attempt
        (before drafting when ``drafts`` is None): it is restored, so the rerun draws what
        the request would have drawn had the attempt never run.
        """
        outputs, failed = [], 0
        for i, row in enumerate(rows):  # i: the request's index in the step (its drafts, its generator state)
            entry = self._running[row]
            generators.restore(i)
            try:
                tick = time.perf_counter()
                if drafts is not None:
                    own = drafts.select([i])
                else:
                    own = self.decoder.propose([entry.request], self._context_features([row]))
                verified = self._verify([row], own, time.perf_counter() - tick)
            except Exception as err:  # noqa: BLE001
                entry.request.finish("error", err)
                outputs.append(StepOutput(entry.request_id, [], "error", None))
                failed += 1
                continue
            outputs += self._commit(verified)
        if not failed:  # not one request's fault: say so, or the engine would silently run one by one
            warnings.warn(
                f"a step of {len(rows)} requests failed, but every request succeeded alone, so the step ran "
                f"them one at a time: {batch_error!r}",
                RuntimeWarning,
                stacklevel=3,
            )
        return outputs

    def _verify(self, rows: list[int], drafts: DraftBlock, draft_s: float) -> _Verified:
        """The compute phase after drafting for the requests in ``rows`` (the other rows of the batch sit it out).

        Scheduling, one target forward, verification, and the rows' new KV lengths (set for
        all rows at once, or not at all). No request's output changes here, so it may be
        rerun; sampled requests draw from their generators (see :class:`~vlmspec.serving.requests.GeneratorStates`).
        drafts: the proposer's block for exactly these requests ([len(rows), gamma]), made in ``draft_s`` seconds.
        """
        requests = [self._running[row].request for row in rows]
        lengths = self._batch.lengths.tolist()  # [R] committed tokens per row
        tick = time.perf_counter()
        plan = self.decoder.plan(requests, drafts, [context_room(self.target, lengths[row]) for row in rows])
        tock = time.perf_counter()

        # Every row of the batch in order (batch 1, and most steps): the plan's tensors are the step's own, no
        # scatter or gather (a gather of the logits copies [R, 1 + w, V] float32 every step).
        everyone = rows == list(range(len(lengths)))
        index = None if everyone else torch.tensor(rows, dtype=torch.long)  # [R'] rows taking part
        tokens, num_tokens = plan.input_ids, plan.num_inputs  # [R', 1 + w], [R']
        if index is not None:
            tokens = torch.zeros(len(lengths), tokens.shape[1], dtype=torch.long)  # [R, 1 + w]
            num_tokens = torch.zeros(len(lengths), dtype=torch.long)  # [R]
            tokens[index], num_tokens[index] = plan.input_ids, plan.num_inputs
        step = self._batch.verify(tokens, num_tokens)
        # Both count positions on from the anchor, one by one: the anchors' must agree.
        target_anchors = step.positions[:, 0].tolist()
        if [target_anchors[row] for row in rows] != plan.positions[:, 0].tolist():
            raise RuntimeError(
                "internal invariant broken: the target's positions of the verified tokens differ from the "
                "drafter's 1-D positions (the step API's plan); please report this with the request"
            )
        logits = step.logits  # [R, 1 + w, V]; the inputs' features are beside their KV (_context_features)
        if index is not None:
            logits = logits[index.to(logits.device)]
        result = self.decoder.verify(requests, plan, logits)
        keep = result.num_accepted + 1  # [R'] the anchor and the accepted drafts stay in the KV cache
        if index is not None:
            keep = torch.zeros(len(lengths), dtype=torch.long).index_copy_(0, index, keep)
        self._batch.advance(keep)  # validates, then sets every row's length: all at once or not at all
        return _Verified(rows, plan, result, draft_s + tock - tick, time.perf_counter() - tock)

    def _commit(self, verified: _Verified) -> list[StepOutput]:
        """The commit phase: each request of the step commits its round, once (a failure ends only that request)."""
        entries = [self._running[row] for row in verified.rows]
        requests = [entry.request for entry in entries]
        accepted = self.decoder.commit(requests, verified.plan, verified.result)
        outputs = []
        for entry, row, record in zip(entries, verified.rows, accepted.records, strict=True):
            request = entry.request
            try:
                request.stats.draft_s += verified.draft_s
                request.stats.verify_s += verified.verify_s
                end_at_context(self.target, request, int(self._batch.lengths[row]))
            except Exception as err:  # noqa: BLE001 - its round is committed: never rerun, end only this request
                request.finish("error", err)
            outputs.append(StepOutput(entry.request_id, record.tokens, request.finish_reason, record))
        return outputs

    def _retire(self) -> None:
        """Finished requests leave: waiting ones from the queue, running ones from their batch rows."""
        for entry in [e for e in self._waiting if e.request.finished]:
            self._waiting.remove(entry)
            self._store(entry)
        for row in reversed(range(len(self._running))):  # highest first: the row moved into a hole is unfinished
            entry = self._running[row]
            if entry.request.finished:
                self._remove_row(row)
                self._store(entry)

    def _remove_row(self, row: int) -> None:
        """Free a request's row (its blocks); the last row moves into the hole, as in the ragged batch."""
        moved = self._batch.remove(row)
        if moved is not None:
            self._running[row] = self._running[moved]
        self._running.pop()

    def _store(self, entry: _Entry) -> None:
        request = entry.request
        request.stats.total_s = time.perf_counter() - entry.added_s
        text = self.target.tokenizer.decode(request.tokens, skip_special_tokens=True)
        self._results[entry.request_id] = GenerationResult(
            text,
            list(request.tokens),
            request.stats,
            request.finish_reason,
            request.error,
            entry.prompt_tokens,
            entry.cached_tokens,
        )

    def _known(self, request_id: str) -> bool:
        return request_id in self._results or any(
            e.request_id == request_id for e in itertools.chain(self._waiting, self._running)
        )
