"""The examples run and check themselves."""

import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_minimal_host_is_short_and_lossless(make_target, capsys):
    source = (EXAMPLES / "minimal_host.py").read_text()
    assert len(source.splitlines()) < 150
    load("minimal_host").main(make_target("qwen2_vl"))  # asserts greedy outputs equal the target alone
    assert "greedy outputs equal the target alone" in capsys.readouterr().out
