"""EngineWorker: the engine on its own thread; every submitted request ends exactly once, whatever happens."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from vlmspec.server.worker import EngineWorker, Overloaded, Unavailable
from vlmspec.serving import BatchEngine

DEADLINE_S = 20.0  # for anything that would wait forever if the worker forgot a request


class Fatal(BaseException):
    """Not an Exception: the worker's per-step guard lets it through, so it ends the engine thread."""


async def settle(worker: EngineWorker) -> None:
    for _ in range(3000):
        if worker.active == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the worker did not settle")


def cancel_a_submit(server_target, before_the_engine_takes_it: bool) -> list[str]:
    """Submit a long request and cancel the submitting task; returns the finish reasons the worker reported."""

    async def scenario() -> list[str]:
        finished = []
        worker = EngineWorker(BatchEngine(server_target), on_finish=lambda h, r: finished.append(r.finish_reason))
        worker.start()
        gate = threading.Event()
        if before_the_engine_takes_it:
            worker._send(gate.wait)  # the worker thread is busy until the gate opens
        submitting = asyncio.ensure_future(worker.submit(prompt="Hello", max_new_tokens=1500))
        await asyncio.sleep(0)  # submit() has sent its command and waits for the engine
        if not before_the_engine_takes_it:
            time.sleep(0.5)  # block the event loop: the engine takes the request before the loop hears of it
        submitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submitting
        gate.set()
        await settle(worker)
        assert not worker.engine.has_unfinished and worker.engine.num_waiting == 0
        worker.stop()
        return finished

    return asyncio.run(scenario())


def test_a_submit_cancelled_after_the_engine_took_it_is_aborted_and_counted(server_target):
    assert cancel_a_submit(server_target, before_the_engine_takes_it=False) == ["abort"]


def test_a_submit_cancelled_before_the_engine_took_it_never_runs(server_target):
    assert cancel_a_submit(server_target, before_the_engine_takes_it=True) == []


def test_stopping_ends_every_request_and_refuses_new_ones(server_target):
    async def scenario() -> None:
        worker = EngineWorker(BatchEngine(server_target, max_batch_size=1), max_queued=1)
        worker.start()
        running = await worker.submit(prompt="Go on.", max_new_tokens=1500)
        queued = await worker.submit(prompt="Me too.", max_new_tokens=1500)
        with pytest.raises(Overloaded, match="at capacity"):
            await worker.submit(prompt="And me.", max_new_tokens=4)
        worker.stop()
        results = await asyncio.gather(running.wait(), queued.wait())
        assert [r.finish_reason for r in results] == ["abort", "abort"]
        assert worker.active == 0 and not worker.alive
        with pytest.raises(RuntimeError, match="not running"):
            await worker.submit(prompt="Late.", max_new_tokens=4)

    asyncio.run(scenario())


def test_a_dying_engine_thread_answers_every_request_and_refuses_new_ones(server_target, monkeypatch):
    """Running, engine-queued and not-yet-taken requests all end with an error naming the cause; none hangs."""

    async def scenario() -> None:
        engine = BatchEngine(server_target, max_batch_size=1)
        worker = EngineWorker(engine, max_queued=4)
        worker.start()
        running = await worker.submit(prompt="Go on.", max_new_tokens=1500)
        waiting = await worker.submit(prompt="Me too.", max_new_tokens=1500)  # in the engine's queue: one row
        in_step, fire = threading.Event(), threading.Event()

        def fatal_decode():
            in_step.set()
            fire.wait(DEADLINE_S)
            raise Fatal("the machine caught fire")

        monkeypatch.setattr(engine, "decode", fatal_decode)
        assert await asyncio.to_thread(in_step.wait, DEADLINE_S)
        not_taken = asyncio.ensure_future(worker.submit(prompt="And me.", max_new_tokens=4))
        await asyncio.sleep(0)  # its command waits in the worker's queue behind the step
        fire.set()

        everyone = asyncio.gather(running.wait(), waiting.wait(), not_taken, return_exceptions=True)
        *results, refused = await asyncio.wait_for(everyone, DEADLINE_S)
        for result in results:
            assert result.finish_reason == "error" and isinstance(result.error, Unavailable)
            assert "died of Fatal" in str(result.error)
        assert isinstance(refused, Unavailable) and "died of Fatal" in str(refused)
        with pytest.raises(Unavailable, match="the engine is not running.*died of Fatal"):
            await asyncio.wait_for(worker.submit(prompt="Late.", max_new_tokens=4), 1.0)
        assert not worker.alive and isinstance(worker.failure, Fatal)
        await settle(worker)  # every admitted request was counted out
        worker.stop(timeout=DEADLINE_S)

    asyncio.run(scenario())


def test_a_request_the_engine_lost_is_answered_without_killing_the_thread(server_target, monkeypatch):
    """A request whose result the engine no longer has (aborted, stopped) still ends, as "abort"."""

    async def scenario() -> None:
        engine = BatchEngine(server_target, max_batch_size=2)
        worker = EngineWorker(engine)
        worker.start()
        real_abort = engine.abort

        def abort_and_lose(request_id: str) -> bool:
            found = real_abort(request_id)
            engine.pop_result(request_id)  # the engine forgets the request: no result to deliver
            return found

        monkeypatch.setattr(engine, "abort", abort_and_lose)
        lost = await worker.submit(prompt="Go on.", max_new_tokens=1500)
        worker.abort(lost)
        assert (await asyncio.wait_for(lost.wait(), DEADLINE_S)).finish_reason == "abort"
        served = await worker.submit(prompt="Still there?", max_new_tokens=3)
        assert (await asyncio.wait_for(served.wait(), DEADLINE_S)).finish_reason == "length"
        assert worker.alive
        stopped = await worker.submit(prompt="Go on.", max_new_tokens=1500)
        worker.stop(timeout=DEADLINE_S)  # aborts every tracked request, each one lost
        assert (await asyncio.wait_for(stopped.wait(), DEADLINE_S)).finish_reason == "abort"
        assert worker.failure is None
        await settle(worker)

    asyncio.run(scenario())


def test_the_engine_thread_runs_torch_on_the_cpu_threads_it_is_given(server_target):
    async def scenario() -> list[int]:
        worker = EngineWorker(BatchEngine(server_target))
        worker.start(cpu_threads=1)
        seen: list[int] = []
        done = threading.Event()
        worker._send(lambda: (seen.append(torch.get_num_threads()), done.set()))
        assert done.wait(DEADLINE_S)
        worker.stop()
        return seen

    before = torch.get_num_threads()
    assert asyncio.run(scenario()) == [1]
    assert torch.get_num_threads() == before  # the process-wide count is the caller's business
