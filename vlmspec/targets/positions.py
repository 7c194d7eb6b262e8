"""Map a Qwen-VL target's M-RoPE positions onto the 1-D positions a text-only drafter uses.

Qwen-VL targets give every token three rotary positions (temporal, height, width):

* a text token has the same value in all three rows;
* the tokens of an image whose merged grid is ``h x w`` and which starts at ``s`` get
  ``t = s``, ``h = s + row``, ``w = s + col``;
* the text after a vision run continues at ``max(positions in the run) + 1``
  (``s + max(h, w)`` for an image), so the stream is shorter than the token count;
* during decoding all three rows equal ``cache_index + rope_delta``.

A drafter sees one scalar per token. Text tokens keep the target's own position. Vision
tokens get a monotone (non-decreasing) scalar chosen by a *rule*, and the text after the
run continues exactly where the target's text does. The rule is part of a drafter's
config, so training caches and inference agree.

Rules
-----
``interpolate`` (default)
    The ``n`` tokens of a vision run that starts at ``s`` and is followed by text at
    ``e`` get ``s + floor(i * (e - s) / n)`` for ``i = 0 .. n-1``: spread evenly over
    the span the target reserves for the run, in reading (raster) order.
``temporal``
    The target's temporal row: every token of an image sits at ``s`` (a video's frames
    step forward in time).
"""

from __future__ import annotations

import torch

from vlmspec.types import DEFAULT_POSITION_RULE

POSITION_RULES = ("interpolate", "temporal")


def check_position_rule(rule: str) -> str:
    if rule not in POSITION_RULES:
        raise ValueError(f"unknown position rule {rule!r}; choose one of {', '.join(POSITION_RULES)}")
    return rule


def text_stream_positions(
    mrope_positions: torch.Tensor,  # [3, L] int64, the target's M-RoPE positions of one sequence
    vision_mask: torch.Tensor,  # [L] bool, True for image/video placeholder tokens
    rule: str = DEFAULT_POSITION_RULE,
) -> torch.Tensor:  # [L] int64
    """1-D text-stream position of every token of one sequence, by ``rule``."""
    check_position_rule(rule)
    assert mrope_positions.dim() == 2 and mrope_positions.shape[0] == 3, mrope_positions.shape
    positions = mrope_positions[0].clone()  # text tokens: all rows are equal; vision: the t row
    if rule == "temporal":
        return positions
    for start, stop in _runs(vision_mask):
        first = int(mrope_positions[0, start])
        follow = int(mrope_positions[:, start:stop].max()) + 1  # where the target's text resumes
        count = stop - start
        offsets = torch.arange(count, dtype=torch.long) * (follow - first) // count
        positions[start:stop] = first + offsets
    return positions


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) index pairs of the maximal runs of True in a 1-D bool mask."""
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), mask.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = torch.diff(padded)
    starts = torch.nonzero(edges == 1).flatten().tolist()
    stops = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, stops))
