"""Drafters: anything implementing the Proposer protocol (prompt and corpus lookup, DSpark, their hybrid)."""

from vlmspec.drafters.base import NoDraft, PerRequestProposer, Proposer
from vlmspec.drafters.corpus_lookup import CorpusLookup, TokenCorpus
from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkProposer
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
