"""Schedulers: how many drafted tokens each request sends to the target, and their inputs.

* :class:`VerifyAll` (default), :class:`ThresholdScheduler`, :class:`SPSArgmaxScheduler`
  (one request), :class:`PrefixScheduler` (Algorithm 1), :class:`LaggedTopKScheduler`
  (production form), all behind the :class:`Scheduler` protocol; :func:`build_scheduler`
  builds them by name (``none``, ``threshold``, ``sps``, ``prefix``, ``lagged-topk``).
* SPS profiling: :class:`SPSTable`, :class:`BatchSPSTable` (one curve per number of
  concurrent requests), :func:`load_sps_table`, :func:`measure_sps`, :func:`profile_forward`,
  :func:`sps_preset`, :func:`plot_sps`.
* Calibration: :class:`RoundRecorder`, :class:`RoundRecords`, :func:`fit_sts`,
  :class:`Calibration`, :class:`CalibratedScheduler`, :func:`plot_reliability`.
"""

from vlmspec.scheduling.base import Scheduler, VerifyAll, survival_probabilities
from vlmspec.scheduling.calibration import (
    CalibratedScheduler,
    Calibration,
    RoundRecorder,
    RoundRecords,
    fit_sts,
    plot_reliability,
    synthetic_records,
)
from vlmspec.scheduling.factory import (
    SCHEDULER_CLASSES,
    SCHEDULERS,
    build_scheduler,
    describe_schedulers,
    resolve_sps_table,
)
from vlmspec.scheduling.prefix import LaggedTopKScheduler, PrefixScheduler, rank_candidates
from vlmspec.scheduling.profiling import measure_sps, plot_sps, profile_forward, sps_preset
from vlmspec.scheduling.sps import SPSArgmaxScheduler
from vlmspec.scheduling.tables import BatchSPSTable, SPSMeta, SPSTable, load_sps_table
from vlmspec.scheduling.threshold import ThresholdScheduler

__all__ = [
    "SCHEDULERS",
    "SCHEDULER_CLASSES",
    "build_scheduler",
    "describe_schedulers",
    "resolve_sps_table",
    "BatchSPSTable",
    "Calibration",
    "CalibratedScheduler",
    "LaggedTopKScheduler",
    "PrefixScheduler",
    "RoundRecorder",
    "RoundRecords",
    "SPSArgmaxScheduler",
    "SPSMeta",
    "SPSTable",
    "Scheduler",
    "ThresholdScheduler",
    "VerifyAll",
    "fit_sts",
    "load_sps_table",
    "measure_sps",
    "plot_reliability",
    "plot_sps",
    "profile_forward",
    "rank_candidates",
    "sps_preset",
    "survival_probabilities",
    "synthetic_records",
]
