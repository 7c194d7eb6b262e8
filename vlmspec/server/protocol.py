"""The OpenAI chat-completions wire format: the request schema, and the bodies the server sends.

Requests are validated strictly (a number sent as a string is an error, not a guess, and
NaN or infinity is no number), and every problem becomes a 400 with an OpenAI-style error
body. Every field of OpenAI's chat-completions request is either honoured or refused with
a 400 that names it, and a field OpenAI does not have is refused the same way: nothing is
silently dropped (:data:`REFUSED` lists what is refused, with the values that are taken
because they leave the answer as it is). ``top_k`` is an extension, as in vLLM
(``extra_body={"top_k": 20}``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vlmspec.server.limits import FLAGS, RequestLimits
from vlmspec.types import GenerationResult, RequestOptions, SpecStats

# How a vlmspec finish reason reads in the OpenAI API. "abort" never reaches a client (it left), and an
# "error" is answered with a 500 or an error event instead. "context" (the model's context window ended the
# answer before max_tokens) is OpenAI's "length", the only value clients know for a cut-short answer; the
# `vlmspec` field then says "context" with a message (see CONTEXT_MESSAGE).
FINISH_REASONS = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "context": "length",
    "abort": "abort",
    "error": "error",
}
CONTEXT_MESSAGE = (
    "the answer was cut short by the model's {context}-token context window, before max_tokens: the prompt "
    "used {prompt} tokens; send a shorter prompt, smaller images or a lower max_tokens"
)


class _Strict(BaseModel):
    # extra="forbid": a field this schema does not name is a 400 that names it, never dropped unread
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # "low": the image is scaled to fit 512 x 512, as OpenAI


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None  # a participant's name: refused (Qwen's chat templates have no place for it)


class StreamOptions(_Strict):
    include_usage: bool = False


def _neutral(value: Any, *taken: Any) -> bool:
    return value is None or any(value == t for t in taken)


# OpenAI request fields vlmspec does not implement -> whether a value leaves the answer as it is
# (then it is taken: a client that sends the default is served). Any other value is a 400 naming the field.
REFUSED: dict[str, Any] = {
    "logprobs": lambda v: _neutral(v, False),
    "top_logprobs": lambda v: _neutral(v, 0),
    "presence_penalty": lambda v: _neutral(v, 0),
    "frequency_penalty": lambda v: _neutral(v, 0),
    "tools": lambda v: _neutral(v, []),
    "tool_choice": lambda v: _neutral(v, "none"),
    "parallel_tool_calls": lambda v: True,  # only means something with tools, which are refused
    "functions": lambda v: _neutral(v, []),
    "function_call": lambda v: _neutral(v, "none"),
    "response_format": lambda v: _neutral(v, {"type": "text"}),
    "audio": lambda v: _neutral(v),
    "modalities": lambda v: _neutral(v, ["text"]),
    "prediction": lambda v: _neutral(v),
    "reasoning_effort": lambda v: _neutral(v),
    "verbosity": lambda v: _neutral(v),
    "web_search_options": lambda v: _neutral(v),
    "store": lambda v: _neutral(v, False),  # nothing is stored
    "service_tier": lambda v: _neutral(v, "auto", "default"),
}


class ChatCompletionRequest(_Strict):
    """``POST /v1/chat/completions``: every OpenAI field (see :data:`REFUSED` for those refused), plus ``top_k``."""

    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 and -1 mean "no top-k", as in vLLM
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension, as in vLLM and llama.cpp
    # token id (a decimal string, as JSON keys are) -> a bias in [-100, 100] added to its logit (OpenAI)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None  # at most RequestLimits.max_stop_strings (OpenAI: 4)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)  # independent choices, each a request with its own seed (choice_seed)
    # Informational: they name or tag the request and never change the answer.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    # Refused unless neutral (REFUSED); typed loosely so the refusal, not a type error, names them.
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None

    def check_supported(self, limits: RequestLimits) -> None:
        """Raise a 400 naming the first refused field used, or a field over one of ``limits``."""
        for name, neutral in REFUSED.items():
            if not neutral(getattr(self, name)):
                raise APIError(
                    400,
                    f"{name} is not supported by vlmspec serve; leave it out (the fields it implements are listed "
                    "in docs/serving.md)",
                    param=name,
                    code="unsupported_parameter",
                )
        for index, message in enumerate(self.messages):
            if message.name is not None:
                raise APIError(
                    400,
                    f"messages[{index}].name is not supported by vlmspec serve (the model's chat template has no "
                    "place for a participant's name); leave it out",
                    param=f"messages[{index}].name",
                    code="unsupported_parameter",
                )
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if self.n > limits.max_choices:
            raise APIError(
                400,
                f"n is {self.n}, over the server's limit of {limits.max_choices} choices per request "
                f"(vlmspec serve {FLAGS['max_choices']})",
                param="n",
                code="limit_exceeded",
            )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > limits.max_stop_strings:
            raise APIError(
                400,
                f"stop has {len(stops)} strings, over the server's limit of {limits.max_stop_strings} "
                f"(vlmspec serve {FLAGS['max_stop_strings']})",
                param="stop",
                code="limit_exceeded",
            )
        if self.logit_bias is not None and len(self.logit_bias) > limits.max_logit_bias:
            raise APIError(
                400,
                f"logit_bias names {len(self.logit_bias)} tokens, over the server's limit of {limits.max_logit_bias} "
                f"(vlmspec serve {FLAGS['max_logit_bias']})",
                param="logit_bias",
                code="limit_exceeded",
            )
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_length:
            raise APIError(
                400,
                f"a stop string has {longest} characters, over the server's limit of {limits.max_stop_length} "
                f"(vlmspec serve {FLAGS['max_stop_length']})",
                param="stop",
                code="limit_exceeded",
            )

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_k_or_none(self) -> int | None:
        return self.top_k if self.top_k is not None and self.top_k > 0 else None

    def request_options(self, default_max_tokens: int, default_seed: int) -> RequestOptions:
        """The engine's request options for this request (the defaults where it names no length or seed).

        The fields' HTTP bounds are checked above; :class:`RequestOptions` checks the rest and
        normalises the stop strings. What it refuses is answered with a 400 that names the field.
        The seed is choice 0's; :func:`choice_seed` derives the others'.
        """
        try:
            return RequestOptions(
                max_new_tokens=self.max_new_tokens or default_max_tokens,
                temperature=self.temperature,
                top_k=self.top_k_or_none,
                top_p=self.top_p,
                min_p=self.min_p,
                logit_bias=self.logit_bias,
                seed=default_seed if self.seed is None else self.seed,
                stop=self.stop,
            )
        except ValueError as err:
            param = next((name for name in ("logit_bias", "min_p", "stop") if str(err).startswith(name)), None)
            raise APIError(400, str(err), param=param) from None


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed``: ``(seed + index) mod 2**63``.

    So choice 0 is the request with ``n = 1``, and choice i is what a request with ``seed + i`` gets
    alone: every choice is reproducible on its own.
    """
    return (seed + index) % 2**63


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def usage(results: GenerationResult | list[GenerationResult]) -> dict:
    """OpenAI ``usage``: prompt tokens (vision tokens included, counted once for ``n`` choices; those the prefix
    cache held in ``prompt_tokens_details.cached_tokens``) and generated tokens (EOS included, every choice's)."""
    results = [results] if isinstance(results, GenerationResult) else results
    prompt = results[0].prompt_tokens
    completion = sum(len(result.token_ids) for result in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens},  # found in the prefix cache
    }


def speculation(result: GenerationResult, context: int | None = None) -> dict:
    """The ``vlmspec`` extension field: how speculation went for this request, and why it ended.

    ``context`` (the model's context in tokens) fills the ``message`` of an answer the context cut short.
    """
    stats = result.stats
    field = {
        "tau": round(stats.tau, 4),
        "rounds": stats.rounds,
        "drafted": stats.drafted,
        "verified": stats.verified,
        "accepted": stats.accepted,
        "acceptance_by_position": [None if a != a else round(a, 4) for a in stats.acceptance_by_position],
        "finish_reason": result.finish_reason,
    }
    if result.finish_reason == "context":
        field["message"] = CONTEXT_MESSAGE.format(context=context or "?", prompt=result.prompt_tokens)
    return field


def completion_body(
    request_id: str, model: str, choices: list[tuple[str, GenerationResult]], context: int | None = None
) -> dict:
    """A whole ``chat.completion`` object of ``choices`` (text, result) (``context``: the model's, for
    :func:`speculation`). With one choice the ``vlmspec`` field is its own; with several, each choice
    carries its own and the top-level one pools their rounds."""
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": FINISH_REASONS[result.finish_reason],
                **({"vlmspec": speculation(result, context)} if len(choices) > 1 else {}),
            }
            for index, (text, result) in enumerate(choices)
        ],
        "usage": usage([result for _, result in choices]),
    }
    if len(choices) == 1:
        body["vlmspec"] = speculation(choices[0][1], context)
    else:
        pooled = SpecStats.merge(result.stats for _, result in choices)
        body["vlmspec"] = {
            key: value
            for key, value in speculation(GenerationResult("", [], pooled, "stop")).items()
            if key != "finish_reason"
        }
    return body


def chunk_body(
    request_id: str, model: str, delta: dict | None, finish_reason: str | None = None, index: int = 0, **extra: Any
) -> dict:
    """One ``chat.completion.chunk`` (a server-sent event of a streamed answer) of choice ``index``."""
    choices = (
        [] if delta is None else [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    )
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def models_body(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "vlmspec"}]}
