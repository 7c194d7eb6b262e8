"""`vlmspec serve`: flags become the engine and the server config; a missing extra or folder says what to do."""

from __future__ import annotations

import importlib
import sys

import pytest

from vlmspec.cli import main
from vlmspec.targets.inputs import ImageLimits


def test_serve_builds_the_engine_and_the_config_from_its_flags(monkeypatch, tmp_path, capsys):
    served = {}
    monkeypatch.setattr("vlmspec.server.serve", lambda engine, config, host, port: served.update(locals()))
    args = ["serve", "--target", "tiny:qwen2_vl", "--drafter", "prompt-lookup", "--port", "8123"]
    args += ["--max-batch-size", "4", "--max-queued", "2", "--allowed-local-media-path", str(tmp_path)]
    args += ["--speculate-up-to", "2", "--max-image-bytes", "1000000", "--max-image-pixels", "2000000"]
    assert main(args) == 0
    engine, config = served["engine"], served["config"]
    assert engine.max_batch_size == 4 and engine.speculate_up_to == 2
    assert type(engine.proposer).__name__ == "PromptLookup"
    assert type(engine.scheduler).__name__ == "VerifyAll"  # prompt lookup has no confidences to threshold
    assert (config.model_name, config.max_queued, config.allowed_media) == ("tiny:qwen2_vl", 2, tmp_path)
    assert (config.image_limits.max_bytes, config.image_limits.max_pixels) == (1_000_000, 2_000_000)
    assert (served["host"], served["port"]) == ("127.0.0.1", 8123)
    assert "http://127.0.0.1:8123/v1" in capsys.readouterr().out


def test_serve_defaults_for_the_reference_pair_read_its_measured_curve_and_calibration(monkeypatch):
    served = {}
    monkeypatch.setattr("vlmspec.server.serve", lambda engine, config, host, port: served.update(locals()))
    assert main(["serve", "--target", "reference", "--drafter", "reference"]) == 0
    engine = served["engine"]
    assert engine.speculate_up_to == 1  # the curve describes one request
    scheduler = engine.scheduler
    assert type(scheduler).__name__ == "CalibratedScheduler"
    assert type(scheduler.inner).__name__ == "SPSArgmaxScheduler"


def test_serve_refuses_a_media_folder_that_does_not_exist(tmp_path, capsys):
    args = ["serve", "--target", "tiny:qwen2_vl", "--allowed-local-media-path", str(tmp_path / "missing")]
    assert main(args) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_serve_image_limits_default_to_image_limits_and_refuse_zero(monkeypatch, capsys):
    served = {}
    monkeypatch.setattr("vlmspec.server.serve", lambda engine, config, host, port: served.update(locals()))
    assert main(["serve", "--target", "tiny:qwen2_vl", "--drafter", "prompt-lookup"]) == 0
    assert served["config"].image_limits == ImageLimits()
    with pytest.raises(SystemExit) as refused:
        main(["serve", "--target", "tiny:qwen2_vl", "--max-image-pixels", "0"])
    assert refused.value.code == 2
    assert "--max-image-pixels: must be an integer >= 1, got '0'" in capsys.readouterr().err


def test_without_the_serve_extra_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if it were not installed
    for name in [m for m in sys.modules if m == "vlmspec.server" or m.startswith("vlmspec.server.")]:
        monkeypatch.delitem(sys.modules, name)
    server = importlib.import_module("vlmspec.server")  # the limits import without it (the command's --help)
    with pytest.raises(ImportError, match=r"pip install 'vlmspec\[serve\]'"):
        getattr(server, "ServerConfig")  # noqa: B009 - the lazy attribute is what is tested
