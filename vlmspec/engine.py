"""SpecEngine: speculative decoding of one request at a time (propose -> schedule -> verify -> commit).

The engine is a host of the step API (:mod:`vlmspec.serving.steps`) with one request per
step, and the simplest one: ``vlmspec.serving.BatchEngine`` runs the same calls over many
requests. One round:

1. the proposer absorbs the span committed last round (with its target features) and
   drafts up to gamma tokens after the anchor (the last committed token);
2. the scheduler decides how many of them to send to the target;
3. the target runs [anchor, drafts...] in one forward; verification keeps the accepted
   prefix and draws the recovered or bonus token;
4. the target's cache is rolled back to what was kept, and the tokens are committed.

Each round is reported as a :class:`~vlmspec.types.RoundRecord` (drafted, verified,
accepted, the confidences the scheduler saw, the committed tokens):
``engine.stream(...).records()`` yields them as they happen. The request's own state
(sampling, generator, the drafter's state, its output) is a
:class:`~vlmspec.serving.steps.SpecRequest`; after the prefill, the target's KV cache and
positions are one row of the runner that ``BatchEngine`` drives with many
(:class:`~vlmspec.targets.ragged.RaggedBatch`), so both run the same decode/verify forward.

What it does not know: Hugging Face, M-RoPE, processors (that is ``vlmspec.targets``);
how drafts are made (``vlmspec.drafters``); acceptance rules (``vlmspec.verify``).
With ``speculative=False`` the proposer is :class:`NoDraft` and every round verifies the
anchor alone, so the target-only baseline runs through exactly the same code.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from vlmspec.drafters.base import NoDraft, Proposer
from vlmspec.scheduling.base import Scheduler, VerifyAll
from vlmspec.serving.steps import SpecDecoder, SpecRequest
from vlmspec.serving.text import TextDeltas
from vlmspec.targets.adapter import QwenVLTarget, RequestState, load_target, prefill_output
from vlmspec.targets.inputs import ImageLike, TargetInputs
from vlmspec.targets.ragged import RaggedBatch
from vlmspec.types import GenerationResult, RoundRecord


class SpecEngine:
    """Speculative decoding over a Qwen-VL target with any proposer and scheduler.

    >>> engine = SpecEngine.from_pretrained("path/to/Qwen2.5-VL-3B-Instruct", drafter="prompt-lookup")
    >>> result = engine.generate("photo.jpg", "What is in this picture?", max_new_tokens=128)
    >>> result.text, result.stats.tau
    """

    def __init__(self, target: QwenVLTarget, proposer: Proposer | None = None, scheduler: Scheduler | None = None):
        self.target = target
        self.decoder = SpecDecoder(proposer, scheduler, vocab_size=target.vocab_size)
        self._alone = SpecDecoder(NoDraft(), VerifyAll())  # the target alone: nothing drafted, nothing to schedule
        target.check_feature_layers(self.decoder.proposer.feature_layers)

    @property
    def proposer(self) -> Proposer:
        return self.decoder.proposer

    @property
    def scheduler(self) -> Scheduler:
        return self.decoder.scheduler

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
        implementing the Proposer protocol.
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
        decoder = self.decoder if speculative else self._alone
        request, inputs = new_request(
            self.target,
            decoder,
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
        return GenerationStream(self, request, inputs.length, self._decode(inputs, decoder, request))

    # ---------------------------------------------------------------- the loop
    def _decode(self, inputs: TargetInputs, decoder: SpecDecoder, request: SpecRequest) -> Iterator[RoundRecord | None]:
        """Yields None once the prefill has committed the first token, then each round's record."""
        started = time.perf_counter()
        state = prefill_request(self.target, decoder, request, inputs)
        yield None
        if not request.finished:
            # One row of the runner that BatchEngine uses: the same KV memory and packed forward.
            batch = RaggedBatch(self.target, feature_layers=decoder.proposer.feature_layers)
            batch.add(state)
            while not request.finished:
                yield self._round(decoder, request, batch)
        request.stats.total_s = time.perf_counter() - started

    def _round(self, decoder: SpecDecoder, request: SpecRequest, batch: RaggedBatch) -> RoundRecord:
        """One step of the step API for this one request (row 0 of ``batch``)."""
        tick = time.perf_counter()
        room = [context_room(self.target, int(batch.lengths[0]))]
        plan = decoder.plan([request], decoder.propose([request]), room=room)
        tock = time.perf_counter()
        request.stats.draft_s += tock - tick

        step = batch.verify(plan.input_ids, plan.num_inputs)
        accepted = decoder.accept([request], plan, step.logits, step.features)
        batch.advance(accepted.keep)
        request.stats.verify_s += time.perf_counter() - tock
        if request.error is not None:
            raise request.error
        end_at_context(self.target, request, int(batch.lengths[0]))
        return accepted.records[0]


def new_request(
    target: QwenVLTarget,
    decoder: SpecDecoder,
    images: ImageLike | Sequence[ImageLike] | None,
    prompt: str | None,
    *,
    messages: list[dict] | None,
    **sampling: Any,
) -> tuple[SpecRequest, TargetInputs]:
    """A step-API request that stops as ``target`` does (its EOS ids, tokenizer, device), and its processed inputs.

    ``sampling``: max_new_tokens, temperature, top_k, top_p, seed, stop. Both are validated
    here, so bad input raises before anything runs.
    """
    request = decoder.new_request(
        eos_token_ids=target.eos_token_ids, tokenizer=target.tokenizer, device=target.device, **sampling
    )
    return request, target.build_inputs(images, prompt, messages=messages)


def prefill_request(
    target: QwenVLTarget, decoder: SpecDecoder, request: SpecRequest, inputs: TargetInputs
) -> RequestState:
    """Run one request's prompt (with its images) through the target and start it: the first token is committed."""
    warn_if_context_cuts(target, request, inputs.length)
    proposer = decoder.proposer
    tick = time.perf_counter()
    state, step = target.prefill(inputs, feature_layers=proposer.feature_layers, position_rule=proposer.position_rule)
    request.stats.prefill_s = time.perf_counter() - tick
    decoder.start(request, prefill_output(inputs, state, step))
    end_at_context(target, request, state.length)
    return state


def warn_if_context_cuts(target: QwenVLTarget, request: SpecRequest, prompt_length: int) -> None:
    """Say so when the context, not ``max_new_tokens``, will end the answer (both end it with "length")."""
    room = target.max_context - prompt_length + 1  # the last token needs no cache slot
    if room < request.max_new_tokens:
        warnings.warn(
            f"the prompt's {prompt_length} tokens leave room for only {room} of max_new_tokens="
            f"{request.max_new_tokens} in this model's {target.max_context}-token context: the answer will stop "
            "there with finish_reason 'length'. Shorten the prompt, use smaller images or lower max_new_tokens.",
            UserWarning,
            stacklevel=3,
        )


def context_room(target: QwenVLTarget, length: int) -> int:
    """Most drafts a request holding ``length`` tokens may verify: the anchor and the drafts must fit the context."""
    return max(target.max_context - length - 1, 0)


def end_at_context(target: QwenVLTarget, request: SpecRequest, length: int) -> None:
    """Finish ``request`` ("length") when its next anchor, at cache index ``length``, would not fit the context."""
    if not request.finished and length + 1 > target.max_context:
        request.finish("length")


class GenerationStream:
    """One generation as it runs: iterate for text deltas, or :meth:`records` for each round's record.

    ``result`` is set when the generation is over. Iterate only once, one way or the other.
    """

    def __init__(
        self, engine: SpecEngine, request: SpecRequest, prompt_tokens: int, steps: Iterator[RoundRecord | None]
    ) -> None:
        self._tokenizer = engine.target.tokenizer
        self._request = request
        self._prompt_tokens = prompt_tokens
        self._steps = steps  # None after the prefill, then one RoundRecord per round
        self.result: GenerationResult | None = None

    def records(self) -> Iterator[RoundRecord]:
        """Run the generation; yields the record of each round as it completes (the prefill is not a round)."""
        for record in self._run():
            if record is not None:
                yield record

    def __iter__(self) -> Iterator[str]:
        deltas = TextDeltas(self._tokenizer)  # no stop strings here: the text keeps them, as result.text does
        for _ in self._run():  # after the prefill and after every round
            delta = deltas.add(self._request.tokens[len(deltas) :])
            if delta:
                yield delta
        if rest := deltas.close():
            yield rest

    def _run(self) -> Iterator[RoundRecord | None]:
        yield from self._steps
        request = self._request
        text = self._tokenizer.decode(request.tokens, skip_special_tokens=True)
        self.result = GenerationResult(
            text, list(request.tokens), request.stats, request.finish_reason, prompt_tokens=self._prompt_tokens
        )


def load_proposer(drafter: str | os.PathLike | Proposer | None, target: QwenVLTarget) -> Proposer:
    """A proposer from a name, a saved drafter directory, or an object that already is one."""
    if drafter is None:
        return NoDraft()
    if isinstance(drafter, Proposer):
        return drafter
    if str(drafter) == "prompt-lookup":
        from vlmspec.drafters.prompt_lookup import PromptLookup

        return PromptLookup()
    from vlmspec.reference import REFERENCE_DRAFTERS, reference_drafter_dir

    path = reference_drafter_dir(str(drafter)) if str(drafter) in REFERENCE_DRAFTERS else Path(drafter)
    if not path.is_dir():
        raise FileNotFoundError(
            f"drafter {str(drafter)!r} is neither 'prompt-lookup', {' nor '.join(map(repr, REFERENCE_DRAFTERS))}, "
            "nor a directory with a saved drafter"
        )
    from vlmspec.drafters.dspark import DSparkDrafter

    return DSparkDrafter.from_pretrained(path, target=target).proposer()
