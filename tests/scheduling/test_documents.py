"""The one reader and writer of the schedulers' versioned JSON files: clear refusals, tags checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmspec.scheduling.documents import read_json, tag_problem, write_json

FIX = "make it again"


def test_write_then_read_round_trips_and_creates_parents(tmp_path: Path) -> None:
    document = {"format": "vlmspec.test", "version": 1, "values": [1, 2, 3]}
    path = write_json(document, tmp_path / "deeper" / "doc.json")
    assert read_json(path, absent="none", fix=FIX) == document
    assert len(path.read_text().splitlines()) > 1  # indented by default: diffs stay readable
    one_line = write_json(document, tmp_path / "records.json", indent=None)
    assert len(one_line.read_text().splitlines()) == 1  # long number lists stay one line


def test_missing_unreadable_and_invalid_files_are_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^no document here$"):
        read_json(tmp_path / "missing.json", absent="no document here", fix=FIX)
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ValueError, match=f"bad.json is not valid JSON .*; {FIX}$"):
        read_json(tmp_path / "bad.json", absent="none", fix=FIX)
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=f"not valid JSON .*; {FIX}$"):
        read_json(tmp_path / "binary.json", absent="none", fix=FIX)
    with pytest.raises(ValueError, match=f"cannot be read .*; {FIX}$"):
        read_json(tmp_path, absent="none", fix=FIX)  # a folder


@pytest.mark.parametrize(
    "document, problem",
    [
        ({"format": "vlmspec.test", "version": 1}, None),
        ([1, 2], "the top level must be a JSON object"),
        ({"format": "other", "version": 1}, "'format' must be 'vlmspec.test', got 'other'"),
        ({"version": 1}, "'format' must be 'vlmspec.test', got None"),
        ({"format": "vlmspec.test", "version": 2}, "version 2 is not supported (this vlmspec reads version 1)"),
        ({"format": "vlmspec.test", "version": "1"}, "version '1' is not supported (this vlmspec reads version 1)"),
    ],
)
def test_tag_problem_names_what_is_wrong(document, problem) -> None:
    assert tag_problem(json.loads(json.dumps(document)), "vlmspec.test", 1) == problem
