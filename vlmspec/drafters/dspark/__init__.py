"""DSpark drafter: a parallel KV-injection backbone, a sequential head and a confidence head.

Build one for a loaded target with ``DSparkDrafter.from_target(target, config)``, save it
with ``save_pretrained(dir)``, load it with ``DSparkDrafter.from_pretrained(dir, target=...)``,
and hand ``DSparkProposer(drafter)`` to the engine.
"""

from vlmspec.drafters.dspark.backbone import DSparkBackbone, anchor_block_mask
from vlmspec.drafters.dspark.cache import DraftContextCache
from vlmspec.drafters.dspark.confidence import ConfidenceHead
from vlmspec.drafters.dspark.config import HEAD_KINDS, DSparkConfig, default_layer_ids
from vlmspec.drafters.dspark.heads import (
    HEADS,
    GatedMarkovHead,
    HeadSample,
    NoHead,
    RNNHead,
    SequentialHead,
    VanillaMarkovHead,
    build_head,
)
from vlmspec.drafters.dspark.model import DraftOutput, DraftSample, DSparkDrafter

__all__ = [
    "HEADS",
    "HEAD_KINDS",
    "ConfidenceHead",
    "DSparkBackbone",
    "DSparkConfig",
    "DSparkDrafter",
    "DSparkProposer",
    "DSparkState",
    "DraftContextCache",
    "DraftOutput",
    "DraftSample",
    "GatedMarkovHead",
    "HeadSample",
    "NoHead",
    "RNNHead",
    "SequentialHead",
    "VanillaMarkovHead",
    "anchor_block_mask",
    "build_head",
    "default_layer_ids",
]


def __getattr__(name: str):
    # The proposer (the engine-facing side) loads on first use, so that importing the model,
    # its config or its heads (export, training) never imports the proposer: the two modules
    # depend one way only, proposer -> model.
    if name in ("DSparkProposer", "DSparkState"):
        from vlmspec.drafters.dspark import proposer

        return getattr(proposer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
