"""Shared helpers for benchmark scripts: timing, summaries, and the JSON / markdown / PNG writers.

Every benchmark writes the same three kinds of output into one directory: a JSON file
with every number (``write_json``), a markdown table a person can paste into a report
(``markdown_table``), and PNG plots (``plot_grouped_bars``, ``plot_lines``,
``plot_stacked_bars``). Plots use matplotlib's object API with the Agg canvas, so they
never touch pyplot's global state or need a display. Both writers stamp each results file
with its provenance (command, commit, date, CPU model and flags, threads), so a number
quoted from it can be traced to the machine and code that measured it.

Timing conventions: wall-clock ``time.perf_counter``; variants compared against each
other are run *interleaved* (``run_order``) within one process so that drift (thermal
throttling, other users of the machine, allocator warm-up) hits all of them alike, and
ratios are always computed between numbers measured in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

# Real pictures live in the package, beside the held-out split that decides which ones a benchmark may use;
# the benchmarks keep importing them from here.
from vlmspec.data.pictures import shrink_image, skimage_image  # noqa: F401
from vlmspec.provenance import provenance, provenance_markdown

T = TypeVar("T")

# MT-Bench's first turns (vlmspec.data.heldout splits off the held-out ones), in the shared data beside the repo.
MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "mt-bench.jsonl"

# A palette that stays readable in grey print and for common colour-vision deficiencies.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
MARKERS = ("o", "s", "^", "D")


# --------------------------------------------------------------------------- timing


class Timer:
    """Wall-clock timer: ``with Timer() as t: work()`` then read ``t.seconds``."""

    def __init__(self) -> None:
        self.start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def timed(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call of ``fn``."""
    with Timer() as timer:
        fn()
    return timer.seconds


def run_order(variants: Sequence[T], step: int) -> list[T]:
    """The run order of ``variants`` for item ``step`` of an interleaved A/B(/C...) benchmark.

    Items come in pairs: item ``2k`` runs the variants rotated left by ``k``, item ``2k + 1`` the same
    rotation reversed. So every pair of variants runs in both orders equally often, whatever their
    places in the list. (A plain rotation runs B right after A in all but one item of every
    ``len(variants)``: the row that always runs second inherits what the one before it left in caches
    and clocks.) Over ``2 * len(variants)`` items every variant runs at every place twice.
    """
    if not variants:
        return []
    k = (step // 2) % len(variants)
    order = list(variants[k:]) + list(variants[:k])
    return order[::-1] if step % 2 else order


# --------------------------------------------------------------------------- numbers


def safe_ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing, not finite, or the denominator is 0."""
    if numerator is None or denominator is None:
        return None
    if not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator == 0:
        return None
    return numerator / denominator


def summarize(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """n, mean, median, min, max and sample standard deviation of the finite values (None when there are none)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"n": 0, "mean": None, "median": None, "min": None, "max": None, "stdev": None}
    return {
        "n": len(finite),
        "mean": statistics.fmean(finite),
        "median": statistics.median(finite),
        "min": min(finite),
        "max": max(finite),
        "stdev": statistics.stdev(finite) if len(finite) > 1 else 0.0,
    }


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def format_number(value: Any, digits: int = 2) -> str:
    """A table cell: numbers with ``digits`` decimals, None/NaN as an en dash, anything else via ``str``."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "–" if not math.isfinite(value) else f"{value:.{digits}f}"
    return str(value)


# --------------------------------------------------------------------------- markdown and JSON


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, digits: int = 2) -> str:
    """A GitHub markdown table; numeric columns are right-aligned, cells are formatted with ``format_number``."""
    rows = [list(row) for row in rows]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"a table row has {len(row)} cells but there are {len(headers)} headers: {row!r}")
    numeric = [_is_numeric_column([row[j] for row in rows]) for j in range(len(headers))]
    cells = [[_escape_cell(format_number(v, digits)) for v in row] for row in rows]
    lines = ["| " + " | ".join(_escape_cell(str(h)) for h in headers) + " |"]
    lines.append("| " + " | ".join("---:" if is_num else "---" for is_num in numeric) + " |")
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def _is_numeric_column(values: Sequence[Any]) -> bool:
    """Right-align a column when it holds numbers (booleans and text excluded) and maybe blanks."""
    present = [v for v in values if v is not None]
    return bool(present) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present)


def _escape_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_jsonable(value: Any) -> Any:
    """Turn dataclasses, paths, tuples, numpy/torch scalars and non-finite floats into plain JSON values.

    NaN and infinities become None (JSON has no NaN; a reader should see "no value").
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy arrays / scalars, torch tensors
        return to_jsonable(value.tolist())
    if hasattr(value, "item"):
        return to_jsonable(value.item())
    return str(value)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` (made JSON-safe by ``to_jsonable``) with indentation; returns the path.

    A results document (a mapping) gets a ``provenance`` field first, unless it has one: the
    command, commit, date, CPU and thread count of this run (``vlmspec.provenance``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, Mapping) and "provenance" not in data:
        data = {"provenance": provenance(), **data}
    path.write_text(json.dumps(to_jsonable(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (newline-terminated) and return the path.

    A markdown file (``.md``) is a results table a reader may quote, so it ends with this
    run's provenance section (``vlmspec.provenance.provenance_markdown``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = text if text.endswith("\n") else text + "\n"
    if path.suffix == ".md":
        text = f"{text}\n{provenance_markdown(provenance())}"
    path.write_text(text, encoding="utf-8")
    return path


def prepare_out_dir(path: str | os.PathLike) -> Path:
    """Create the output directory (parents included) and return it; refuse a path that is a file."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {str(path)!r} is a file; give a directory path (it is created if missing)")
    path.mkdir(parents=True, exist_ok=True)
    return path


def held_out_prompts_of_length(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """``count`` different held-out MT-Bench prompts, each repeated to about ``tokens`` tokens of ``tokenizer``."""
    from vlmspec.data.heldout import held_out_prompts

    texts = held_out_prompts(MT_BENCH)
    out = []
    for i in range(count):
        base = texts[i % len(texts)] + f" (request {i})"
        repeats = max(1, tokens // max(1, len(tokenizer(base).input_ids)))
        out.append(" ".join([base] * repeats))
    return out


def add_target_arguments(parser: Any, *, out: str) -> None:
    """``--target``, ``--dtype``, ``--threads`` and ``--out`` (default ``out``), as every one-target benchmark takes them."""
    parser.add_argument("--target", default="reference", help="'reference', a Qwen-VL directory, or tiny:FAMILY")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2, help="torch threads (and the peers' threads)")
    parser.add_argument("--out", type=Path, default=Path(out))


def add_server_arguments(parser: Any) -> None:
    """``--drafter``, ``--server-args`` and ``--startup-timeout``: how a benchmark starts ``vlmspec serve``.

    Call :func:`server_drafter` after parsing: an unset ``--drafter`` is the reference pair's own for the
    reference target, else the server's default.
    """
    parser.add_argument(
        "--drafter", default=None, help="vlmspec serve's --drafter (default: 'reference' for the reference target)"
    )
    parser.add_argument(
        "--server-args", type=shlex.split, default=[], help="more vlmspec serve flags, one string (shell quoting)"
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for a server")


def server_drafter(args: Any) -> str | None:
    """``--drafter``, else ``reference`` for the reference target, else None (the server's own default)."""
    return args.drafter or ("reference" if args.target == "reference" else None)


def peer_logs_dir(out: str | os.PathLike, peer: str) -> Path:
    """Where a peer's logs and job files go for the results in ``out``: ``runs/peer-logs/<out's name>/<peer>``.

    Never beside the results: a results directory holds only what its provenance names (a
    committed one is checked by tests/test_results_provenance.py), and server logs are
    neither small nor reproducible. The directory is created.
    """
    path = Path(__file__).resolve().parents[1] / "runs" / "peer-logs" / Path(out).resolve().name / peer
    path.mkdir(parents=True, exist_ok=True)
    return path


def environment_info() -> dict[str, Any]:
    """Versions that a reader needs to interpret timings (command, commit, CPU: ``write_json``'s provenance)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - every benchmark here needs torch
        info["torch"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        info["transformers"] = None
    return info


# --------------------------------------------------------------------------- progress


def progress(iterable: Iterable[T], *, total: int | None = None, desc: str = "", enabled: bool = True) -> Iterator[T]:
    """A tqdm progress bar on stderr (a plain iterator when disabled or tqdm is missing).

    The returned object supports ``set_postfix_str`` when it is a real bar; use
    ``set_postfix(bar, text)`` to call it safely either way.
    """
    if not enabled:
        return iter(iterable)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency of the package
        return iter(iterable)
    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, leave=True, file=sys.stderr)


def set_postfix(bar: Iterator[Any], text: str) -> None:
    """Show ``text`` beside a progress bar made by ``progress`` (no-op for a plain iterator)."""
    if hasattr(bar, "set_postfix_str"):
        bar.set_postfix_str(text, refresh=False)


# --------------------------------------------------------------------------- plots


def _new_axes(figsize: tuple[float, float]):
    from matplotlib.figure import Figure

    figure = Figure(figsize=figsize, dpi=120, layout="constrained")
    return figure, figure.subplots()


def _finite_or_zero(values: Sequence[float | None]) -> list[float]:
    return [float(v) if v is not None and math.isfinite(v) else 0.0 for v in values]


def plot_grouped_bars(
    path: str | os.PathLike,
    categories: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    title: str,
    ylabel: str,
    reference: float | None = None,
    annotate: bool = True,
) -> Path:
    """Grouped bars: one group per category, one bar per series; missing values draw no bar.

    ``reference`` draws a dashed horizontal line (e.g. 1.0 for "no speedup").
    """
    if not categories:
        raise ValueError("plot_grouped_bars needs at least one category")
    for name, values in series.items():
        if len(values) != len(categories):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(categories)} categories")
    figure, axes = _new_axes((max(4.0, 1.1 * len(categories) * max(1, len(series)) * 0.6 + 2), 3.6))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(categories))]
        shown = [(x, v) for x, v in zip(xs, values) if v is not None and math.isfinite(v)]
        if not shown:
            continue
        bars = axes.bar(
            [x for x, _ in shown], [v for _, v in shown], width, label=name, color=PALETTE[k % len(PALETTE)]
        )
        if annotate:
            axes.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    if reference is not None:
        axes.axhline(reference, color="grey", linestyle="--", linewidth=1)
    axes.set_xticks(
        range(len(categories)),
        [str(c) for c in categories],
        rotation=30 if len(categories) > 4 else 0,
        ha="right" if len(categories) > 4 else "center",
    )
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.margins(y=0.12)  # room for the value labels
    if len(series) > 1:
        _outside_legend(axes)
    return _save(figure, path)


def plot_lines(
    path: str | os.PathLike,
    series: Mapping[str, tuple[Sequence[float], Sequence[float | None]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    ylim: tuple[float, float] | None = None,
) -> Path:
    """One line with markers per series: ``{name: (xs, ys)}``; points with a missing y are skipped."""
    figure, axes = _new_axes((6.5, 3.6))
    drawn = 0
    for k, (name, (xs, ys)) in enumerate(series.items()):
        points = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
        if not points:
            continue
        cycle = k // len(PALETTE)  # past the palette's colours, the marker and dash tell series apart
        axes.plot(
            [x for x, _ in points],
            [y for _, y in points],
            marker=MARKERS[cycle % len(MARKERS)],
            linestyle="-" if cycle % 2 == 0 else "--",
            label=name,
            color=PALETTE[k % len(PALETTE)],
        )
        drawn += 1
    if drawn == 0:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
    if ylim is not None:
        axes.set_ylim(*ylim)
    if all(float(x).is_integer() for xs, _ in series.values() for x in xs):
        from matplotlib.ticker import MaxNLocator

        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    if drawn > 1:
        _outside_legend(axes)
    return _save(figure, path)


def plot_stacked_bars(
    path: str | os.PathLike,
    labels: Sequence[str],
    parts: Mapping[str, Sequence[float | None]],
    *,
    title: str,
    ylabel: str,
) -> Path:
    """Stacked bars: one bar per label, one stacked segment per part (e.g. draft / verify / engine time)."""
    if not labels:
        raise ValueError("plot_stacked_bars needs at least one label")
    figure, axes = _new_axes((max(4.0, 0.9 * len(labels) + 2), 3.6))
    bottom = [0.0] * len(labels)
    for k, (name, values) in enumerate(parts.items()):
        heights = _finite_or_zero(values)
        axes.bar(range(len(labels)), heights, 0.6, bottom=bottom, label=name, color=PALETTE[k % len(PALETTE)])
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes.set_xticks(
        range(len(labels)),
        list(labels),
        rotation=30 if len(labels) > 4 else 0,
        ha="right" if len(labels) > 4 else "center",
    )
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    _outside_legend(axes)
    return _save(figure, path)


def _outside_legend(axes: Any) -> None:
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _save(figure: Any, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


# --------------------------------------------------------------------------- messages


def log(message: str) -> None:
    """Print a line to stderr without breaking an active tqdm progress bar."""
    try:
        from tqdm.auto import tqdm

        tqdm.write(message, file=sys.stderr)
    except ImportError:  # pragma: no cover
        print(message, file=sys.stderr)
