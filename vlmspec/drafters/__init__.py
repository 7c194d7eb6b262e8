"""Drafters: anything implementing the Proposer protocol (prompt and corpus lookup, DSpark, their hybrid)."""

from vlmspec.drafters.base import NoDraft, PerRequestProposer, Proposer
from vlmspec.drafters.corpus_lookup import CorpusLookup, TokenCorpus
from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter
from vlmspec.drafters.hybrid import HybridProposer
from vlmspec.drafters.prompt_lookup import PromptLookup

__all__ = [
    "NoDraft",
    "PerRequestProposer",
    "Proposer",
    "PromptLookup",
    "CorpusLookup",
    "TokenCorpus",
    "DSparkConfig",
    "DSparkDrafter",
    "DSparkProposer",
    "HybridProposer",
]


def __getattr__(name: str):
    if name == "DSparkProposer":  # loaded on first use: see vlmspec.drafters.dspark's __getattr__
        from vlmspec.drafters.dspark.proposer import DSparkProposer

        return DSparkProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
