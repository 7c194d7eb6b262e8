"""SpecEngine: the single-request speculative loop (propose -> schedule -> verify -> commit).

This is the only module that wires a target, a proposer, a scheduler and verification
together, and it calls each through its protocol. One round:

1. the proposer absorbs the span committed last round (with its target features) and
   drafts up to gamma tokens after the anchor (the last committed token);
2. the scheduler decides how many of them to send to the target;
3. the target runs [anchor, drafts...] in one forward; verification keeps the accepted
   prefix and draws the recovered or bonus token;
4. the target's cache is rolled back to what was kept, and the tokens are committed.

Each round is reported as a :class:`~vlmspec.types.RoundRecord` (drafted, verified,
accepted, the confidences the scheduler saw, the committed tokens):
``engine.stream(...).records()`` yields them as they happen. Everything one generation
needs (proposer, scheduler, sampling, generator, the target's and the drafter's state)
lives on its request object, so a round is ``_round(request)``.

What it does not know: Hugging Face, M-RoPE, processors (that is ``vlmspec.target``);
how drafts are made (``vlmspec.drafters``); acceptance rules (``vlmspec.verify``).
With ``speculative=False`` the proposer is :class:`NoDraft` and every round verifies the
anchor alone, so the target-only baseline runs through exactly the same code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlmspec.drafters.base import NoDraft, Proposer
from vlmspec.sampling import sample, target_probs
from vlmspec.scheduling.base import Scheduler, VerifyAll
from vlmspec.target.adapter import QwenVLTarget, RequestState, load_target
from vlmspec.target.inputs import ImageLike, TargetInputs
from vlmspec.types import ContextUpdate, GenerationResult, RoundRecord, SamplingParams, SpecStats
from vlmspec.verify import verify


@dataclass
class _Request:
    """One generation: how it decodes, its live state, what it committed and why it ended."""

    proposer: Proposer
    scheduler: Scheduler
    params: SamplingParams
    generator: torch.Generator  # seeded per request; every draw of this generation comes from it
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop: tuple[str, ...]
    tokenizer: object
    state: RequestState | None = None  # the target's cache and positions, set by the prefill
    draft_state: Any = None  # the proposer's own per-request state (proposer.new_state())
    update: ContextUpdate | None = None  # what the proposer absorbs at the start of the next round
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)

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


class SpecEngine:
    """Speculative decoding over a Qwen-VL target with any proposer and scheduler.

    >>> engine = SpecEngine.from_pretrained("path/to/Qwen2.5-VL-3B-Instruct", drafter="prompt-lookup")
    >>> result = engine.generate("photo.jpg", "What is in this picture?", max_new_tokens=128)
    >>> result.text, result.stats.tau
    """

    def __init__(self, target: QwenVLTarget, proposer: Proposer | None = None, scheduler: Scheduler | None = None):
        self.target = target
        self.proposer = proposer if proposer is not None else NoDraft()
        self.scheduler = scheduler if scheduler is not None else VerifyAll()
        if not isinstance(self.proposer, Proposer):
            raise TypeError(f"{type(self.proposer).__name__} does not implement the Proposer protocol (vlmspec.drafters)")
        if not isinstance(self.scheduler, Scheduler):
            raise TypeError(f"{type(self.scheduler).__name__} does not implement the Scheduler protocol (vlmspec.scheduling)")
        vocab = self.proposer.vocab_size
        if vocab is not None and vocab != target.vocab_size:
            raise ValueError(
                f"the drafter's vocabulary ({vocab} ids) does not match the target's ({target.vocab_size}); "
                "use a drafter built for this target (DSparkDrafter.from_target(target, config))"
            )
        target.check_feature_layers(self.proposer.feature_layers)

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
    ) -> "SpecEngine":
        """Load a target from a local directory (or ``tiny:FAMILY``) and attach a drafter.

        ``target_dir`` may also be ``"reference"``: the bundled real-weights reference
        target (:mod:`vlmspec.reference`). ``drafter`` is None (target alone),
        ``"prompt-lookup"``, ``"reference"`` / ``"reference-dflash"`` (the drafters trained
        for the reference target), the directory of a saved DSpark drafter, or any object
        implementing the Proposer protocol.
        """
        target = load_target(target_dir, dtype=dtype, attn_implementation=attn_implementation, device=device)
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
        stream = self.stream(images, prompt, messages=messages, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed, stop=stop, speculative=speculative)  # fmt: skip
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
    ) -> "GenerationStream":
        """Like :meth:`generate`, but iterate over the result to get text as it is committed.

        Arguments are validated here, before anything runs; ``stream.result`` holds the
        :class:`GenerationResult` once the iteration is over. ``stream.records()``
        iterates over the rounds' :class:`~vlmspec.types.RoundRecord` instead of text.
        """
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        # The target alone: nothing drafted, so nothing to schedule either.
        proposer, scheduler = (self.proposer, self.scheduler) if speculative else (NoDraft(), VerifyAll())
        generator = torch.Generator(device=self.target.device).manual_seed(int(seed))
        request = self._new_request(proposer, scheduler, params, generator, max_new_tokens, stop)
        inputs = self.target.build_inputs(images, prompt, messages=messages)
        return GenerationStream(self, request, self._decode(inputs, request))

    # ---------------------------------------------------------------- the loop
    def _decode(self, inputs: TargetInputs, request: _Request) -> Iterator[RoundRecord | None]:
        """Yields None once the prefill has committed the first token, then each round's record."""
        started = time.perf_counter()
        self._prefill(inputs, request)
        yield None
        while request.finish_reason is None:
            yield self._round(request)
        request.stats.total_s = time.perf_counter() - started

    def _prefill(self, inputs: TargetInputs, request: _Request) -> None:
        """Run the prompt through the target, commit the first token, and set the request's state."""
        proposer = request.proposer
        tick = time.perf_counter()
        state, step = self.target.prefill(inputs, feature_layers=proposer.feature_layers, position_rule=proposer.position_rule)
        request.stats.prefill_s = time.perf_counter() - tick
        first = int(sample(target_probs(step.logits[-1:], request.params), [request.generator])[0])
        request.commit([first])
        request.state, request.draft_state = state, proposer.new_state()
        request.update = ContextUpdate(
            token_ids=inputs.input_ids[0].cpu(),
            positions=step.positions,
            features=step.features,
            anchor=first,
            anchor_position=inputs.length + state.rope_delta,
        )
        self._check_context(request)

    def _round(self, request: _Request) -> RoundRecord:
        """Propose, schedule, verify and commit once; the request's state moves on to the next round."""
        state, update = request.state, request.update
        tick = time.perf_counter()
        proposed = request.proposer.propose(request.draft_state, update, request.params, request.generator)
        lengths = request.scheduler.schedule(proposed.confidences, proposed.num_tokens)  # [1]
        block = proposed.truncated(lengths.clamp(max=self._room(request)))
        tock = time.perf_counter()
        request.stats.draft_s += tock - tick

        step = self.target.verify(state, [update.anchor] + block.tokens[0].tolist())
        result = verify(block, step.logits[None], request.params, [request.generator])
        accepted = int(result.num_accepted[0])
        self.target.rollback(state, keep=accepted + 1)
        request.stats.verify_s += time.perf_counter() - tock

        drafted, verified = int(proposed.num_tokens[0]), int(block.num_tokens[0])
        request.stats.record_round(drafted=drafted, verified=verified, accepted=accepted)
        kept_drafts = block.tokens[0, :accepted].tolist()
        committed = request.commit(kept_drafts + [int(result.next_tokens[0])])
        request.update = ContextUpdate(  # the anchor and the accepted drafts now have target features
            token_ids=torch.tensor([update.anchor] + kept_drafts),
            positions=step.positions[: accepted + 1],
            features=None if step.features is None else step.features[: accepted + 1],
            anchor=committed[-1],
            anchor_position=int(step.positions[accepted]) + 1,
        )
        self._check_context(request)
        return RoundRecord(drafted, verified, accepted, _first_row(proposed.confidences), committed)

    # --------------------------------------------------------------- helpers
    def _new_request(self, proposer: Proposer, scheduler: Scheduler, params: SamplingParams, generator: torch.Generator,
                     max_new_tokens: int, stop: str | Sequence[str] | None) -> _Request:  # fmt: skip
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        eos = frozenset(self.target.eos_token_ids)
        return _Request(proposer, scheduler, params, generator, max_new_tokens, eos, stops, self.target.tokenizer)

    def _room(self, request: _Request) -> int:
        """Most drafts this round may verify: past max_new_tokens or the context they could not be kept."""
        return max(min(request.remaining - 1, self.target.max_context - request.state.length - 1), 0)

    def _check_context(self, request: _Request) -> None:
        # The next round feeds the anchor at cache index state.length: it must fit.
        if request.finish_reason is None and request.state.length + 1 > self.target.max_context:
            request.finish_reason = "length"


class GenerationStream:
    """One generation as it runs: iterate for text deltas, or :meth:`records` for each round's record.

    ``result`` is set when the generation is over. Iterate only once, one way or the other.
    """

    def __init__(self, engine: SpecEngine, request: _Request, steps: Iterator[RoundRecord | None]) -> None:
        self._tokenizer = engine.target.tokenizer
        self._request = request
        self._steps = steps  # None after the prefill, then one RoundRecord per round
        self.result: GenerationResult | None = None

    def records(self) -> Iterator[RoundRecord]:
        """Run the generation; yields the record of each round as it completes (the prefill is not a round)."""
        for record in self._run():
            if record is not None:
                yield record

    def __iter__(self) -> Iterator[str]:
        shown = ""
        for _ in self._run():  # after the prefill and after every round
            text = self._tokenizer.decode(self._request.tokens, skip_special_tokens=True)
            if len(text) > len(shown) and not text.endswith("\ufffd"):  # wait for a whole character
                yield text[len(shown) :]
                shown = text
        if len(self.result.text) > len(shown):
            yield self.result.text[len(shown) :]

    def _run(self) -> Iterator[RoundRecord | None]:
        yield from self._steps
        request = self._request
        text = self._tokenizer.decode(request.tokens, skip_special_tokens=True)
        self.result = GenerationResult(text, list(request.tokens), request.stats, request.finish_reason)


def _first_row(confidences: torch.Tensor | None) -> torch.Tensor | None:
    """Row 0 of ``confidences`` [1, gamma] as a float32 CPU copy [gamma] (the proposer may reuse its buffer)."""
    return None if confidences is None else confidences[0].detach().to("cpu", torch.float32, copy=True)


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
