"""How much faster, and is it really lossless? Speculative decoding vs the target alone, on real workloads.

One command runs the same questions through

* ``target``    - the target alone, through vlmspec's own loop (``speculative=False``): the fair baseline;
* ``vlmspec``   - ``SpecEngine`` with the chosen drafter (prompt lookup or a DSpark checkpoint) and scheduler;
* ``hf-generate``, ``hf-prompt-lookup``, ``hf-assistant`` - transformers' own ``generate`` on the same
  model: plain, with ``prompt_lookup_num_tokens``, and with a small ``assistant_model``. These are
  what a user would pick instead; a configuration transformers refuses is reported, not skipped.

Variants run interleaved question by question (the order rotates), with identical settings and
seeds, so every ratio is measured within one run. Every timing is wall clock from (image, prompt)
to generated token ids, input processing included, for all variants alike.

Workloads: an MMBench TSV (``--mmbench``), prompt sets such as ``../shared/data/prompts/mt-bench.jsonl``
(``--prompt-set``, first turn of each entry), and image questions on real images (``--vqa``:
easy-vqa shapes with one-word answers, scikit-image photographs with open, long answers).

Reported per question and in total: output identity with the target alone (greedy: must be
zero differences; each difference is printed with its question), tau, acceptance by draft
position, tokens per second and speedups, the time split (prefill / draft / verify / engine
overhead / input processing), and answer accuracy (MMBench: the extracted option letter).
Outputs in ``--out``: ``results.json`` (every number), ``results.md`` (tables) and PNG plots.
The exit status is 1 when a greedy run shows any difference from the target alone.

Example (a tiny random target; mechanics only, its speed says nothing)::

    python -m benchmarks.mmbench_spec --target tiny:qwen2_vl --mmbench tests/fixtures/mmbench_mini.tsv \\
        --prompt-set ../shared/data/prompts/mt-bench.jsonl --vqa --num-questions 4 --out runs/demo
"""

from __future__ import annotations

import argparse
import base64
import binascii
import csv
import io
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python benchmarks/x.py): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmspec.scheduling.factory import SCHEDULERS

from benchmarks.common import (
    Timer,
    environment_info,
    log,
    markdown_table,
    plot_grouped_bars,
    plot_lines,
    plot_stacked_bars,
    prepare_out_dir,
    progress,
    rotated,
    safe_ratio,
    set_postfix,
    shrink_image,
    skimage_image,
    summarize,
    write_json,
    write_text,
)

# =========================================================================== MMBench TSV

OPTION_LETTERS = "ABCDEFGHI"  # MMBench uses A-D and sometimes E; a few derived sets go further
REQUIRED_COLUMNS = ("index", "question", "A", "B", "image")
# Cells that mean "no value": empty, and the NaN that pandas writes for missing cells.
_MISSING = frozenset({"", "nan"})
# Real MMBench files store an image once; rows that reuse it hold the other row's index instead.
_MAX_REFERENCE_LENGTH = 64

ANSWER_INSTRUCTION = "Answer with the option's letter from the given choices directly."


@dataclass
class MMBenchQuestion:
    """One MMBench row: a multiple-choice question about one image."""

    index: str
    question: str
    options: dict[str, str]  # letter -> option text, in letter order, only the options present
    image: Any  # PIL.Image.Image (RGB)
    hint: str | None = None
    answer: str | None = None  # the correct letter; None in splits without answers
    category: str | None = None
    l2_category: str | None = None
    split: str | None = None


@dataclass
class RowProblem:
    """A row that could not be used, with the reason; the rest of the file is still read."""

    index: str
    line: int  # 1-based line where the row starts in the file (the header is line 1)
    message: str


@dataclass
class MMBenchFile:
    questions: list[MMBenchQuestion]
    problems: list[RowProblem] = field(default_factory=list)


def read_mmbench_tsv(path: str | Path, limit: int | None = None) -> MMBenchFile:
    """Parse an MMBench TSV into questions; unusable rows become ``problems`` instead of errors.

    Handles a missing or empty hint, four or five (or more) options, a missing ``answer``
    column (test splits), and image cells that refer to another row by its index. A
    broken base64 image is reported with its row index. ``limit`` stops after that many
    usable questions. Raises ValueError when the file is not an MMBench TSV at all.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"MMBench file {str(path)!r} does not exist; pass the path of an MMBench .tsv file")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of questions, got {limit}")
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # base64 images are far longer than csv's default cap
    with path.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t")
        _check_header(reader.fieldnames, path)
        rows, end = [], reader.line_num
        for row in reader:  # a quoted cell may span lines: remember where each row starts
            rows.append((end + 1, row))
            end = reader.line_num
    images_by_index = {_cell(row, "index"): _cell(row, "image") for _, row in rows}
    result = MMBenchFile(questions=[])
    seen: set[str] = set()
    for line, row in rows:
        try:
            question = _parse_row(row, images_by_index)
            if question.index in seen:
                raise ValueError(f"row index {question.index}: the index is used by an earlier row; indices must be unique")
            seen.add(question.index)
            result.questions.append(question)
        except ValueError as err:
            result.problems.append(RowProblem(index=_cell(row, "index") or "?", line=line, message=str(err)))
        if limit is not None and len(result.questions) >= limit:
            break
    return result


def _check_header(fieldnames: Sequence[str] | None, path: Path) -> None:
    if not fieldnames:
        raise ValueError(f"{str(path)!r} is empty; an MMBench TSV starts with a header row")
    missing = [c for c in REQUIRED_COLUMNS if c not in fieldnames]
    if missing:
        hint = " (the file does not look tab-separated)" if len(fieldnames) == 1 else ""
        raise ValueError(
            f"{str(path)!r} lacks the MMBench column(s) {', '.join(missing)}{hint}; an MMBench TSV has the "
            "tab-separated columns index, question, hint, A, B, C, D[, E], answer, category, l2-category, split, image"
        )


def _cell(row: Mapping[str, str | None], column: str) -> str | None:
    """The stripped cell, or None when the column is absent or the cell means 'no value'."""
    value = row.get(column)
    if value is None:
        return None
    value = value.strip()
    return None if value.lower() in _MISSING else value


def _parse_row(row: Mapping[str, str | None], images_by_index: Mapping[str | None, str | None]) -> MMBenchQuestion:
    index = _cell(row, "index")
    if index is None:
        raise ValueError("the index cell is empty; every MMBench row needs a unique index")
    question = _cell(row, "question")
    if question is None:
        raise ValueError(f"row index {index}: the question cell is empty")
    options = {letter: text for letter in OPTION_LETTERS if (text := _cell(row, letter)) is not None}
    if len(options) < 2:
        raise ValueError(f"row index {index}: needs at least two options in columns A, B, ...; found {len(options)}")
    answer = _cell(row, "answer")
    if answer is not None:
        answer = answer.upper()
        if answer not in options:
            raise ValueError(f"row index {index}: answer {answer!r} is not one of the row's options {''.join(options)}")
    return MMBenchQuestion(
        index=index,
        question=question,
        options=options,
        image=_row_image(index, _cell(row, "image"), images_by_index),
        hint=_cell(row, "hint"),
        answer=answer,
        category=_cell(row, "category"),
        l2_category=_cell(row, "l2-category"),
        split=_cell(row, "split"),
    )


def _row_image(index: str, cell: str | None, images_by_index: Mapping[str | None, str | None]):
    if cell is None:
        raise ValueError(f"row index {index}: the image cell is empty; MMBench rows carry a base64-encoded image")
    if len(cell) <= _MAX_REFERENCE_LENGTH and cell in images_by_index and cell != index:
        referenced = images_by_index[cell]
        if referenced is None or len(referenced) <= _MAX_REFERENCE_LENGTH:
            raise ValueError(f"row index {index}: the image refers to row {cell}, which holds no image")
        cell = referenced
    return decode_base64_image(cell, where=f"row index {index}")


def decode_base64_image(text: str, where: str = "image"):
    """A base64-encoded PNG/JPEG as an RGB PIL image; ValueError naming ``where`` if it is not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{where}: the image cell is not valid base64 ({err}); store base64.b64encode(png_bytes)") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{where}: the image cell decodes to bytes that are not an image ({err})") from None


def build_mmbench_prompt(question: MMBenchQuestion) -> str:
    """The standard MMBench multiple-choice prompt: hint, question, lettered options, instruction."""
    lines = []
    if question.hint:
        lines.append(f"Hint: {question.hint}")
    lines.append(f"Question: {question.question}")
    lines.append("Options:")
    lines += [f"{letter}. {text}" for letter, text in question.options.items()]
    lines.append(ANSWER_INSTRUCTION)
    return "\n".join(lines)


# =========================================================================== letter extraction

# An option letter, optionally in brackets or followed by ".", ")", ":" or ","; never part of a word.
_LETTER = r"(?P<open>[\(\[]?)(?P<letter>[A-Za-z])(?P<close>[\)\]\.:,]?)(?![A-Za-z0-9])"
_CUE = re.compile(
    r"\b(?:answer|option|choice)\b(?:\s+(?:is|would\s+be|should\s+be))?\s*[:\-]?\s*(?:option\s+)?" + _LETTER,
    re.IGNORECASE,
)
_LEADING = re.compile(r"^\s*" + _LETTER + r"(?P<rest>.*)", re.DOTALL)
_BRACKETED = re.compile(r"[\(\[]([A-Za-z])[\)\]]")
_LONE_CAPITAL = re.compile(r"(?<![A-Za-z0-9'])([A-Z])(?![A-Za-z0-9'])")
_WORD_LETTERS = frozenset("AI")  # capitals that are also English words ("A cat ...", "I think ...")


def extract_choice(response: str, options: Mapping[str, str] | Iterable[str] = "ABCDE") -> str | None:
    """The option letter a free-form answer chose, or None when it names no single option.

    Tried in order, the first rule that finds exactly one valid letter wins:
    an explicit cue ("The answer is (B).", "Answer: C", "option d"), a leading letter
    ("B", "b) ...", "(C) ..."), a single bracketed letter anywhere, the text of exactly
    one option, a single capital letter standing alone. Only letters of ``options``
    count (a mapping letter -> text also enables matching by option text).
    """
    valid = [str(k).upper() for k in options]
    texts = dict(options) if isinstance(options, Mapping) else {}
    text = response.replace("*", "").strip()
    if not text:
        return None
    for rule in (_by_cue, _by_leading_letter, _by_brackets, lambda t, v: _by_option_text(t, texts), _by_lone_capital):
        letter = rule(text, valid)
        if letter is not None and letter in valid:
            return letter
    return None


def _acceptable(match: re.Match, whole_text: bool) -> bool:
    """A lowercase letter counts only with brackets or a closing mark ("b)"), or as the whole answer."""
    letter = match.group("letter")
    return letter.isupper() or bool(match.group("open") or match.group("close")) or whole_text


def _by_cue(text: str, valid: list[str]) -> str | None:
    for match in _CUE.finditer(text):
        letter = match.group("letter")
        if letter.upper() in valid and _acceptable(match, match.end() == len(text)):
            return letter.upper()
    return None


def _by_leading_letter(text: str, valid: list[str]) -> str | None:
    match = _LEADING.match(text)
    if match is None:
        return None
    letter, rest = match.group("letter"), match.group("rest")
    delimited = bool(match.group("open") or match.group("close"))
    if not _acceptable(match, not rest.strip()):
        return None
    # "A cat sits ..." is an article, not option A.
    if letter in _WORD_LETTERS and not delimited and re.match(r"\s+[a-z]", rest):
        return None
    return letter.upper()


def _by_brackets(text: str, valid: list[str]) -> str | None:
    found = {m.group(1).upper() for m in _BRACKETED.finditer(text)} & set(valid)
    return found.pop() if len(found) == 1 else None


def _normalize(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def _by_option_text(text: str, options: Mapping[str, str]) -> str | None:
    said = f" {_normalize(text)} "
    matched = {k.upper(): _normalize(v) for k, v in options.items() if _normalize(v) and f" {_normalize(v)} " in said}
    # "A red car" also contains "car": keep only options that are not part of another matched one.
    maximal = [k for k, v in matched.items() if not any(v != w and v in w for w in matched.values())]
    return maximal[0] if len(maximal) == 1 else None


def _by_lone_capital(text: str, valid: list[str]) -> str | None:
    found = {
        m.group(1)
        for m in _LONE_CAPITAL.finditer(text)
        if not (m.group(1) in _WORD_LETTERS and re.match(r"\s+[a-z]", text[m.end() :]))  # "A cat", "I think"
    }
    found &= set(valid)
    return found.pop() if len(found) == 1 else None


# =========================================================================== workloads


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
            images=(shrink_image(q.image, max_side),),
            answer=q.answer,
            options=q.options,
            scoring="letter" if q.answer else "none",
        )
        for q in parsed.questions
    ]
    return tasks, parsed.problems


def read_prompt_set(path: str | Path) -> list[str]:
    """First user turn of every line of a ``{"turns": [...]}`` JSONL prompt set."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt set {str(path)!r} does not exist; pass a .jsonl file such as ../shared/data/prompts/mt-bench.jsonl")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}); each line must be {{\"turns\": [\"...\"]}}") from None
        turns = entry.get("turns") if isinstance(entry, dict) else None
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip()):
            raise ValueError(f'{path}:{number}: expected {{"turns": ["first user turn", ...]}} with a non-empty first turn')
        prompts.append(turns[0])
    return prompts


def prompt_set_tasks(path: str | Path, limit: int | None) -> list[Task]:
    """Text-only tasks from a prompt set; the workload is named after the file (``mt-bench``, ``gsm8k``)."""
    name = Path(path).stem
    prompts = read_prompt_set(path)[:limit]
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
        Task(workload="skimage-open", qid=f"skimage-{i}-{name}", group="skimage-open", prompt=question,
             images=(skimage_image(name, max_side),))
        for i, (name, question) in enumerate(chosen)
    ]  # fmt: skip


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
        tasks.append(Task(workload="easy-vqa", qid=f"easy-vqa-{i}", group="easy-vqa", prompt=prompt,
                          images=(rgb,), answer=answers[i], scoring="word"))  # fmt: skip
    return tasks


def score(task: Task, text: str) -> tuple[str | None, bool | None]:
    """(prediction, correct) for one answer; (None, None) when the task has no reference answer."""
    if task.scoring == "letter":
        prediction = extract_choice(text, task.options or "ABCDE")
        return prediction, prediction == task.answer
    if task.scoring == "word":
        words = _normalize(text).split()
        return (words[0] if words else None), task.answer.lower() in words
    return None, None


# =========================================================================== the engine and the peers


def parse_key_values(pairs: Sequence[str]) -> dict[str, Any]:
    """``["threshold=0.6", "name=x"]`` -> ``{"threshold": 0.6, "name": "x"}`` (values parsed as JSON when they can be)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--scheduler-arg {pair!r} must look like KEY=VALUE, e.g. threshold=0.6")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def make_scheduler(name: str, options: Mapping[str, Any]):
    """The scheduler called ``name`` (``none`` = verify every draft), built by ``vlmspec.scheduling.build_scheduler``."""
    if name == "none":
        return None
    try:
        from vlmspec.scheduling import build_scheduler
    except ImportError:
        raise ValueError(
            f"--scheduler {name} needs vlmspec.scheduling.build_scheduler, which this vlmspec version does not "
            "provide yet; use --scheduler none"
        ) from None
    return build_scheduler(name, **options)


def load_engine(args: argparse.Namespace):
    """A SpecEngine for ``--target`` (a directory, ``tiny:FAMILY`` or ``small:FAMILY``) with ``--drafter`` and ``--scheduler``."""
    from vlmspec.drafters.prompt_lookup import PromptLookup
    from vlmspec.engine import SpecEngine, load_proposer
    from vlmspec.target import load_target

    scheduler = make_scheduler(args.scheduler, parse_key_values(args.scheduler_arg))
    target = load_target(args.target, dtype=args.dtype, attn_implementation=args.attn_implementation, device=args.device)
    if args.drafter == "prompt-lookup":
        proposer = PromptLookup(max_draft_tokens=args.max_draft_tokens, max_ngram=args.max_ngram, min_ngram=args.min_ngram)
    else:
        proposer = load_proposer(args.drafter, target)
    return SpecEngine(target, proposer, scheduler)


@dataclass
class Settings:
    """Generation settings shared by every variant."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RunRecord:
    """One variant's answer to one question."""

    variant: str
    seconds: float  # wall clock from (images, prompt) to token ids, input processing included
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: Any = None  # vlmspec.types.SpecStats for the engine's runs; None for transformers' runs

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float | None:
        return safe_ratio(self.new_tokens, self.seconds)


def run_engine(engine, task: Task, settings: Settings, *, speculative: bool, seed: int) -> RunRecord:
    """``engine.generate`` on one task, timed; ``speculative=False`` is the target alone."""
    with Timer() as timer:
        result = engine.generate(task.image_arg, task.prompt, max_new_tokens=settings.max_new_tokens,
                                 temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                                 seed=seed, speculative=speculative)  # fmt: skip
    return RunRecord("vlmspec" if speculative else "target", timer.seconds, list(result.token_ids), result.text,
                     result.finish_reason, result.stats)  # fmt: skip


@dataclass
class Peer:
    """A transformers ``generate`` configuration run beside ours; ``status`` records refusals."""

    name: str
    description: str
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"  # "ok" | "refused" | "not run"
    detail: str = ""

    @property
    def active(self) -> bool:
        return self.status == "ok"

    def refuse(self, detail: str) -> None:
        self.status, self.detail = "refused", detail


def hf_generate_kwargs(engine, settings: Settings) -> dict[str, Any]:
    """Keyword arguments that make ``model.generate`` sample exactly what vlmspec samples.

    A checkpoint's generation_config may carry its own temperature, top-k/top-p or a
    repetition penalty; every one of them is overridden so that all variants draw from
    the same distribution and stop on the same tokens.
    """
    eos = list(engine.target.eos_token_ids)
    kwargs: dict[str, Any] = dict(max_new_tokens=settings.max_new_tokens, eos_token_id=eos, pad_token_id=eos[0],
                                  repetition_penalty=1.0, num_beams=1, do_sample=not settings.greedy)  # fmt: skip
    if settings.greedy:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(temperature=settings.temperature, top_k=settings.top_k or 0, top_p=settings.top_p or 1.0)
    return kwargs


def run_hf(engine, task: Task, settings: Settings, peer: Peer, *, seed: int) -> RunRecord:
    """transformers' ``generate`` on the same model and inputs, timed like ``run_engine``."""
    import torch

    kwargs = {**hf_generate_kwargs(engine, settings), **peer.generate_kwargs}
    torch.manual_seed(seed)  # transformers samples from the global generator
    with Timer() as timer:
        inputs = engine.target.build_inputs(task.image_arg, task.prompt)
        with torch.inference_mode():
            output = engine.target.model.generate(**inputs.model_kwargs, **kwargs)
        tokens = output[0, inputs.length :].tolist()  # inside the timer: waits for a GPU to finish
    eos = set(engine.target.eos_token_ids)
    finish = "eos" if tokens and tokens[-1] in eos else "length"
    text = engine.target.tokenizer.decode(tokens, skip_special_tokens=True)
    return RunRecord(peer.name, timer.seconds, tokens, text, finish)


def build_peers(engine, args: argparse.Namespace) -> list[Peer]:
    """The transformers configurations to compare against, per ``--peers`` and ``--assistant``."""
    wanted = {p.strip() for p in args.peers.split(",") if p.strip()} - {"none"}
    unknown = wanted - {"prompt-lookup", "assistant"}
    if unknown:
        raise ValueError(f"--peers {args.peers!r}: unknown peer(s) {', '.join(sorted(unknown))}; use prompt-lookup, assistant or none")
    if not wanted:
        return []
    peers = [Peer("hf-generate", "transformers generate(), target alone")]
    if "prompt-lookup" in wanted:
        k = args.prompt_lookup_num_tokens or args.max_draft_tokens
        peers.append(Peer("hf-prompt-lookup", f"generate(prompt_lookup_num_tokens={k}, max_matching_ngram_size={args.max_ngram})",
                          {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": args.max_ngram}))  # fmt: skip
    if "assistant" in wanted:
        peers.append(assistant_peer(engine, args.assistant, args.target))
    return peers


def assistant_peer(engine, assistant: str, target: str) -> Peer:
    """``generate(assistant_model=...)``: a smaller model of the target's family; loading problems are recorded."""
    if assistant == "none" or (assistant == "auto" and not target.startswith(("tiny:", "small:"))):
        return Peer("hf-assistant", "generate(assistant_model=...)", status="not run",
                    detail="no assistant given: pass --assistant DIR (a smaller Qwen-VL checkpoint of the same family)")  # fmt: skip
    try:
        model, description = _load_assistant(engine, assistant)
    except Exception as err:  # noqa: BLE001 - any loading failure is a result to report
        return Peer("hf-assistant", f"generate(assistant_model={assistant})", status="refused", detail=_describe_error(err))
    return Peer("hf-assistant", f"generate(assistant_model={description})", {"assistant_model": model})


def _load_assistant(engine, assistant: str):
    family = engine.target.family
    if assistant in ("auto", "tiny"):
        from vlmspec.target.tiny import tiny_model

        model = tiny_model(family, hidden_size=32, num_layers=2, seed=1).to(engine.target.dtype)
        return model, f"tiny random {family}, hidden 32, 2 layers"
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = Path(assistant)
    if not (path / "config.json").is_file():
        raise ValueError(f"--assistant {assistant!r} is not a saved model directory (no config.json); pass one or 'none'")
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=engine.target.dtype, local_files_only=True)
    except ValueError:  # a text-only assistant; transformers decides whether it may assist a VLM
        model = AutoModelForCausalLM.from_pretrained(path, dtype=engine.target.dtype, local_files_only=True)
    return model.to(engine.target.device).eval(), path.name


def _describe_error(err: BaseException) -> str:
    lines = str(err).strip().splitlines() or [""]
    first = lines[0] if len(lines[0]) <= 400 else lines[0][:400] + " ..."
    return f"{type(err).__name__}: {first}"


# =========================================================================== the benchmark loop


@dataclass
class QuestionResult:
    """Every variant's run of one task, and how they compare."""

    task: Task
    runs: dict[str, RunRecord]
    first_difference: int | None  # first token index where vlmspec differs from the target alone
    predictions: dict[str, str | None] = field(default_factory=dict)
    correct: dict[str, bool | None] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.first_difference is None

    @property
    def tau(self) -> float | None:
        stats = self.runs["vlmspec"].stats
        return None if stats is None else stats.tau

    def speedup(self, variant: str = "vlmspec", baseline: str = "target") -> float | None:
        if variant not in self.runs or baseline not in self.runs:
            return None
        return safe_ratio(self.runs[variant].tokens_per_s, self.runs[baseline].tokens_per_s)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Benchmark:
    """Runs tasks through every variant, interleaved, and collects ``QuestionResult``s."""

    def __init__(
        self, engine, settings: Settings, peers: Sequence[Peer] = (), *, repeats: int = 1, show_progress: bool = True
    ) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        self.engine = engine
        self.settings = settings
        self.peers = list(peers)
        self.repeats = repeats
        self.show_progress = show_progress
        self.results: list[QuestionResult] = []

    def variants(self) -> list[str]:
        return ["target", "vlmspec"] + [p.name for p in self.peers if p.active]

    def warm_up(self, task: Task, rounds: int) -> None:
        """Untimed runs of every variant (first calls pay one-off costs); a peer that fails here is refused."""
        for _ in range(rounds):
            for variant in self.variants():
                self._run(variant, task, self.settings.seed, warmup=True)

    def run(self, tasks: Sequence[Task]) -> list[QuestionResult]:
        bar = progress(tasks, total=len(tasks), desc="questions", enabled=self.show_progress)
        for step, task in enumerate(bar):
            self.results.append(self.run_task(task, step))
            set_postfix(bar, self._postfix())
        return self.results

    def run_task(self, task: Task, step: int) -> QuestionResult:
        """Every variant on ``task``, in rotating order, ``repeats`` times; the fastest run of each is kept."""
        seed = self.settings.seed + step
        runs: dict[str, RunRecord] = {}
        for repeat in range(self.repeats):
            for variant in rotated(self.variants(), step + repeat):
                record = self._run(variant, task, seed)
                if record is not None and (variant not in runs or record.seconds < runs[variant].seconds):
                    runs[variant] = record
        result = QuestionResult(task, runs, first_difference(runs["target"].token_ids, runs["vlmspec"].token_ids))
        for name, record in runs.items():
            result.predictions[name], result.correct[name] = score(task, record.text)
        if not result.identical and self.settings.greedy:
            log(describe_difference(result))
        return result

    def _run(self, variant: str, task: Task, seed: int, warmup: bool = False) -> RunRecord | None:
        if variant in ("target", "vlmspec"):
            try:
                return run_engine(self.engine, task, self.settings, speculative=variant == "vlmspec", seed=seed)
            except Exception as err:
                raise RuntimeError(f"vlmspec failed on question {task.qid} ({variant}): {_describe_error(err)}") from err
        peer = next(p for p in self.peers if p.name == variant)
        if not peer.active:
            return None
        try:
            return run_hf(self.engine, task, self.settings, peer, seed=seed)
        except Exception as err:  # noqa: BLE001 - transformers refusing a configuration is a finding
            where = "during warm-up" if warmup else f"on question {task.qid}"
            peer.refuse(f"{_describe_error(err)} ({where})")
            log(f"[{peer.name}] refused {where}: {peer.detail}")
            return None

    def _postfix(self) -> str:
        diffs = sum(not r.identical for r in self.results)
        speed = aggregate_speedup(self.results)
        return f"diffs={diffs} speedup={speed:.2f}x" if speed else f"diffs={diffs}"


def describe_difference(result: QuestionResult) -> str:
    """A readable report of where vlmspec's output left the target's, for one question."""
    i = result.first_difference
    target, spec = result.runs["target"], result.runs["vlmspec"]
    return (
        f"DIFFERENCE in {result.task.qid} ({result.task.workload}) at generated token {i}: "
        f"target {target.token_ids[i:i + 5]} vs vlmspec {spec.token_ids[i:i + 5]}\n"
        f"  prompt:  {_shorten(result.task.prompt, 160)}\n"
        f"  target:  {_shorten(target.text, 160)}\n"
        f"  vlmspec: {_shorten(spec.text, 160)}"
    )


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


# =========================================================================== aggregation


def aggregate_speedup(results: Sequence[QuestionResult], variant: str = "vlmspec", baseline: str = "target") -> float | None:
    """Total tokens per second of ``variant`` over that of ``baseline``, on the questions both ran."""
    both = [r for r in results if variant in r.runs and baseline in r.runs]
    return safe_ratio(_throughput(both, variant), _throughput(both, baseline))


def _throughput(results: Sequence[QuestionResult], variant: str) -> float | None:
    records = [r.runs[variant] for r in results if variant in r.runs]
    return safe_ratio(sum(x.new_tokens for x in records), sum(x.seconds for x in records)) if records else None


TIME_PARTS = ("prefill_s", "draft_s", "verify_s", "other_s")


def aggregate(results: Sequence[QuestionResult], variants: Sequence[str]) -> dict[str, Any]:
    """Every total for a set of questions: identity, throughput, speedups, tau, acceptance, time split, accuracy."""
    spec_stats = [r.runs["vlmspec"].stats for r in results if r.runs["vlmspec"].stats is not None]
    rounds = sum(s.rounds for s in spec_stats)
    accepted_by_position, verified_by_position = _position_totals(spec_stats)
    speedups = {
        "vlmspec_vs_target": aggregate_speedup(results),
        "vlmspec_vs_target_median_per_question": summarize(r.speedup() for r in results)["median"],
        "vlmspec_vs_hf_generate": aggregate_speedup(results, "vlmspec", "hf-generate"),
        "hf_prompt_lookup_vs_hf_generate": aggregate_speedup(results, "hf-prompt-lookup", "hf-generate"),
        "hf_assistant_vs_hf_generate": aggregate_speedup(results, "hf-assistant", "hf-generate"),
        "target_vs_hf_generate": aggregate_speedup(results, "target", "hf-generate"),
    }
    return {
        "questions": len(results),
        "identical": sum(r.identical for r in results),
        "differences": [r.task.qid for r in results if not r.identical],
        "variants": {v: _variant_totals(results, v) for v in variants},
        "speedup": speedups,
        "tau": safe_ratio(sum(s.accepted for s in spec_stats) + rounds, rounds),
        "mean_verified_length": safe_ratio(sum(s.verified for s in spec_stats), rounds),
        "acceptance_by_position": [safe_ratio(a, v) for a, v in zip(accepted_by_position, verified_by_position)],
        "verified_by_position": verified_by_position,
        "time_split_s": {v: _time_split(results, v) for v in ("target", "vlmspec")},
        "accuracy": {v: _accuracy(results, v) for v in variants},
        "identical_to_target": {v: _identical_count(results, v) for v in variants if v != "target"},
    }


def _position_totals(stats: Sequence[Any]) -> tuple[list[int], list[int]]:
    """Accepted and verified counts per draft position, summed over SpecStats."""
    length = max((len(s.verified_by_position) for s in stats), default=0)
    accepted, verified = [0] * length, [0] * length
    for s in stats:
        for k, (a, v) in enumerate(zip(s.accepted_by_position, s.verified_by_position)):
            accepted[k] += a
            verified[k] += v
    return accepted, verified


def _variant_totals(results: Sequence[QuestionResult], variant: str) -> dict[str, Any]:
    records = [r.runs[variant] for r in results if variant in r.runs]
    return {
        "questions": len(records),
        "new_tokens": sum(x.new_tokens for x in records),
        "seconds": sum(x.seconds for x in records),
        "tokens_per_s": _throughput(results, variant),
        "tokens_per_s_per_question": summarize(x.tokens_per_s for x in records),
    }


def _time_split(results: Sequence[QuestionResult], variant: str) -> dict[str, float]:
    """Seconds summed over questions: the engine's own parts, plus input processing outside its loop."""
    records = [r.runs[variant] for r in results if variant in r.runs and r.runs[variant].stats is not None]
    split = {part: sum(getattr(x.stats, part) for x in records) for part in TIME_PARTS}
    split["inputs_s"] = sum(max(x.seconds - x.stats.total_s, 0.0) for x in records)
    split["wall_s"] = sum(x.seconds for x in records)
    return split


def _accuracy(results: Sequence[QuestionResult], variant: str) -> dict[str, Any]:
    scored = [r.correct[variant] for r in results if r.correct.get(variant) is not None]
    return {"correct": sum(scored), "scored": len(scored), "accuracy": safe_ratio(sum(scored), len(scored))}


def _identical_count(results: Sequence[QuestionResult], variant: str) -> dict[str, int]:
    both = [r for r in results if variant in r.runs]
    same = sum(first_difference(r.runs["target"].token_ids, r.runs[variant].token_ids) is None for r in both)
    return {"identical": same, "compared": len(both)}


def summarize_results(results: Sequence[QuestionResult], variants: Sequence[str]) -> dict[str, Any]:
    """Totals over all questions, per workload, and per (workload, group) where groups are finer."""
    by_workload: dict[str, list[QuestionResult]] = defaultdict(list)
    by_group: dict[str, list[QuestionResult]] = defaultdict(list)
    for r in results:
        by_workload[r.task.workload].append(r)
        if r.task.group != r.task.workload:
            by_group[f"{r.task.workload}/{r.task.group}"].append(r)
    return {
        "all": aggregate(results, variants),
        "by_workload": {k: aggregate(v, variants) for k, v in by_workload.items()},
        "by_group": {k: aggregate(v, variants) for k, v in sorted(by_group.items())},
    }


def question_record(result: QuestionResult) -> dict[str, Any]:
    """One question in the JSON: its task, each variant's numbers and text, identity and scores."""
    task = result.task
    runs = {}
    for name, x in result.runs.items():
        runs[name] = {"seconds": x.seconds, "new_tokens": x.new_tokens, "tokens_per_s": x.tokens_per_s,
                      "finish_reason": x.finish_reason, "text": x.text,
                      "stats": None if x.stats is None else x.stats.as_dict(),
                      "identical_to_target": first_difference(result.runs["target"].token_ids, x.token_ids) is None}  # fmt: skip
    record = {
        "qid": task.qid, "workload": task.workload, "group": task.group, "prompt": task.prompt,
        "num_images": len(task.images), "answer": task.answer, "identical": result.identical,
        "first_difference": result.first_difference, "speedup": result.speedup(),
        "tau": result.tau,
        "predictions": result.predictions, "correct": result.correct, "runs": runs,
    }  # fmt: skip
    if not result.identical:
        record["token_ids"] = {"target": result.runs["target"].token_ids, "vlmspec": result.runs["vlmspec"].token_ids}
    return record


# =========================================================================== report


def verdict(summary: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
    """The two answers the benchmark exists for, in words and numbers."""
    total = summary["all"]
    differences = len(total["differences"])
    if settings.greedy:
        check = "passed" if differences == 0 else "FAILED"
        text = f"greedy outputs identical to the target alone: {total['identical']}/{total['questions']} ({check})"
    else:
        check = "not applicable"
        text = (f"sampling (temperature {settings.temperature}): token identity is not expected; "
                f"{total['identical']}/{total['questions']} outputs happen to match")  # fmt: skip
    speedup = total["speedup"]["vlmspec_vs_target"]
    acc_target, acc_spec = total["accuracy"]["target"], total["accuracy"]["vlmspec"]
    if acc_target["scored"]:
        same = "equal" if acc_target["correct"] == acc_spec["correct"] else "NOT equal"
        answers = (f"correct against the reference answers: target {acc_target['correct']}/{acc_target['scored']}, "
                   f"vlmspec {acc_spec['correct']}/{acc_spec['scored']} ({same})")  # fmt: skip
    else:
        answers = "no reference answers in these workloads"
    return {"lossless_check": check, "differences": differences, "identity": text, "answers": answers,
            "speedup_vs_target": speedup, "speedup_vs_hf_generate": total["speedup"]["vlmspec_vs_hf_generate"]}  # fmt: skip


def speed_sentence(v: Mapping[str, Any]) -> str:
    """The headline speed numbers in words."""
    if v["speedup_vs_target"] is None:
        return "not measured"
    text = f"vlmspec {v['speedup_vs_target']:.2f}x the target alone (tokens/s, interleaved in one run)"
    if v["speedup_vs_hf_generate"] is not None:
        text += f"; {v['speedup_vs_hf_generate']:.2f}x transformers generate()"
    return text


def _speed_cell(totals: Mapping[str, Any], variant: str, ratio: float | None) -> str:
    tps = totals["variants"].get(variant, {}).get("tokens_per_s")
    if tps is None:
        return "–"
    return f"{tps:.1f} ({ratio:.2f}x)" if ratio is not None else f"{tps:.1f}"


def _accuracy_cell(totals: Mapping[str, Any], variant: str) -> str:
    acc = totals["accuracy"].get(variant, {})
    return f"{acc['correct']}/{acc['scored']}" if acc.get("scored") else "–"


def summary_table(rows: Mapping[str, Mapping[str, Any]], label: str) -> str:
    """One line per workload (or group): identity, tau, tokens/s of every variant with its ratio, accuracy."""
    headers = [label, "n", "identical", "tau", "target tok/s", "vlmspec tok/s (vs target)",
               "hf-generate tok/s", "hf-prompt-lookup tok/s (vs hf)", "hf-assistant tok/s (vs hf)",
               "acc target", "acc vlmspec"]  # fmt: skip
    lines = []
    for name, t in rows.items():
        s = t["speedup"]
        lines.append([
            name, t["questions"], f"{t['identical']}/{t['questions']}", t["tau"],
            _speed_cell(t, "target", None), _speed_cell(t, "vlmspec", s["vlmspec_vs_target"]),
            _speed_cell(t, "hf-generate", None), _speed_cell(t, "hf-prompt-lookup", s["hf_prompt_lookup_vs_hf_generate"]),
            _speed_cell(t, "hf-assistant", s["hf_assistant_vs_hf_generate"]),
            _accuracy_cell(t, "target"), _accuracy_cell(t, "vlmspec"),
        ])  # fmt: skip
    return markdown_table(headers, lines)


def acceptance_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    width = max((len(t["acceptance_by_position"]) for t in rows.values()), default=0)
    headers = ["workload", "tau", "mean verified"] + [f"pos {k + 1}" for k in range(width)]
    lines = []
    for name, t in rows.items():
        rates = list(t["acceptance_by_position"]) + [None] * (width - len(t["acceptance_by_position"]))
        lines.append([name, t["tau"], t["mean_verified_length"], *rates])
    return markdown_table(headers, lines)


def time_split_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    headers = ["workload", "run", "prefill s", "draft s", "verify s", "engine s", "inputs s", "wall s", "ms / token"]
    lines = []
    for name, t in rows.items():
        for variant in ("target", "vlmspec"):
            split = t["time_split_s"][variant]
            tokens = t["variants"][variant]["new_tokens"]
            per_token = safe_ratio(1000 * split["wall_s"], tokens)
            lines.append([name, variant, *(split[p] for p in TIME_PARTS), split["inputs_s"], split["wall_s"], per_token])
    return markdown_table(headers, lines, digits=3)


def peers_table(peers: Sequence[Peer], totals: Mapping[str, Any]) -> str:
    """Each transformers configuration: what ran, whether transformers accepted it, and how its output compares."""
    lines = []
    for p in peers:
        same = totals["identical_to_target"].get(p.name)
        identical = f"{same['identical']}/{same['compared']}" if same and same["compared"] else "–"
        lines.append([p.name, p.description, p.status, identical, p.detail or ""])
    return markdown_table(["peer", "configuration", "status", "output = target alone", "detail"], lines)


def questions_table(results: Sequence[QuestionResult]) -> str:
    headers = ["question", "workload", "tokens", "identical", "tau", "target tok/s", "vlmspec tok/s", "speedup",
               "answer", "target said", "vlmspec said"]  # fmt: skip
    lines = []
    for r in results:
        target, spec = r.runs["target"], r.runs["vlmspec"]
        lines.append([r.task.qid, r.task.workload, spec.new_tokens, "yes" if r.identical else f"NO (token {r.first_difference})",
                      r.tau, target.tokens_per_s, spec.tokens_per_s, r.speedup(),
                      r.task.answer or "–", r.predictions.get("target") or "–", r.predictions.get("vlmspec") or "–"])  # fmt: skip
    return markdown_table(headers, lines)


def render_markdown(report: Mapping[str, Any], results: Sequence[QuestionResult], peers: Sequence[Peer]) -> str:
    """The whole report as markdown: verdict, summary, breakdowns, peers, differences, every question."""
    s, v, summary = report["settings"], report["verdict"], report["summary"]
    parts = [
        "# Speculative decoding benchmark",
        f"target `{s['target']}` · drafter `{s['drafter']}` · scheduler `{s['scheduler']}` · "
        f"temperature {s['temperature']} · max new tokens {s['max_new_tokens']} · seed {s['seed']} · "
        f"torch {report['environment'].get('torch')} / transformers {report['environment'].get('transformers')}",
        f"- **Lossless:** {v['identity']}\n- **Answers:** {v['answers']}\n- **Speed:** {speed_sentence(v)}",
        "## Summary by workload",
        summary_table({**summary["by_workload"], "all": summary["all"]}, "workload"),
    ]
    if summary["by_group"]:
        parts += ["## By category", summary_table(summary["by_group"], "category")]
    parts += [
        "## Acceptance by draft position",
        "Rate at which draft position k survived verification, over the rounds that verified it; tau = accepted + 1 per round.",
        acceptance_table({**summary["by_workload"], "all": summary["all"]}),
        "## Time split (seconds summed over questions)",
        "engine = the loop's own overhead outside the two models; inputs = image and prompt processing before the loop.",
        time_split_table({**summary["by_workload"], "all": summary["all"]}),
        "## transformers peers (same model, same inputs, same run)",
        peers_table(peers, summary["all"]),
    ]
    differing = [r for r in results if not r.identical]
    if differing:
        parts += ["## Differences from the target alone", *("```\n" + describe_difference(r) + "\n```" for r in differing)]
    if report["problems"]:
        parts += ["## Skipped MMBench rows", markdown_table(["index", "line", "problem"],
                                                             [[p.index, p.line, p.message] for p in report["problems"]])]  # fmt: skip
    parts += ["## Every question", questions_table(results)]
    return "\n\n".join(parts) + "\n"


def write_plots(summary: Mapping[str, Any], out: Path) -> list[Path]:
    """acceptance_by_position.png, speedup.png (by workload and category), tokens_per_s.png, time_split.png."""
    workloads = {**summary["by_workload"], "all": summary["all"]}
    paths = [
        plot_lines(out / "acceptance_by_position.png",
                   {name: (list(range(1, len(t["acceptance_by_position"]) + 1)), t["acceptance_by_position"])
                    for name, t in workloads.items()},
                   title="Acceptance by draft position", xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05)),
    ]  # fmt: skip
    groups = {**workloads, **summary["by_group"]}
    paths.append(plot_grouped_bars(
        out / "speedup.png", list(groups),
        {"vlmspec vs target": [t["speedup"]["vlmspec_vs_target"] for t in groups.values()],
         "hf prompt lookup vs hf generate": [t["speedup"]["hf_prompt_lookup_vs_hf_generate"] for t in groups.values()],
         "hf assistant vs hf generate": [t["speedup"]["hf_assistant_vs_hf_generate"] for t in groups.values()]},
        title="Speedup (tokens/s ratio, same run)", ylabel="speedup (x)", reference=1.0))  # fmt: skip
    variants = list(summary["all"]["variants"])
    paths.append(plot_grouped_bars(
        out / "tokens_per_s.png", list(workloads),
        {v: [t["variants"][v]["tokens_per_s"] for t in workloads.values()] for v in variants},
        title="Throughput by variant", ylabel="tokens / s"))  # fmt: skip
    labels, parts = [], {p: [] for p in (*TIME_PARTS, "inputs_s")}
    for name, t in workloads.items():
        for variant in ("target", "vlmspec"):
            split = t["time_split_s"][variant]
            tokens = t["variants"][variant]["new_tokens"]
            labels.append(f"{name}\n{variant}")
            for p in parts:
                parts[p].append(safe_ratio(1000 * split[p], tokens))
    names = {"prefill_s": "prefill", "draft_s": "draft", "verify_s": "verify", "other_s": "engine", "inputs_s": "inputs"}
    paths.append(plot_stacked_bars(out / "time_split.png", labels, {names[p]: v for p, v in parts.items()},
                                   title="Time per generated token", ylabel="ms / token"))  # fmt: skip
    return paths


# =========================================================================== command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mmbench_spec",
        description=__doc__.split("\n\n")[0] + " Runs the target alone, vlmspec and transformers' assisted "
        "generation on the same questions, interleaved, and writes results.json, results.md and PNG plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = parser.add_argument_group("models")
    model.add_argument("--target", required=True, help="directory of a saved Qwen-VL model, or tiny:FAMILY (qwen2_vl, qwen2_5_vl, qwen3_vl) for a random tiny one")
    model.add_argument("--drafter", default="prompt-lookup", help="'prompt-lookup' or the directory of a saved DSpark drafter")
    model.add_argument("--scheduler", default="none", choices=SCHEDULERS, help="how many drafts to verify per round (none = all)")
    model.add_argument("--scheduler-arg", action="append", default=[], metavar="KEY=VALUE", help="option for the scheduler, e.g. threshold=0.6 (repeatable)")
    model.add_argument("--max-draft-tokens", type=int, default=8, help="prompt lookup: tokens drafted per round")
    model.add_argument("--max-ngram", type=int, default=3, help="prompt lookup: longest n-gram matched (also transformers' max_matching_ngram_size)")
    model.add_argument("--min-ngram", type=int, default=1, help="prompt lookup: shortest n-gram matched")
    model.add_argument("--dtype", default="float32", help="target dtype (float32, bfloat16, float16)")
    model.add_argument("--attn-implementation", default="sdpa", help="sdpa, eager or flash_attention_2")
    model.add_argument("--device", default="cpu", help="torch device of the target")

    data = parser.add_argument_group("workloads (at least one)")
    data.add_argument("--mmbench", type=Path, help="an MMBench TSV (e.g. tests/fixtures/mmbench_mini.tsv)")
    data.add_argument("--prompt-set", type=Path, action="append", default=[], help="a {\"turns\": [...]} JSONL prompt set, e.g. ../shared/data/prompts/gsm8k.jsonl (repeatable; first turns only)")
    data.add_argument("--vqa", action="store_true", help="add image questions on real images: easy-vqa shapes and open questions on scikit-image photographs")
    data.add_argument("--num-questions", type=int, default=20, help="questions per workload")
    data.add_argument("--image-max-side", type=int, default=448, help="shrink images whose longer side exceeds this (pixels); 0 keeps them as they are")

    gen = parser.add_argument_group("generation (identical for every variant)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs must be identical)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0, help="question i uses seed + i in every variant")

    peers = parser.add_argument_group("transformers peers")
    peers.add_argument("--peers", default="prompt-lookup,assistant", help="comma list of prompt-lookup, assistant; or none")
    peers.add_argument("--prompt-lookup-num-tokens", type=int, default=None, help="transformers' prompt_lookup_num_tokens (None: same as --max-draft-tokens)")
    peers.add_argument("--assistant", default="auto", help="assistant model for generate(assistant_model=...): a directory, 'tiny' (random tiny model of the target's family), 'none', or 'auto' (tiny for tiny targets, none otherwise)")

    run = parser.add_argument_group("run")
    run.add_argument("--out", type=Path, required=True, help="output directory for results.json, results.md and the plots")
    run.add_argument("--warmup", type=int, default=1, help="untimed runs of every variant before measuring")
    run.add_argument("--repeats", type=int, default=1, help="timed runs of every variant per question; the fastest is reported")
    run.add_argument("--threads", type=int, default=None, help="torch CPU threads (None: torch's choice)")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def validate_args(args: argparse.Namespace) -> Settings:
    """Check the arguments that argparse cannot; returns the generation settings."""
    if not (args.mmbench or args.prompt_set or args.vqa):
        raise ValueError("no workload chosen: pass --mmbench FILE.tsv, --prompt-set FILE.jsonl and/or --vqa")
    for name in ("num_questions", "max_new_tokens", "max_draft_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.image_max_side < 0:
        raise ValueError("--warmup and --image-max-side must be >= 0")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    return Settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)


def collect_tasks(args: argparse.Namespace) -> tuple[list[Task], list[RowProblem]]:
    """All workloads' tasks in a fixed order, plus MMBench rows that were skipped."""
    max_side = args.image_max_side or None
    tasks: list[Task] = []
    problems: list[RowProblem] = []
    if args.mmbench:
        mm, problems = mmbench_tasks(args.mmbench, args.num_questions, max_side)
        tasks += mm
        for p in problems:
            log(f"skipped MMBench row index {p.index} (line {p.line}): {p.message}")
    for path in args.prompt_set:
        tasks += prompt_set_tasks(path, args.num_questions)
    if args.vqa:
        tasks += easy_vqa_tasks(args.num_questions) + skimage_open_tasks(args.num_questions, max_side)
    if not tasks:
        raise ValueError("the chosen workloads hold no usable questions; see the skipped rows above")
    return tasks, problems


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (1 when a greedy run differs from the target alone)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:  # problems with what the user passed end here, with the message and the usage
        settings = validate_args(args)
        out = prepare_out_dir(args.out)
        tasks, problems = collect_tasks(args)
        engine = load_engine(args)
        peers = build_peers(engine, args)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    bench = Benchmark(engine, settings, peers, repeats=args.repeats, show_progress=not args.no_progress)
    bench.warm_up(tasks[0], args.warmup)
    results = bench.run(tasks)
    report = build_report(args, settings, bench, problems)
    paths = write_report(report, results, peers, out)
    print(render_summary(report, peers))
    print("\n".join(f"wrote {p}" for p in paths))
    return 1 if settings.greedy and report["verdict"]["differences"] else 0


def build_report(args: argparse.Namespace, settings: Settings, bench: Benchmark, problems: Sequence[RowProblem]) -> dict[str, Any]:
    variants = ["target", "vlmspec"] + [p.name for p in bench.peers if any(p.name in r.runs for r in bench.results)]
    summary = summarize_results(bench.results, variants)
    settings_record = {
        "target": args.target, "drafter": args.drafter, "scheduler": args.scheduler,
        "scheduler_args": parse_key_values(args.scheduler_arg), "max_draft_tokens": args.max_draft_tokens,
        "max_ngram": args.max_ngram, "min_ngram": args.min_ngram, "dtype": args.dtype, "device": args.device,
        "max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature, "top_k": settings.top_k,
        "top_p": settings.top_p, "seed": settings.seed, "num_questions": args.num_questions,
        "warmup": args.warmup, "repeats": args.repeats, "image_max_side": args.image_max_side, "order": "interleaved, rotating per question",
    }  # fmt: skip
    return {
        "settings": settings_record,
        "environment": environment_info(),
        "verdict": verdict(summary, settings),
        "peers": [{"name": p.name, "configuration": p.description, "status": p.status, "detail": p.detail} for p in bench.peers],
        "summary": summary,
        "problems": [vars(p) for p in problems],
        "questions": [question_record(r) for r in bench.results],
    }


def write_report(report: Mapping[str, Any], results: Sequence[QuestionResult], peers: Sequence[Peer], out: Path) -> list[Path]:
    """results.json, results.md and the plots in ``out``."""
    paths = [write_json(out / "results.json", report), write_text(out / "results.md", render_markdown(report, results, peers))]
    return paths + write_plots(report["summary"], out)


def render_summary(report: Mapping[str, Any], peers: Sequence[Peer]) -> str:
    """What the console shows at the end: the verdict, the workload table and the peers."""
    v, summary = report["verdict"], report["summary"]
    lines = [f"lossless: {v['identity']}", f"answers: {v['answers']}", f"speed: {speed_sentence(v)}"]
    lines += ["", summary_table({**summary["by_workload"], "all": summary["all"]}, "workload"), "",
              peers_table(peers, summary["all"])]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
