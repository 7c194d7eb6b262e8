"""The serving benchmark's rounds: each round sends its own questions, and a bad count is refused."""

from __future__ import annotations

import pytest

from benchmarks import serving


def test_each_round_sends_other_questions():
    args = serving.parse_args(["--workload", "text", "--requests", "4", "--rounds", "3"])
    bodies = serving.chat_requests(args)
    assert len(bodies) == 4 * 3
    texts = [body["messages"][0]["content"][-1]["text"] for body in bodies]
    assert len(set(texts)) == len(texts)  # a prefix cache never holds a later round's prompt
    one_round = serving.chat_requests(serving.parse_args(["--workload", "text", "--requests", "4"]))
    assert [body["messages"] for body in one_round] == [body["messages"] for body in bodies[:4]]


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        serving.parse_args(["--rounds", "0"])


def test_restarts_must_be_positive():
    with pytest.raises(SystemExit):
        serving.parse_args(["--restarts", "0"])
    assert serving.parse_args([]).restarts == 1


def _run(start: int, round_index: int, wall_s: float, tokens: int) -> serving.Run:
    timing = serving.Timing(0.0)
    timing.completion_tokens = tokens
    return serving.Run(start, round_index, wall_s, [timing])


def test_ratio_by_start_pools_each_start_then_averages_the_starts():
    alone = [_run(0, 0, 1.0, 100), _run(0, 1, 1.0, 100), _run(1, 0, 2.0, 100), _run(1, 1, 2.0, 100)]
    # start 0: 200 tokens in 2.5 s against 200 in 2.0 s -> 0.8; start 1: 200 in 2.0 s against 200 in 4.0 s -> 2.0
    variant = [_run(0, 0, 1.0, 100), _run(0, 1, 1.5, 100), _run(1, 0, 1.0, 100), _run(1, 1, 1.0, 100)]
    summary = serving.ratio_by_start(variant, alone)
    assert summary["start_vs_alone"] == pytest.approx([0.8, 2.0])
    assert summary["vs_alone_mean_of_starts"] == pytest.approx(1.4)
    assert summary["vs_alone_standard_error"] == pytest.approx(0.6)  # stdev 0.8485 / sqrt(2)
    assert serving.format_by_start(summary | {"start_vs_alone": [0.8, 2.0]}) == "1.400 +- 0.600 (2 starts)"


def test_one_start_has_no_standard_error():
    summary = serving.ratio_by_start([_run(0, 0, 1.0, 90)], [_run(0, 0, 1.0, 100)])
    assert summary["start_vs_alone"] == pytest.approx([0.9])
    assert summary["vs_alone_standard_error"] is None
    assert serving.format_by_start(summary) == "0.900 (1 start)"


def test_the_servers_launch_in_alternating_orders_over_the_starts(monkeypatch, tmp_path):
    launched = []

    class Server:
        url = "http://127.0.0.1:1/v1"

        def wait_ready(self, timeout):
            pass

        def stop(self):
            pass

    def start_server(variant, args, sps, out):
        launched.append(variant)
        return Server()

    async def run_cell(url, bodies, clients):
        return 0.0, []

    monkeypatch.setattr(serving, "start_server", start_server)
    monkeypatch.setattr(serving, "run_cell", run_cell)
    args = serving.parse_args(["--variants", "alone,default"])
    orders = []
    for start in range(4):
        launched.clear()
        servers = serving.start_servers(args, None, tmp_path, warm_up=[], start=start)
        orders.append(list(launched))
        assert list(servers) == launched  # warmed up and measured in the same order
    assert orders.count(["alone", "default"]) == orders.count(["default", "alone"]) == 2
