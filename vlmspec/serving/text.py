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
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._tokens: list[int] = []
        self._shown = 0  # characters already handed out
        self.text = ""  # everything handed out so far (the whole answer after close())

    def __len__(self) -> int:
        """Tokens added so far."""
        return len(self._tokens)

    def add(self, tokens: Sequence[int]) -> str:
        """Append ``tokens``; returns the text that became safe to show (possibly "")."""
        self._tokens.extend(tokens)
        return self._hand_out(self._visible(final=False))

    def close(self) -> str:
        """The generation is over: returns the text still held back (cut at a stop string, if one occurred)."""
        return self._hand_out(self._visible(final=True))

    def _hand_out(self, visible: str) -> str:
        delta = visible[self._shown :]
        if delta:
            self._shown = len(visible)
            self.text = visible
        return delta

    def _visible(self, final: bool) -> str:
        text = self._tokenizer.decode(self._tokens, skip_special_tokens=True)
        cut = min((text.find(s) for s in self._stop if s in text), default=-1)
        if cut >= 0:
            return text[:cut]
        if final:
            return text
        return text[: len(text) - self._held_back(text)]

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may still change: an incomplete character, a stop string's start."""
        if text.endswith(REPLACEMENT_CHARACTER):
            return len(text) - len(text.rstrip(REPLACEMENT_CHARACTER))
        for size in range(max((len(s) for s in self._stop), default=1) - 1, 0, -1):
            if any(s.startswith(text[-size:]) for s in self._stop if len(text) >= size):
                return size
        return 0
