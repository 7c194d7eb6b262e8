"""Build a scheduler from a name and plain options (CLI flags, benchmark arguments).

The names below are the one spelling of the schedulers across vlmspec: ``build_scheduler``,
``vlmspec generate/demo --scheduler``, ``benchmarks/mmbench_spec.py --scheduler`` and the
serving simulation ``benchmarks/scheduler_sim.py`` all use them.
"""

from __future__ import annotations

import os
from pathlib import Path

from vlmspec.scheduling.base import Scheduler, VerifyAll
from vlmspec.scheduling.calibration import CalibratedScheduler, Calibration
from vlmspec.scheduling.prefix import LaggedTopKScheduler, PrefixScheduler
from vlmspec.scheduling.profiling import PRESETS, sps_preset
from vlmspec.scheduling.sps import SPSArgmaxScheduler
from vlmspec.scheduling.tables import BatchSPSTable, SPSTable, load_sps_table
from vlmspec.scheduling.threshold import ThresholdScheduler

# name -> the class it builds
SCHEDULER_CLASSES: dict[str, type] = {
    "none": VerifyAll,  # verify every draft (the default)
    "threshold": ThresholdScheduler,  # a static confidence threshold
    "sps": SPSArgmaxScheduler,  # one request: argmax of expected tokens per second
    "prefix": PrefixScheduler,  # Algorithm 1: many requests sharing one verify forward
    "lagged-topk": LaggedTopKScheduler,  # Algorithm 1's production form, with a lagged budget
}
SCHEDULERS = tuple(SCHEDULER_CLASSES)


def describe_schedulers() -> str:
    """``"none (VerifyAll), threshold (ThresholdScheduler), ..."``: the names with the classes they build."""
    return ", ".join(f"{name} ({cls.__name__})" for name, cls in SCHEDULER_CLASSES.items())


def build_scheduler(
    name: str,
    *,
    threshold: float | str = 0.5,
    sps: SPSTable | BatchSPSTable | str | os.PathLike | None = None,
    lag: int | str = 2,
    calibration: Calibration | str | os.PathLike | None = None,
) -> Scheduler:
    """The scheduler called ``name``.

    ``sps`` (for ``sps``, ``prefix`` and ``lagged-topk``) is an :class:`SPSTable`, the path
    of a table written by ``vlmspec profile``, or a preset name (``cpu``, ``gpu_like``,
    ``appendix_a``). ``calibration`` (a :class:`Calibration` or the drafter directory /
    ``calibration.json`` written by STS) makes the scheduler see calibrated confidences.
    """
    if name not in SCHEDULER_CLASSES:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {describe_schedulers()}")
    scheduler: Scheduler
    if name == "none":
        scheduler = VerifyAll()
    elif name == "threshold":
        scheduler = ThresholdScheduler(float(threshold))
    else:
        table = resolve_sps_table(sps, name)
        if name == "sps":
            scheduler = SPSArgmaxScheduler(table)
        elif name == "prefix":
            scheduler = PrefixScheduler(table)
        else:
            scheduler = LaggedTopKScheduler(table, lag=int(lag))
    if calibration is not None:
        if not isinstance(calibration, Calibration):
            calibration = Calibration.load(calibration)
        scheduler = CalibratedScheduler(scheduler, calibration)
    return scheduler


def resolve_sps_table(
    sps: SPSTable | BatchSPSTable | str | os.PathLike | None, for_scheduler: str = "sps"
) -> SPSTable | BatchSPSTable:
    """An SPS table from a table object, a JSON path (one curve or a batch table) or a preset name."""
    if isinstance(sps, (SPSTable, BatchSPSTable)):
        return sps
    if sps is None:
        raise ValueError(
            f"the {for_scheduler!r} scheduler needs an SPS table: measure one with "
            f"`vlmspec profile --target DIR --out sps.json` and pass sps='sps.json', or pass a preset ({', '.join(PRESETS)})"
        )
    if str(sps) in PRESETS:
        return sps_preset(str(sps))
    return load_sps_table(Path(sps))
