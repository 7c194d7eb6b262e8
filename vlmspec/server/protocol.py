"""The OpenAI chat-completions wire format: the request schema, and the bodies the server sends.

Requests are validated strictly (a number sent as a string is an error, not a guess), and
every problem becomes a 400 with an OpenAI-style error body. Fields of the OpenAI API
that vlmspec does not implement are refused when they would change the answer
(``n > 1``, ``logprobs``, tools, penalties) and ignored when they do not (``user``,
``metadata`` ...). ``top_k`` is an extension, as in vLLM (``extra_body={"top_k": 20}``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vlmspec.types import GenerationResult, RequestOptions

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
MAX_STOP_STRINGS = 4  # as the OpenAI API


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    """``POST /v1/chat/completions``; the OpenAI fields vlmspec implements, plus ``top_k``."""

    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 and -1 mean "no top-k", as in vLLM
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None  # as the OpenAI API
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI fields that would change the answer: accepted only at their neutral values.
    n: int = 1
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        unsupported = {
            "n": self.n != 1,
            "logprobs": self.logprobs,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "tools": bool(self.tools),
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(f"{name} is not supported by vlmspec (lossless speculative decoding of one answer)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

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
        """
        try:
            return RequestOptions(
                max_new_tokens=self.max_new_tokens or default_max_tokens,
                temperature=self.temperature,
                top_k=self.top_k_or_none,
                top_p=self.top_p,
                seed=default_seed if self.seed is None else self.seed,
                stop=self.stop,
            )
        except ValueError as err:
            raise APIError(400, str(err)) from None


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(result: GenerationResult) -> dict:
    """OpenAI ``usage``: prompt tokens (vision tokens included) and generated tokens (EOS included)."""
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
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
    request_id: str, model: str, text: str, result: GenerationResult, context: int | None = None
) -> dict:
    """A whole ``chat.completion`` object (``context``: the model's context in tokens, for :func:`speculation`)."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": FINISH_REASONS[result.finish_reason],
            }
        ],
        "usage": usage(result),
        "vlmspec": speculation(result, context),
    }


def chunk_body(request_id: str, model: str, delta: dict, finish_reason: str | None = None, **extra: Any) -> dict:
    """One ``chat.completion.chunk`` (a server-sent event of a streamed answer)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
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
