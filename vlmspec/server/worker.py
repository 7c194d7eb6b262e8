"""EngineWorker: a BatchEngine on its own thread, driven from asyncio.

HTTP handlers run on the event loop, and the engine's forwards must not block it. The
worker's thread is the only one that touches the engine (and its tokenizer, which also
turns each request's tokens into text): handlers send it commands
(add a request, abort one) through a queue, and the thread sends each request's step
outputs back to that request's :class:`RequestHandle` on the event loop. Between
commands the thread runs ``engine.step()`` while anything is unfinished, and sleeps on
an event otherwise.

Admission is decided on the event loop (one thread, so the count cannot race): at most
``max_batch_size`` requests run and ``max_queued`` more wait; the next one is refused
with :class:`Overloaded` (HTTP 429) instead of waiting without bound. A server takes its
places with :meth:`EngineWorker.reserve` before it reads a request's body, so a full
server decodes no image and tokenises no prompt; a :class:`Reservation` not spent on a
request is given back (``release``).

Whatever ends the thread (``stop()``, or an error nothing below caught), it answers
everything still waiting on it before it goes: each submit whose command never ran gets
:class:`Unavailable`, each request in the engine its result (``"abort"`` on a stop,
``"error"`` with an :class:`Unavailable` naming the cause when the thread died), and
later submits are refused at once. So no caller waits on a thread that is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vlmspec.kernels.threads import take_cpu_threads
from vlmspec.serving.engine import BatchEngine, StepOutput
from vlmspec.serving.text import TextDeltas
from vlmspec.types import GenerationResult, SpecStats

LOG = logging.getLogger("vlmspec.server")


class Overloaded(RuntimeError):
    """Every running and queued place is taken (HTTP 429)."""


class Unavailable(RuntimeError):
    """The engine is stopping or its thread has died (HTTP 503)."""


@dataclass
class Delta:
    """What one request committed in one engine step (the first token after its prefill, or a round's tokens)."""

    tokens: list[int]
    text: str  # the text that became safe to show (whole characters, cut before any stop string)
    time_s: float  # perf_counter() when the worker handed them out


class RequestHandle:
    """One request on the event loop's side: iterate for :class:`Delta`s; ``result`` is set at the end.

    Each request's outputs arrive in order, and the iteration ends exactly once, after the
    request's :class:`GenerationResult` arrived (whatever ended it: EOS, a stop string,
    the length limit, an abort or an error).
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.text: TextDeltas | None = None  # the answer's text; the worker thread writes it until the result arrives
        self.created_s = time.perf_counter()
        self.first_token_s: float | None = None  # perf_counter() of the first committed token (worker thread)
        self.result: GenerationResult | None = None
        self._loop = loop
        self._events: asyncio.Queue[Delta | GenerationResult] = asyncio.Queue()

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from the handle's creation (the HTTP request's arrival)."""
        return None if self.first_token_s is None else self.first_token_s - self.created_s

    def __aiter__(self):
        return self._deltas()

    async def _deltas(self):
        while self.result is None:
            event = await self._events.get()
            if isinstance(event, GenerationResult):
                self.result = event
            else:
                yield event

    async def wait(self) -> GenerationResult:
        """Run to the end, ignoring the deltas; returns the result (``self.text.text`` is the whole answer)."""
        async for _ in self:
            pass
        return self.result

    def _post(self, event: Delta | GenerationResult) -> None:  # any thread
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)


class Reservation:
    """Places taken in the worker before a request's work starts; each :meth:`EngineWorker.submit` spends one.

    ``release()`` gives back the places not spent (always call it, e.g. in ``finally``); ``grow(k)``
    takes k more (``Overloaded`` if they are not free: ``n`` choices need n places).
    """

    def __init__(self, worker: EngineWorker, places: int) -> None:
        self._worker, self.places = worker, places

    def grow(self, places: int) -> None:
        self._worker._take(places)
        self.places += places

    def spend(self) -> None:
        if self.places < 1:
            raise RuntimeError("the reservation has no place left: reserve one per request")
        self.places -= 1

    def release(self) -> None:
        self._worker._active -= self.places
        self.places = 0


class EngineWorker:
    """Owns a :class:`BatchEngine` and runs it on a background thread.

    >>> worker = EngineWorker(engine, max_queued=64)
    >>> worker.start()                       # on the event loop
    >>> handle = await worker.submit(prompt="Hi", max_new_tokens=32)
    >>> async for delta in handle: ...
    >>> worker.stop()

    ``on_finish(handle, result)`` is called on the event loop for every request when its
    result has arrived (the server counts it in its metrics there); ``on_step(engine)`` on the
    worker thread after each engine step and after requests were added or aborted.
    """

    def __init__(
        self,
        engine: BatchEngine,
        *,
        max_queued: int = 64,
        on_finish: Callable[[RequestHandle, GenerationResult], None] | None = None,
        on_step: Callable[[BatchEngine], None] | None = None,
    ) -> None:
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.engine = engine
        self.max_queued = max_queued
        self._on_finish = on_finish
        self._on_step = on_step
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sending = threading.Lock()  # a command is queued, or the thread has closed its queue: never both
        self._closed: Unavailable | None = None  # set by the thread as it ends; no command is queued after
        self._replies: set[concurrent.futures.Future] = set()  # submits' futures their commands have not answered
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._cpu_threads = 1  # how many CPU threads the engine thread runs torch on (set by start)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handles: dict[str, RequestHandle] = {}  # worker thread only: unfinished requests in the engine
        self._active = 0  # event loop only: submitted requests whose result has not arrived
        self.failure: BaseException | None = None  # what killed the thread, if anything did

    # ------------------------------------------------------------- event loop side
    @property
    def capacity(self) -> int:
        """Requests admitted at once: running plus queued."""
        return self.engine.max_batch_size + self.max_queued

    @property
    def active(self) -> int:
        """Requests admitted whose result has not arrived yet."""
        return self._active

    @property
    def num_tracked(self) -> int:
        """Requests the worker thread follows in the engine (added, result not yet delivered)."""
        return len(self._handles)

    @property
    def alive(self) -> bool:
        # failure first: a failed thread still runs for a moment while it fails its requests
        return self.failure is None and self._thread is not None and self._thread.is_alive() and not self._stopping

    def unavailable(self) -> Unavailable:
        """Why the worker takes no requests (meaningful when ``alive`` is False): the error submit() raises."""
        if self.failure is not None:
            # the type alone: an exception's text may name files on the server (the log has all of it)
            return Unavailable(
                f"the engine is not running: the engine thread died of {type(self.failure).__name__} "
                "(the server's log has the details)"
            )
        return Unavailable("the engine is not running: " + ("it is stopping" if self._thread else "it is not started"))

    def start(self, cpu_threads: int | None = None) -> None:
        """Start the engine thread; call from the event loop that will submit requests.

        The engine thread runs torch on ``cpu_threads`` CPU threads (default: the calling thread's count).
        """
        if self._thread is not None:
            raise RuntimeError("the worker is already started")
        self._loop = asyncio.get_running_loop()
        self._cpu_threads = cpu_threads or torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="vlmspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is unfinished and end the thread (waits for the step in progress)."""
        if self._thread is None or self._stopping:
            return
        self._send(self._abort_all)
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def reserve(self, places: int = 1) -> Reservation:
        """Take ``places`` now, before the requests' work (:class:`Overloaded` if they are not free)."""
        if not self.alive:
            raise self.unavailable()
        self._take(places)
        return Reservation(self, places)

    def _take(self, places: int) -> None:
        if self._active + places > self.capacity:
            raise Overloaded(
                f"the server is at capacity ({self.engine.max_batch_size} running, {self.max_queued} queued); "
                "retry later"
            )
        self._active += places

    async def submit(self, reservation: Reservation | None = None, **options: Any) -> RequestHandle:
        """Queue a request (``BatchEngine.add_request`` arguments); returns its handle once the engine took it.

        It spends a place of ``reservation``, or takes one (:class:`Overloaded` when every
        place is taken). Raises :class:`Unavailable` when the engine is not running, and the
        engine's own ValueError / TypeError / FileNotFoundError for bad input (nothing is
        queued then; the place is freed).
        """
        if reservation is None:
            reservation = self.reserve()
        reservation.spend()  # the place is the request's now: its result (or a failure below) frees it
        if not self.alive:
            self._active -= 1
            raise self.unavailable()
        handle = RequestHandle("", self._loop)
        taken: concurrent.futures.Future[str] = concurrent.futures.Future()
        if not self._send(lambda: self._add(handle, options, taken), reply=taken):
            self._active -= 1
            raise self.unavailable()  # the thread ended since `alive` was read
        try:
            handle.request_id = await asyncio.wrap_future(taken)
        except asyncio.CancelledError:  # the caller went away; the engine may take the request all the same
            taken.add_done_callback(lambda done: self._loop.call_soon_threadsafe(self._abandoned, handle, done))
            raise
        except BaseException:
            self._active -= 1
            raise
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """End the request now (a client went away); its handle still gets its result ("abort")."""
        if handle.result is None and self.alive:
            self._send(lambda: self._abort(handle.request_id))

    def _abandoned(self, handle: RequestHandle, taken: concurrent.futures.Future) -> None:  # event loop
        if not taken.cancelled() and taken.exception() is None:
            self.abort(handle)  # it runs: end it; its result still arrives, and is counted, as any other
        else:
            self._active -= 1

    def _finished(self, handle: RequestHandle, result: GenerationResult) -> None:  # event loop
        self._active -= 1
        if self._on_finish is not None:
            self._on_finish(handle, result)

    # ---------------------------------------------------------------- worker thread
    def _send(self, command: Callable[[], None], reply: concurrent.futures.Future | None = None) -> bool:
        """Queue a command for the thread; False if the thread has ended (the command will never run).

        ``reply`` is the future the command answers: if the thread ends first, it is failed instead.
        """
        with self._sending:
            if self._closed is not None:
                return False
            if reply is not None:
                self._replies.add(reply)
                reply.add_done_callback(self._replies.discard)
            self._commands.put(command)
        self._wake.set()
        return True

    def _run(self) -> None:
        try:
            take_cpu_threads(self._cpu_threads)
            while not self._stopping or not self._commands.empty():
                self._wake.clear()
                if self._run_commands() and self._on_step is not None:
                    self._on_step(self.engine)  # requests were added or aborted: the queue changed
                if self.engine.has_unfinished and not self._stopping:
                    self._step()
                elif not self._stopping:
                    self._wake.wait()
        except BaseException as err:  # the thread must not die silently: /health and submit() report it
            self.failure = err
            LOG.critical("the engine thread stopped: %r", err, exc_info=True)
        finally:
            self._close()

    def _close(self) -> None:
        """The thread's last act: refuse new commands, then answer everyone still waiting on it."""
        reason = self.unavailable()
        with self._sending:
            self._closed = reason
            replies = list(self._replies)
        while not self._commands.empty():
            self._commands.get_nowait()  # never run: their submits are answered below
        for reply in replies:
            _fail(reply, reason)
        self._abort_all(error=reason if self.failure is not None else None)

    def _run_commands(self) -> int:
        """Run the commands sent so far; returns how many."""
        done = 0
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return done
            command()
            done += 1

    def _add(self, handle: RequestHandle, options: dict, taken: concurrent.futures.Future) -> None:
        if not taken.set_running_or_notify_cancel():
            return  # the caller went away before the engine got to it: nothing to add
        try:
            request_id = self.engine.add_request(**options)
        except Exception as err:  # noqa: BLE001 - bad input: the caller answers 400
            taken.set_exception(err)
            return
        handle.request_id = request_id
        stop = self.engine.request_options(request_id).stop  # the request's own, normalised once
        handle.text = TextDeltas(self.engine.target.tokenizer, stop)
        self._handles[request_id] = handle
        taken.set_result(request_id)

    def _step(self) -> None:
        """``engine.step()``, in its parts: first tokens go out as soon as their (shared) prefill is done."""
        try:
            admitted = self.engine.admit()
            now = time.perf_counter()
            for output in admitted:
                self._publish(output, now)
            outputs = self.engine.decode()
        except Exception as err:  # noqa: BLE001 - the engine isolates request failures; this is anything else
            self._abort_all(error=err)
            return
        now = time.perf_counter()
        for output in outputs:
            self._publish(output, now)
        if self._on_step is not None:
            self._on_step(self.engine)

    def _publish(self, output: StepOutput, now: float) -> None:
        handle = self._handles.get(output.request_id)
        if handle is None:
            return
        if output.tokens and handle.first_token_s is None:
            handle.first_token_s = now
        handle._post(Delta(output.tokens, handle.text.add(output.tokens), now))
        if output.finished:
            self._deliver(output.request_id)

    def _abort(self, request_id: str) -> None:
        if self.engine.abort(request_id):
            self._deliver(request_id)

    def _abort_all(self, error: BaseException | None = None) -> None:
        """End every tracked request: ``"abort"``, or ``"error"`` with ``error`` (the engine may be broken)."""
        for request_id in list(self._handles):
            try:
                self.engine.abort(request_id)
            except Exception as err:  # noqa: BLE001 - a broken engine: its requests are answered all the same
                LOG.warning("aborting request %s failed: %r", request_id, err)
            self._deliver(request_id, error)

    def _deliver(self, request_id: str, error: BaseException | None = None) -> None:
        """Hand the request's result to its handle; ``error`` turns it into ``finish_reason "error"``."""
        result = self.engine.pop_result(request_id)
        if result is None:  # the engine lost it (or it broke before storing it): answer it all the same
            LOG.warning("the engine has no result for request %s", request_id)
            result = GenerationResult("", [], SpecStats(), "abort")
        if error is not None:
            result.finish_reason, result.error = "error", error
        self._deliver_result(request_id, result)

    def _deliver_result(self, request_id: str, result: GenerationResult) -> None:
        handle = self._handles.pop(request_id)
        if result.finish_reason == "error":
            LOG.warning("request %s failed: %r", request_id, result.error)
        rest = handle.text.close()  # text held back for a possible stop string that never came
        if rest:
            handle._post(Delta([], rest, time.perf_counter()))
        # The place is given back before the answer can go out: a client that sends its next request as soon as
        # it has this answer must find the place free (both callbacks run on the event loop, in this order).
        self._loop.call_soon_threadsafe(self._finished, handle, result)
        handle._post(result)


def _fail(reply: concurrent.futures.Future, error: BaseException) -> None:
    """Fail a future nobody will answer now, unless its caller has cancelled it."""
    if reply.done() or not (reply.running() or reply.set_running_or_notify_cancel()):
        return
    reply.set_exception(error)
