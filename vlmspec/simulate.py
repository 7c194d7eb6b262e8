"""The interactive scheduler simulator (docs/design.md §15): one self-contained HTML page.

``write_simulator(path, table)`` writes a page that needs no server, no network and no
external file: inline CSS, inline JavaScript, an inline SVG plot, and the SPS table
embedded as JSON in ``<script type="application/json" id="sps-table">``. On the page a
person drags the per-position conditional confidences ``c_k`` and sees

* the survival chain ``a_k = c_1 * ... * c_k``;
* ``Theta(l) = (1 + a_1 + ... + a_l) * SPS(1 + l)`` for l = 0..gamma, plotted;
* the causal choice (:class:`~vlmspec.scheduling.SPSArgmaxScheduler`: grow l while Theta
  strictly rises, stop at the first drop) and the retrospective choice (the global
  argmax of Theta over every l, no break: the peeking search of the Appendix A
  counterexample), with a sentence on why they differ and why only the causal one is
  lossless;
* Algorithm 1 (:class:`~vlmspec.scheduling.PrefixScheduler`) for R requests: the
  admission order and the chosen lengths.

The page's arithmetic is a line-by-line mirror of the Python schedulers in float64
(``SPSTable.steps_per_second``'s interpolation of step time, ``np.cumprod``/``np.cumsum``
order, strict ``>`` for a rise, NaN beyond the table counting as a drop, the smallest l on
ties of the global argmax); ``tests/test_simulate.py`` drives the page in headless
Chromium with cases generated here and compares against the schedulers.

Command line (also ``vlmspec simulate``)::

    python -m vlmspec.simulate --preset appendix_a --out page.html [--open]
    python -m vlmspec.simulate --sps sps.json --gamma 7 --confidences 0.9,0.85,0.8
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
import warnings
import webbrowser
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from vlmspec.scheduling.prefix import require_anchors_fit
from vlmspec.scheduling.profiling import PRESETS, sps_preset
from vlmspec.scheduling.tables import BatchSPSTable, SPSTable, load_sps_table

SIMULATOR_PRESETS: tuple[str, ...] = tuple(PRESETS)  # names `sps_preset` accepts: appendix_a, gpu_like, cpu
MAX_GAMMA = 16  # sliders on the page
MAX_REQUESTS = 8  # requests in the batched view
DEFAULT_GAMMA = 7  # the paper's block size
APPENDIX_A_CONFIDENCES = (0.8, 0.95)  # c1 = 0.8 (docs/design.md §9); c2 high enough that Theta(2) = 1.152 > Theta(0)
_TEMPLATE = "simulator_page.html"

# Requests 2..8 of the batched view (request 1 is the sliders): varied, readable defaults.
_BATCH_ROWS = (
    (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65),
    (0.6, 0.5, 0.4, 0.3),
    (0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93),
    (0.7, 0.9, 0.9, 0.9, 0.9),
    (0.3, 0.9, 0.9),
    (0.85, 0.85, 0.85, 0.85, 0.85, 0.85, 0.85),
    (0.5,),
)
_DEFAULT_REQUESTS = 4


def default_confidences(count: int = MAX_GAMMA) -> list[float]:
    """The page's default sliders: a drafter whose confidence falls along the block (0.92, 0.89, ...)."""
    return [round(0.92 - 0.03 * k, 2) for k in range(count)]


def load_table_for_simulator(sps: str | Path | None, preset: str | None) -> SPSTable:
    """The SPS table to embed: a JSON table written by ``vlmspec profile`` (``sps``) or a named preset.

    Exactly one of ``sps`` and ``preset`` must be given; ``preset`` is one of
    :data:`SIMULATOR_PRESETS` (``appendix_a``: SPS(1)=1.0, SPS(2)=0.5, SPS(3)=0.45;
    ``gpu_like``: a synthetic GPU-shaped curve; ``cpu``: this project's CPU machines).
    """
    if (sps is None) == (preset is None):
        given = "both" if sps is not None else "neither"
        raise ValueError(
            f"pass exactly one SPS source, got {given}: sps='table.json' (written by `vlmspec profile`) "
            f"or preset= one of {', '.join(SIMULATOR_PRESETS)}"
        )
    if preset is not None:
        if preset not in SIMULATOR_PRESETS:
            raise ValueError(
                f"unknown SPS preset {preset!r}; choose one of {', '.join(SIMULATOR_PRESETS)} "
                "or pass sps='table.json' from `vlmspec profile`"
            )
        return sps_preset(preset)
    if not isinstance(sps, (str, Path)):
        raise TypeError(f"sps must be the path of an SPS table JSON file, got {type(sps).__name__}")
    table = load_sps_table(Path(sps))
    if isinstance(table, BatchSPSTable):  # from `vlmspec profile --requests`: the page shows one request's curve
        if table.requests[0] != 1:
            raise ValueError(
                f"{sps} holds batch curves for {list(table.requests)} requests; the simulator needs the curve of "
                "one request: measure with `vlmspec profile --requests 1,...` or without --requests"
            )
        return table.curves[0]
    return table


def write_simulator(
    path: str | Path,
    table: SPSTable,
    *,
    gamma: int | None = None,
    confidences: Sequence[float] | None = None,
    open_browser: bool = False,
) -> Path:
    """Write the simulator page for ``table`` to ``path`` (parents created); return the path.

    gamma: draft positions shown at first, 1..16 (default: ``len(confidences)``, else 2
        for the Appendix A curve and 7 otherwise). The page lets the reader change it.
    confidences: the initial c_1..c_gamma, each in [0, 1] (default: the Appendix A
        example (0.8, 0.95) on that curve, else a falling 0.92, 0.89, ...).
    open_browser: open the written page with :mod:`webbrowser` (a warning if none opens).
    """
    if not isinstance(table, SPSTable):
        raise TypeError(
            f"table must be an SPSTable, got {type(table).__name__}; build one with "
            "load_table_for_simulator(sps='table.json', preset=None) or vlmspec.scheduling.sps_preset(name)"
        )
    require_anchors_fit(1, table)  # one request: B = 1 must be in the table, as SPSArgmaxScheduler requires
    values = _check_confidences(confidences)
    gamma = _check_gamma(gamma, values, table)
    if values is None:
        values = list(APPENDIX_A_CONFIDENCES) if _is_appendix_a(table) and gamma <= 2 else default_confidences()
    sliders = values + default_confidences()[len(values) :]  # all 16 sliders get a value; gamma shows the first
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory; pass the .html file to write, e.g. {path / 'simulator.html'}")
    page = render_page(table, gamma=gamma, sliders=sliders)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    if open_browser and not webbrowser.open(path.resolve().as_uri()):
        warnings.warn(f"no browser could be opened; open {path.resolve().as_uri()} yourself", stacklevel=2)
    return path


def render_page(table: SPSTable, *, gamma: int, sliders: Sequence[float]) -> str:
    """The page's HTML: the template with the table, the configuration and the control rows filled in."""
    appendix = sps_preset("appendix_a")
    requests = max(1, min(_DEFAULT_REQUESTS, table.max_tokens))  # a default batch the table covers
    config: dict[str, Any] = {
        "gamma": gamma,
        "confidences": list(sliders),
        "max_gamma": MAX_GAMMA,
        "max_requests": MAX_REQUESTS,
        "table_label": table_label(table),
        "appendix_a": {
            "table": appendix.to_dict(),
            "label": table_label(appendix),
            "gamma": 2,
            "confidences": list(APPENDIX_A_CONFIDENCES),
        },
    }
    fills = {
        "{{SPS_TABLE_JSON}}": _script_json(table.to_dict()),
        "{{CONFIG_JSON}}": _script_json(config),
        "{{TABLE_LABEL}}": html.escape(table_label(table)),
        "{{GAMMA}}": str(gamma),
        "{{SLIDER_ROWS}}": _slider_rows(sliders, gamma),
        "{{BATCH_ROWS}}": _batch_rows(requests),
        "{{BATCH_REQUESTS}}": str(requests),
    }
    template = resources.files("vlmspec").joinpath(_TEMPLATE).read_text(encoding="utf-8")
    assert all(template.count(key) == 1 for key in fills), "each template placeholder appears exactly once"
    # one pass, so text inside a filled value (a table's notes, say) is never taken for a placeholder
    return re.sub(r"\{\{[A-Z_]+\}\}", lambda match: fills[match.group(0)], template)


def table_label(table: SPSTable) -> str:
    """One line naming an SPS table: what it was measured on and the token counts it covers."""
    meta = table.meta
    parts = [meta.model]
    parts += [p for p in (meta.hardware or meta.device, meta.dtype) if p and p != "none"]
    if meta.context_length is not None:
        parts.append(f"context {meta.context_length}")
    return f"{', '.join(parts)} ({table.min_tokens}..{table.max_tokens} tokens in flight)"


# -- helpers ---------------------------------------------------------------------------------


def _is_appendix_a(table: SPSTable) -> bool:
    return table.meta.source == "preset:appendix_a"


def _check_confidences(confidences: Sequence[float] | None) -> list[float] | None:
    if confidences is None:
        return None
    if isinstance(confidences, (str, bytes)):
        raise TypeError(
            f"confidences must be a sequence of numbers such as (0.9, 0.8, 0.7), not a string {confidences!r}"
        )
    try:
        values = [float(c) for c in confidences]
    except (TypeError, ValueError):
        raise TypeError(
            f"confidences must be a sequence of numbers in [0, 1] such as (0.9, 0.8, 0.7), got {confidences!r}"
        ) from None
    if not 1 <= len(values) <= MAX_GAMMA:
        raise ValueError(f"the page shows 1..{MAX_GAMMA} draft positions; got {len(values)} confidences")
    bad = [c for c in values if not (math.isfinite(c) and 0.0 <= c <= 1.0)]
    if bad:
        raise ValueError(
            f"confidences must be probabilities in [0, 1] (the confidence head's sigmoid output, not logits); got {bad}"
        )
    return values


def _check_gamma(gamma: int | None, values: list[float] | None, table: SPSTable) -> int:
    if gamma is None:
        if values is not None:
            return len(values)
        return 2 if _is_appendix_a(table) else DEFAULT_GAMMA
    if not isinstance(gamma, int) or isinstance(gamma, bool):
        raise TypeError(f"gamma must be an integer (draft positions, 1..{MAX_GAMMA}), got {gamma!r}")
    if not 1 <= gamma <= MAX_GAMMA:
        raise ValueError(f"gamma must be in 1..{MAX_GAMMA} (the page has {MAX_GAMMA} sliders), got {gamma}")
    if values is not None and len(values) != gamma:
        raise ValueError(f"gamma={gamma} but {len(values)} confidences were given; pass one confidence per position")
    return gamma


def _script_json(data: Any) -> str:
    """JSON safe inside a <script> element: '<', '>' and '&' as \\u escapes, so no '</script>' can end it early."""
    text = json.dumps(data, allow_nan=False, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _slider_rows(sliders: Sequence[float], gamma: int) -> str:
    rows = []
    for k, value in enumerate(sliders, start=1):
        hidden = "" if k <= gamma else " hidden"
        rows.append(
            f'<div class="crow" id="row-{k}" data-testid="row-{k}"{hidden}>'
            f'<label for="c-{k}">c<sub>{k}</sub></label>'
            f'<input type="range" id="c-{k}" data-testid="c-{k}" min="0" max="1" step="0.01" value="{value!r}" '
            f'aria-describedby="a-{k}-text">'
            f'<input type="number" id="c-{k}-value" data-testid="c-{k}-value" class="cnum" min="0" max="1" step="0.01" '
            f'value="{value!r}" aria-label="c_{k}, conditional confidence of draft position {k}">'
            f'<span class="abar" aria-hidden="true"><span class="afill" id="a-{k}-bar"></span></span>'
            f'<output id="a-{k}" data-testid="a-{k}" for="c-{k}" class="aval"></output>'
            f'<span class="visually-hidden" id="a-{k}-text">survival a_{k} is shown next to this slider</span>'
            "</div>"
        )
    return "\n".join(rows)


def _batch_rows(requests: int) -> str:
    rows = [
        '<div class="brow" id="batch-row-1"><label for="batch-c-1">request 1</label>'
        '<input type="text" id="batch-c-1" data-testid="batch-c-1" readonly aria-describedby="batch-row-1-note">'
        '<span class="hint" id="batch-row-1-note">= the sliders above</span></div>'
    ]
    for r in range(2, MAX_REQUESTS + 1):
        value = ", ".join(repr(c) for c in _BATCH_ROWS[r - 2])
        hidden = "" if r <= requests else " hidden"
        rows.append(
            f'<div class="brow" id="batch-row-{r}"{hidden}><label for="batch-c-{r}">request {r}</label>'
            f'<input type="text" id="batch-c-{r}" data-testid="batch-c-{r}" value="{value}" spellcheck="false" '
            f'aria-describedby="batch-help"><span class="hint" id="batch-c-{r}-error" role="alert"></span></div>'
        )
    return "\n".join(rows)


# -- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlmspec.simulate",
        description="Write the interactive scheduler simulator: one self-contained HTML page.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--sps", help="an SPS table JSON written by `vlmspec profile`")
    source.add_argument(
        "--preset", choices=SIMULATOR_PRESETS, help=f"a named SPS curve: {', '.join(SIMULATOR_PRESETS)} (default: cpu)"
    )
    parser.add_argument("--gamma", type=int, default=None, help=f"draft positions shown at first (1..{MAX_GAMMA})")
    parser.add_argument("--confidences", default=None, help="initial c_1..c_gamma, comma-separated, e.g. 0.9,0.85,0.8")
    parser.add_argument("--out", default="scheduler-simulator.html", help="the HTML file to write")
    parser.add_argument("--open", action="store_true", help="open the page in a browser")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = args.preset if (args.preset or args.sps) else "cpu"
    try:
        confidences = None
        if args.confidences is not None:
            try:
                confidences = [float(c) for c in args.confidences.replace(" ", "").split(",") if c]
            except ValueError:
                raise ValueError(f"--confidences takes numbers separated by commas, not {args.confidences!r}") from None
        table = load_table_for_simulator(args.sps, preset)
        path = write_simulator(args.out, table, gamma=args.gamma, confidences=confidences, open_browser=args.open)
    except (ValueError, TypeError) as err:
        parser.error(str(err))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
