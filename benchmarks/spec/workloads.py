"""Workloads: the questions every variant answers, and how an answer is scored.

An MMBench TSV (multiple choice over an image, scored by the extracted letter), prompt sets
such as ``../shared/data/prompts/mt-bench.jsonl`` (first turns, text only, held-out entries
only: ``vlmspec.data.heldout``), easy-vqa's shape images (one-word answers) and open
questions about scikit-image photographs (long answers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import shrink_image, skimage_image
from benchmarks.spec.choices import extract_choice, normalize_words
from vlmspec.data.heldout import held_out_prompts
from vlmspec.data.mmbench import RowProblem, build_mmbench_prompt, read_mmbench_tsv
from vlmspec.data.prompt_sets import prompt_set_name, read_prompt_set  # noqa: F401 - read here by tests


@dataclass
class Task:
    """One question of a workload, ready for every variant."""

    workload: str  # "mmbench", a prompt set's name, "easy-vqa" or "skimage-open"
    qid: str  # unique within the run
    group: str  # what speedups are broken down by: MMBench category, or the workload itself
    prompt: str
    images: tuple[Any, ...] = ()  # PIL images (none for text prompts)
    answer: str | None = None
    options: dict[str, str] | None = None  # MMBench: scored by the extracted letter
    scoring: str = "none"  # "letter" | "word" | "none"

    @property
    def image_arg(self) -> Any:
        """What ``SpecEngine.generate`` takes: None, one image, or a list."""
        if not self.images:
            return None
        return self.images[0] if len(self.images) == 1 else list(self.images)


def mmbench_tasks(path: str | Path, limit: int | None, max_side: int | None) -> tuple[list[Task], list[RowProblem]]:
    """Tasks from an MMBench TSV (grouped by category), and the rows that could not be used."""
    parsed = read_mmbench_tsv(path, limit)
    tasks = [
        Task(
            workload="mmbench",
            qid=f"mmbench-{q.index}",
            group=q.category or "uncategorized",
            prompt=build_mmbench_prompt(q),
            images=(shrink_image(q.pil_image(), max_side),),
            answer=q.answer,
            options=q.options,
            scoring="letter" if q.answer else "none",
        )
        for q in parsed.questions
    ]
    return tasks, parsed.problems


def prompt_set_tasks(path: str | Path, limit: int | None) -> list[Task]:
    """Text-only tasks from a prompt set's held-out entries; the workload is named after the file (``mt-bench``).

    ``limit`` None takes every held-out entry; a limit past them raises ValueError (see vlmspec.data.heldout).
    """
    name = prompt_set_name(path)
    prompts = held_out_prompts(path, limit)
    return [Task(workload=name, qid=f"{name}-{i}", group=name, prompt=p) for i, p in enumerate(prompts)]


# Open questions about scikit-image photographs: answers are long and free-form.
SKIMAGE_OPEN_QUESTIONS: tuple[tuple[str, str], ...] = (
    ("astronaut", "Describe this photograph in detail: the person, what they are wearing, and the background."),
    ("coffee", "Describe everything you can see in this picture, including the colors and the objects."),
    ("chelsea", "Write a short story of about five sentences about the animal in this picture."),
    ("rocket", "Explain what is happening in this scene and what will probably happen next."),
    ("hubble_deep_field", "What does this image show? Explain how an image like this is made."),
    ("coins", "Describe the objects in this image and how they are arranged."),
    ("page", "Transcribe the text in this image as accurately as you can."),
    ("camera", "Describe the man in this photo and what he is doing."),
    ("immunohistochemistry", "What kind of image is this? Describe its colors and structures."),
    ("colorwheel", "List the colors you see in this image and describe how they are arranged."),
    ("brick", "Describe the texture and the material shown in this image."),
    ("text", "Read the handwriting in this image and explain what it is about."),
)


def skimage_open_tasks(limit: int | None, max_side: int | None) -> list[Task]:
    """Open, long-answer questions about real photographs from scikit-image."""
    chosen = SKIMAGE_OPEN_QUESTIONS[:limit]
    return [
        Task(
            workload="skimage-open",
            qid=f"skimage-{i}-{name}",
            group="skimage-open",
            prompt=question,
            images=(skimage_image(name, max_side),),
        )
        for i, (name, question) in enumerate(chosen)
    ]


def easy_vqa_tasks(limit: int | None) -> list[Task]:
    """Short-answer questions about easy-vqa's 64x64 shape images, spread evenly over its test split."""
    try:
        import easy_vqa
    except ImportError as err:
        raise ImportError("--vqa needs the easy-vqa package: pip install easy-vqa") from err
    from PIL import Image

    questions, answers, image_ids = easy_vqa.get_test_questions()
    paths = easy_vqa.get_test_image_paths()
    count = len(questions) if limit is None else min(limit, len(questions))
    picks = [i * len(questions) // count for i in range(count)]
    tasks = []
    for i in picks:
        with Image.open(paths[image_ids[i]]) as image:
            rgb = image.convert("RGB")
        prompt = f"{questions[i][0].upper()}{questions[i][1:]} Answer with one word."
        tasks.append(
            Task(
                workload="easy-vqa",
                qid=f"easy-vqa-{i}",
                group="easy-vqa",
                prompt=prompt,
                images=(rgb,),
                answer=answers[i],
                scoring="word",
            )
        )
    return tasks


def score(task: Task, text: str) -> tuple[str | None, bool | None]:
    """(prediction, correct) for one answer; (None, None) when the task has no reference answer."""
    if task.scoring == "letter":
        prediction = extract_choice(text, task.options or "ABCDE")
        return prediction, prediction == task.answer
    if task.scoring == "word":
        words = normalize_words(text).split()
        return (words[0] if words else None), task.answer.lower() in words
    return None, None
