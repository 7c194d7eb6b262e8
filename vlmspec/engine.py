"""SpecEngine: speculative decoding of one request at a time, the one-request face of the host.

There is one host of the round, :class:`~vlmspec.serving.engine.BatchEngine`: it
prefills a request, then runs the step API (propose -> plan -> one target forward ->
accept and roll back) over the rows of the runner
(:class:`~vlmspec.targets.ragged.RaggedBatch`). A SpecEngine is that host with one row:

1. the proposer absorbs the span committed last round (with its target features) and
   drafts up to gamma tokens after the anchor (the last committed token);
2. the scheduler decides how many of them to send to the target;
3. the target runs [anchor, drafts...] in one forward; verification keeps the accepted
   prefix and draws the recovered or bonus token;
4. the runner keeps what was accepted (rollback by length), and the tokens are committed.

Each round is reported as a :class:`~vlmspec.types.RoundRecord` (drafted, verified,
accepted, the confidences the scheduler saw, the committed tokens):
``engine.stream(...).records()`` yields them as they happen.

What it does not know: Hugging Face, M-RoPE, processors (that is ``vlmspec.targets``);
how drafts are made (``vlmspec.drafters``); acceptance rules (``vlmspec.verify``); how a
round runs (``vlmspec.serving``). With ``speculative=False`` (a request option) the same host
drafts nothing for the request: every round verifies the anchor alone, so the target-only
baseline runs through exactly the same code, on the same KV rows.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from vlmspec.drafters.base import Proposer
from vlmspec.loading import load_proposer, load_target
from vlmspec.scheduling.base import Scheduler
from vlmspec.serving.engine import BatchEngine, StepOutput
from vlmspec.serving.steps import SpecDecoder
from vlmspec.serving.text import TextDeltas
from vlmspec.targets.adapter import QwenVLTarget
from vlmspec.targets.inputs import ImageLike
from vlmspec.types import GenerationResult, RequestOptions, RoundRecord


class SpecEngine:
    """Speculative decoding over a Qwen-VL target with any proposer and scheduler.

    >>> engine = SpecEngine.from_pretrained("path/to/Qwen2.5-VL-3B-Instruct", drafter="prompt-lookup")
    >>> result = engine.generate("photo.jpg", "What is in this picture?", max_new_tokens=128)
    >>> result.text, result.stats.tau
    """

    def __init__(
        self,
        target: QwenVLTarget,
        proposer: Proposer | None = None,
        scheduler: Scheduler | None = None,
        *,
        prefix_caching: bool = True,
        batch_invariant: bool | None = None,
    ):
        """``prefix_caching``: a prompt that starts as an earlier one did (the next turn of a chat about the same
        image) reuses that prompt's KV and drafter context instead of computing them again. ``batch_invariant``:
        prompts run through the decode step's kernels, so such a turn answers bit for bit as a fresh engine
        would (None: where that costs nothing measured, see :class:`~vlmspec.serving.BatchEngine`)."""
        self.target = target
        # One host, so one owner of the target's KV; speculative=False is a request option it honours.
        self._host = BatchEngine(
            target,
            proposer,
            scheduler,
            max_batch_size=1,
            prefix_caching=prefix_caching,
            batch_invariant=batch_invariant,
        )
        self._outputs = _Outputs(self._host)

    @property
    def decoder(self) -> SpecDecoder:
        return self._host.decoder

    @property
    def proposer(self) -> Proposer:
        return self._host.proposer

    @property
    def scheduler(self) -> Scheduler:
        return self._host.scheduler

    @classmethod
    def from_pretrained(
        cls,
        target_dir: str | os.PathLike,
        drafter: str | os.PathLike | Proposer | None = None,
        *,
        scheduler: Scheduler | None = None,
        dtype: str | torch.dtype = "float32",
        attn_implementation: str = "sdpa",
        device: str | torch.device = "cpu",
        decode: str = "fast",
        prefix_caching: bool = True,
        batch_invariant: bool | None = None,
        drafter_dtype: str | torch.dtype | None = None,
    ) -> SpecEngine:
        """Load a target from a local directory (or ``tiny:FAMILY``) and attach a drafter.

        ``target_dir`` may also be ``"reference"``: the bundled real-weights reference
        target (:mod:`vlmspec.reference`). ``drafter`` is None (target alone),
        ``"prompt-lookup"``, ``"reference"`` / ``"reference-dflash"`` (the drafters trained
        for the reference target), the directory of a saved DSpark drafter, or any object
        implementing the Proposer protocol (:mod:`vlmspec.loading`). ``drafter_dtype``: what a DSpark drafter
        drafts in (None: :func:`vlmspec.loading.drafting_dtype`'s measured default).
        """
        target = load_target(
            target_dir, dtype=dtype, attn_implementation=attn_implementation, device=device, decode=decode
        )
        return cls(
            target,
            load_proposer(drafter, target, drafter_dtype=drafter_dtype),
            scheduler,
            prefix_caching=prefix_caching,
            batch_invariant=batch_invariant,
        )

    # ------------------------------------------------------------------ public
    def generate(
        self,
        images: ImageLike | Sequence[ImageLike] | None = None,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        options: RequestOptions | None = None,
        speculative: bool | None = None,
        **overrides: Any,
    ) -> GenerationResult:
        """Answer ``prompt`` about ``images`` (one, several or None) with exactly the target's output.

        ``options`` (a :class:`~vlmspec.types.RequestOptions`) says how to sample and when
        to stop; request options given by name replace its fields (``max_new_tokens=128,
        temperature=0.0, top_k=None, top_p=None, seed=0, stop=None`` by default).
        Greedy (``temperature=0``) output is token for token the target's own; sampled
        output follows the target's distribution (with the same top-k / top-p).
        ``stop`` strings end generation at the token that completes one (kept in the
        text). ``speculative=False`` runs the target alone through the same host (a request
        option like the others, so it may also come in ``options``).
        A failure inside the generation is raised (``BatchEngine`` keeps it in the result).
        """
        stream = self.stream(images, prompt, messages=messages, options=options, speculative=speculative, **overrides)
        for _ in stream.records():
            pass
        return stream.result

    def stream(
        self,
        images: ImageLike | Sequence[ImageLike] | None = None,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        options: RequestOptions | None = None,
        speculative: bool | None = None,
        **overrides: Any,
    ) -> GenerationStream:
        """Like :meth:`generate`, but iterate over the result to get text as it is committed.

        Arguments are validated here, before anything runs; ``stream.result`` holds the
        :class:`GenerationResult` once the iteration is over. ``stream.records()``
        iterates over the rounds' :class:`~vlmspec.types.RoundRecord` instead of text.
        Several streams may be open on one engine: each yields its own request's output
        (their requests take turns on the engine, in the order they were opened).
        """
        if speculative is not None:  # a named option, as max_new_tokens=... is (None: what options say)
            overrides["speculative"] = speculative
        request_id = self._host.add_request(images, prompt, messages=messages, options=options, **overrides)
        return GenerationStream(self._outputs, request_id)


class _Outputs:
    """One host's step outputs, sorted by request, for the streams that take turns running the host.

    Whichever stream runs a host step, every output goes to the queue of the request it
    belongs to, so each stream yields its own request's output and no other's.
    """

    def __init__(self, host: BatchEngine) -> None:
        self.host = host
        self._queues: dict[str, deque[StepOutput]] = {}  # request id -> outputs not yet taken by its stream
        self._stepping = False  # a host step is running (on this thread)
        self._abandoned: list[str] = []  # requests of streams dropped during a step: they leave after it

    def open(self, request_id: str) -> None:
        self._queues[request_id] = deque()

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def abandon(self, request_id: str) -> None:
        """A stream was dropped unfinished (garbage-collected): its request leaves the host, row, KV and images.

        Now, or, if the drop happened inside a host step (a garbage collection there), right after that step.
        """
        self.close(request_id)
        if self._stepping:
            self._abandoned.append(request_id)
        else:
            self._free(request_id)

    def _free(self, request_id: str) -> None:
        self.host.abort(request_id)
        self.host.pop_result(request_id)

    def next(self, request_id: str) -> StepOutput | None:
        """The request's next output, running host steps until there is one; None if the host has nothing to run."""
        queue = self._queues[request_id]
        while not queue and self.host.has_unfinished:
            self._stepping = True
            try:
                outputs = self.host.step()
            finally:
                self._stepping = False
            for output in outputs:
                if output.request_id in self._queues:  # else its stream was closed: nobody reads it
                    self._queues[output.request_id].append(output)
            while self._abandoned:
                self._free(self._abandoned.pop())
        return queue.popleft() if queue else None


class GenerationStream:
    """One generation as it runs: iterate for text deltas, or :meth:`records` for each round's record.

    ``result`` is set when the generation is over. Iterate only once, one way or the other.
    """

    def __init__(self, outputs: _Outputs, request_id: str) -> None:
        self._outputs = outputs
        self._host = outputs.host
        self._request_id = request_id
        self._tokens: list[int] = []  # committed so far
        self.result: GenerationResult | None = None
        outputs.open(request_id)
        # Dropped before it ends (never iterated, or left half-way): the request must not keep running
        # inside the host, holding its row, its KV and its images, for other streams' steps.
        self._abandoned = weakref.finalize(self, outputs.abandon, request_id)

    def records(self) -> Iterator[RoundRecord]:
        """Run the generation; yields the record of each round as it completes (the prefill is not a round)."""
        for output in self._run():
            if output.record is not None:
                yield output.record

    def __iter__(self) -> Iterator[str]:
        deltas = TextDeltas(self._host.target.tokenizer)  # no stop strings here: the text keeps them, as result.text
        for _ in self._run():  # after the prefill and after every round
            if delta := deltas.add(self._tokens[len(deltas) :]):
                yield delta
        if rest := deltas.close():
            yield rest

    def _run(self) -> Iterator[StepOutput]:
        """This request's outputs until it ends (the prefill's first token, then one output per round).

        Other requests' outputs of the same host steps wait in their own streams' queues.
        """
        try:
            while (output := self._outputs.next(self._request_id)) is not None:
                self._tokens += output.tokens
                yield output
                if output.finished:
                    break
        finally:  # also when the caller stops early: the request leaves the host (a no-op once it has finished)
            self._abandoned.detach()
            self._outputs.close(self._request_id)
            self._host.abort(self._request_id)
            self.result = self._host.pop_result(self._request_id)
        if self.result is not None and self.result.finish_reason == "error" and self.result.error is not None:
            raise self.result.error
