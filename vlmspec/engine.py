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
round runs (``vlmspec.serving``). With ``speculative=False`` the request goes to a second
host whose proposer is :class:`NoDraft`: every round verifies the anchor alone, so the
target-only baseline runs through exactly the same code.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch

from vlmspec.drafters.base import NoDraft, Proposer
from vlmspec.loading import load_proposer, load_target
from vlmspec.scheduling.base import Scheduler, VerifyAll
from vlmspec.serving.engine import BatchEngine, StepOutput
from vlmspec.serving.steps import SpecDecoder
from vlmspec.serving.text import TextDeltas
from vlmspec.targets.adapter import QwenVLTarget
from vlmspec.targets.inputs import ImageLike
from vlmspec.types import GenerationResult, RoundRecord


class SpecEngine:
    """Speculative decoding over a Qwen-VL target with any proposer and scheduler.

    >>> engine = SpecEngine.from_pretrained("path/to/Qwen2.5-VL-3B-Instruct", drafter="prompt-lookup")
    >>> result = engine.generate("photo.jpg", "What is in this picture?", max_new_tokens=128)
    >>> result.text, result.stats.tau
    """

    def __init__(self, target: QwenVLTarget, proposer: Proposer | None = None, scheduler: Scheduler | None = None):
        self.target = target
        self._host = BatchEngine(target, proposer, scheduler, max_batch_size=1)
        # The target alone: nothing drafted, nothing to schedule; its KV rows are allocated on first use.
        self._alone = BatchEngine(target, NoDraft(), VerifyAll(), max_batch_size=1)

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
    ) -> SpecEngine:
        """Load a target from a local directory (or ``tiny:FAMILY``) and attach a drafter.

        ``target_dir`` may also be ``"reference"``: the bundled real-weights reference
        target (:mod:`vlmspec.reference`). ``drafter`` is None (target alone),
        ``"prompt-lookup"``, ``"reference"`` / ``"reference-dflash"`` (the drafters trained
        for the reference target), the directory of a saved DSpark drafter, or any object
        implementing the Proposer protocol (:mod:`vlmspec.loading`).
        """
        target = load_target(
            target_dir, dtype=dtype, attn_implementation=attn_implementation, device=device, decode=decode
        )
        return cls(target, load_proposer(drafter, target), scheduler)

    # ------------------------------------------------------------------ public
    def generate(
        self,
        images: ImageLike | Sequence[ImageLike] | None = None,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
        speculative: bool = True,
    ) -> GenerationResult:
        """Answer ``prompt`` about ``images`` (one, several or None) with exactly the target's output.

        Greedy (``temperature=0``) output is token for token the target's own; sampled
        output follows the target's distribution (with the same top-k / top-p).
        ``stop`` strings end generation at the token that completes one (kept in the
        text). ``speculative=False`` runs the target alone through the same code path.
        A failure inside the generation is raised (``BatchEngine`` keeps it in the result).
        """
        stream = self.stream(
            images,
            prompt,
            messages=messages,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
            speculative=speculative,
        )
        for _ in stream.records():
            pass
        return stream.result

    def stream(
        self,
        images: ImageLike | Sequence[ImageLike] | None = None,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
        speculative: bool = True,
    ) -> GenerationStream:
        """Like :meth:`generate`, but iterate over the result to get text as it is committed.

        Arguments are validated here, before anything runs; ``stream.result`` holds the
        :class:`GenerationResult` once the iteration is over. ``stream.records()``
        iterates over the rounds' :class:`~vlmspec.types.RoundRecord` instead of text.
        """
        host = self._host if speculative else self._alone
        request_id = host.add_request(
            images,
            prompt,
            messages=messages,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
        )
        return GenerationStream(host, request_id)


class GenerationStream:
    """One generation as it runs: iterate for text deltas, or :meth:`records` for each round's record.

    ``result`` is set when the generation is over. Iterate only once, one way or the other.
    """

    def __init__(self, host: BatchEngine, request_id: str) -> None:
        self._host = host
        self._request_id = request_id
        self._tokens: list[int] = []  # committed so far
        self.result: GenerationResult | None = None

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
        """The host's steps until this request ends (the prefill's first token, then one output per round)."""
        try:
            while self._host.has_unfinished:
                for output in self._host.step():
                    self._tokens += output.tokens
                    yield output
        finally:  # also when the caller stops early: leave the host empty for the next request
            if self._host.has_unfinished:
                self._host.abort(self._request_id)
            self.result = self._host.pop_result(self._request_id)
        if self.result is not None and self.result.finish_reason == "error" and self.result.error is not None:
            raise self.result.error
