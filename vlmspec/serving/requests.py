"""A request's life around the round, shared by every host: validated creation, start after prefill, the context's end."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from vlmspec.serving.steps import SpecDecoder, SpecRequest
from vlmspec.targets.adapter import QwenVLTarget, TargetStep, prefill_output
from vlmspec.targets.inputs import ImageLike, TargetInputs
from vlmspec.targets.prompts import RowPrompt
from vlmspec.types import RequestOptions, RoundRecord

CONTEXT_FINISH = "context"  # the finish reason of a request the context window cut short (see end_at_context)


def new_request(
    target: QwenVLTarget,
    decoder: SpecDecoder,
    images: ImageLike | Sequence[ImageLike] | None,
    prompt: str | None,
    *,
    messages: list[dict] | None,
    options: RequestOptions,
    inputs: TargetInputs | None = None,
) -> tuple[SpecRequest, TargetInputs]:
    """A step-API request that stops as ``target`` does (its EOS ids, tokenizer, device), and its processed inputs.

    The inputs are validated here, so bad input raises before anything runs (``options`` were when built).
    ``inputs``, if given, are already processed (``target.build_inputs``): then no images, prompt or messages.
    """
    if inputs is not None and (images is not None or prompt is not None or messages is not None):
        raise ValueError("pass either inputs (already processed) or images / prompt / messages, not both")
    if inputs is not None and not isinstance(inputs, TargetInputs):
        raise TypeError(f"inputs must be the TargetInputs of target.build_inputs, got {type(inputs).__name__}")
    request = decoder.new_request(
        options, eos_token_ids=target.eos_token_ids, tokenizer=target.tokenizer, device=target.device
    )
    return request, inputs if inputs is not None else target.build_inputs(images, prompt, messages=messages)


def prepare_prompt(
    target: QwenVLTarget, decoder: SpecDecoder, request: SpecRequest, inputs: TargetInputs
) -> tuple[RowPrompt, float]:
    """A request's prompt for the runner's prefill (its images through the vision tower), and the seconds it took.

    Warns first if the context, not ``max_new_tokens``, will end the answer.
    """
    warn_if_context_cuts(target, request, inputs.length)
    tick = time.perf_counter()
    prompt = target.row_prompt(inputs, decoder.proposer.position_rule)  # the drafter's 1-D position rule
    return prompt, time.perf_counter() - tick


def start_request(
    target: QwenVLTarget,
    decoder: SpecDecoder,
    request: SpecRequest,
    prompt: TargetInputs,
    step: TargetStep,
    prefill_s: float,
    rope_delta: int = 0,
) -> None:
    """Start a request from its row's prefill (:meth:`RaggedBatch.prefill`): the first token is committed.

    ``step`` is the prefill's output for this prompt and ``rope_delta`` its row's (0 for
    text). A failure to start ends the request with "error"; its row stays until the host retires it.
    """
    request.stats.prefill_s = prefill_s
    try:
        decoder.start(request, prefill_output(prompt, step, rope_delta))
    except Exception as err:  # noqa: BLE001 - only this request's start failed
        request.finish("error", err)
    end_at_context(target, request, prompt.length)


def warn_if_context_cuts(target: QwenVLTarget, request: SpecRequest, prompt_length: int) -> None:
    """Say so before the prefill when the context, not ``max_new_tokens``, will end the answer ("context")."""
    room = target.max_context - prompt_length + 1  # the last token needs no cache slot
    if room < request.max_new_tokens:
        warnings.warn(
            f"the prompt's {prompt_length} tokens leave room for only {room} of max_new_tokens="
            f"{request.max_new_tokens} in this model's {target.max_context}-token context: the answer will stop "
            "there with finish_reason 'context'. Shorten the prompt, use smaller images or lower max_new_tokens.",
            UserWarning,
            stacklevel=4,
        )


def context_room(target: QwenVLTarget, length: int) -> int:
    """Most drafts a request holding ``length`` tokens may verify: the anchor and the drafts must fit the context."""
    return max(target.max_context - length - 1, 0)


def end_at_context(target: QwenVLTarget, request: SpecRequest, length: int) -> None:
    """Finish ``request`` when its next anchor, at cache index ``length``, would not fit the context.

    The reason is ``"context"``, not ``"length"``: the answer was cut short by the model's context
    window before ``max_new_tokens``, which a caller must be able to tell from reaching its own limit.
    """
    if not request.finished and length + 1 > target.max_context:
        request.finish(CONTEXT_FINISH)


class GeneratorStates:
    """The generator states of a step's sampled requests, to undo the draws of an attempt that failed.

    A failed batched attempt may have drawn from some generators (a proposer that sampled
    for a few requests, then raised; verification of one group of rows before another
    failed). Restoring them before the rerun keeps each seeded request's sample the one it
    gets alone. Greedy requests are skipped: no draw changes their output.
    """

    def __init__(self, requests: Sequence[SpecRequest]) -> None:
        self._generators = [r.generator for r in requests]
        self._states = [None if r.params.greedy else r.generator.get_state() for r in requests]

    def restore(self, index: int) -> None:
        """Put request ``requests[index]``'s generator back where it was."""
        if self._states[index] is not None:
            self._generators[index].set_state(self._states[index])


def check_positive(name: str, value: object) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an integer >= 1 (a host's size settings)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass
class StepOutput:
    """What one request did in one :meth:`BatchEngine.step`."""

    request_id: str
    tokens: list[int]  # committed this step: the first token after its prefill, or a round's tokens
    finish_reason: str | None  # set when the request ended in this step
    record: RoundRecord | None  # the round's record (None for the prefill's first token and for failures)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
