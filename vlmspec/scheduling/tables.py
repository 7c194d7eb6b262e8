"""SPS tables: the target's forward steps per second against the tokens in flight, as data.

The hardware-aware schedulers weigh expected accepted tokens against what a larger
verification batch costs. That cost is a measured curve, ``SPS(B)``: forward passes per
second when the target processes ``B`` tokens in one forward (at a given context
length). This module stores it with what it was measured on (:class:`SPSTable`, JSON)
and refuses tables that are malformed or were measured for something else;
:mod:`vlmspec.scheduling.profiling` measures curves, offers presets and plots them.

Batched verification: R concurrent requests share one forward of ``B = sum_r (1 + l_r)``
tokens, and what that forward costs depends on R as well as B (every row attends over its
own context). A :class:`BatchSPSTable` holds one curve per measured R
(``vlmspec profile --requests 1,4,16,32``); ``table.for_requests(R)`` gives the curve the
schedulers use for a batch of R requests. Both kinds answer ``for_requests``, so a
scheduler takes either.

Drafting costs travel with the curve: ``vlmspec profile --drafter NAME`` also times a drafting
round of that drafter beside a one-token step of the target, interleaved in one run
(:class:`DraftTiming`), and the drafting policy reads ``T_draft / T(1)`` from it
(:meth:`DraftTiming.steps`). A table without them (older tables, or profiled without
``--drafter``) still loads; its ``drafting`` is None, and the loader measures the costs then
(:func:`vlmspec.loading.reference_costs`).

JSON layout of a saved table (``format`` and ``version`` are checked on load)::

    {"format": "vlmspec.sps_table", "version": 1,
     "tokens": [1, 2, 3, ...],              # strictly increasing token counts B
     "steps_per_s": [48.1, 47.9, ...],      # forward passes per second at each B
     "meta": {"model": ..., "device": ..., "dtype": ..., "context_length": ...,
              "hardware": ..., "cpu": ..., "model_config": {...}, "torch_version": ...,
              "created": ..., "source": "measured", "warmup": 3, "repeats": 10, "notes": ""},
     "drafting": {"drafter": "reference-dspark",  # optional: see DraftTiming
                  "round_s": {"model": 0.0011}, "step_s": 0.0116, "repeats": 15}}
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlmspec.scheduling.documents import read_json, tag_problem, write_json

FORMAT = "vlmspec.sps_table"
BATCH_FORMAT = "vlmspec.batch_sps_table"
VERSION = 1

_REGENERATE = "regenerate it with `vlmspec profile --target <target> --out <table.json>`"


@dataclass
class SPSMeta:
    """What an SPS table was measured on. Two tables are comparable only if these agree."""

    model: str  # model name or path (or "preset:<name>")
    device: str  # torch device string, e.g. "cuda:0" or "cpu"
    dtype: str  # e.g. "bfloat16"
    context_length: int | None  # tokens already in the KV cache while timing; None = synthetic
    hardware: str = ""  # e.g. "NVIDIA H200" or "2 CPU threads"
    cpu: str = ""  # the CPU a cpu-device table was measured on (vlmspec.provenance.cpu_signature); "" = unknown
    model_config: dict[str, Any] = field(default_factory=dict)  # small JSON summary (hidden, layers, vocab)
    torch_version: str = torch.__version__
    created: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    )
    source: str = "measured"  # "measured" or "preset:<name>"
    warmup: int | None = None
    repeats: int | None = None
    notes: str = ""

    def mismatches(
        self,
        *,
        model: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        context_length: int | None = None,
        hardware: str | None = None,
    ) -> list[str]:
        """Human-readable differences from what a caller expects (fields passed as None are not checked)."""
        expected = {
            "model": model,
            "device": device,
            "dtype": dtype,
            "context_length": context_length,
            "hardware": hardware,
        }
        return [
            f"{name} is {getattr(self, name)!r}, expected {want!r}"
            for name, want in expected.items()
            if want is not None and getattr(self, name) != want
        ]


@dataclass(frozen=True)
class DraftTiming:
    """A drafting round's cost, timed beside the target's one-token step in the same run (medians, seconds).

    ``round_s`` maps a draft source (``"model"``: the drafter named by ``drafter``) to the
    seconds of one drafting round for one request; ``step_s`` is the one-token target step
    timed between those rounds, so a busy machine slows both alike and :meth:`steps` (what
    the drafting policy reads) stays a property of the pair.
    """

    drafter: str  # the drafter whose round "model" timed: a name ("reference-dspark") or a directory
    round_s: dict[str, float]  # source -> seconds per drafting round
    step_s: float  # seconds per one-token target step, timed between the rounds
    repeats: int | None = None
    dtype: str | None = None  # the dtype the drafter drafted in ("bfloat16"); None: the target's (older tables)

    def drafted_in(self, target_dtype: str) -> str:
        """The dtype the timed drafter drafted in, for a table of a ``target_dtype`` target."""
        return self.dtype or target_dtype

    def __post_init__(self) -> None:
        values = [self.step_s, *self.round_s.values()]
        if not isinstance(self.round_s, dict) or not all(isinstance(k, str) for k in self.round_s):
            raise ValueError(f"round_s must map draft source names to seconds, got {self.round_s!r}")
        if not all(_positive_number(v) for v in values):
            raise ValueError(f"drafting round and step times must be finite seconds > 0, got {values}")

    def steps(self) -> dict[str, float]:
        """``T_draft / T(1)`` per source: what a drafting round costs in target steps."""
        return {source: seconds / self.step_s for source, seconds in self.round_s.items()}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, where: str) -> DraftTiming:
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or not {"drafter", "round_s", "step_s"} <= set(data) or set(data) - fields:
            raise ValueError(
                f"{where}: 'drafting' must hold drafter, round_s and step_s (and repeats, dtype); {_REGENERATE}"
            )
        try:
            return cls(**data)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: invalid 'drafting' ({error}); {_REGENERATE}") from None


@dataclass(frozen=True)
class SPSTable:
    """A measured (or preset) cost curve: ``tokens[i]`` tokens in flight run at ``steps_per_s[i]`` forwards/s.

    Lookups between tabulated token counts interpolate the *step time* linearly (the
    natural quantity: cost grows roughly linearly between measured points). Token counts
    outside ``[tokens[0], tokens[-1]]`` are not extrapolated: :meth:`sps` raises and
    :meth:`steps_per_second` returns NaN, which the schedulers treat as "not feasible".
    """

    tokens: tuple[int, ...]
    steps_per_s: tuple[float, ...]
    meta: SPSMeta
    drafting: DraftTiming | None = None  # a drafting round timed beside the target's step, if measured

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "steps_per_s", tuple(float(s) for s in self.steps_per_s))
        problem = _table_problem(self.tokens, self.steps_per_s)
        if problem:
            raise ValueError(f"invalid SPS table: {problem}")

    # -- lookup -------------------------------------------------------------------------
    def for_requests(self, num_requests: int) -> SPSTable:
        """The curve for a forward shared by ``num_requests`` requests: this one table, whatever R."""
        return self

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    @property
    def min_tokens(self) -> int:
        return self.tokens[0]

    def sps(self, num_tokens: int) -> float:
        """Forward passes per second with ``num_tokens`` tokens in flight."""
        value = float(self.steps_per_second(np.array([num_tokens]))[0])
        if math.isnan(value):
            raise ValueError(
                f"the SPS table covers {self.min_tokens}..{self.max_tokens} tokens in flight, not {num_tokens}; "
                f"profile a wider range (`vlmspec profile --max-tokens {max(num_tokens, self.max_tokens)}`) "
                "or schedule fewer tokens"
            )
        return value

    def steps_per_second(self, num_tokens: np.ndarray | torch.Tensor | Sequence[int]) -> np.ndarray:
        """Vectorised :meth:`sps`: [n] token counts -> [n] float64 steps/s, NaN outside the table."""
        query = np.asarray(num_tokens, dtype=np.float64)  # [n]
        step_time = np.interp(query, self._tokens_array, self._step_time_array, left=np.nan, right=np.nan)
        return 1.0 / step_time

    @functools.cached_property
    def _tokens_array(self) -> np.ndarray:
        return np.asarray(self.tokens, dtype=np.float64)  # [T]

    @functools.cached_property
    def _step_time_array(self) -> np.ndarray:
        return 1.0 / np.asarray(self.steps_per_s, dtype=np.float64)  # [T] seconds per forward

    # -- the monotone fit ----------------------------------------------------------------
    def fitted(self) -> SPSTable:
        """This curve with its step times fitted non-decreasing in tokens (itself if they already are).

        A forward over more tokens never costs less; a table where it does (a busy machine,
        or one written before ``vlmspec profile`` fitted its curves) would make a scheduler
        verify more tokens for less. ``vlmspec profile`` already fits what it measures.
        """
        step_time = [1.0 / s for s in self.steps_per_s]
        fit = monotone_fit(step_time)
        if fit == step_time:
            return self
        notes = (self.meta.notes + "; " if self.meta.notes else "") + "steps/s fitted non-increasing when loaded"
        meta = dataclasses.replace(self.meta, notes=notes)
        return SPSTable(self.tokens, tuple(1.0 / t for t in fit), meta, self.drafting)

    def with_drafting(self, drafting: DraftTiming) -> SPSTable:
        """This curve carrying ``drafting`` (a drafting round timed beside the target's step)."""
        return dataclasses.replace(self, drafting=drafting)

    def off_fit(self, tolerance: float = 1e-9) -> list[str]:
        """The points whose step time lies more than ``tolerance`` (relative) off :meth:`fitted`'s, described."""
        fit = self.fitted()
        return [
            f"{n} tokens: {1e3 / raw:.2f} ms, fit {1e3 / fitted:.2f} ms"
            for n, raw, fitted in zip(self.tokens, self.steps_per_s, fit.steps_per_s)
            if abs(1 / raw - 1 / fitted) > tolerance / fitted
        ]

    # -- checks and (de)serialisation ----------------------------------------------------
    def check_matches(self, *, where: str = "SPS table", **expected: Any) -> None:
        """Raise ValueError if the metadata differs from ``expected`` (see :meth:`SPSMeta.mismatches`)."""
        problems = self.meta.mismatches(**expected)
        if problems:
            raise ValueError(f"{where} was measured for something else ({'; '.join(problems)}); {_REGENERATE}")

    def to_dict(self) -> dict[str, Any]:
        data = {
            "format": FORMAT,
            "version": VERSION,
            "tokens": list(self.tokens),
            "steps_per_s": list(self.steps_per_s),
            "meta": dataclasses.asdict(self.meta),
        }
        if self.drafting is not None:
            data["drafting"] = self.drafting.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "SPS table") -> SPSTable:
        """Build a table from :meth:`to_dict` output; ValueError naming ``where`` on any defect."""
        problem = _document_problem(data)
        if problem:
            raise ValueError(f"{where} is not a valid SPS table: {problem}; {_REGENERATE}")
        meta = SPSMeta(**{k: v for k, v in data["meta"].items() if k in _META_FIELDS})
        drafting = data.get("drafting")
        drafting = None if drafting is None else DraftTiming.from_dict(drafting, where=where)
        return cls(tuple(data["tokens"]), tuple(data["steps_per_s"]), meta, drafting)

    def save(self, path: str | Path) -> Path:
        """Write the table as JSON (parents created); returns the path."""
        return write_json(self.to_dict(), path)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        expect_model: str | None = None,
        expect_device: str | None = None,
        expect_dtype: str | None = None,
        expect_context_length: int | None = None,
        expect_hardware: str | None = None,
    ) -> SPSTable:
        """Read a table saved by :meth:`save`; refuse it if malformed or measured for something else.

        Every ``expect_*`` given must equal the stored metadata exactly; a table measured
        for another model, device, dtype or context length describes other costs.
        """
        path = Path(path)
        table = cls.from_dict(_read_document(path), where=str(path))
        table.check_matches(
            where=str(path),
            model=expect_model,
            device=expect_device,
            dtype=expect_dtype,
            context_length=expect_context_length,
            hardware=expect_hardware,
        )
        return table


@dataclass(frozen=True)
class BatchSPSTable:
    """SPS curves of batched forwards: for each measured number of requests R, steps/s against tokens B.

    ``curves[i]`` was measured with ``requests[i]`` requests sharing every forward, over
    ``B`` from ``requests[i]`` (anchors only) up to ``requests[i] * (1 + gamma)``.
    :meth:`for_requests` returns the curve for any R between the smallest and the largest
    measured: a measured one as it is, otherwise step times interpolated linearly in R
    between the two neighbouring curves (each held flat beyond its own token range).
    """

    requests: tuple[int, ...]
    curves: tuple[SPSTable, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        object.__setattr__(self, "curves", tuple(self.curves))
        if not self.requests or len(self.requests) != len(self.curves):
            raise ValueError(
                f"invalid batch SPS table: {len(self.requests)} request counts for {len(self.curves)} curves"
            )
        if not all(is_int(r) and r >= 1 for r in self.requests) or any(
            b <= a for a, b in zip(self.requests, self.requests[1:])
        ):
            raise ValueError(
                f"invalid batch SPS table: request counts must be increasing integers >= 1, got {list(self.requests)}"
            )
        for r, curve in zip(self.requests, self.curves):
            if not isinstance(curve, SPSTable) or not curve.min_tokens <= r <= curve.max_tokens:
                raise ValueError(
                    f"invalid batch SPS table: the curve for {r} requests must cover B = {r} (its anchors)"
                )
        object.__setattr__(self, "_by_requests", {})

    @property
    def meta(self) -> SPSMeta:
        """What the curves were measured on (the first curve's metadata; they share model, device and dtype)."""
        return self.curves[0].meta

    def for_requests(self, num_requests: int) -> SPSTable:
        """The curve for ``num_requests`` requests sharing a forward (see the class docstring)."""
        cached = self._by_requests.get(num_requests)
        if cached is not None:
            return cached
        if not self.requests[0] <= num_requests <= self.requests[-1]:
            raise ValueError(
                f"the batch SPS table was measured for {self.requests[0]}..{self.requests[-1]} concurrent requests, "
                f"not {num_requests}; profile that many (`vlmspec profile --requests ...,{num_requests}`) "
                "or lower the engine's max_batch_size"
            )
        hi = int(np.searchsorted(self.requests, num_requests))
        if self.requests[hi] == num_requests:
            table = self.curves[hi]
        else:
            table = self._between(num_requests, hi - 1, hi)
        self._by_requests[num_requests] = table
        return table

    def _between(self, num_requests: int, lo: int, hi: int) -> SPSTable:
        low, high = self.curves[lo], self.curves[hi]
        weight = (num_requests - self.requests[lo]) / (self.requests[hi] - self.requests[lo])
        tokens = np.arange(num_requests, high.max_tokens + 1)  # [T]
        step_time = [
            (1 - weight) / low.steps_per_second(np.clip(tokens, low.min_tokens, low.max_tokens)),
            weight / high.steps_per_second(np.clip(tokens, high.min_tokens, high.max_tokens)),
        ]
        meta = dataclasses.replace(
            high.meta, notes=f"interpolated between {self.requests[lo]} and {self.requests[hi]} requests"
        )
        return SPSTable(tuple(int(t) for t in tokens), tuple(1.0 / (step_time[0] + step_time[1])), meta)

    def fitted(self) -> BatchSPSTable:
        """Every curve fitted non-decreasing in step time (:meth:`SPSTable.fitted`)."""
        curves = tuple(curve.fitted() for curve in self.curves)
        return self if curves == self.curves else BatchSPSTable(self.requests, curves)

    def off_fit(self, tolerance: float = 1e-9) -> list[str]:
        """:meth:`SPSTable.off_fit` of every curve, each point prefixed with its number of requests."""
        return [f"{r} requests, {point}" for r, c in zip(self.requests, self.curves) for point in c.off_fit(tolerance)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": BATCH_FORMAT,
            "version": VERSION,
            "requests": list(self.requests),
            "curves": [curve.to_dict() for curve in self.curves],
        }

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "batch SPS table") -> BatchSPSTable:
        problem = tag_problem(data, BATCH_FORMAT, VERSION)
        if problem:
            raise ValueError(f"{where} is not a batch SPS table: {problem}; {_REGENERATE}")
        if not isinstance(data.get("requests"), list) or not isinstance(data.get("curves"), list):
            raise ValueError(f"{where} needs the lists 'requests' and 'curves'; {_REGENERATE}")
        curves = [SPSTable.from_dict(curve, where=f"{where}, curve {i}") for i, curve in enumerate(data["curves"])]
        return cls(tuple(data["requests"]), tuple(curves))

    def save(self, path: str | Path) -> Path:
        """Write the table as JSON (parents created); returns the path."""
        return write_json(self.to_dict(), path)


def load_sps_table(path: str | Path, *, fit: bool = True) -> SPSTable | BatchSPSTable:
    """A table written by ``vlmspec profile``: one curve, or one per measured number of requests.

    With ``fit`` (the default, what the schedulers read) every curve is fitted non-decreasing
    in step time, with a RuntimeWarning naming the points the fit moved (``vlmspec profile``
    writes fitted curves, so a table that needs it is hand-made, old, or edited).
    """
    table = _read_sps_table(Path(path))
    if not fit:
        return table
    off = table.off_fit()
    if off:
        warnings.warn(
            f"{path}: a forward over more tokens costs less than over fewer, so the schedulers read the monotone fit "
            f"of this curve; measure it again on an idle machine with `vlmspec profile`: {'; '.join(off)}",
            RuntimeWarning,
            stacklevel=2,
        )
    return table.fitted()


def monotone_fit(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            blocks[-1][0] = (blocks[-1][0] * blocks[-1][1] + mean * count) / (blocks[-1][1] + count)
            blocks[-1][1] += count
    return [mean for mean, count in blocks for _ in range(int(count))]


def _read_document(path: Path) -> Any:
    """The decoded JSON of the SPS table file at ``path`` (either kind), unchecked."""
    absent = f"no SPS table at {path}; create one with `vlmspec profile --target <target> --out {path}`"
    return read_json(path, absent=absent, fix=_REGENERATE)


def _read_sps_table(path: Path) -> SPSTable | BatchSPSTable:
    data = _read_document(path)
    if isinstance(data, dict) and data.get("format") == BATCH_FORMAT:
        return BatchSPSTable.from_dict(data, where=str(path))
    return SPSTable.from_dict(data, where=str(path))


_META_FIELDS = {f.name for f in dataclasses.fields(SPSMeta)}
_REQUIRED_META = ("model", "device", "dtype", "context_length")


def _positive_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _table_problem(tokens: Sequence[Any], steps_per_s: Sequence[Any]) -> str | None:
    """What is wrong with a (tokens, steps/s) pair, or None."""
    if len(tokens) == 0:
        return "it has no entries"
    if len(tokens) != len(steps_per_s):
        return f"{len(tokens)} token counts but {len(steps_per_s)} steps/s values"
    if not all(is_int(t) and t >= 1 for t in tokens):
        return f"token counts must be integers >= 1, got {list(tokens)[:8]}..."
    if any(b <= a for a, b in zip(tokens, tokens[1:])):
        return "token counts must be strictly increasing"
    if not all(
        isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0 for s in steps_per_s
    ):
        return "every steps/s value must be a finite number > 0"
    return None


def _document_problem(data: Any) -> str | None:
    """What is wrong with a decoded JSON document, or None."""
    problem = tag_problem(data, FORMAT, VERSION)
    if problem:
        return problem
    for key in ("tokens", "steps_per_s", "meta"):
        if key not in data:
            return f"the key {key!r} is missing"
    if not isinstance(data["tokens"], list) or not isinstance(data["steps_per_s"], list):
        return "'tokens' and 'steps_per_s' must be lists"
    meta = data["meta"]
    if not isinstance(meta, dict):
        return "'meta' must be an object"
    missing = [k for k in _REQUIRED_META if k not in meta]
    if missing:
        return f"'meta' lacks {missing}"
    unknown = sorted(set(meta) - _META_FIELDS)
    if unknown:
        return f"'meta' has unknown keys {unknown}"
    return _table_problem(data["tokens"], data["steps_per_s"])
