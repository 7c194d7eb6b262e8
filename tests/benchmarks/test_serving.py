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
