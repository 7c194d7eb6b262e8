"""recipes/README.md's code blocks run: the CPU example, loading what it wrote, the library underneath.

The same rules as ``tests/test_readme.py``: blocks marked ``<!-- test: NAME -->`` run in
README order with the CPU-sized variants in :data:`VARIANTS` (fewer prompts, tokens and
steps; a temporary directory for ``/tmp/cpu-example``; the prompt file the training tests
use), and every Python block must be marked. The GPU and multi-machine command lines are
not run here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "recipes" / "README.md"
BLOCK = re.compile(r"<!-- test: (?P<name>[\w-]+) -->\n```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.S)
GSM8K_MINI = REPO / "tests" / "training" / "data" / "gsm8k-mini.jsonl"

# (what the README says, what runs here)
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "load-trained": [
        ('"/models/Qwen2.5-VL-3B-Instruct"', '"{out}/target"'),
        ('"runs/qwen25vl-3b-dspark/drafter"', '"{out}/drafter"'),
        ('device="cuda"', 'device="cpu"'),
    ],
    "cpu-example": [
        ("python recipes/", "{python} recipes/"),
        ("../shared/data/prompts/gsm8k.jsonl", str(GSM8K_MINI)),
        ("--num-prompts 64 --heldout-prompts 8", "--num-prompts 10 --heldout-prompts 2"),
        ("--max-new-tokens 48", "--max-new-tokens 12"),
        ("--steps 200", "--steps 6"),
        (
            "--eval-every 50 --save-every 100 --eval-sequences 8 --eval-max-new-tokens 48",
            "--eval-every 3 --save-every 3 --eval-sequences 2 --eval-max-new-tokens 8",
        ),
        ("/tmp/cpu-example", "{out}"),
    ],
    "cpu-example-load": [("/tmp/cpu-example", "{out}")],
    "library": [
        ('["prompts.jsonl"]', f'["{GSM8K_MINI}"]'),
        ("GenerationConfig(max_new_tokens=256)", "GenerationConfig(max_new_tokens=8, temperature=0)"),
        ("TrainConfig(steps=1000)", "TrainConfig(steps=2, batch_size=1, num_anchors=2, eval_every=0, save_every=0)"),
    ],
}


def readme_blocks() -> dict[str, tuple[str, str]]:
    return {m["name"]: (m["lang"], m["code"]) for m in BLOCK.finditer(README.read_text())}


def variant(name: str, **fill: object) -> str:
    code = readme_blocks()[name][1]
    for said, run in VARIANTS[name]:
        assert said in code, f"recipes/README.md block {name!r} no longer contains {said!r}: update VARIANTS"
        code = code.replace(said, run.format(**fill))
    return code


def test_every_python_block_is_marked():
    text = README.read_text()
    marked = readme_blocks()
    assert sum(lang == "python" for lang, _ in marked.values()) == len(re.findall(r"^```python$", text, re.M))
    assert sorted(marked) == sorted(VARIANTS)


def test_the_cpu_example_trains_a_drafter_the_engine_loads(tmp_path):
    out = tmp_path / "cpu-example"
    command = variant("cpu-example", python=sys.executable, out=out)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained drafter: tau" in done.stdout and (out / "report.json").is_file()
    namespace: dict = {}
    exec(compile(variant("cpu-example-load", out=out), "recipes/README.md cpu-example-load", "exec"), namespace)
    exec(compile(variant("load-trained", out=out), "recipes/README.md load-trained", "exec"), namespace)
    assert namespace["engine"].generate(None, "What is 2 + 3?", max_new_tokens=4).token_ids


@pytest.mark.usefixtures("monkeypatch")
def test_the_library_block_builds_a_cache_and_trains(make_target, tmp_path, monkeypatch):
    from tiny_drafters import tiny_drafter

    monkeypatch.chdir(tmp_path)
    target = make_target("qwen2_5_vl")
    namespace = {"target": target, "drafter": tiny_drafter(target)}
    exec(compile(variant("library"), "recipes/README.md library", "exec"), namespace)
    assert namespace["summary"].steps == 2 and (tmp_path / "cache" / "index.json").is_file()
