"""Held out means held out: no benchmark's default selection is something the reference drafter trains on.

The split is defined once (``vlmspec.data.heldout``); this checks it where it matters, by
content: the reference prompt mix is written (``recipes/reference_prompts.py`` with the
shipped drafter's arguments, ``recipes/reference_mix.sh``) and every benchmark's default
questions are built with the benchmark's own code, then their prompt texts and pictures are compared. Pictures are compared by pixel
digest, the benchmark's at full size shrunk the way the mix shrinks its own, so a picture
is caught under any name (``skimage.data.cat`` is the benchmarks' ``chelsea``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks import concurrency, make_mmbench_fixture, mmbench_spec, serving
from benchmarks.common import shrink_image
from benchmarks.spec.workloads import Task, prompt_set_tasks
from vlmspec.data.heldout import (
    HELD_OUT_PROMPTS,
    held_out_picture_digests,
    held_out_prompts,
    is_held_out_picture,
    training_prompts,
)
from vlmspec.data.pictures import pixel_digest, skimage_image

REPO = Path(__file__).parents[2]
PROMPTS = REPO.parent / "shared" / "data" / "prompts"
CODE_MATHS = REPO / "benchmarks" / "data" / "code-maths.jsonl"
REFERENCE_MIX = REPO / "recipes" / "reference_mix.sh"

needs_prompt_sets = pytest.mark.skipif(
    not all((PROMPTS / name).is_file() for name in ("gsm8k.jsonl", "mt-bench.jsonl")),
    reason="the GSM8K and MT-Bench prompt sets live beside the checkout (../shared/data/prompts)",
)


@dataclass
class Mix:
    """What the reference mix trains on, by content."""

    texts: set[str]  # every user turn
    pictures: set[str]  # pixel digests of the pictures, as saved for training
    picture_max_side: int  # how small the mix saves its pictures


def load_mix_recipe():
    """recipes/reference_prompts.py as a module (the recipes directory is not a package; the script finds its siblings)."""
    spec = importlib.util.spec_from_file_location("reference_prompts", REPO / "recipes" / "reference_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_mix_args() -> list[str]:
    """The shipped drafter's mix: the REFERENCE_MIX array of recipes/reference_mix.sh."""
    text = REFERENCE_MIX.read_text()
    body = text[text.index("REFERENCE_MIX=(") + len("REFERENCE_MIX=(") :]
    return shlex.split(body[: body.index(")")], comments=True)


@pytest.fixture(scope="module")
def mix(tmp_path_factory) -> Mix:
    pytest.importorskip("easy_vqa")  # the mix and the image workloads read easy-vqa's pictures
    recipe = load_mix_recipe()
    out = tmp_path_factory.mktemp("mix")
    path = recipe.main(["--out", str(out), "--prompts-dir", str(PROMPTS), *reference_mix_args()])
    records = [json.loads(line) for line in path.read_text().splitlines()]
    pictures = {pixel_digest(path.parent / image) for r in records for image in r.get("images", [])}
    return Mix({turn for r in records for turn in r["turns"]}, pictures, recipe.PICTURE_MAX_SIDE)


@pytest.fixture
def in_repo(monkeypatch):
    """The benchmarks' default prompt sets are paths relative to the repository root."""
    monkeypatch.chdir(REPO)


def concurrency_tasks(workload: str) -> list[Task]:
    args = concurrency.parse_args(["--workload", workload])
    return concurrency.workload(args, max(args.levels))


def serving_tasks(workload: str) -> list[Task]:
    args = serving.parse_args(["--workload", workload])
    return concurrency.workload(args, args.requests)


def mmbench_spec_tasks(tmp_path: Path) -> list[Task]:
    """The README's reference-pair benchmark at the default --num-questions, pictures at full size."""
    sets = [str(PROMPTS / "gsm8k.jsonl"), str(PROMPTS / "mt-bench.jsonl"), str(CODE_MATHS)]
    argv = ["--target", "reference", "--vqa", "--image-max-side", "0", "--out", str(tmp_path)]
    argv += [a for s in sets for a in ("--prompt-set", s)]
    return mmbench_spec.collect_tasks(mmbench_spec.build_parser().parse_args(argv))[0]


def prompt_set_benchmarks() -> dict[str, list[Task]]:
    """The benchmarks with a ``PROMPT_SETS`` default (vs_peers, vllm_export, ...): the first --num-questions of each.

    Their mains select this way inline; finding them by the constant keeps a new one from slipping past.
    """
    selections = {}
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        if not re.search(r"^PROMPT_SETS\b", path.read_text(), re.MULTILINE):
            continue
        module = importlib.import_module(f"benchmarks.{path.stem}")
        args = module.parse_args([])
        paths = args.prompt_set or module.PROMPT_SETS
        selections[path.stem] = [t for p in paths for t in prompt_set_tasks(p, args.num_questions)]
    assert {"vs_peers"} <= set(selections)  # the search finds them
    return selections


def mmbench_fixture_pictures() -> list:
    """The pictures of the MMBench fixture (tests/fixtures/mmbench_mini.tsv), at full size."""
    return [skimage_image(row[0]) for row in make_mmbench_fixture.FIXTURE_ROWS]


def default_selections(tmp_path: Path) -> dict[str, list[Task]]:
    return {
        "concurrency (mixed)": concurrency_tasks("mixed"),
        "concurrency (text)": concurrency_tasks("text"),
        "serving (mixed)": serving_tasks("mixed"),
        "serving (text)": serving_tasks("text"),
        "mmbench_spec": mmbench_spec_tasks(tmp_path),
        **prompt_set_benchmarks(),
    }


@needs_prompt_sets
def test_no_benchmark_asks_a_question_or_shows_a_picture_the_mix_trains_on(mix, in_repo, tmp_path):
    def trained_on(image) -> bool:  # compared at the size the mix saves its pictures at
        return pixel_digest(shrink_image(image, mix.picture_max_side)) in mix.pictures

    for benchmark, tasks in default_selections(tmp_path).items():
        assert tasks, benchmark
        for task in tasks:
            trained = task.prompt in mix.texts
            assert not trained, f"{benchmark}: {task.qid} is in the training mix: {task.prompt[:60]!r}"
            assert not any(map(trained_on, task.images)), f"{benchmark}: {task.qid}'s picture is in the training mix"
    fixture = make_mmbench_fixture.FIXTURE_ROWS
    assert not [row[0] for row, image in zip(fixture, mmbench_fixture_pictures()) if trained_on(image)]


@needs_prompt_sets
def test_every_benchmark_selection_lies_inside_the_held_out_split(in_repo, tmp_path):
    """The split knows every benchmark's questions and pictures, so the mix's filter through it is complete."""
    pytest.importorskip("easy_vqa")
    held_out = held_out_picture_digests()
    for benchmark, tasks in default_selections(tmp_path).items():
        for task in tasks:
            if task.workload in HELD_OUT_PROMPTS:
                path = PROMPTS / f"{task.workload}.jsonl"
                assert task.prompt in held_out_prompts(path), f"{benchmark}: {task.qid} is past the held-out entries"
            for image in task.images:
                assert pixel_digest(image) in held_out, f"{benchmark}: {task.qid}'s picture is not in the split"
    assert all(pixel_digest(image) in held_out for image in mmbench_fixture_pictures())


def test_a_picture_is_held_out_by_its_pixels_not_its_name():
    assert is_held_out_picture(skimage_image("cat"))  # scikit-image's cat is the benchmarks' chelsea
    assert not is_held_out_picture(skimage_image("horse"))


def write_prompt_set(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(count)))
    return path


def test_a_split_set_gives_benchmarks_its_head_and_training_its_tail(tmp_path):
    path = write_prompt_set(tmp_path / "mt-bench.jsonl", 30)
    held = HELD_OUT_PROMPTS["mt-bench"]
    assert held_out_prompts(path) == [f"question {i}" for i in range(held)]
    assert training_prompts(path, 30 - held) == [f"question {i}" for i in range(held, 30)]
    with pytest.raises(ValueError, match=f"only the first {held} of 'mt-bench' are held out"):
        held_out_prompts(path, held + 1)
    with pytest.raises(ValueError, match="ask for at most"):
        training_prompts(path, 30 - held + 1)


def test_a_set_the_split_does_not_name_is_held_out_entirely(tmp_path):
    path = write_prompt_set(tmp_path / "my-questions.jsonl", 3)
    assert held_out_prompts(path, 10) == ["question 0", "question 1", "question 2"]  # nothing more exists
    with pytest.raises(ValueError, match="add how many of its first entries"):
        training_prompts(path, 1)
