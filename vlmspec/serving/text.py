"""Text of a growing token list, handed out in pieces that are safe to show.

A token may end in the middle of a UTF-8 character (byte-level BPE), and with stop
strings a piece of text may turn out to be the start of one. :class:`TextDeltas` hands
out only text that can no longer change: whole characters, never a possible beginning of
a stop string, and nothing from a stop string on (the OpenAI convention: the stop string
is not part of the answer). ``SpecEngine.stream`` uses it without stop strings, the HTTP
server with the request's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHARACTER = "\ufffd"  # what decoding shows for an incomplete UTF-8 sequence


class TextDeltas:
    """Feed committed tokens with :meth:`add`, get the new visible text; :meth:`close` gives the rest.

    >>> deltas = TextDeltas(tokenizer, stop=["\\n\\n"])
    >>> pieces = [deltas.add(tokens) for tokens in rounds] + [deltas.close()]
    >>> "".join(pieces) == deltas.text

    Decoding is incremental, so a step costs its new tokens, not the whole answer: only
    the tokens since the last whole character are decoded, after the previous step's
    tokens as context (some tokenizers render a token differently at the start of a text).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._tokens: list[int] = []
        self._context = 0  # token index where decoding restarts, for context
        self._read = 0  # tokens[:_read] are in _decoded
        self._decoded = ""  # the text of tokens[:_read]: whole characters, final
        self._shown = 0  # characters already handed out
        self.text = ""  # everything handed out so far (the whole answer after close())

    def __len__(self) -> int:
        """Tokens added so far."""
        return len(self._tokens)

    def add(self, tokens: Sequence[int]) -> str:
        """Append ``tokens``; returns the text that became safe to show (possibly "")."""
        self._tokens.extend(tokens)
        pending = self._pending()
        if not pending.endswith(REPLACEMENT_CHARACTER):  # whole characters: they are final now
            self._decoded += pending
            self._context, self._read = self._read, len(self._tokens)
        return self._hand_out(self._visible(self._decoded, final=False))

    def close(self) -> str:
        """The generation is over: returns the text still held back (cut at a stop string, if one occurred)."""
        return self._hand_out(self._visible(self._decoded + self._pending(), final=True))

    def _pending(self) -> str:
        """The text of the tokens after ``_read`` (may end in an incomplete character)."""
        if self._read == len(self._tokens):
            return ""
        decode = self._tokenizer.decode
        before = decode(self._tokens[self._context : self._read], skip_special_tokens=True)
        after = decode(self._tokens[self._context :], skip_special_tokens=True)
        return after[len(before) :]

    def _hand_out(self, visible: str) -> str:
        delta = visible[self._shown :]
        if delta:
            self._shown = len(visible)
            self.text = visible
        return delta

    def _visible(self, text: str, final: bool) -> str:
        cut = min((text.find(s) for s in self._stop if s in text), default=-1)
        if cut >= 0:
            return text[:cut]
        if final:
            return text
        return text[: len(text) - self._held_back(text)]

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may still become the start of a stop string."""
        for size in range(max((len(s) for s in self._stop), default=1) - 1, 0, -1):
            if len(text) >= size and any(s.startswith(text[-size:]) for s in self._stop):
                return size
        return 0
