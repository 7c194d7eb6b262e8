"""Thread placement for a server process: the engine thread runs torch's CPU threads, helpers run alone."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from vlmspec.kernels import threads


def _on_new_thread(fn):
    """Run ``fn`` on a fresh thread (so nothing here changes the test runner's own thread) and return its result."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result(timeout=60)


needs_openmp = pytest.mark.skipif(
    threads._openmp() is None, reason="torch runs on no OpenMP runtime this process can find (not Linux/libgomp)"
)


@needs_openmp
def test_torch_runtime_is_the_one_found():
    assert threads._loaded_openmp_path() is not None


@needs_openmp
def test_single_threaded_helper_leaves_other_threads_alone():
    before = torch.get_num_threads()

    def helper() -> int:
        threads.run_single_threaded()
        torch.ones(4096, 64).sum()  # a first torch op must not reset the count
        return torch.get_num_threads()

    assert _on_new_thread(helper) == 1
    assert torch.get_num_threads() == before
    assert _on_new_thread(torch.get_num_threads) == before  # nor the process-wide count new threads start from


@needs_openmp
def test_hand_over_and_take_back_nest_on_one_thread():
    def starter() -> tuple[int, int, int, int, int, int]:
        own = torch.get_num_threads()
        first = threads.hand_over_cpu_threads()
        second = threads.hand_over_cpu_threads()  # a second engine started from the same thread
        during = torch.get_num_threads()
        threads.take_back_cpu_threads()
        still = torch.get_num_threads()
        threads.take_back_cpu_threads()
        return own, first, second, during, still, torch.get_num_threads()

    own, first, second, during, still, after = _on_new_thread(starter)
    assert first == second == own
    assert during == (1 if own > 1 else own)
    assert still == during  # the outer engine is still running
    assert after == own


def test_take_back_without_hand_over_is_a_no_op():
    assert _on_new_thread(lambda: (threads.take_back_cpu_threads(), torch.get_num_threads())[1]) == (
        torch.get_num_threads()
    )


@needs_openmp
def test_engine_thread_takes_the_count_it_is_given():
    before = torch.get_num_threads()
    try:
        assert _on_new_thread(lambda: (threads.take_cpu_threads(1), torch.get_num_threads())[1]) == 1
        assert _on_new_thread(torch.get_num_threads) == before  # later threads start from the process-wide count
    finally:
        torch.set_num_threads(before)
