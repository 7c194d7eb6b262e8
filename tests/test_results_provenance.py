"""Every published number can be traced: to a results file, and from it to a command, commit, date, CPU and threads.

The README's results table names its results files in a ``<!-- results: FILE ... -->`` line
just above it; every number in the table must appear in those files, and the section must
state the date they record. Every results file under ``docs/results/`` carries its
provenance: a JSON file a ``provenance`` object, a markdown table a "Provenance" section.
The writers that stamp them (``benchmarks.common.write_json`` / ``write_text`` and
``vlmspec demo --out``) are tested here too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.common import write_json, write_text
from vlmspec.cli import main as cli
from vlmspec.provenance import REQUIRED_FIELDS, missing_fields, provenance, provenance_markdown

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
MARKER = re.compile(r"<!-- results: (?P<files>[^>]+?) -->\n(?P<table>(?:\|.*\|\n)+)")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def results_tables(text: str) -> list[tuple[list[Path], list[list[str]]]]:
    """(named files, body rows as cells) of every table that follows a ``<!-- results: ... -->`` line."""
    tables = []
    for match in MARKER.finditer(text):
        files = [ROOT / name for name in match["files"].split()]
        rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in match["table"].splitlines()]
        tables.append((files, rows[2:]))  # past the header and the alignment row
    return tables


def numbers_not_in(rows: list[list[str]], source: str) -> list[str]:
    """The numbers of ``rows`` (cells after the first, the row's name) that ``source`` does not contain as a number."""
    missing = []
    for row in rows:
        for cell in row[1:]:
            for number in NUMBER.findall(cell):
                if not re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", source):
                    missing.append(f"{row[0]}: {number}")
    return missing


def markdown_provenance(text: str) -> dict[str, str]:
    """The "- field: value" lines of a markdown results file's Provenance section."""
    _, found, section = text.partition("\n## Provenance\n")
    assert found, "no '## Provenance' section"
    return dict(re.findall(r"^- (\w+): (.+)$", section, re.M))


def test_every_number_of_the_readme_results_table_is_in_its_results_files():
    readme = (ROOT / "README.md").read_text()
    tables = results_tables(readme)
    assert tables, "the README's results table lost its <!-- results: FILE ... --> line"
    for files, rows in tables:
        assert rows and all(path.is_file() for path in files), files
        sources = [path.read_text() for path in files]
        assert numbers_not_in(rows, "\n".join(sources)) == []
        for source in sources:  # the date each file records is stated on the front page
            date = markdown_provenance(source)["date"][:10]
            assert date in readme, f"the README's results section does not say the results date {date}"


def test_the_number_check_catches_a_number_that_is_not_in_the_file():
    source = "| vlmspec | 43.00 | 1.69 |\n"
    assert numbers_not_in([["vlmspec", "**43.00**", "1.69"]], source) == []
    assert numbers_not_in([["vlmspec", "43.01", "1.6"]], source) == ["vlmspec: 43.01", "vlmspec: 1.6"]


def result_files() -> list[Path]:
    return sorted(path for path in RESULTS.rglob("*") if path.is_file())


@pytest.mark.parametrize("path", result_files(), ids=lambda path: str(path.relative_to(RESULTS)))
def test_every_results_file_records_command_commit_date_cpu_and_threads(path):
    if path.suffix == ".json":
        record = json.loads(path.read_text()).get("provenance", {})
        assert missing_fields(record) == [], f"{path}: add these provenance fields"
        assert isinstance(record["cpu"], dict) and record["cpu"].get("model"), path
    elif path.suffix == ".md":
        assert set(markdown_provenance(path.read_text())) >= set(REQUIRED_FIELDS), path
    else:  # a plot: its numbers and provenance are in a results JSON beside it
        assert list(path.parent.glob("*.json")), f"{path} has no results JSON beside it"


def test_the_benchmark_writers_stamp_this_runs_provenance(tmp_path):
    document = json.loads(write_json(tmp_path / "r.json", {"x": 1}).read_text())
    record = document["provenance"]
    assert missing_fields(record) == [] and document["x"] == 1
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]), record["commit"]  # this checkout's HEAD
    assert record["date"][:4].isdigit() and isinstance(record["threads"], int)
    assert record["cpu"]["model"] and isinstance(record["cpu"]["flags"], list)
    kept = json.loads(write_json(tmp_path / "k.json", {"provenance": {"command": "older"}}).read_text())
    assert kept["provenance"] == {"command": "older"}  # a document with its own provenance is written as it is
    table = write_text(tmp_path / "t.md", "| a |\n| --- |\n| 1 |").read_text()
    assert table.startswith("| a |") and set(markdown_provenance(table)) >= set(REQUIRED_FIELDS)
    assert "Provenance" not in write_text(tmp_path / "log.txt", "plain").read_text()


def test_provenance_markdown_says_where_each_field_came_from():
    record = {**provenance(["vlmspec", "demo", "--out", "a b.json"]), "date_source": "the commit that added the file"}
    text = provenance_markdown(record)
    assert "- command: `vlmspec demo --out 'a b.json'`" in text
    assert f"- date: {record['date']} — the commit that added the file" in text


def test_the_demo_writes_its_printed_figures_with_their_provenance(tmp_path, capsys):
    out = tmp_path / "demo.json"
    args = ["demo", "--target", "tiny:qwen2_vl", "--drafter", "prompt-lookup", "--max-new-tokens", "6"]
    assert cli([*args, "--repeats", "1", "--text-prompt", "", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    document = json.loads(out.read_text())
    assert missing_fields(document["provenance"]) == []
    assert document["settings"]["target"] == "tiny:qwen2_vl" and document["timing"] in printed
    (request,) = document["requests"]
    assert request["answer"] in printed and request["identical_to_target_alone"]
    assert f"({request['speculative']['tokens_per_s']:.1f} tok/s)" in printed
    assert f"target alone: {request['target_alone']['tokens_per_s']:.1f} tok/s" in printed
    assert f"transformers generate(): {request['generate']['tokens_per_s']:.1f} tok/s" in printed
