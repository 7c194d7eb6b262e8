"""The step API: the calls a host engine makes each step to decode its running requests speculatively.

A host serving engine owns its request queue, its batching and its KV memory; vlmspec
owns drafting, scheduling and the acceptance rule. For the R requests a host runs in one
step (R >= 1, any mix of images, text and sampling settings)::

    drafts = decoder.propose(requests)                  # DraftBlock: tokens [R, gamma], confidences [R, gamma]
    plan = decoder.plan(requests, drafts, room)          # VerifyPlan: input_ids [R, 1 + w], num_inputs [R]
    logits, features = host_forward(plan)                # the host's forward: [R, 1 + w, V], [R, 1 + w, m * d]
    accepted = decoder.accept(requests, plan, logits, features)   # Acceptance: keep [R], one RoundRecord each
    host_rollback(accepted.keep)                         # request r keeps its first keep[r] inputs in its KV

Before its first step, the host runs a request's prompt through the target (prefill) and
calls ``decoder.start(request, PrefillOutput(...))``, which draws the first token.

What crosses each boundary:

* ``propose``: in, the requests; out, a :class:`~vlmspec.types.DraftBlock` with up to
  gamma drafts per request (one drafter forward for all of them).
* ``plan``: in, the drafts and what the host can hold (``room[r]``: most drafts request r
  may verify, e.g. its KV space left minus one for the anchor); out, a
  :class:`VerifyPlan`: request r must feed ``input_ids[r, :num_inputs[r]]`` (its anchor,
  then its scheduled drafts) at the 1-D ``positions[r, :num_inputs[r]]``. The scheduler
  (any :class:`~vlmspec.scheduling.Scheduler`, Algorithm 1 included) chose the lengths from
  the [R, gamma] confidences; the forward holds ``plan.num_tokens`` tokens in all.
* the host's forward: ``logits[r, i]`` is the target's prediction after input i of
  request r (entries beyond ``num_inputs[r]`` are ignored); ``features[r, i]`` its
  hooked decoder-layer outputs (layers ``decoder.proposer.feature_layers``,
  concatenated), or None when the proposer needs none. For Qwen-VL targets every input
  sits at M-RoPE position ``positions[r, i]`` in all three components.
* ``accept``: verification (greedy matching or lossless rejection sampling, with request
  r's own params and generator) and commit: each request appends its accepted drafts and
  the recovered or bonus token, checks EOS / stop strings / length, and keeps what the
  proposer absorbs next step (``accept`` is ``verify`` then ``commit``, which a host that
  retries failed steps calls apart). ``keep[r] = accepted + 1`` is how many of request r's inputs
  stay in its KV cache; the rest must be rolled back (vLLM: decrement the computed tokens).

Requests that finished (``request.finished``) must leave the batch before the next
``propose``. A request whose own commit raises is finished with reason ``"error"``
(``request.error`` holds the exception); the other requests of the step are unaffected.
``propose``, ``plan`` and ``verify`` commit nothing, so when they raise a host may retry
the step, e.g. request by request to find the one that fails; sampled requests may have
drawn from their generators by then, so such a host restores their states before the retry
(:class:`~vlmspec.serving.BatchEngine` does). ``commit`` runs once per step: it is never retried.

``vlmspec.SpecEngine`` (R = 1) and :class:`vlmspec.serving.BatchEngine` are hosts built
only from these calls. What this module does not know: the target, its cache, M-RoPE.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vlmspec.drafters.base import NoDraft, Proposer
from vlmspec.sampling import sample, target_probs
from vlmspec.scheduling.base import Scheduler, VerifyAll
from vlmspec.types import (
    ContextUpdate,
    DraftBlock,
    PrefillOutput,
    RequestOptions,
    RoundRecord,
    SamplingParams,
    SpecStats,
    VerifyResult,
)
from vlmspec.verify import verify_rows

# (i, n) -> [n, m * d]: the hooked features of request i's last n committed tokens (see SpecDecoder.propose)
ContextFeatures = Callable[[int, int], torch.Tensor]


@dataclass
class PendingContext:
    """What a request's proposer has not absorbed yet: committed spans that have target features, then the anchor.

    The prompt's span stays as the prefill gave it (tensors); the spans of later rounds are kept as
    Python ints and, when the host hands features to ``commit``, their feature rows. So a request that
    sits out drafting for many steps (every request under load, with the serving defaults) holds the same
    few tensors throughout, not two more each step: long-lived tensors of a few bytes, made every step,
    split the allocator's free chunks so that each step's logits ([R, V] float32) landed on fresh pages
    (768 page faults, about 0.5 ms of a 17 ms 16-row step on a 2-core Xeon: docs/design.md §21.5).
    """

    anchor: int  # the last committed token (the target has not run it yet): the next round's first input
    anchor_position: int  # its 1-D text-stream position
    prompt_ids: torch.Tensor | None = None  # [L] int64 the prefill's tokens, until the proposer absorbs them
    prompt_positions: torch.Tensor | None = None  # [L] int64 their 1-D positions
    prompt_features: torch.Tensor | None = None  # [L, m * d] their hooked features, or None
    token_ids: list[int] = field(default_factory=list)  # [n] later rounds' committed inputs, in order
    positions: list[int] = field(default_factory=list)  # [n] their 1-D positions
    features: list[torch.Tensor] | None = field(default_factory=list)  # their [k, m * d] rows; None: a round had none

    @classmethod
    def of_prefill(cls, prefill: PrefillOutput, anchor: int) -> PendingContext:
        """The prompt's span, anchored at ``anchor`` (the first token drawn, or a resumed request's last)."""
        return cls(
            anchor=anchor,
            anchor_position=int(prefill.next_position),
            prompt_ids=prefill.token_ids.reshape(-1).cpu(),
            prompt_positions=prefill.positions.reshape(-1).cpu(),
            prompt_features=prefill.features,
        )

    def extend(
        self,
        token_ids: list[int],  # [k] a round's committed inputs: the anchor and the accepted drafts
        positions: list[int],  # [k]
        features: torch.Tensor | None,  # [k, m * d] or None
        anchor: int,
        anchor_position: int,
    ) -> None:
        """Append a round's span and move the anchor past it."""
        self.token_ids += token_ids
        self.positions += positions
        if features is None:
            self.features = None
        elif self.features is not None:
            self.features.append(features)
        self.anchor, self.anchor_position = anchor, anchor_position

    def update(self) -> ContextUpdate:
        """Every pending span as one :class:`ContextUpdate` (what the proposer absorbs this round)."""
        ids = torch.tensor(self.token_ids, dtype=torch.long)  # [n]
        positions = torch.tensor(self.positions, dtype=torch.long)  # [n]
        rows = self.features
        if self.prompt_ids is not None:
            ids, positions = torch.cat((self.prompt_ids, ids)), torch.cat((self.prompt_positions, positions))
            rows = None if rows is None or self.prompt_features is None else [self.prompt_features, *rows]
        features = None
        if rows:
            features = rows[0] if len(rows) == 1 else torch.cat([row.to(rows[0].device) for row in rows])
        return ContextUpdate(ids, positions, features, self.anchor, self.anchor_position)

    def absorbed(self) -> PendingContext:
        """What is pending once the proposer has absorbed every span: the anchor alone."""
        return PendingContext(self.anchor, self.anchor_position)


@dataclass
class SpecRequest:
    """One request as the step API sees it: how it samples and stops, the drafter's state, its output.

    Create with :meth:`SpecDecoder.new_request`. The host keeps its own per-request state
    (KV cache, positions) beside it.
    """

    options: RequestOptions  # how it samples and stops (validated, stop strings normalised)
    generator: torch.Generator  # seeded per request; every draw of this request comes from it
    eos_token_ids: frozenset[int]
    tokenizer: Any = None  # decodes the output's tail for stop strings (needed only with stop strings)
    draft_state: Any = None  # the proposer's own per-request state (proposer.new_state())
    pending: PendingContext | None = None  # what the proposer absorbs when it next drafts (None: not started)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "stop", "length", "context", "abort" or "error"
    error: BaseException | None = None  # why the request failed (finish_reason "error")
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def params(self) -> SamplingParams:
        """The distribution the target samples from (what the proposer and verification take)."""
        return self.options.sampling

    @property
    def max_new_tokens(self) -> int:
        return self.options.max_new_tokens

    @property
    def stop(self) -> tuple[str, ...]:
        return self.options.stop

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    def commit(self, new_tokens: Sequence[int]) -> list[int]:
        """Append tokens one by one, stopping exactly where the target alone would stop."""
        kept = []
        for token in new_tokens:
            self.tokens.append(token)
            kept.append(token)
            self.finish_reason = self._finish_reason(token)
            if self.finish_reason:
                break
        self.stats.new_tokens = len(self.tokens)
        return kept

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        """End the request now (the host's reasons: ``"context"`` at its context limit, ``"abort"``, ``"error"``)."""
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error

    def _finish_reason(self, token: int) -> str | None:
        if token in self.eos_token_ids:
            return "eos"
        if self.stop and self._ends_with_stop():
            return "stop"
        if self.remaining <= 0:
            return "length"
        return None

    def _ends_with_stop(self) -> bool:
        # A stop string of c characters spans at most 4c + 2 byte-level tokens; earlier
        # occurrences were caught when they completed, so only the tail needs decoding.
        window = 4 * max(len(s) for s in self.stop) + 2
        tail = self.tokenizer.decode(self.tokens[-window:], skip_special_tokens=True)
        return any(s in tail for s in self.stop)


@dataclass
class VerifyPlan:
    """What the host's verification forward must run this step (from :meth:`SpecDecoder.plan`)."""

    drafts: DraftBlock  # everything the proposer drafted: tokens [R, gamma], confidences [R, gamma]
    block: DraftBlock  # the drafts to verify, cut to the scheduled lengths: tokens [R, w], num_tokens [R]
    input_ids: torch.Tensor  # [R, 1 + w] int64 (CPU): the anchor, then the scheduled drafts; padding after num_inputs
    num_inputs: torch.Tensor  # [R] int64 (CPU): 1 + scheduled drafts, the tokens request r feeds
    positions: torch.Tensor  # [R, 1 + w] int64 (CPU): 1-D text-stream positions of the inputs

    @property
    def num_tokens(self) -> int:
        """Tokens in the verification forward, ``B = sum_r (1 + l_r)``."""
        return int(self.num_inputs.sum())


@dataclass
class Acceptance:
    """What verification decided and each request committed (from :meth:`SpecDecoder.accept`)."""

    num_accepted: torch.Tensor  # [R] int64 (CPU) leading drafts that survived
    next_tokens: torch.Tensor  # [R] int64 (CPU) the recovered or bonus token
    keep: torch.Tensor  # [R] int64 (CPU) inputs request r keeps in its KV cache (accepted + 1); roll back the rest
    records: list[RoundRecord]  # per request: drafted, verified, accepted, confidences, committed tokens


class SpecDecoder:
    """The step API over one proposer and one scheduler (see the module docstring for a step).

    The decoder holds no request: every call takes the requests it acts on, so a host
    may batch them as it likes. ``vocab_size`` (the target's) lets the decoder refuse a
    drafter built for another vocabulary.
    """

    def __init__(
        self, proposer: Proposer | None = None, scheduler: Scheduler | None = None, *, vocab_size: int | None = None
    ) -> None:
        self.proposer = proposer if proposer is not None else NoDraft()
        self.scheduler = scheduler if scheduler is not None else VerifyAll()
        if not isinstance(self.proposer, Proposer):
            raise TypeError(
                f"{type(self.proposer).__name__} does not implement the Proposer protocol (vlmspec.drafters): "
                "it needs max_draft_tokens, feature_layers, vocab_size, position_rule, new_state() and "
                "a batched propose(states, updates, params, generators)"
            )
        if list(inspect.signature(self.proposer.propose).parameters)[:2] == ["state", "update"]:
            raise TypeError(
                f"{type(self.proposer).__name__}.propose(state, update, params, generator) drafts for one request, "
                "but the Proposer protocol drafts for several at once: subclass vlmspec.drafters.PerRequestProposer "
                "and rename the method to propose_one"
            )
        if not isinstance(self.scheduler, Scheduler):
            raise TypeError(
                f"{type(self.scheduler).__name__} does not implement the Scheduler protocol (vlmspec.scheduling)"
            )
        drafter_vocab = self.proposer.vocab_size
        if vocab_size is not None and drafter_vocab is not None and drafter_vocab != vocab_size:
            raise ValueError(
                f"the drafter's vocabulary ({drafter_vocab} ids) does not match the target's ({vocab_size}); "
                "use a drafter built for this target (DSparkDrafter.from_target(target, config))"
            )

    # ------------------------------------------------------------ requests
    @staticmethod
    def new_request(
        options: RequestOptions | None = None,
        *,
        eos_token_ids: Sequence[int],
        tokenizer: Any = None,
        device: str | torch.device = "cpu",
        **overrides: Any,
    ) -> SpecRequest:
        """A request with ``options`` (a :class:`~vlmspec.types.RequestOptions`), or with these keywords replaced.

        ``overrides`` are request options by name (``max_new_tokens=64, temperature=0.7``,
        see :meth:`RequestOptions.build`). The seed seeds the request's own generator (on
        ``device``), so its draws are its own.
        """
        options = RequestOptions.build(options, **overrides)
        if options.stop and tokenizer is None:
            raise ValueError("stop strings need the tokenizer that decodes the output: pass tokenizer=...")
        generator = torch.Generator(device=device).manual_seed(options.seed)
        return SpecRequest(options, generator, frozenset(eos_token_ids), tokenizer)

    def start(self, request: SpecRequest, prefill: PrefillOutput) -> list[int]:
        """After the host's prefill: draw the first token, commit it, and open the drafter's state."""
        if request.pending is not None or request.tokens:
            raise ValueError("start() takes a new request (this one has already started)")
        logits = prefill.logits.reshape(1, -1)  # [1, V]
        first = int(sample(target_probs(logits, request.params), [request.generator])[0])
        committed = request.commit([first])
        # A request that does not speculate never reaches the proposer: no drafter state, no spans kept for it.
        request.draft_state = self.proposer.new_state() if request.options.speculative else None
        request.pending = PendingContext.of_prefill(prefill, first)
        return committed

    def resume(self, request: SpecRequest, prefill: PrefillOutput) -> None:
        """After the host recomputed a preempted request's KV: reopen the drafter's state; nothing is drawn.

        ``prefill`` covers the prompt and every committed token but the last (its ids,
        positions and features); the last committed token is the anchor again, at
        ``prefill.next_position``. The drafter starts as on a new prompt that long.
        """
        if not request.tokens or request.finished:
            raise ValueError("resume() takes a started, unfinished request")
        request.draft_state = self.proposer.new_state() if request.options.speculative else None
        request.pending = PendingContext.of_prefill(prefill, request.tokens[-1])

    # ---------------------------------------------------------------- steps
    def propose(self, requests: Sequence[SpecRequest], context_features: ContextFeatures | None = None) -> DraftBlock:
        """Drafts for every request in one proposer call: tokens [R, gamma], num_tokens [R], confidences [R, gamma].

        Requests with ``speculative=False`` are left out of the call and get no drafts.
        ``context_features``: for a host that started and committed its requests without
        features (``features=None``) because it keeps them itself, a reader of request
        ``requests[i]``'s last ``n`` committed tokens' features ([n, m * d]): only the spans
        the proposer absorbs now are read, so a request that never drafts never copies any.
        """
        _check_running(requests)
        drafting = [row for row, request in enumerate(requests) if request.options.speculative]
        if not drafting:
            return self.skip_drafting(requests)
        if len(drafting) < len(requests):
            read = None if context_features is None else lambda i, n: context_features(drafting[i], n)
            return self._propose([requests[row] for row in drafting], read).scattered(drafting, len(requests))
        return self._propose(requests, context_features)

    def _propose(self, requests: Sequence[SpecRequest], context_features: ContextFeatures | None) -> DraftBlock:
        updates = [r.pending.update() for r in requests]  # every request speculates; spans of skipped steps included
        if context_features is not None and self.proposer.feature_layers:
            updates = [
                u if u.features is not None else replace(u, features=context_features(i, u.token_ids.numel()))
                for i, u in enumerate(updates)
            ]
        drafts = self.proposer.propose(
            [r.draft_state for r in requests],
            updates,
            [r.params for r in requests],
            [r.generator for r in requests],
        )
        for request in requests:
            request.pending = request.pending.absorbed()
        if drafts.tokens.dim() != 2 or drafts.tokens.shape[0] != len(requests):
            raise ValueError(
                f"{type(self.proposer).__name__}.propose returned tokens of shape {tuple(drafts.tokens.shape)} "
                f"for {len(requests)} requests; a proposer returns one row per request"
            )
        return drafts

    def skip_drafting(self, requests: Sequence[SpecRequest]) -> DraftBlock:
        """No drafts this step, without calling the proposer: tokens [R, 0], num_tokens [R] zeros.

        A host calls it instead of :meth:`propose` when drafting would not pay (a large
        batch on a compute-bound machine). The step then verifies each request's anchor
        alone, and the span it commits is kept for the proposer, which absorbs every
        skipped step's span with the next one when drafting resumes.
        """
        _check_running(requests)
        none = torch.zeros(len(requests), dtype=torch.long)
        return DraftBlock(none[:, None][:, :0], none, sources=("none",) * len(requests))

    def plan(
        self,
        requests: Sequence[SpecRequest],
        drafts: DraftBlock,
        room: torch.Tensor | Sequence[int] | None = None,  # [R] most drafts each request may verify
    ) -> VerifyPlan:
        """Schedule how many drafts each request verifies and lay out the verification inputs.

        The scheduler sees every drafted confidence and, as drafted counts, what each
        request can take: its drafts, cut to ``room[r]`` and to its ``max_new_tokens``
        (a request one token short of its limit verifies only its anchor). Both bounds
        are known before any draft is sampled, so the cut keeps scheduling causal.
        """
        _check_running(requests)
        # Python ints: a few per request, where tensor ops would each cost a dispatch on every round.
        limit = [max(r.remaining - 1, 0) for r in requests]  # [R]
        if room is not None:
            room = room.long().tolist() if isinstance(room, torch.Tensor) else [int(fits) for fits in room]
            if not isinstance(room, list) or len(room) != len(limit):
                raise ValueError(f"room must hold one count per request ([{len(requests)}]), got {room}")
            limit = [min(most, max(fits, 0)) for most, fits in zip(limit, room)]
        schedulable = [min(n, most) for n, most in zip(drafts.num_tokens.tolist(), limit)]  # [R]
        if drafts.gamma == 0:  # nothing drafted (the target alone): nothing to schedule
            lengths = schedulable
        else:
            device = drafts.num_tokens.device
            scheduled = self.scheduler.schedule(drafts.confidences, torch.tensor(schedulable, device=device))
            lengths = torch.as_tensor(scheduled).tolist()
        if (
            not isinstance(lengths, list)
            or len(lengths) != len(schedulable)
            or any(not isinstance(n, int) or not 0 <= n <= most for n, most in zip(lengths, schedulable))
        ):
            raise ValueError(
                f"{type(self.scheduler).__name__}.schedule returned {lengths} for drafted counts "
                f"{schedulable}; a scheduler returns [R] lengths with 0 <= length <= drafted"
            )
        block = drafts.truncated(torch.tensor(lengths, dtype=torch.long, device=drafts.num_tokens.device))
        width = 1 + block.gamma
        drafted_ids = block.tokens.tolist()  # [R][w]
        return VerifyPlan(
            drafts=drafts,
            block=block,
            input_ids=torch.tensor([[r.pending.anchor, *ids] for r, ids in zip(requests, drafted_ids)]).view(-1, width),
            num_inputs=torch.tensor([1 + n for n in lengths], dtype=torch.long),
            positions=torch.tensor([[r.pending.anchor_position + i for i in range(width)] for r in requests]).view(
                -1, width
            ),
        )

    def accept(
        self,
        requests: Sequence[SpecRequest],
        plan: VerifyPlan,
        logits: torch.Tensor,  # [R, 1 + w, V] the host's target logits for the plan's inputs
        features: torch.Tensor | None = None,  # [R, 1 + w, m * d] hooked features of those inputs, or None
    ) -> Acceptance:
        """Verify every request's drafts against the target's logits and commit the outcome.

        The same as :meth:`verify`, then :meth:`commit`: a host that retries a failed step
        calls them apart, so that nothing it retries has committed.
        """
        return self.commit(requests, plan, self.verify(requests, plan, logits, features), features)

    def verify(
        self,
        requests: Sequence[SpecRequest],
        plan: VerifyPlan,
        logits: torch.Tensor,  # [R, 1 + w, V] the host's target logits for the plan's inputs
        features: torch.Tensor | None = None,  # [R, 1 + w, m * d] hooked features of those inputs (shape-checked)
    ) -> VerifyResult:
        """Verification alone (greedy matching or lossless rejection sampling, each request with its own params).

        It commits nothing, but sampled requests draw from their generators: a host that
        retries after a failure restores their states first (``generator.get_state()``)
        so that a seeded request draws what it would have drawn alone.
        """
        width = plan.input_ids.shape[1]
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (len(requests), width):
            raise ValueError(
                f"logits must be [R, 1 + w, V] = [{len(requests)}, {width}, V] (one entry per planned input), "
                f"got {tuple(logits.shape)}"
            )
        if features is not None and tuple(features.shape[:2]) != (len(requests), width):
            raise ValueError(
                f"features must be [R, 1 + w, m * d] = [{len(requests)}, {width}, ...], got {tuple(features.shape)}"
            )
        block = _on(plan.block, logits.device)
        result = verify_rows(block, logits, [r.params for r in requests], [r.generator for r in requests])
        return VerifyResult(num_accepted=result.num_accepted.cpu(), next_tokens=result.next_tokens.cpu())

    def commit(
        self,
        requests: Sequence[SpecRequest],
        plan: VerifyPlan,
        verified: VerifyResult,  # [R] accepted counts and next tokens, from :meth:`verify`
        features: torch.Tensor | None = None,  # [R, 1 + w, m * d] hooked features of the plan's inputs, or None
    ) -> Acceptance:
        """Commit each request's round: its accepted drafts, then the recovered or bonus token.

        Each request appends them, checks EOS / stop strings / length, and keeps what the
        proposer absorbs next step. Call it once per :meth:`verify`: a commit is not undone.
        A failure in one request's commit ends only that request (finish_reason "error").
        """
        num_accepted, next_tokens = verified.num_accepted.cpu(), verified.next_tokens.cpu()
        rounds = _PlanRows(plan)
        records = [
            self._commit(request, rounds, row, accepted, next_token, features)
            for row, (request, accepted, next_token) in enumerate(
                zip(requests, num_accepted.tolist(), next_tokens.tolist(), strict=True)
            )
        ]
        return Acceptance(num_accepted, next_tokens, keep=num_accepted + 1, records=records)

    def _commit(
        self,
        request: SpecRequest,
        plan: _PlanRows,
        row: int,
        accepted: int,
        next_token: int,
        features: torch.Tensor | None,
    ) -> RoundRecord:
        """Commit one request's round; a failure here ends only this request (finish_reason "error")."""
        drafted = verified = 0
        source, confidences, committed = None, None, []
        try:
            drafted, verified = plan.drafted[row], plan.verified[row]
            source = None if plan.sources is None else plan.sources[row]
            request.stats.record_round(drafted=drafted, verified=verified, accepted=accepted)
            if source is not None:
                request.stats.rounds_by_source[source] = request.stats.rounds_by_source.get(source, 0) + 1
            inputs, positions = plan.input_ids[row], plan.positions[row]
            committed = request.commit(inputs[1 : accepted + 1] + [next_token])
            kept = slice(0, accepted + 1)  # the anchor and the accepted drafts now have target features
            anchor, anchor_position = committed[-1], positions[accepted] + 1
            if request.options.speculative:  # kept for the proposer (with the spans of steps it sat out)
                span_features = None if features is None else features[row, kept]
                request.pending.extend(inputs[kept], positions[kept], span_features, anchor, anchor_position)
            else:  # the proposer never sees this request: only the anchor matters
                request.pending = PendingContext(anchor, anchor_position)
            confidences = _row_confidences(plan.confidences, row)
        except Exception as err:  # noqa: BLE001 - isolated to this request, reported on it
            request.finish("error", err)
        return RoundRecord(drafted, verified, accepted, confidences, committed, source)


class _PlanRows:
    """A plan's per-request numbers as Python ints, read once for the whole commit (not tensor by tensor)."""

    def __init__(self, plan: VerifyPlan) -> None:
        self.drafted: list[int] = plan.drafts.num_tokens.tolist()  # [R]
        self.verified: list[int] = plan.block.num_tokens.tolist()  # [R]
        self.input_ids: list[list[int]] = plan.input_ids.tolist()  # [R][1 + w]
        self.positions: list[list[int]] = plan.positions.tolist()  # [R][1 + w]
        self.sources = plan.drafts.sources
        self.confidences = plan.drafts.confidences  # [R, gamma] or None


def _check_running(requests: Sequence[SpecRequest]) -> None:
    if not requests:
        raise ValueError("a step needs at least one request")
    for request in requests:
        if request.pending is None:
            raise ValueError("a request takes part in steps only after start(request, prefill)")
        if request.finished:
            raise ValueError(f"a finished request ({request.finish_reason}) must leave the batch before the next step")


def _on(block: DraftBlock, device: torch.device) -> DraftBlock:
    """The block's tensors on ``device`` (a proposer may draft on the CPU for a GPU target)."""
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return DraftBlock(move(block.tokens), move(block.num_tokens), move(block.draft_probs), move(block.confidences))


def _row_confidences(confidences: torch.Tensor | None, row: int) -> torch.Tensor | None:
    """Row ``row`` of ``confidences`` [R, gamma] as a float32 CPU copy [gamma] (the proposer may reuse its buffer)."""
    return None if confidences is None else confidences[row].detach().to("cpu", torch.float32, copy=True)
