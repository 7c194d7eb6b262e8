"""The option letter a free-form answer chose: rules from explicit cues to a lone capital letter."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

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


def normalize_words(text: str) -> str:
    """Lowercase words of letters and digits, single-spaced ("A red-car!" -> "a red car")."""
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def _by_option_text(text: str, options: Mapping[str, str]) -> str | None:
    said = f" {normalize_words(text)} "
    normalized = {k.upper(): normalize_words(v) for k, v in options.items()}
    matched = {k: v for k, v in normalized.items() if v and f" {v} " in said}
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
