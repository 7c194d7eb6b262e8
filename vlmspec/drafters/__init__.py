"""Drafters: anything implementing the Proposer protocol (prompt lookup, DSpark, the hybrid of both)."""

from vlmspec.drafters.base import NoDraft, PerRequestProposer, Proposer
from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkProposer
from vlmspec.drafters.hybrid import HybridProposer
from vlmspec.drafters.prompt_lookup import PromptLookup

__all__ = [
    "NoDraft",
    "PerRequestProposer",
    "Proposer",
    "PromptLookup",
    "DSparkConfig",
    "DSparkDrafter",
    "DSparkProposer",
    "HybridProposer",
]
