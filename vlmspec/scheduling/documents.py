"""Versioned JSON documents: the one reader and writer of the files the schedulers keep.

SPS tables (:mod:`vlmspec.scheduling.tables`), calibrations and round records
(:mod:`vlmspec.scheduling.calibration`) are JSON objects tagged with ``"format"`` and
``"version"``. Each module knows its own fields; reading, writing and checking the tag
happen here, so every file refuses a bad document the same way, with a message that
says how to make a good one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, *, absent: str, fix: str) -> Any:
    """The decoded JSON at ``path``.

    ValueError with ``absent`` (what the caller says to do) if there is no such file, and
    naming the problem followed by ``fix`` if it cannot be read or is not JSON.
    """
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(absent) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); {fix}") from None
    except OSError as err:  # a folder, no permission: the message says which
        raise ValueError(f"{path} cannot be read ({err}); {fix}") from None


def write_json(document: dict[str, Any], path: str | Path, *, indent: int | None = 1) -> Path:
    """Write ``document`` as JSON to ``path`` (parents created); returns the path.

    ``indent=None`` writes one line, for documents of long number lists (round records).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=indent) + "\n")
    return path


def tag_problem(document: Any, format: str, version: int) -> str | None:
    """What keeps ``document`` from being a ``format`` document of ``version`` (its tag only), or None."""
    if not isinstance(document, dict):
        return "the top level must be a JSON object"
    if document.get("format") != format:
        return f"'format' must be {format!r}, got {document.get('format')!r}"
    if document.get("version") != version:
        return f"version {document.get('version')!r} is not supported (this vlmspec reads version {version})"
    return None
