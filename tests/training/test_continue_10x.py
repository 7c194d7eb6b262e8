"""recipes/continue_10x.sh picks the stage that is due and carries the run in its state file.

The recipe itself is stubbed out (a fake ``python3`` on PATH records its arguments and leaves the
report a training chunk would), so this checks the script's own logic: which stage runs, on which
prompts, when the drafter is shipped, and what the state file says afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TOTAL = 10_000  # training prompts in the stub mix (the real one has 26,686)

STUB = """#!/usr/bin/env bash
if [[ "$1" == "-" ]]; then exec {python} "$@"; fi   # the script's own report check runs for real
echo "$*" >> {calls}
out=""; prev=""
for arg in "$@"; do [[ "$prev" == --out ]] && out="$arg"; prev="$arg"; done
if [[ "$*" == *--init-from* ]]; then
  mkdir -p "$out"
  echo '{{"untrained": {{"tau": 1.40}}, "trained": {{"tau": '"$TAU_AFTER"', "identical_to_target": true, "rounds": 9}}}}' \\
    > "$out/report.json"
fi
"""


@pytest.fixture
def layout(tmp_path):
    """A checkout with the script, the mix, a state file, a RUN with the prompts, and the stub recipe."""
    (tmp_path / "recipes").mkdir()
    for name in ("continue_10x.sh", "reference_mix.sh"):
        shutil.copy(RECIPES / name, tmp_path / "recipes" / name)
    (tmp_path / "run" / "prompts").mkdir(parents=True)
    (tmp_path / "run" / "prompts" / "prompts.jsonl").write_text("{}\n" * (TOTAL + 16))  # 16 held out
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "python3"
    stub.write_text(STUB.format(python=sys.executable, calls=tmp_path / "calls.log"))
    stub.chmod(0o755)
    return tmp_path


def write_state(root: Path, **values: int) -> None:
    (root / "recipes" / "reference_10x.state").write_text("".join(f"{k}={v}\n" for k, v in values.items()))


def read_state(root: Path) -> dict[str, int]:
    lines = (root / "recipes" / "reference_10x.state").read_text().splitlines()
    return {k: int(v.split()[0]) for k, v in (line.split("=", 1) for line in lines if "=" in line)}


def run_stage(root: Path, tau_after: float = 1.5, **env: str) -> tuple[int, list[str]]:
    calls = root / "calls.log"
    calls.unlink(missing_ok=True)
    environ = {**os.environ, "PATH": f"{root / 'bin'}:{os.environ['PATH']}", "RUN": str(root / "run")}
    result = subprocess.run(
        ["bash", str(root / "recipes" / "continue_10x.sh")],
        env={**environ, "TAU_AFTER": str(tau_after), **env},
        capture_output=True,
        text=True,
    )
    return result.returncode, calls.read_text().splitlines() if calls.exists() else []


def test_stages_alternate_a_chunk_on_new_answers_and_more_answers(layout):
    # answers of 6,144 prompts and no chunk yet (a state file from before chunks alternated): a chunk is due
    write_state(layout, REGENERATED_PROMPTS=6144, TRAINED_CHUNKS=0, IMPROVED_CHUNKS=0)
    code, calls = run_stage(layout, tau_after=1.6)
    assert code == 0 and len(calls) == 2  # the chunk, then shipping its drafter
    assert "--num-prompts 6144" in calls[0] and "--init-from" in calls[0] and "chunk-1-cache" in calls[0]
    assert "ship_reference_drafter.py" in calls[1]
    assert read_state(layout) == dict(
        REGENERATED_PROMPTS=6144, TRAINED_CHUNKS=1, IMPROVED_CHUNKS=1, TRAINED_ON_PROMPTS=6144
    )
    # nothing new since that chunk: more answers
    code, calls = run_stage(layout)
    assert code == 0 and len(calls) == 1 and "--cache-only" in calls[0] and "--num-prompts 8192" in calls[0]
    assert read_state(layout)["REGENERATED_PROMPTS"] == 8192
    # new answers: a chunk on all 8,192; it loses to the shipped drafter, which stays
    code, calls = run_stage(layout, tau_after=1.3)
    assert code == 0 and len(calls) == 1 and "--num-prompts 8192" in calls[0] and "chunk-2" in calls[0]
    assert read_state(layout) == dict(
        REGENERATED_PROMPTS=8192, TRAINED_CHUNKS=2, IMPROVED_CHUNKS=1, TRAINED_ON_PROMPTS=8192
    )


def test_every_prompt_answered_leaves_only_chunks(layout):
    write_state(layout, REGENERATED_PROMPTS=TOTAL, TRAINED_CHUNKS=3, IMPROVED_CHUNKS=2, TRAINED_ON_PROMPTS=TOTAL)
    code, calls = run_stage(layout)
    assert code == 0 and "chunk-4" in calls[0]
    code, calls = run_stage(layout, NEXT="regen")
    assert code == 0 and calls == []


def test_an_unknown_next_stage_is_refused_with_the_choices(layout):
    write_state(layout, REGENERATED_PROMPTS=6144, TRAINED_CHUNKS=0, IMPROVED_CHUNKS=0)
    code, calls = run_stage(layout, NEXT="training")
    assert code == 2 and calls == []
