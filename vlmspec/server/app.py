"""The HTTP application: OpenAI chat completions over a :class:`~vlmspec.serving.BatchEngine`.

``create_app(engine, ServerConfig(...))`` returns a FastAPI app; ``serve(...)`` runs it
with uvicorn (``vlmspec serve`` does that). Endpoints:

* ``POST /v1/chat/completions``: text and ``image_url`` parts (base64 ``data:`` URLs; local
  paths only inside ``--allowed-local-media-path``), ``max_tokens``, ``temperature``,
  ``top_p``, ``top_k`` (extension), ``seed``, ``stop``, ``stream`` (server-sent events
  ending with ``data: [DONE]``). Responses carry ``usage`` and a ``vlmspec`` field with
  tau and the acceptance by draft position.
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

Every request is validated before it reaches the engine: malformed ones get a 400 with an
OpenAI-style error body (an image over the server's :class:`~vlmspec.targets.inputs.ImageLimits`
or unreadable included), a full server a 429, a dead engine a 503 (and so does a request
the engine thread died under). A client that disconnects has its request aborted, which
frees its row of the batch and its cache.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vlmspec.server.media import engine_messages
from vlmspec.server.metrics import CONTENT_TYPE, ServerMetrics
from vlmspec.server.protocol import (
    FINISH_REASONS,
    APIError,
    ChatCompletionRequest,
    chunk_body,
    completion_body,
    completion_id,
    models_body,
    speculation,
    usage,
)
from vlmspec.server.worker import EngineWorker, Overloaded, RequestHandle, Unavailable
from vlmspec.serving.engine import BatchEngine
from vlmspec.targets.inputs import DEFAULT_IMAGE_LIMITS, ImageLimits
from vlmspec.types import GenerationResult


@dataclass
class ServerConfig:
    """How the server admits and answers requests (``vlmspec serve --help`` has the flags)."""

    model_name: str = "vlmspec"  # the id /v1/models lists and responses carry
    max_queued: int = 64  # requests waiting for a batch row beyond max_batch_size running; then 429
    default_max_tokens: int = 256  # when a request gives neither max_tokens nor max_completion_tokens
    allowed_media: Path | None = None  # a folder local image paths may be read from (None: no local paths)
    # caps on each image a request sends, checked before decoding (defaults: 20 MiB, 40 megapixels; see ImageLimits)
    image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS


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
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="vlmspec", description="Lossless speculative decoding for Qwen-VL", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, config

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        metrics.rejected.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_error(err))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if body.model is not None and body.model != config.model_name:
            raise APIError(
                404, f"model {body.model!r} does not exist; this server serves {config.model_name!r}", param="model"
            )
        options = await _engine_options(body, engine, config)
        handle = await _submit(worker, options)
        request_id = completion_id()
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = _stream(worker, handle, request_id, config.model_name, include_usage, engine.target.max_context)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        result = await _until_finished_or_gone(worker, handle, request)
        if result is None:  # the client went away: its request was aborted, nobody reads an answer
            return Response(status_code=499)
        if result.finish_reason == "error":
            error = _generation_error(result)
            return JSONResponse(error.body(), status_code=error.status)
        return JSONResponse(
            completion_body(request_id, config.model_name, handle.text.text, result, engine.target.max_context)
        )

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


# --------------------------------------------------------------------------- handlers
async def _engine_options(body: ChatCompletionRequest, engine: BatchEngine, config: ServerConfig) -> dict:
    """``BatchEngine.add_request`` arguments for the request (images are decoded off the event loop)."""
    options = body.request_options(config.default_max_tokens, default_seed=secrets.randbits(63))
    if options.max_new_tokens > engine.target.max_context:
        raise APIError(
            400,
            f"max_tokens is {options.max_new_tokens} but the model's context is {engine.target.max_context} tokens",
            param="max_tokens",
        )
    messages, images = await asyncio.to_thread(
        engine_messages, body.messages, config.allowed_media, config.image_limits
    )
    return dict(images=images or None, messages=messages, options=options)


async def _submit(worker: EngineWorker, options: dict) -> RequestHandle:
    try:
        return await worker.submit(**options)
    except Overloaded as err:
        raise APIError(429, str(err), code="server_overloaded") from None
    except Unavailable as err:
        raise APIError(503, str(err), code="engine_unavailable") from None
    except (ValueError, TypeError, FileNotFoundError) as err:  # the engine's checks: prompt over the context ...
        raise APIError(400, str(err)) from None


async def _until_finished_or_gone(
    worker: EngineWorker, handle: RequestHandle, request: Request
) -> GenerationResult | None:
    """The request's result, or None if the client disconnected first (the request is aborted then)."""
    finished = asyncio.ensure_future(handle.wait())
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({finished, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if finished.done():
        return finished.result()
    worker.abort(handle)
    await finished  # the result ("abort") still arrives, so the request is counted and forgotten
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body is already read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(
    worker: EngineWorker, handle: RequestHandle, request_id: str, model: str, include_usage: bool, context: int
) -> AsyncIterator[str]:
    """Server-sent events of one answer: a role chunk, content chunks, the finish chunk, usage, [DONE].

    If the client disconnects, Starlette cancels this generator: ``finally`` aborts the request.
    """
    try:
        yield _event(chunk_body(request_id, model, {"role": "assistant", "content": ""}))
        async for delta in handle:
            if delta.text:
                yield _event(chunk_body(request_id, model, {"content": delta.text}))
        result = handle.result
        if result.finish_reason == "error":
            yield _event(_generation_error(result).body())
        else:
            finish = FINISH_REASONS[result.finish_reason]
            yield _event(chunk_body(request_id, model, {}, finish, vlmspec=speculation(result, context)))
            if include_usage:
                yield _event(chunk_body(request_id, model, None, usage=usage(result)))
        yield "data: [DONE]\n\n"
    finally:
        if handle.result is None:
            worker.abort(handle)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _generation_error(result: GenerationResult) -> APIError:
    """The answer to a request that ended in an error: 503 if the engine thread died under it, else 500."""
    if isinstance(result.error, Unavailable):
        return APIError(503, f"generation failed: {result.error}", code="engine_unavailable")
    return APIError(500, f"generation failed: {result.error!r}")


def _validation_error(err: RequestValidationError) -> APIError:
    """Pydantic's complaints as one OpenAI-style 400: ``messages.0.content: Field required; ...``."""
    problems, param = [], None
    for problem in err.errors()[:5]:
        if problem.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON ({problem.get('ctx', {}).get('error', 'parse error')})")
            continue
        location = ".".join(str(part) for part in problem.get("loc", ()) if part != "body")
        message = str(problem.get("msg")).removeprefix("Value error, ")
        param = param or location or None
        problems.append(f"{location}: {message}" if location else message)
    return APIError(400, "; ".join(problems) or "invalid request", param=param)


def _count_finished(metrics: ServerMetrics, handle: RequestHandle, result: GenerationResult) -> None:
    metrics.finished(result, handle.ttft_s, time.perf_counter() - handle.created_s)
