"""Write the prompt mix that trains the reference target's drafter (``recipes/train_qwen3vl.py --prompts``).

The mix has prompts with and without images, and leaves out everything the benchmarks
measure, so that their numbers are held out. The split is defined once, in
``vlmspec.data.heldout``, and the mix takes its prompts and pictures through it:

* text: GSM8K and MT-Bench entries past the held-out ones (the benchmarks ask the first
  entries of each, as many as ``HELD_OUT_PROMPTS`` holds out);
* easy-vqa's *train* split: its questions and "describe" prompts (the benchmarks ask
  about the *test* split), minus any picture that is also a test picture;
* scikit-image pictures that no benchmark uses, compared by their pixels (``cat`` is
  the benchmarks' ``chelsea``), each with a few open prompts;
* synthetic instructions: task templates (writing, explaining, coding, lists, advice,
  comparisons, role play, maths) crossed with topics, so that the text mix covers more
  than GSM8K's word problems. None is copied from a benchmark set.

Images are written next to the JSONL as PNG files (paths in the JSONL are relative to it).

    python recipes/reference_prompts.py --out runs/reference-drafter/prompts
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))

from prompt_sources import (  # noqa: E402 - the recipes directory is not a package
    MORE_TEMPLATES,
    MORE_TOPICS,
    code_records,
    maths_records,
    with_followups,
)

from vlmspec.data.heldout import is_held_out_picture, training_prompts  # noqa: E402
from vlmspec.data.pictures import skimage_image  # noqa: E402

SHARED_PROMPTS = REPO.parent / "shared" / "data" / "prompts"

# skimage.data pictures that load offline; training_pictures() drops any a benchmark uses, by its pixels.
CANDIDATE_PICTURES = ("horse", "clock", "grass", "gravel", "moon", "cell", "checkerboard", "retina", "logo")
PICTURE_MAX_SIDE = 448  # pixels: the training pictures are saved this small, to keep training cheap
OPEN_PROMPTS = (
    "Describe the image.",
    "What is in this image?",
    "Describe this picture in a few words.",
    "What colors do you see in this picture?",
    "Write one sentence about this image.",
    "What shape is in the image?",
)
TOPICS = (
    "the water cycle",
    "black holes",
    "photosynthesis",
    "the French Revolution",
    "machine learning",
    "climate change",
    "the human heart",
    "volcanoes",
    "the stock market",
    "renewable energy",
    "the Roman Empire",
    "vaccines",
    "the internet",
    "honey bees",
    "chess",
    "jazz music",
    "the Moon landing",
    "electric cars",
    "coffee",
    "sleep",
    "recycling",
    "the Great Wall of China",
    "earthquakes",
    "friendship",
    "time management",
    "public speaking",
    "gardening",
    "the ocean",
    "dinosaurs",
    "the printing press",
    "democracy",
    "inflation",
    "meditation",
    "robots",
    "rainforests",
    "the Olympic Games",
    "smartphones",
    "the immune system",
    "gravity",
    "Shakespeare",
    "a small bakery",
    "a rainy day in the city",
    "learning a new language",
    "a trip to the mountains",
    "a lost cat",
    "a job interview",
    "the first day of school",
    "a birthday party",
    "a dragon who is afraid of fire",
    "a robot learning to paint",
    "saving money",
    "healthy breakfasts",
    "remote work",
    "video games",
    "the solar system",
    "antibiotics",
    "bridges",
    "the Renaissance",
    "tea",
    "social media",
    "bicycles",
    "the desert",
    "penguins",
    "volunteering",
)
TEXT_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Write a short story about {topic}.",
    "Write a poem about {topic}.",
    "Give me five interesting facts about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a blog post introduction about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Summarize the history of {topic} in a paragraph.",
    "Write a haiku about {topic}.",
    "List three common misconceptions about {topic} and correct them.",
    "Write a persuasive paragraph about {topic}.",
    "Draft a short email to a friend about {topic}.",
    "What questions would a student ask about {topic}? Answer two of them.",
    "Describe {topic} as if you were a tour guide.",
    "Write a dialogue between two people discussing {topic}.",
    "Give step-by-step advice for someone interested in {topic}.",
    "Write a limerick about {topic}.",
    "Compare {topic} and {other} in a short essay.",
    "What is the most important thing to know about {topic}?",
    "Create an outline for a presentation on {topic}.",
    "Pretend you are a scientist and describe {topic}.",
    "Write a product description inspired by {topic}.",
    "Write a news headline and a short article about {topic}.",
)
CODE_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "computes the factorial of n",
    "sorts a list of numbers",
    "counts the words in a sentence",
    "finds the largest element in a list",
    "returns the Fibonacci numbers below n",
    "checks whether a word is a palindrome",
    "merges two sorted lists",
    "removes duplicates from a list",
    "converts Celsius to Fahrenheit",
    "computes the average of a list",
    "counts the vowels in a string",
    "finds the second largest number in a list",
    "flattens a nested list",
    "checks whether two strings are anagrams",
    "computes the greatest common divisor of two numbers",
    "returns the n-th triangular number",
    "reads a text file and counts its lines",
    "implements binary search",
)
CODE_TEMPLATES = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}, with a docstring and an example.",
    "How would you write a function in JavaScript that {task}?",
    "Explain how to write a program that {task}.",
)
MATH_TEMPLATES = (
    "What is {a} plus {b}? Explain your steps.",
    "A shop sells pens at {a} cents each. How much do {b} pens cost?",
    "If a train travels {a} miles in {b} hours, what is its average speed?",
    "What is {a} times {b}? Show your work.",
    "Tom has {a} apples and gives away {b}. How many does he have left? Reason step by step.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
)
EASY_VQA_DESCRIBE = ("Describe the image.", "What is in this image?", "Describe this picture in a few words.")


def first_turns(path: Path, count: int) -> list[dict]:
    """``count`` first turns of a prompt set that the held-out split leaves to training."""
    return [{"turns": [prompt]} for prompt in training_prompts(path, count)]


def easy_vqa_records(count: int, rng: random.Random) -> list[dict]:
    """Questions and describe prompts about easy-vqa train images (absolute paths into the package)."""
    import easy_vqa

    questions, _, image_ids = easy_vqa.get_train_questions()
    paths = easy_vqa.get_train_image_paths()
    held_out = {image_id for image_id, path in paths.items() if is_held_out_picture(path)}
    usable = [i for i in range(len(questions)) if image_ids[i] not in held_out]
    picks = rng.sample(usable, count)
    records = []
    for n, i in enumerate(picks):
        prompt = questions[i][0].upper() + questions[i][1:] if n % 2 else rng.choice(EASY_VQA_DESCRIBE)
        records.append({"turns": [prompt], "images": [str(Path(paths[image_ids[i]]).resolve())]})
    return records


def instruction_records(count: int, rng: random.Random) -> list[dict]:
    """Synthetic text instructions: templates crossed with topics, coding tasks and small maths problems."""
    records = []
    for n in range(count):
        kind = n % 5
        if kind < 3:  # writing, explaining, advice
            topic, other = rng.sample(TOPICS, 2)
            prompt = rng.choice(TEXT_TEMPLATES).format(topic=topic, other=other)
        elif kind == 3:
            prompt = rng.choice(CODE_TEMPLATES).format(task=rng.choice(CODE_TASKS))
        else:
            prompt = rng.choice(MATH_TEMPLATES).format(a=rng.randint(3, 99), b=rng.randint(2, 30))
        records.append({"turns": [prompt[0].upper() + prompt[1:]]})
    return distinct(records)


def wide_instruction_records(count: int, rng: random.Random) -> list[dict]:
    """More instructions: every topic list crossed with every template list (the 10x mix)."""
    topics, templates = TOPICS + MORE_TOPICS, TEXT_TEMPLATES + MORE_TEMPLATES
    records = []
    for _ in range(count):
        topic, other = rng.sample(topics, 2)
        prompt = rng.choice(templates).format(topic=topic, other=other)
        records.append({"turns": [prompt[0].upper() + prompt[1:]]})
    return distinct(records)


def distinct(records: list[dict]) -> list[dict]:
    """One record per distinct first turn."""
    return list({r["turns"][0]: r for r in records}.values())


def training_pictures() -> list[str]:
    """The candidate pictures that no benchmark uses (compared by pixels at full size, so not by name)."""
    return [name for name in CANDIDATE_PICTURES if not is_held_out_picture(skimage_image(name))]


def picture_records(out: Path, prompts_per_picture: int, rng: random.Random) -> list[dict]:
    """Each training picture saved as PNG beside the JSONL, with open prompts."""
    records = []
    for name in training_pictures():
        skimage_image(name, max_side=PICTURE_MAX_SIDE).save(out / f"{name}.png")
        for prompt in rng.sample(OPEN_PROMPTS, prompts_per_picture):
            records.append({"turns": [prompt], "images": [f"{name}.png"]})
    return records


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for prompts.jsonl and its images")
    parser.add_argument(
        "--prompts-dir", type=Path, default=SHARED_PROMPTS, help="where gsm8k.jsonl and mt-bench.jsonl are"
    )
    parser.add_argument("--gsm8k", type=int, default=1219, help="GSM8K prompts (past the held-out entries)")
    parser.add_argument("--mt-bench", type=int, default=56, help="MT-Bench first turns (past the held-out entries)")
    parser.add_argument(
        "--instructions", type=int, default=1600, help="synthetic text instructions (before de-duplication)"
    )
    parser.add_argument("--easy-vqa", type=int, default=600, help="easy-vqa train questions / describe prompts")
    parser.add_argument("--prompts-per-picture", type=int, default=6, help="open prompts per scikit-image picture")
    parser.add_argument(
        "--wide-instructions", type=int, default=0, help="more instructions from the wider topic and template lists"
    )
    parser.add_argument("--code", type=int, default=0, help="code prompts (standard-library functions, write tasks)")
    parser.add_argument("--maths", type=int, default=0, help="templated maths word problems and questions")
    parser.add_argument(
        "--followup-fraction", type=float, default=0.0, help="share of synthetic text prompts given a second turn"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    synthetic = distinct(
        instruction_records(args.instructions, rng)
        + wide_instruction_records(args.wide_instructions, rng)
        + code_records(args.code, rng)
        + maths_records(args.maths, rng)
    )
    records = (
        first_turns(args.prompts_dir / "gsm8k.jsonl", args.gsm8k)
        + first_turns(args.prompts_dir / "mt-bench.jsonl", args.mt_bench)
        + with_followups(synthetic, args.followup_fraction, rng)
        + easy_vqa_records(args.easy_vqa, rng)
        + picture_records(args.out, args.prompts_per_picture, rng)
    )
    rng.shuffle(records)
    path = args.out / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with_images = sum(bool(r.get("images")) for r in records)
    print(f"wrote {path}: {len(records)} prompts, {with_images} with an image")
    return path


if __name__ == "__main__":
    main()
