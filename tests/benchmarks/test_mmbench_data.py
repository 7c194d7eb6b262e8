"""MMBench TSV parsing, prompt building, letter extraction and the other workloads (no model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from benchmarks.make_mmbench_fixture import FIXTURE_ROWS, encode_image_base64, fixture_rows, write_mmbench_tsv
from benchmarks.spec.choices import extract_choice
from benchmarks.spec.runs import parse_key_values
from benchmarks.spec.workloads import (
    Task,
    easy_vqa_tasks,
    mmbench_tasks,
    prompt_set_tasks,
    read_prompt_set,
    score,
    skimage_open_tasks,
)
from vlmspec.data.mmbench import ANSWER_INSTRUCTION, MMBenchQuestion, build_mmbench_prompt, read_mmbench_tsv

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MMBENCH_MINI = FIXTURES / "mmbench_mini.tsv"


@pytest.fixture(scope="module")
def png_b64() -> str:
    return encode_image_base64(Image.new("RGB", (32, 24), (200, 30, 30)))


def _row(index, png, **cells):
    base = {
        "index": index,
        "question": f"Question {index}?",
        "A": "red",
        "B": "green",
        "C": "blue",
        "D": "grey",
        "answer": "A",
        "category": "attribute_recognition",
        "l2-category": "finegrained_perception (instance-level)",
        "split": "dev",
        "image": png,
    }
    return {**base, **cells}


def test_parses_hint_and_no_hint_four_and_five_options(tmp_path, png_b64):
    path = write_mmbench_tsv(
        [
            _row(1, png_b64, hint="Look at the color."),  # hint, four options (E empty)
            _row(2, png_b64, hint="", E="black", answer="e"),  # no hint, five options, lowercase answer
            _row(3, png_b64, hint="nan", C="", D=""),  # pandas' NaN hint, two options
        ],
        tmp_path / "mm.tsv",
    )
    parsed = read_mmbench_tsv(path)
    assert parsed.problems == []
    first, second, third = parsed.questions
    assert first.hint == "Look at the color." and list(first.options) == ["A", "B", "C", "D"]
    assert second.hint is None and list(second.options) == ["A", "B", "C", "D", "E"] and second.answer == "E"
    assert third.hint is None and third.options == {"A": "red", "B": "green"}
    assert first.pil_image().size == (32, 24) and first.pil_image().mode == "RGB"
    assert first.category == "attribute_recognition" and first.split == "dev"


def test_a_file_without_hint_or_answer_columns_parses(tmp_path, png_b64):
    columns = ("index", "question", "A", "B", "C", "D", "image")
    path = write_mmbench_tsv([_row(7, png_b64)], tmp_path / "test-split.tsv", columns=columns)
    (question,) = read_mmbench_tsv(path).questions
    assert question.hint is None and question.answer is None and question.category is None


def test_broken_base64_image_is_reported_with_its_index_not_a_crash(tmp_path, png_b64):
    not_an_image = encode_image_base64(Image.new("RGB", (4, 4)))[:40] + "AAAA"  # valid base64, truncated PNG
    path = write_mmbench_tsv(
        [_row(10, png_b64), _row(11, "this is *not* base64!"), _row(12, not_an_image), _row(13, png_b64)],
        tmp_path / "broken.tsv",
    )
    parsed = read_mmbench_tsv(path)
    assert [q.index for q in parsed.questions] == ["10", "13"]
    assert [(p.index, p.line) for p in parsed.problems] == [("11", 3), ("12", 4)]
    assert "row index 11" in parsed.problems[0].message and "base64" in parsed.problems[0].message
    assert "row index 12" in parsed.problems[1].message and "not an image" in parsed.problems[1].message


def test_other_bad_rows_are_reported(tmp_path, png_b64):
    path = write_mmbench_tsv(
        [
            _row(1, png_b64),
            _row(1, png_b64),
            _row(2, png_b64, answer="F"),
            _row(3, png_b64, B="", C="", D=""),
            _row(4, png_b64, question=""),
        ],
        tmp_path / "bad.tsv",
    )
    parsed = read_mmbench_tsv(path)
    assert [q.index for q in parsed.questions] == ["1"]
    messages = [p.message for p in parsed.problems]
    assert "used by an earlier row" in messages[0]
    assert "answer 'F' is not one of" in messages[1]
    assert "at least two options" in messages[2]
    assert "question cell is empty" in messages[3]


def test_image_cell_may_refer_to_another_row(tmp_path, png_b64):
    path = write_mmbench_tsv([_row(100, png_b64), _row(101, "100"), _row(102, "999")], tmp_path / "ref.tsv")
    parsed = read_mmbench_tsv(path)
    assert [q.index for q in parsed.questions] == ["100", "101"]
    assert parsed.questions[1].pil_image().size == (32, 24)
    assert parsed.problems[0].index == "102" and "not valid base64" in parsed.problems[0].message


def test_multiline_cells_and_limit(tmp_path, png_b64):
    path = write_mmbench_tsv(
        [_row(1, png_b64, question="Line one\nline two?"), _row(2, png_b64), _row(3, png_b64)], tmp_path / "multi.tsv"
    )
    parsed = read_mmbench_tsv(path, limit=2)
    assert [q.index for q in parsed.questions] == ["1", "2"]
    assert parsed.questions[0].question == "Line one\nline two?"


def test_files_that_are_not_mmbench_raise_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_mmbench_tsv(tmp_path / "missing.tsv")
    csv_file = tmp_path / "comma.tsv"
    csv_file.write_text("index,question,A,B,image\n1,q,a,b,xx\n")
    with pytest.raises(ValueError, match="does not look tab-separated"):
        read_mmbench_tsv(csv_file)
    no_image = tmp_path / "noimage.tsv"
    no_image.write_text("index\tquestion\tA\tB\n1\tq\ta\tb\n")
    with pytest.raises(ValueError, match="lacks the MMBench column\\(s\\) image"):
        read_mmbench_tsv(no_image)


def test_prompt_in_the_standard_mmbench_format():
    question = MMBenchQuestion(
        index="3",
        question="What is shown?",
        options={"A": "A cat", "B": "A dog", "C": "A fox"},
        image=None,
        hint="It purrs.",
    )
    assert build_mmbench_prompt(question) == (
        "Hint: It purrs.\nQuestion: What is shown?\nOptions:\nA. A cat\nB. A dog\nC. A fox\n" + ANSWER_INSTRUCTION
    )
    question.hint = None
    assert build_mmbench_prompt(question).startswith("Question: What is shown?\nOptions:\nA. A cat\n")


OPTIONS = {"A": "A space suit", "B": "A wedding dress", "C": "A diving suit", "D": "A chef's uniform"}


@pytest.mark.parametrize(
    "response, letter",
    [
        ("The answer is (B).", "B"),
        ("B", "B"),
        ("b) A wedding dress", "B"),
        ("Answer: C", "C"),
        ("**Answer:** D", "D"),
        ("The correct option is d", "D"),
        ("(C) A diving suit", "C"),
        ("A. A space suit", "A"),
        ("A", "A"),
        ("c.", "C"),
        ("I think it is D, because of the hat.", "D"),
        ("The person is wearing a wedding dress.", "B"),  # by option text
        ("A cat is sitting on the mat.", None),  # an article, not option A
        ("the answer is a cat", None),
        ("e.g. nothing at all", None),
        ("Options:\nA. x\nB. y", None),  # an echo of the options names no single one
        ("E", None),  # not an option of this question
        ("", None),
    ],
)
def test_extract_choice(response, letter):
    assert extract_choice(response, OPTIONS) == letter


def test_extract_choice_with_five_letters_and_no_texts():
    assert extract_choice("The answer is E.", "ABCDE") == "E"
    assert extract_choice("The answer is E.", "ABCD") is None


def test_score_letter_and_word_tasks():
    mc = Task("mmbench", "q", "g", "p", answer="B", options=OPTIONS, scoring="letter")
    assert score(mc, "The answer is (B).") == ("B", True)
    assert score(mc, "Answer: C") == ("C", False)
    word = Task("easy-vqa", "q", "g", "p", answer="circle", scoring="word")
    assert score(word, "Circle.") == ("circle", True)
    assert score(Task("mt-bench", "q", "g", "p"), "anything") == (None, None)


def test_checked_in_fixture_matches_its_builder():
    parsed = read_mmbench_tsv(MMBENCH_MINI)
    assert parsed.problems == [] and len(parsed.questions) == len(FIXTURE_ROWS) >= 12
    assert sum(q.hint is not None for q in parsed.questions) == 1
    assert any(list(q.options) == list("ABCDE") for q in parsed.questions)
    rebuilt = fixture_rows()
    assert [q.question for q in parsed.questions] == [r["question"] for r in rebuilt]
    assert [q.answer for q in parsed.questions] == [r["answer"] for r in rebuilt]


def test_workload_builders(tmp_path):
    tasks, problems = mmbench_tasks(MMBENCH_MINI, limit=3, max_side=64)
    assert problems == [] and [t.qid for t in tasks] == ["mmbench-0", "mmbench-1", "mmbench-2"]
    assert max(tasks[0].images[0].size) <= 64 and tasks[0].scoring == "letter"
    text = prompt_set_tasks(FIXTURES / "mt-bench-mini.jsonl", limit=2)
    assert [t.workload for t in text] == ["mt-bench-mini"] * 2 and text[0].image_arg is None
    assert text[0].prompt.startswith("Compose an engaging travel blog post")
    shapes = easy_vqa_tasks(limit=3)
    assert len({t.qid for t in shapes}) == 3 and shapes[0].images[0].size == (64, 64) and shapes[0].scoring == "word"
    assert shapes[0].prompt.endswith("Answer with one word.") and shapes[0].answer
    photos = skimage_open_tasks(limit=2, max_side=96)
    assert len(photos) == 2 and max(photos[0].images[0].size) == 96
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"prompt": "no turns"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_prompt_set(bad)


def test_parse_key_values():
    assert parse_key_values(["threshold=0.6", "name=abc", "flag=true"]) == {
        "threshold": 0.6,
        "name": "abc",
        "flag": True,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_key_values(["oops"])
