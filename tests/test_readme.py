"""The documentation's code blocks run: each block marked ``<!-- test: NAME -->`` in README.md and docs/*.md.

The pages are README.md, then every ``docs/*.md`` page (:func:`pages`). Blocks run as written
except for the CPU-sized variants in :data:`VARIANTS` (a tiny random target where a page names
a model directory, fewer new tokens, a batch table measured for 1-2 requests, a free port
instead of 8000), and every Python block of every page must be marked, so a new example cannot
go untested. The blocks of one page run in page order in one namespace, as in one session (the
drafting-policy block uses the drafter the block before it saved); each page starts a fresh
one. Bash blocks run through ``bash``, a one-line ``vlmspec`` command in this process. Blocks
that need a host or a server (:data:`OWN_TESTS`) run in their own tests below: the step-API
block is a host's loop, for which the test supplies the host's own functions (``my_prefill``,
``my_forward``, ``kv_space_left``, ``my_rollback``) over one KV state per request, as
``examples/minimal_host.py`` does; the server blocks run against ``vlmspec serve`` on a free port.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vlmspec.cli import main as cli
from vlmspec.demo import demo_image

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- test: (?P<name>[\w-]+) -->\n```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.S)
MODEL_DIR = '"/models/Qwen2.5-VL-3B-Instruct"'

# (what the page says, what runs here): the documented CPU-sized variant of each block, by its name.
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "quickstart": [(MODEL_DIR, '"tiny:qwen2_5_vl"'), ("max_new_tokens=128", "max_new_tokens=24")],
    "dspark-drafter": [(MODEL_DIR, '"tiny:qwen2_5_vl"')],
    "drafting-policy": [],
    "batch-profile": [("--requests 1,4,16,32", "--requests 1,2 --warmup 1 --repeats 2")],
    "batch-engine": [("max_new_tokens=64", "max_new_tokens=12"), ("max_new_tokens=32", "max_new_tokens=8")],
    "step-api": [],
    "serve": [("--port 8000", "--port {port}")],
    "curl": [("8000", "{port}")],
    "openai-client": [("8000", "{port}"), ("max_tokens=64", "max_tokens=12"), ("max_tokens=32", "max_tokens=8")],
}
OWN_TESTS = {"step-api", "serve", "curl", "openai-client"}  # need a host's functions or a running server
# What a page's run must have left in its namespace after a block, beyond running without an error.
AFTER: dict[str, Callable[[dict], bool]] = {
    "drafting-policy": lambda ns: ns["proposer"].policy is not None,
    "batch-engine": lambda ns: ns["engine"].result(ns["rid"]).finish_reason in ("eos", "length"),
}


def pages() -> list[Path]:
    """README.md, then every docs/*.md page: the pages whose marked blocks run, in this order."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def page_blocks(page: Path) -> dict[str, tuple[str, str]]:
    """NAME -> (language, code) of every marked block of ``page``, in page order."""
    return {m["name"]: (m["lang"], m["code"]) for m in BLOCK.finditer(page.read_text())}


def find_block(name: str) -> tuple[Path, str, str]:
    """(page, language, code) of the marked block ``name``, wherever it is."""
    for page in pages():
        if name in (blocks := page_blocks(page)):
            return (page, *blocks[name])
    raise AssertionError(f"no page has a block marked <!-- test: {name} -->: update VARIANTS")


def variant(name: str, code: str, **fill: object) -> str:
    for said, run in VARIANTS[name]:
        assert said in code, f"the block {name!r} no longer contains {said!r}: update VARIANTS"
        code = code.replace(said, run.format(**fill))
    return code


def test_every_python_block_is_marked_and_every_marked_block_has_its_variant():
    names: list[str] = []
    for page in pages():
        text, marked = page.read_text(), page_blocks(page)
        python_blocks = len(re.findall(r"^```python$", text, re.M))
        marked_python = sum(lang == "python" for lang, _ in marked.values())
        assert marked_python == python_blocks, f"mark each ```python block of {page.relative_to(ROOT)}"
        names += marked
    assert len(names) == len(set(names)), "block names must be unique across the pages"
    assert sorted(names) == sorted(VARIANTS)


@pytest.fixture
def session(tmp_path, monkeypatch):
    """A fresh folder with the files the pages' examples name, and the tables they read."""
    monkeypatch.chdir(tmp_path)
    image = demo_image()
    for name in ("photo.jpg", "a.png", "b.png", "shape.png"):
        image.save(name)
    # sps.json as the dspark-drafter block's comment makes it, for its tiny target
    assert (
        cli(["profile", "--target", "tiny:qwen2_5_vl", "--dtype", "bfloat16", "--max-tokens", "8", "--out", "sps.json"])
        == 0
    )
    return tmp_path


def run_python(name: str, namespace: dict, **fill: object) -> None:
    page, _, code = find_block(name)
    exec(compile(variant(name, code, **fill), f"{page.name} <!-- test: {name} -->", "exec"), namespace)


def run_bash(name: str, **fill: object) -> str:
    page, _, code = find_block(name)
    code = variant(name, code, **fill)
    if len(code.splitlines()) == 1 and code.startswith("vlmspec "):  # in this process: no second start-up
        assert cli(shlex.split(code)[1:]) == 0, f"{page.name} block {name!r} failed"
        return ""
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page.name} block {name!r} failed:\n{done.stderr}"
    return done.stdout


def pages_with_runnable_blocks() -> list[Path]:
    return [page for page in pages() if set(page_blocks(page)) - OWN_TESTS]


@pytest.mark.parametrize("page", pages_with_runnable_blocks(), ids=lambda page: page.name)
def test_the_examples_of_each_page_run(page, session, capsys):
    """Each page's marked blocks in page order, one namespace a page (the quick start's identity assert included)."""
    namespace: dict = {}
    for name, (lang, _) in page_blocks(page).items():
        if name in OWN_TESTS:
            continue
        if lang == "python":
            run_python(name, namespace)
        else:
            run_bash(name)
        assert AFTER.get(name, lambda ns: True)(namespace), f"{page.name} block {name!r} did not do what it says"


def test_the_step_api_host_loop_runs(make_target):
    from vlmspec.drafters import PromptLookup
    from vlmspec.scheduling import build_scheduler
    from vlmspec.targets.adapter import prefill_output

    target, proposer = make_target("qwen2_vl"), PromptLookup(max_draft_tokens=4)
    kv: dict[int, object] = {}  # the host's KV: one request state per request
    namespace: dict = dict(target=target, proposer=proposer, scheduler=build_scheduler("none"), running=[])

    def my_prefill(request):
        inputs = target.build_inputs(None, "Repeat: one two three, one two three, one two three.")
        state, step = target.prefill(
            inputs, feature_layers=proposer.feature_layers, position_rule=proposer.position_rule
        )
        kv[id(request)] = state
        namespace["running"].append(request)
        return prefill_output(inputs, step, state.rope_delta)

    def my_forward(input_ids, num_inputs, positions):  # one row at a time, as examples/minimal_host.py
        logits = torch.zeros(*input_ids.shape, target.vocab_size)
        for row, request in enumerate(namespace["running"]):
            step = target.verify(kv[id(request)], input_ids[row, : int(num_inputs[row])])
            logits[row, : int(num_inputs[row])] = step.logits
        return logits, None

    def my_rollback(running, keep):
        for request, kept in zip(running, keep.tolist()):
            target.rollback(kv[id(request)], keep=kept)

    namespace.update(
        my_prefill=my_prefill,
        my_forward=my_forward,
        my_rollback=my_rollback,
        kv_space_left=lambda request: target.max_context - kv[id(request)].length,
    )
    run_python("step-api", namespace)
    request = namespace["request"]
    assert request.finished and 0 < len(request.tokens) <= 64 and request.stats.rounds > 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(shutil.which("vlmspec") is None or shutil.which("curl") is None, reason="needs vlmspec and curl")
def test_the_server_examples_run(session, capsys):
    """``vlmspec serve`` as written (on a free port), then the curl call and the openai client against it."""
    port = free_port()
    command = variant("serve", find_block("serve")[2].splitlines()[0], port=port)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = (session / "serve.log").open("w")  # a file, not a pipe: a full pipe would stall the server
    server = subprocess.Popen(shlex.split(command), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for_health(server, port, session / "serve.log")
        answer = run_bash("curl", port=port)
        assert '"choices"' in answer and '"vlmspec"' in answer, answer
        run_python("openai-client", {}, port=port)
        out = capsys.readouterr().out
        assert "'tau'" in out and "CompletionUsage" in out, out
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def wait_for_health(server: subprocess.Popen, port: int, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"vlmspec serve exited:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("vlmspec serve did not become healthy")
