"""vlmspec: lossless speculative decoding (DSpark) for Qwen-VL models.

The public face: the engines (one request, many concurrent requests), the step API host
engines embed, the target adapter, the protocols and the schedulers.
"""

from vlmspec.drafters import DSparkConfig, DSparkDrafter, NoDraft, PerRequestProposer, PromptLookup, Proposer
from vlmspec.engine import SpecEngine
from vlmspec.loading import load_proposer, load_target
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
from vlmspec.serving.engine import BatchEngine, StepOutput
from vlmspec.serving.steps import SpecDecoder, SpecRequest
from vlmspec.targets import QwenVLTarget
from vlmspec.types import DraftBlock, GenerationResult, RequestOptions, SamplingParams, SpecStats, VerifyResult

__version__ = "0.1.0"

__all__ = [
    "SpecEngine",
    "BatchEngine",
    "StepOutput",
    "SpecDecoder",
    "SpecRequest",
    "QwenVLTarget",
    "load_target",
    "load_proposer",
    "Proposer",
    "NoDraft",
    "PerRequestProposer",
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
    "RequestOptions",
    "SamplingParams",
    "SpecStats",
]
