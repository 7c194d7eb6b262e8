"""Training DSpark drafters: target cache, anchor packing, losses, trainer, calibration.

The pipeline (``recipes/train_qwen3vl.py`` runs it in one command):

1. ``read_prompts`` / ``load_prompt_sources``: prompts from JSONL or MMBench TSV;
2. ``open_cache_dir`` + ``build_cache`` + ``finalize_cache``: the target regenerates the
   answers; features and final-norm states go to memory-mapped shards (``TargetCache``);
3. ``PackedDataset``: anchors sampled per sequence, all blocks of a sequence in one row
   (``anchors.py``, ``packing.py``), attended in one pass (``attention.py``);
4. ``Trainer``: accelerate-based training with the DSpark losses (``losses.py``), its
   checkpoints (``checkpoints.py``) and metrics log (``metrics.py``);
5. ``run_heldout`` + ``calibrate``: tau on held-out prompts through the engine, and STS
   calibration saved beside the drafter.

``answers.py`` keeps the regenerated answers as a small committable file (token ids only);
``build_cache(..., answers=...)`` replays them instead of regenerating.
"""

from vlmspec.training.anchors import block_targets, sample_anchors, valid_anchor_mask, valid_prefix
from vlmspec.training.attention import checked_flex, flex_block_mask, packed_hidden, packed_mask, resolve_attention
from vlmspec.training.cache import CachedSequence, CacheSpec, TargetCache, open_cache_dir, target_fingerprint
from vlmspec.training.cache_build import CacheEstimate, build_cache, estimate_cache_size, finalize_cache
from vlmspec.training.calibrate import HeldoutRun, calibrate, run_heldout
from vlmspec.training.checkpoints import latest_checkpoint
from vlmspec.training.losses import (
    LossWeights,
    PositionTerms,
    block_terms,
    position_terms,
    position_weights,
    reduce_terms,
)
from vlmspec.training.packing import PackedBatch, PackedDataset, PackedRow, collate, pack_sequence
from vlmspec.training.prompts import PromptItem, load_prompt_sources, read_prompts, split_prompts
from vlmspec.training.regenerate import GenerationConfig, RegeneratedSequence, regenerate_item, regenerate_items
from vlmspec.training.trainer import TrainConfig, Trainer, TrainSummary
from vlmspec.training.vocabulary import answer_token_counts, coverage, draft_vocabulary

__all__ = [
    "CacheEstimate",
    "CacheSpec",
    "CachedSequence",
    "GenerationConfig",
    "HeldoutRun",
    "LossWeights",
    "PackedBatch",
    "PackedDataset",
    "PackedRow",
    "PositionTerms",
    "PromptItem",
    "RegeneratedSequence",
    "TargetCache",
    "TrainConfig",
    "TrainSummary",
    "Trainer",
    "block_targets",
    "block_terms",
    "build_cache",
    "checked_flex",
    "calibrate",
    "collate",
    "estimate_cache_size",
    "finalize_cache",
    "flex_block_mask",
    "latest_checkpoint",
    "load_prompt_sources",
    "open_cache_dir",
    "pack_sequence",
    "packed_hidden",
    "packed_mask",
    "position_terms",
    "position_weights",
    "read_prompts",
    "reduce_terms",
    "regenerate_item",
    "regenerate_items",
    "answer_token_counts",
    "coverage",
    "draft_vocabulary",
    "resolve_attention",
    "run_heldout",
    "sample_anchors",
    "split_prompts",
    "target_fingerprint",
    "valid_anchor_mask",
    "valid_prefix",
]
