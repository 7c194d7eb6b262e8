"""Calibration of confidence heads: round records and Sequential Temperature Scaling (STS).

The hardware-aware schedulers multiply confidences into prefix survival probabilities
``a_k = prod_{i<=k} c_i`` and weigh them against measured costs, so the *magnitudes*
must be right, not only the ranking. Raw heads are overconfident (docs/design.md §7.2).

* :class:`RoundRecorder` collects, per verified round, the confidences the scheduler saw
  and the realised accepted prefix; :class:`RoundRecords` is the stored form (JSON or
  NPZ, format below). The scheduler benchmark reads the same files.
* :func:`fit_sts` fits one temperature per position, left to right: position k's
  temperature minimises the ECE of the cumulative product (earlier positions already
  calibrated and held fixed) against the observed prefix acceptance. Each position is
  mapped by ``sigmoid(logit(c_k) / T_k)``: order-preserving, so each position's own
  discrimination (its conditional AUC) is unchanged.
* :class:`Calibration` applies and stores the temperatures (``calibration.json`` beside
  the drafter); :class:`CalibratedScheduler` feeds calibrated confidences to any scheduler.
* :func:`plot_reliability` draws a per-position reliability diagram (PNG).

Records file format (``RoundRecords.save``; N rounds, block size gamma):

* JSON: ``{"format": "vlmspec.round_records", "version": 1, "gamma": gamma,
  "confidences": [[c_1..c_gamma] x N], "num_drafted": [N], "num_verified": [N],
  "num_accepted": [N], "meta": {...}}``
* NPZ: arrays ``confidences`` [N, gamma] float32, ``num_drafted``, ``num_verified``,
  ``num_accepted`` [N] int64, and ``meta_json`` (a 0-d string array holding the JSON of
  ``meta``, which includes the ``format`` and ``version`` tags).

``confidences`` are the head's raw (uncalibrated) conditional confidences; entries at or
beyond ``num_drafted`` are padding. ``num_accepted <= num_verified <= num_drafted <= gamma``.
Rounds recorded with :class:`~vlmspec.scheduling.base.VerifyAll` observe every position;
with another scheduler, labels beyond the verified length stay unknown (see
:func:`vlmspec.metrics.prefix_labels`), so collect calibration data with VerifyAll.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlmspec.metrics import (
    PositionMetrics,
    expected_calibration_error,
    expected_calibration_error_rows,
    position_metrics,
    prefix_labels,
)
from vlmspec.scheduling.base import Scheduler
from vlmspec.scheduling.documents import read_json, tag_problem, write_json

RECORDS_FORMAT = "vlmspec.round_records"
CALIBRATION_FORMAT = "vlmspec.calibration"
CALIBRATION_FILE = "calibration.json"
VERSION = 1


# -- records ----------------------------------------------------------------------------------


@dataclass
class RoundRecords:
    """Per-round confidences and outcomes of speculative rounds (one row per request-round)."""

    confidences: torch.Tensor  # [N, gamma] float32, raw conditional confidences
    num_drafted: torch.Tensor  # [N] int64
    num_verified: torch.Tensor  # [N] int64
    num_accepted: torch.Tensor  # [N] int64, leading verified drafts that survived
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.confidences = torch.as_tensor(self.confidences, dtype=torch.float32)
        self.num_drafted, self.num_verified, self.num_accepted = (
            torch.as_tensor(x, dtype=torch.int64).reshape(-1)
            for x in (self.num_drafted, self.num_verified, self.num_accepted)
        )
        problem = self._problem()
        if problem:
            raise ValueError(f"invalid round records: {problem}")

    def _problem(self) -> str | None:
        if self.confidences.dim() != 2:
            return f"confidences must be [N, gamma], got shape {tuple(self.confidences.shape)}"
        n, gamma = self.confidences.shape
        if not all(x.numel() == n for x in (self.num_drafted, self.num_verified, self.num_accepted)):
            return f"num_drafted, num_verified and num_accepted need one entry per round ({n})"
        if bool((self.num_accepted < 0).any()) or bool((self.num_accepted > self.num_verified).any()):
            return "need 0 <= num_accepted <= num_verified in every round"
        if bool((self.num_verified > self.num_drafted).any()) or bool((self.num_drafted > gamma).any()):
            return f"need num_verified <= num_drafted <= gamma={gamma} in every round"
        real = torch.arange(gamma).unsqueeze(0) < self.num_drafted.unsqueeze(1)  # [N, gamma]
        values = self.confidences[real]
        if bool((~torch.isfinite(values) | (values < 0) | (values > 1)).any()):
            return "confidences must lie in [0, 1] at drafted positions"
        return None

    @property
    def gamma(self) -> int:
        return self.confidences.shape[1]

    def __len__(self) -> int:
        return self.confidences.shape[0]

    def subset(self, index: torch.Tensor) -> RoundRecords:
        """The rounds selected by ``index`` ([n] int64 or [N] bool)."""
        return RoundRecords(
            self.confidences[index],
            self.num_drafted[index],
            self.num_verified[index],
            self.num_accepted[index],
            dict(self.meta),
        )

    def metrics(self, calibration: Calibration | None = None, num_bins: int = 15) -> PositionMetrics:
        """Per-position ECE / Brier / AUC of the (optionally calibrated) confidences."""
        conf = calibration.apply(self.confidences) if calibration is not None else self.confidences
        return position_metrics(
            conf, self.num_accepted, num_verified=self.num_verified, num_drafted=self.num_drafted, num_bins=num_bins
        )

    # -- storage --------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write to ``path``: NPZ if it ends in ``.npz``, JSON otherwise."""
        path = Path(path)
        if path.suffix == ".npz":
            path.parent.mkdir(parents=True, exist_ok=True)
            meta = {**self.meta, "format": RECORDS_FORMAT, "version": VERSION}
            with path.open("wb") as handle:  # a file handle keeps numpy from appending another suffix
                np.savez_compressed(
                    handle,
                    confidences=self.confidences.numpy(),
                    num_drafted=self.num_drafted.numpy(),
                    num_verified=self.num_verified.numpy(),
                    num_accepted=self.num_accepted.numpy(),
                    meta_json=np.array(json.dumps(meta)),
                )
            return path
        document = {
            "format": RECORDS_FORMAT,
            "version": VERSION,
            "gamma": self.gamma,
            "confidences": self.confidences.tolist(),
            "num_drafted": self.num_drafted.tolist(),
            "num_verified": self.num_verified.tolist(),
            "num_accepted": self.num_accepted.tolist(),
            "meta": self.meta,
        }
        return write_json(document, path, indent=None)

    @classmethod
    def load(cls, path: str | Path) -> RoundRecords:
        """Read a file written by :meth:`save` (``.npz`` or JSON)."""
        fix = "record rounds with RoundRecorder and save them with RoundRecords.save"
        path = Path(path)
        document = _read_document(path, RECORDS_FORMAT, absent=f"no round records at {path}; {fix}", fix=fix)
        try:
            return cls(
                torch.as_tensor(np.asarray(document["confidences"], dtype=np.float32).reshape(-1, document["gamma"])),
                document["num_drafted"],
                document["num_verified"],
                document["num_accepted"],
                document.get("meta", {}),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}: round records lack or mangle field {err}") from None


def _read_document(path: Path, format: str, *, absent: str, fix: str) -> dict[str, Any]:
    """The one reader of this module's files: the ``format`` document at ``path`` (JSON, or NPZ records).

    ValueError with ``absent`` if there is no file, and naming the problem followed by
    ``fix`` if it cannot be read or carries another format or version.
    """
    if not path.is_file():
        raise ValueError(absent)
    document = _read_npz(path, fix) if path.suffix == ".npz" else read_json(path, absent=absent, fix=fix)
    problem = tag_problem(document, format, VERSION)
    if problem:
        raise ValueError(f"{path} is not a {format!r} version {VERSION} file ({problem}); {fix}")
    return document


def _read_npz(path: Path, fix: str) -> dict[str, Any]:
    """Round records saved as NPZ, in the shape of their JSON document (see the module docstring)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta_json"]))
            return {
                "format": meta.pop("format", None),
                "version": meta.pop("version", None),
                "meta": meta,
                "gamma": data["confidences"].shape[1],
                "confidences": data["confidences"],
                "num_drafted": data["num_drafted"],
                "num_verified": data["num_verified"],
                "num_accepted": data["num_accepted"],
            }
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(f"{path} is not a readable round-records NPZ file ({err}); {fix}") from None


class RoundRecorder:
    """Accumulates rounds as the engine runs them; ``records()`` returns :class:`RoundRecords`.

    Call :meth:`record` once per verification step with the *raw* confidences (before any
    calibration) and the outcome of every request in that step.
    """

    def __init__(self) -> None:
        self._rows: list[tuple[torch.Tensor, ...]] = []

    def record(
        self,
        confidences: torch.Tensor,  # [R, gamma] raw conditional confidences
        num_drafted: torch.Tensor,  # [R] int64
        num_verified: torch.Tensor,  # [R] int64, the scheduled lengths
        num_accepted: torch.Tensor,  # [R] int64
    ) -> None:
        if self._rows and confidences.shape[1] != self._rows[0][0].shape[1]:
            raise ValueError(
                f"confidences have gamma={confidences.shape[1]} but earlier rounds had {self._rows[0][0].shape[1]}; "
                "use one RoundRecorder per drafter configuration"
            )
        row = tuple(x.detach().cpu() for x in (confidences.float(), num_drafted, num_verified, num_accepted))
        RoundRecords(*row)  # validate now, where the caller can see which round was bad
        self._rows.append(row)

    def __len__(self) -> int:
        return sum(row[0].shape[0] for row in self._rows)

    def records(self, meta: dict[str, Any] | None = None) -> RoundRecords:
        if not self._rows:
            raise ValueError("no rounds recorded yet; call record() after each verification step")
        return RoundRecords(*(torch.cat(column) for column in zip(*self._rows)), meta=dict(meta or {}))


def synthetic_records(
    num_rounds: int,
    gamma: int,
    *,
    generator: torch.Generator,
    first_acceptance: float = 0.85,
    last_acceptance: float = 0.70,
    difficulty_spread: float = 1.0,
    position_noise: float = 0.75,
    overconfidence: float = 1.0,
) -> RoundRecords:
    """SYNTHETIC rounds for tests and benchmarks when no recorded rounds exist.

    Per round, a shared difficulty ``z ~ N(0, 1)`` and per-position noise ``e_k ~ N(0, 1)``
    set the true conditional acceptance ``p_k = sigmoid(m_k + difficulty_spread * z +
    position_noise * e_k)``, where ``m_k`` goes linearly (in logit space) from
    ``logit(first_acceptance)`` to ``logit(last_acceptance)``. Outcomes are sampled
    left to right (``num_accepted`` = leading successes); every position is drafted and
    verified. The head reports ``sigmoid(overconfidence * logit(p_k))``: calibrated at 1,
    overconfident above 1.
    """
    if num_rounds < 1 or gamma < 1:
        raise ValueError(f"need num_rounds >= 1 and gamma >= 1, got {num_rounds} and {gamma}")
    start, end = math.log(first_acceptance / (1 - first_acceptance)), math.log(last_acceptance / (1 - last_acceptance))
    mean_logit = torch.linspace(start, end, gamma, dtype=torch.float64)  # [gamma]
    difficulty = torch.randn(num_rounds, 1, generator=generator, dtype=torch.float64)  # [N, 1]
    noise = torch.randn(num_rounds, gamma, generator=generator, dtype=torch.float64)  # [N, gamma]
    true_logit = mean_logit + difficulty_spread * difficulty + position_noise * noise  # [N, gamma]
    survived = torch.rand(num_rounds, gamma, generator=generator, dtype=torch.float64) < torch.sigmoid(true_logit)
    num_accepted = torch.cumprod(survived.to(torch.int64), dim=1).sum(dim=1)  # [N]
    full = torch.full((num_rounds,), gamma, dtype=torch.int64)
    meta = {
        "source": "synthetic",
        "first_acceptance": first_acceptance,
        "last_acceptance": last_acceptance,
        "difficulty_spread": difficulty_spread,
        "position_noise": position_noise,
        "overconfidence": overconfidence,
    }
    return RoundRecords(torch.sigmoid(overconfidence * true_logit).float(), full, full.clone(), num_accepted, meta)


# -- calibration ----------------------------------------------------------------------------------


def temperature_scale(confidences: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``sigmoid(logit(c) / T)`` elementwise; ``temperatures`` broadcasts against ``confidences``."""
    return torch.sigmoid(torch.logit(confidences) / temperatures)


@dataclass(frozen=True)
class Calibration:
    """One temperature per draft position, applied as ``sigmoid(logit(c_k) / T_k)``."""

    temperatures: tuple[float, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        if not self.temperatures or not all(math.isfinite(t) and t > 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of finite numbers > 0, got {self.temperatures}")

    @classmethod
    def identity(cls, gamma: int) -> Calibration:
        return cls((1.0,) * gamma, {"method": "identity"})

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    def apply(self, confidences: torch.Tensor) -> torch.Tensor:
        """Calibrate [..., gamma'] confidences (gamma' <= gamma: the leading positions); same dtype."""
        width = confidences.shape[-1]
        if width > self.gamma:
            raise ValueError(
                f"confidences have {width} positions but the calibration covers {self.gamma}; "
                "refit it (fit_sts) on rounds drafted with the current block size"
            )
        return temperature_scale(confidences.to(torch.float64), self._temperatures[:width]).to(confidences.dtype)

    @functools.cached_property
    def _temperatures(self) -> torch.Tensor:  # [gamma] float64, built once: apply runs every round
        return torch.tensor(self.temperatures, dtype=torch.float64)

    def save(self, directory: str | Path) -> Path:
        """Write ``calibration.json`` into ``directory`` (the drafter's directory); returns its path."""
        document = {
            "format": CALIBRATION_FORMAT,
            "version": VERSION,
            "temperatures": list(self.temperatures),
            "meta": self.meta,
        }
        return write_json(document, Path(directory) / CALIBRATION_FILE)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read ``calibration.json`` from a drafter directory (or the file itself)."""
        path = Path(path)
        path = path / CALIBRATION_FILE if path.is_dir() else path
        fix = "refit and save the calibration"
        absent = f"no calibration at {path}; fit one with fit_sts(...) and Calibration.save(drafter_dir)"
        document = _read_document(path, CALIBRATION_FORMAT, absent=absent, fix=fix)
        temperatures = document.get("temperatures")
        if not isinstance(temperatures, list) or not all(isinstance(t, (int, float)) for t in temperatures):
            raise ValueError(f"{path}: 'temperatures' must be a list of numbers; {fix}")
        return cls(tuple(temperatures), document.get("meta", {}))


def default_grid() -> torch.Tensor:
    """97 temperatures, geometric from 0.2 to 5 (1.0 included)."""
    return torch.logspace(math.log10(0.2), math.log10(5.0), 97, dtype=torch.float64)


def fit_sts(
    confidences: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    num_verified: torch.Tensor | None = None,
    num_drafted: torch.Tensor | None = None,
    grid: torch.Tensor | None = None,
    num_bins: int = 15,
) -> Calibration:
    """Sequential Temperature Scaling (docs/design.md §7.2).

    For k = 1..gamma in order, with T_1..T_{k-1} fixed: pick the T_k in ``grid`` that
    minimises the ECE of ``prod_{i<=k} sigmoid(logit(c_i) / T_i)`` against the observed
    prefix acceptance ``num_accepted >= k`` (ties: the temperature closest to 1).
    Positions with no observed label keep T = 1.

    confidences: [N, gamma] raw conditional confidences (held-out rounds).
    num_accepted: [N]; num_verified / num_drafted: [N] (default gamma: all verified).
    grid: [G] candidate temperatures > 0 (default :func:`default_grid`).
    """
    conf = torch.as_tensor(confidences).to("cpu", torch.float64)
    if conf.dim() != 2 or conf.shape[0] == 0:
        raise ValueError(f"confidences must be a non-empty [N, gamma] tensor, got shape {tuple(conf.shape)}")
    grid = default_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64).reshape(-1)
    if grid.numel() == 0 or bool((grid <= 0).any()) or bool((~torch.isfinite(grid)).any()):
        raise ValueError("grid must hold finite temperatures > 0")
    labels, observed = prefix_labels(num_accepted, conf.shape[1], num_verified, num_drafted)  # [N, gamma] x2
    candidates = grid[torch.argsort(grid.log().abs(), stable=True)]  # closest to T = 1 first: wins ties
    prefix = torch.ones(conf.shape[0], dtype=torch.float64)  # calibrated a_{k-1}, [N]
    temperatures, ece_before, ece_after = [], [], []
    for k in range(conf.shape[1]):
        seen = observed[:, k]  # rounds whose prefix label at position k is known
        target, before = labels[seen, k], prefix[seen]
        best, best_ece = 1.0, float("nan")
        if seen.any():
            scaled = temperature_scale(conf[seen, k].unsqueeze(0), candidates.unsqueeze(1))  # [G, n]
            eces = expected_calibration_error_rows(before * scaled, target, num_bins)  # [G]
            choice = int(torch.argmin(eces))
            best, best_ece = float(candidates[choice]), float(eces[choice])
        temperatures.append(best)
        ece_before.append(expected_calibration_error(torch.cumprod(conf[seen, : k + 1], 1)[:, -1], target, num_bins))
        ece_after.append(best_ece)
        prefix = prefix * temperature_scale(conf[:, k], torch.tensor(best, dtype=torch.float64))
    meta = {
        "method": "sts",
        "num_rounds": int(conf.shape[0]),
        "num_bins": num_bins,
        "grid": [float(grid.min()), float(grid.max()), int(grid.numel())],
        "ece_before": ece_before,
        "ece_after": ece_after,
    }
    return Calibration(tuple(temperatures), meta)


class CalibratedScheduler:
    """Wraps any scheduler so it sees calibrated confidences.

    Calibration maps each position by its own order-preserving function of ``c_k`` alone,
    so a non-anticipating scheduler stays non-anticipating. ``None`` confidences (no
    confidence head) are passed through, so the inner scheduler's message applies.
    """

    def __init__(self, inner: Scheduler, calibration: Calibration) -> None:
        self.inner = inner
        self.calibration = calibration

    def schedule(self, confidences: torch.Tensor | None, num_drafted: torch.Tensor) -> torch.Tensor:
        calibrated = None if confidences is None else self.calibration.apply(confidences)
        return self.inner.schedule(calibrated, num_drafted)

    def __repr__(self) -> str:
        return f"CalibratedScheduler({self.inner!r}, temperatures={self.calibration.temperatures})"


# -- plotting -------------------------------------------------------------------------------------


def plot_reliability(
    records: RoundRecords, path: str | Path, *, calibration: Calibration | None = None, num_bins: int = 10
) -> Path:
    """Reliability diagram per position (cumulative ``a_k`` vs prefix acceptance), raw and calibrated.

    Needs matplotlib (the ``plot`` extra), imported here so the library does not depend on it.
    """
    from matplotlib.figure import Figure

    curves = [("raw", records.metrics(num_bins=num_bins))]
    if calibration is not None:
        curves.append(("STS", records.metrics(calibration, num_bins=num_bins)))
    columns = min(records.gamma, 4)
    rows = math.ceil(records.gamma / columns)
    fig = Figure(figsize=(3.2 * columns, 3.0 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, columns, squeeze=False)).reshape(-1)
    for k, ax in enumerate(axes):
        if k >= records.gamma:
            ax.set_visible(False)
            continue
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
        for label, metrics in curves:
            bins = metrics.bins[k]
            filled = bins.count > 0
            ax.plot(
                bins.mean_confidence[filled],
                bins.frequency[filled],
                marker="o",
                markersize=3,
                label=f"{label} ECE {metrics.ece[k]:.3f}",
            )
        ax.set(
            xlim=(0, 1),
            ylim=(0, 1),
            title=f"position {k + 1}",
            xlabel="predicted a_k",
            ylabel="observed prefix acceptance",
        )
        ax.legend(fontsize=7, loc="upper left")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
