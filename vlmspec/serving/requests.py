"""A request's life around the round, shared by every host: validated creation, prefill, the context's end."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence

from vlmspec.serving.steps import SpecDecoder, SpecRequest
from vlmspec.targets.adapter import QwenVLTarget, RequestState, TargetStep, prefill_output
from vlmspec.targets.inputs import ImageLike, TargetInputs
from vlmspec.types import RequestOptions

CONTEXT_FINISH = "context"  # the finish reason of a request the context window cut short (see end_at_context)


def new_request(
    target: QwenVLTarget,
    decoder: SpecDecoder,
    images: ImageLike | Sequence[ImageLike] | None,
    prompt: str | None,
    *,
    messages: list[dict] | None,
    options: RequestOptions,
) -> tuple[SpecRequest, TargetInputs]:
    """A step-API request that stops as ``target`` does (its EOS ids, tokenizer, device), and its processed inputs.

    The inputs are validated here, so bad input raises before anything runs (``options`` were when built).
    """
    request = decoder.new_request(
        options, eos_token_ids=target.eos_token_ids, tokenizer=target.tokenizer, device=target.device
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
    decoder.start(request, prefill_output(inputs, step, state.rope_delta))
    end_at_context(target, request, state.length)
    return state


def start_text_request(
    target: QwenVLTarget,
    decoder: SpecDecoder,
    request: SpecRequest,
    prompt: TargetInputs,
    step: TargetStep,
    prefill_s: float,
) -> None:
    """Start a text-only request from its row's prefill (:meth:`RaggedBatch.prefill`): the first token is committed.

    A failure to start ends the request with "error"; its row stays until the host retires it.
    """
    request.stats.prefill_s = prefill_s
    try:
        decoder.start(request, prefill_output(prompt, step))  # text only: rope_delta 0
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
            stacklevel=3,
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
