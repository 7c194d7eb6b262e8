"""Fixtures of the server tests: a tiny target, a tiny DSpark drafter and a live server (see server_helpers)."""

from __future__ import annotations

import pytest
from server_helpers import MODEL
from tiny_drafters import tiny_drafter

from vlmspec.drafters.dspark import DSparkProposer
from vlmspec.server import BackgroundServer, ServerConfig
from vlmspec.serving import BatchEngine


@pytest.fixture(scope="module")
def server_target(make_target):
    # Tests compute their expected outputs with SpecEngine on this target while the server is idle:
    # the ragged batch switches the model's attention for its own forwards only.
    return make_target("qwen2_vl")


@pytest.fixture(scope="module")
def drafter(server_target):
    return DSparkProposer(tiny_drafter(server_target))


@pytest.fixture(scope="module")
def live(server_target, drafter):
    server = BackgroundServer(
        BatchEngine(server_target, drafter, max_batch_size=8), ServerConfig(MODEL, max_queued=32)
    ).start()
    yield server
    server.stop()
