"""The HTTP application: OpenAI chat completions over a :class:`~vlmspec.serving.BatchEngine`.

``create_app(engine, ServerConfig(...))`` returns a FastAPI app; ``serve(...)`` runs it
with uvicorn (``vlmspec serve`` does that). Endpoints:

* ``POST /v1/chat/completions``: text and ``image_url`` parts (base64 ``data:`` URLs; local
  paths only inside ``--allowed-local-media-path``), ``max_tokens``, ``temperature``,
  ``top_p``, ``top_k`` and ``min_p`` (extensions), ``logit_bias``, ``seed``, ``n``
  (:func:`~vlmspec.server.protocol.choice_seed`), ``stop``, ``stream`` (server-sent events
  ending with ``data: [DONE]``). Responses carry ``usage`` and a ``vlmspec`` field with
  tau and the acceptance by draft position. Every other OpenAI field is refused with a 400
  naming it unless its value leaves the answer as it is (:data:`~vlmspec.server.protocol.REFUSED`).
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

A request is checked in the order of what it would cost (:mod:`vlmspec.server.limits`):
the API key (401), a place in the engine (429 with ``Retry-After``, before the body is
read), the body's size (413, reading stops at the cap), the fields (400), every image's
header and the request's total pixels (400, before any image is decoded), the prompt's
length (400). Images are decoded and prompts tokenised on a preprocessing thread, one
request at a time, never on the engine's thread. A full server answers 429, a dead
engine 503 (and so does a request the engine thread died under). A client that
disconnects has its request aborted, which frees its row of the batch and its cache.

Every response carries an ``x-request-id`` header; an error inside the server is logged
with that id and answered with it, never with a path, a traceback or an exception's text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from vlmspec.kernels.threads import hand_over_cpu_threads, run_single_threaded, take_back_cpu_threads
from vlmspec.server.limits import DEFAULT_REQUEST_LIMITS, FLAGS, RETRY_AFTER_S, RequestLimits
from vlmspec.server.media import engine_messages
from vlmspec.server.metrics import CONTENT_TYPE, ServerMetrics
from vlmspec.server.protocol import (
    FINISH_REASONS,
    APIError,
    ChatCompletionRequest,
    choice_seed,
    chunk_body,
    completion_body,
    models_body,
    speculation,
    usage,
)
from vlmspec.server.worker import EngineWorker, Overloaded, RequestHandle, Reservation, Unavailable
from vlmspec.serving.engine import BatchEngine
from vlmspec.targets.inputs import DEFAULT_IMAGE_LIMITS, ImageLimits, TargetInputs
from vlmspec.types import GenerationResult

LOG = logging.getLogger("vlmspec.server")
OPEN_PATHS = ("/health",)  # answered without the API key (a load balancer's probe)


@dataclass
class ServerConfig:
    """How the server admits and answers requests (``vlmspec serve --help`` has the flags)."""

    model_name: str = "vlmspec"  # the id /v1/models lists and responses carry
    max_queued: int = 64  # requests waiting for a batch row beyond max_batch_size running; then 429
    default_max_tokens: int = 256  # when a request gives neither max_tokens nor max_completion_tokens
    allowed_media: Path | None = None  # a folder local image paths may be read from (None: no local paths)
    # caps on each image a request sends, checked before decoding (defaults: 20 MiB, 40 megapixels; see ImageLimits)
    image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS
    # caps on each request: body, images, prompt, stop strings, n (see RequestLimits)
    limits: RequestLimits = field(default=DEFAULT_REQUEST_LIMITS)
    # clients must send "Authorization: Bearer <api_key>" to every endpoint but /health (None: no key)
    api_key: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.default_max_tokens, bool) or not isinstance(self.default_max_tokens, int):
            raise ValueError(f"default_max_tokens must be an integer >= 1, got {self.default_max_tokens!r}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be an integer >= 1, got {self.default_max_tokens!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string, or None for no key")


def create_app(engine: BatchEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine thread starts and stops with the app (its lifespan)."""
    config = config or ServerConfig()
    metrics = ServerMetrics()
    worker = EngineWorker(
        engine,
        max_queued=config.max_queued,
        on_finish=lambda handle, result: _count_finished(metrics, handle, result),
        on_step=lambda e: metrics.queue(e.num_running, e.num_waiting, e.kv_cache),
    )
    # Images are decoded and prompts tokenised here, one request at a time: never on the engine's thread
    # (a long prompt would stall every stream), and never many at once (each holds its decoded images).
    # Single-threaded, so it never builds an OpenMP pool beside the engine's (see kernels.threads).
    preprocessor = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="vlmspec-preprocess", initializer=run_single_threaded
    )
    # A text of more characters than this cannot fit the prompt cap: no token is longer than the longest one.
    longest_token = max(map(len, engine.target.tokenizer.get_vocab()), default=1)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # This thread loaded the model; its CPU threads go to the engine's thread while it runs (kernels.threads).
        cpu_threads = hand_over_cpu_threads()
        try:
            worker.start(cpu_threads)
            yield
        finally:
            worker.stop()
            preprocessor.shutdown(wait=False, cancel_futures=True)
            take_back_cpu_threads()

    app = FastAPI(title="vlmspec", description="Lossless speculative decoding for Qwen-VL", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, config
    app.add_middleware(_Guard, config=config, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        metrics.rejected.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_error(err.errors()))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        request_id = _request_id(request)
        LOG.error("request %s failed inside the server", request_id, exc_info=err)
        return JSONResponse(_internal(request_id).body(), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        request_id = _request_id(request)
        reservation = _reserve(worker)  # before the body is read: a full server spends nothing on it
        handles: list[RequestHandle] = []
        try:
            body = _parse(await _read_body(request))
            if body.model is not None and body.model != config.model_name:
                raise APIError(
                    404,
                    f"model {body.model!r} does not exist; this server serves {config.model_name!r}",
                    param="model",
                )
            body.check_supported(config.limits)
            options = _request_options(body, engine, config)
            if body.n > 1:
                _grow(reservation, body.n - 1)
            work = functools.partial(_prepare, body, engine, config, longest_token)
            inputs = await asyncio.get_running_loop().run_in_executor(preprocessor, work)
            stream, include_usage, n = (
                body.stream,
                bool(body.stream_options and body.stream_options.include_usage),
                body.n,
            )
            del body, work  # the images' base64 text is not needed any more: only the processed inputs are
            for index in range(n):
                handles.append(await _submit(worker, reservation, inputs, options, choice_seed(options.seed, index)))
        except BaseException:
            reservation.release()
            for handle in handles:  # choices already running: nobody will read them
                worker.abort(handle)
            raise
        reservation.release()  # nothing is left: each request holds its own place now
        completion = f"chatcmpl-{request_id}"
        context = engine.target.max_context
        if stream:
            events = _stream(worker, handles, completion, config.model_name, include_usage, context, request_id)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        results = await _until_finished_or_gone(worker, handles, request)
        if results is None:  # the client went away: its requests were aborted, nobody reads an answer
            return Response(status_code=499)
        for result in results:
            if result.finish_reason == "error":
                error = _generation_error(result, request_id)
                return JSONResponse(error.body(), status_code=error.status)
        choices = [(handle.text.text, result) for handle, result in zip(handles, results, strict=True)]
        return JSONResponse(completion_body(completion, config.model_name, choices, context))

    @app.get("/v1/models")
    async def models() -> dict:
        return models_body(config.model_name, created)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not worker.alive:
            status = "unavailable" if worker.failure is None else "dead"  # dead: the engine thread ended in an error
            return JSONResponse({"status": status, "error": str(worker.unavailable())}, status_code=503)
        return JSONResponse({"status": "ok", "active_requests": worker.active})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def serve(engine: BatchEngine, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``engine`` until interrupted (Ctrl-C)."""
    import uvicorn

    uvicorn.run(create_app(engine, config), host=host, port=port, log_level="info")


# --------------------------------------------------------------------------- the guard
class _Guard:
    """ASGI middleware, before any endpoint: the request id, the API key (401), the body cap (413).

    The body cap is checked on ``Content-Length`` before anything is read, and on the bytes
    as they arrive (a chunked body, or a lying header): reading stops at the cap.
    """

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        headers = dict(scope.get("headers") or [])
        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            self.metrics.rejected.labels(str(refusal.status)).inc()
            response = JSONResponse(refusal.body(), status_code=refusal.status, headers=refusal.headers)
            await response(scope, receive, send_with_id)
            return
        cap, received = self.config.limits.max_body_bytes, 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    raise _body_too_large(cap)  # answered 413 by the app's APIError handler
            return message

        await self.app(scope, counted_receive, send_with_id)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        key = self.config.api_key
        if key is not None and path not in OPEN_PATHS:
            scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
                return APIError(
                    401,
                    "a valid API key is needed: send the header 'Authorization: Bearer <key>' (the key the server "
                    "was started with, vlmspec serve --api-key or VLMSPEC_API_KEY)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.config.limits.max_body_bytes:
            return _body_too_large(self.config.limits.max_body_bytes)
        return None


def _body_too_large(cap: int) -> APIError:
    return APIError(
        413,
        f"the request body is over the server's limit of {cap:,} bytes (vlmspec serve {FLAGS['max_body_bytes']}); "
        "send fewer or smaller images",
        code="request_too_large",
    )


def _request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex


# --------------------------------------------------------------------------- handlers
def _reserve(worker: EngineWorker) -> Reservation:
    try:
        return worker.reserve()
    except Overloaded as err:
        raise _overloaded(err) from None
    except Unavailable as err:
        raise APIError(503, str(err), code="engine_unavailable") from None


def _grow(reservation: Reservation, places: int) -> None:
    try:
        reservation.grow(places)
    except Overloaded as err:
        raise _overloaded(err) from None


def _overloaded(err: Overloaded) -> APIError:
    return APIError(429, str(err), code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _read_body(request: Request) -> bytes:
    """The body, read as it streams in (the guard stops it at the cap); not cached on the request."""
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
    return bytes(chunks)


def _parse(raw: bytes) -> ChatCompletionRequest:
    """The request from its JSON (pydantic parses the bytes itself: no Python copy of the whole document)."""
    try:
        return ChatCompletionRequest.model_validate_json(raw)
    except ValidationError as err:
        raise _validation_error(err.errors(include_input=False, include_url=False)) from None


def _request_options(body: ChatCompletionRequest, engine: BatchEngine, config: ServerConfig):
    """The request's :class:`RequestOptions` (choice 0's seed), checked against the model."""
    options = body.request_options(config.default_max_tokens, default_seed=secrets.randbits(63))
    try:
        options.check_vocabulary(engine.target.vocab_size)
    except ValueError as err:
        raise APIError(400, str(err), param="logit_bias") from None
    if options.max_new_tokens > engine.target.max_context:
        raise APIError(
            400,
            f"max_tokens is {options.max_new_tokens} but the model's context is {engine.target.max_context} tokens",
            param="max_tokens",
        )
    return options


def _prepare(body: ChatCompletionRequest, engine: BatchEngine, config: ServerConfig, longest_token: int):
    """The request's processed inputs (preprocessing thread): images checked then decoded, the prompt tokenised."""
    cap = config.limits.prompt_tokens(engine.target.max_context)
    characters = sum(
        len(message.content)
        if isinstance(message.content, str)
        else sum(len(getattr(p, "text", "")) for p in message.content)
        for message in body.messages
    )
    if characters > cap * longest_token:  # so many characters make more tokens than the cap: do not tokenise them
        raise _prompt_too_long(f"{characters:,} characters (more than {cap:,} tokens)", cap)
    messages, images = engine_messages(body.messages, config.allowed_media, config.image_limits, config.limits)
    try:
        inputs: TargetInputs = engine.target.build_inputs(images or None, messages=messages)
    except (ValueError, TypeError) as err:  # the target's own checks (a prompt over the context ...)
        raise APIError(400, _scrubbed(str(err))) from None
    if inputs.length > cap:
        raise _prompt_too_long(f"{inputs.length:,} tokens", cap)
    return inputs


def _prompt_too_long(found: str, cap: int) -> APIError:
    return APIError(
        400,
        f"the prompt has {found}, over the server's limit of {cap:,} prompt tokens (vlmspec serve "
        f"{FLAGS['max_prompt_tokens']}, at most the model's context less one); send a shorter prompt or fewer images",
        param="messages",
        code="prompt_too_long",
    )


async def _submit(
    worker: EngineWorker, reservation: Reservation, inputs: TargetInputs, options, seed: int
) -> RequestHandle:
    try:
        return await worker.submit(reservation, inputs=inputs, options=options, seed=seed)
    except Unavailable as err:
        raise APIError(503, str(err), code="engine_unavailable") from None
    except (ValueError, TypeError) as err:  # the engine's checks
        raise APIError(400, _scrubbed(str(err))) from None


async def _until_finished_or_gone(
    worker: EngineWorker, handles: list[RequestHandle], request: Request
) -> list[GenerationResult] | None:
    """Every choice's result, or None if the client disconnected first (the requests are aborted then)."""
    finished = asyncio.ensure_future(asyncio.gather(*(handle.wait() for handle in handles)))
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({finished, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if finished.done():
        return finished.result()
    for handle in handles:
        worker.abort(handle)
    await finished  # the results ("abort") still arrive, so the requests are counted and forgotten
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body is already read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(
    worker: EngineWorker,
    handles: list[RequestHandle],
    completion: str,
    model: str,
    include_usage: bool,
    context: int,
    request_id: str,
) -> AsyncIterator[str]:
    """Server-sent events of the answer's choices: role chunks, content chunks, finish chunks, usage, [DONE].

    The choices' chunks interleave as their tokens arrive (``index`` tells them apart). If the
    client disconnects, Starlette cancels this generator: ``finally`` aborts what is unfinished.
    """
    arrived: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        async for delta in handle:
            if delta.text:
                await arrived.put((index, delta.text))
        await arrived.put((index, None))  # finished

    pumps = [asyncio.ensure_future(pump(index, handle)) for index, handle in enumerate(handles)]
    try:
        for index in range(len(handles)):
            yield _event(chunk_body(completion, model, {"role": "assistant", "content": ""}, index=index))
        unfinished = len(handles)
        while unfinished:
            index, text = await arrived.get()
            if text is not None:
                yield _event(chunk_body(completion, model, {"content": text}, index=index))
                continue
            unfinished -= 1
            result = handles[index].result
            if result.finish_reason == "error":
                yield _event(_generation_error(result, request_id).body())
                break
            finish = FINISH_REASONS[result.finish_reason]
            yield _event(chunk_body(completion, model, {}, finish, index=index, vlmspec=speculation(result, context)))
        else:
            if include_usage:
                results = [handle.result for handle in handles]
                yield _event(chunk_body(completion, model, None, usage=usage(results)))
        yield "data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
        for handle in handles:
            if handle.result is None:
                worker.abort(handle)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _generation_error(result: GenerationResult, request_id: str) -> APIError:
    """The answer to a request that ended in an error: 503 if the engine thread died under it, else 500.

    The error itself goes to the server's log, with the request id the answer names.
    """
    if isinstance(result.error, Unavailable):
        return APIError(503, f"generation failed: {result.error}", code="engine_unavailable")
    LOG.error("request %s failed in the engine", request_id, exc_info=result.error)
    return _internal(request_id)


def _internal(request_id: str) -> APIError:
    return APIError(
        500,
        f"generation failed inside the server (request id {request_id}); the server's log has the details",
        code="internal_error",
    )


# An absolute path in a message that came from an exception (the server's files are nobody's business).
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.@+-]+/)+[\w.@+-]*")


def _scrubbed(message: str) -> str:
    """``message`` with every absolute path replaced by ``<path>`` (for the text of exceptions sent to a client)."""
    return _PATH.sub("<path>", message)


def _validation_error(errors: list[dict]) -> APIError:
    """Pydantic's complaints as one OpenAI-style 400: ``messages.0.content: Field required; ...``."""
    problems, param = [], None
    for problem in errors[:5]:
        if problem.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON ({problem.get('ctx', {}).get('error', 'parse error')})")
            continue
        location = ".".join(str(part) for part in problem.get("loc", ()) if part != "body")
        if problem.get("type") == "extra_forbidden":
            message = "unknown field: vlmspec serve implements the OpenAI chat-completions fields; leave it out"
        else:
            message = str(problem.get("msg")).removeprefix("Value error, ")
        param = param or location or None
        problems.append(f"{location}: {message}" if location else message)
    return APIError(400, "; ".join(problems) or "invalid request", param=param)


def _count_finished(metrics: ServerMetrics, handle: RequestHandle, result: GenerationResult) -> None:
    metrics.finished(result, handle.ttft_s, time.perf_counter() - handle.created_s)
