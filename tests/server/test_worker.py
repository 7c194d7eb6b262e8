"""EngineWorker: the engine on its own thread; every submitted request ends exactly once, whatever happens."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from vlmspec.server.worker import EngineWorker, Overloaded
from vlmspec.serving import BatchEngine


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
