"""MMBench TSV files: each row a multiple-choice question about one image.

The one reader of the format in vlmspec: training reads MMBench rows as prompts
(``vlmspec.training.prompts``), the benchmark as scored questions
(``benchmarks/mmbench_spec.py``). Both build the same prompt (:func:`build_mmbench_prompt`).

The layout: tab-separated columns ``index, question, hint, A, B, C, D[, E], answer,
category, l2-category, split, image``, where ``image`` is a base64-encoded PNG or JPEG.
Real files store an image once; a row that reuses it holds the other row's index instead.
Test splits have no ``answer`` column; pandas writes a missing cell as ``nan``.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

OPTION_LETTERS = "ABCDEFGHI"  # MMBench uses A-D and sometimes E; a few derived sets go further
REQUIRED_COLUMNS = ("index", "question", "A", "B", "image")
# Cells that mean "no value": empty, and the NaN that pandas writes for missing cells.
_MISSING = frozenset({"", "nan"})
# An image cell this short is a reference to another row's index, not an encoded image.
_MAX_REFERENCE_LENGTH = 64

ANSWER_INSTRUCTION = "Answer with the option's letter from the given choices directly."

Row = Mapping[str, str | None]  # one TSV row: column name -> cell


@dataclass
class MMBenchQuestion:
    """One MMBench row: a multiple-choice question about one image."""

    index: str
    question: str
    options: dict[str, str]  # letter -> option text, in letter order, only the options present
    image: bytes | None  # the encoded PNG/JPEG (checked to decode); None only in hand-built questions
    hint: str | None = None
    answer: str | None = None  # the correct letter; None in splits without answers
    category: str | None = None
    l2_category: str | None = None
    split: str | None = None

    def pil_image(self) -> Image.Image:
        """The image as an RGB PIL image (decoded on each call; the row keeps only the bytes)."""
        if self.image is None:
            raise ValueError(f"MMBench question {self.index} has no image")
        return decode_image(self.image, where=f"row index {self.index}")


@dataclass
class RowProblem:
    """A row that could not be used, with the reason; the rest of the file is still read."""

    index: str
    line: int  # 1-based line where the row starts in the file (the header is line 1)
    message: str


@dataclass
class MMBenchFile:
    """The usable questions of a file, in file order, and the rows that were not usable."""

    questions: list[MMBenchQuestion]
    problems: list[RowProblem] = field(default_factory=list)


def read_mmbench_tsv(path: str | Path, limit: int | None = None) -> MMBenchFile:
    """Parse an MMBench TSV into questions; unusable rows become ``problems`` instead of errors.

    Handles a missing or empty hint, four or five (or more) options, a missing ``answer``
    column (test splits), and image cells that refer to another row by its index. A
    broken base64 image, or bytes that are not an image, is reported with its row index.
    ``limit`` stops after that many usable questions. Raises ValueError when the file is
    not an MMBench TSV at all.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"MMBench file {str(path)!r} does not exist; pass the path of an MMBench .tsv file")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of questions, got {limit}")
    rows = _read_rows(path)
    images_by_index = {_cell(row, "index"): _cell(row, "image") for _, row in rows}
    result = MMBenchFile(questions=[])
    seen: set[str] = set()
    for line, row in rows:
        try:
            question = _parse_row(row, images_by_index)
            if question.index in seen:
                raise ValueError(
                    f"row index {question.index}: the index is used by an earlier row; indices must be unique"
                )
            seen.add(question.index)
            result.questions.append(question)
        except ValueError as err:
            result.problems.append(RowProblem(index=_cell(row, "index") or "?", line=line, message=str(err)))
        if limit is not None and len(result.questions) >= limit:
            break
    return result


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


def decode_image(data: bytes, where: str = "image") -> Image.Image:
    """Encoded PNG/JPEG bytes as an RGB PIL image; ValueError naming ``where`` if they are not an image."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{where}: the image cell decodes to bytes that are not an image ({err})") from None


def _read_rows(path: Path) -> list[tuple[int, Row]]:
    """(line where the row starts, row) for every data row; the header is checked first."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # base64 images are far longer than csv's default cap
    with path.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t")
        _check_header(reader.fieldnames, path)
        rows, end = [], reader.line_num
        for row in reader:  # a quoted cell may span lines: remember where each row starts
            rows.append((end + 1, row))
            end = reader.line_num
    return rows


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


def _cell(row: Row, column: str) -> str | None:
    """The stripped cell, or None when the column is absent or the cell means 'no value'."""
    value = row.get(column)
    if value is None:
        return None
    value = value.strip()
    return None if value.lower() in _MISSING else value


def _parse_row(row: Row, images_by_index: Mapping[str | None, str | None]) -> MMBenchQuestion:
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


def _row_image(index: str, cell: str | None, images_by_index: Mapping[str | None, str | None]) -> bytes:
    """The row's encoded image, following a reference to another row; checked to decode."""
    if cell is None:
        raise ValueError(f"row index {index}: the image cell is empty; MMBench rows carry a base64-encoded image")
    if len(cell) <= _MAX_REFERENCE_LENGTH and cell in images_by_index and cell != index:
        referenced = images_by_index[cell]
        if referenced is None or len(referenced) <= _MAX_REFERENCE_LENGTH:
            raise ValueError(f"row index {index}: the image refers to row {cell}, which holds no image")
        cell = referenced
    where = f"row index {index}"
    try:
        data = base64.b64decode(cell, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(
            f"{where}: the image cell is not valid base64 ({err}); store base64.b64encode(png_bytes)"
        ) from None
    decode_image(data, where)  # a broken image is this row's problem, not a later crash
    return data
