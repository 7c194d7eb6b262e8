"""vlmspec: lossless speculative decoding (DSpark) for Qwen-VL models.

The public face: the engine, the target adapter, the protocols and the schedulers.
"""

from vlmspec.drafters import DSparkConfig, DSparkDrafter, NoDraft, PromptLookup, Proposer
from vlmspec.engine import SpecEngine
from vlmspec.scheduling import (
    LaggedTopKScheduler,
    PrefixScheduler,
    Scheduler,
    SPSArgmaxScheduler,
    SPSTable,
    ThresholdScheduler,
    VerifyAll,
    build_scheduler,
)
from vlmspec.target import QwenVLTarget, load_target
from vlmspec.types import DraftBlock, GenerationResult, SamplingParams, SpecStats, VerifyResult

__version__ = "0.1.0"

__all__ = [
    "SpecEngine",
    "QwenVLTarget",
    "load_target",
    "Proposer",
    "NoDraft",
    "PromptLookup",
    "DSparkConfig",
    "DSparkDrafter",
    "Scheduler",
    "VerifyAll",
    "ThresholdScheduler",
    "SPSArgmaxScheduler",
    "PrefixScheduler",
    "LaggedTopKScheduler",
    "SPSTable",
    "build_scheduler",
    "DraftBlock",
    "VerifyResult",
    "GenerationResult",
    "SamplingParams",
    "SpecStats",
]
