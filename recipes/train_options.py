"""The command-line options of ``recipes/train_qwen3vl.py``, and the configs they build.

:func:`add_options` adds every option group to the recipe's parser; :func:`drafter_config`,
:func:`cache_spec` and :func:`train_config` turn the parsed options into the library's
``DSparkConfig``, ``CacheSpec`` and ``TrainConfig`` (:func:`target_dtype`: the target's dtype).
recipes/ is not a package: the recipe imports this module after putting recipes/ on ``sys.path``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from vlmspec.drafters.dspark import DSparkConfig
from vlmspec.training import CacheSpec, GenerationConfig, LossWeights, TrainConfig, target_fingerprint
from vlmspec.training.losses import FOCUS_KINDS
from vlmspec.training.warm_start import target_layer_shape

# ----------------------------------------------------------------------------- options


def add_options(parser: argparse.ArgumentParser) -> None:
    """Every option of the recipe, in its --help groups."""
    _data_options(parser.add_argument_group("target, data and output"))
    _cache_options(parser.add_argument_group("regeneration and cache"))
    _drafter_options(parser.add_argument_group("drafter"))
    _training_options(parser.add_argument_group("training"))
    _heldout_options(parser.add_argument_group("held-out measurement and calibration"))


def _data_options(group) -> None:
    add = group.add_argument
    add(
        "--target",
        required=True,
        help="saved Qwen-VL directory, reference (the bundled SmolLM2 Qwen2-VL), or tiny:qwen2_vl | tiny:qwen2_5_vl | tiny:qwen3_vl",
    )
    add(
        "--prompts",
        action="append",
        required=True,
        help="prompt file: .jsonl (turns or messages) or MMBench .tsv; repeatable",
    )
    add("--out", required=True, help="output directory: drafter/, checkpoints/, cache/, metrics.jsonl, report.json")
    add("--cache", default=None, help="target cache directory (default OUT/cache); reused when its manifest matches")
    add("--num-prompts", type=int, default=None, help="training prompts (default: all but the held-out ones)")
    add("--heldout-prompts", type=int, default=16, help="prompts kept out of the cache to measure tau and calibrate")
    add(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="target dtype; auto: bfloat16 on GPU, float32 on CPU",
    )
    add(
        "--attn-implementation", default="sdpa", choices=("sdpa", "eager", "flash_attention_2"), help="target attention"
    )
    add("--save-target", action="store_true", help="also save the target to OUT/target (always for tiny: targets)")
    add("--threads", type=int, default=None, help="torch CPU threads per process (1 is often fastest on a shared CPU)")
    add("--dist-timeout", type=float, default=180, help="minutes a process may wait for the others at a barrier")


def _cache_options(group) -> None:
    add = group.add_argument
    add("--max-new-tokens", type=int, default=512, help="longest regenerated answer")
    add("--temperature", type=float, default=0.7, help="regeneration temperature (0: greedy)")
    add("--top-p", type=float, default=0.8, help="regeneration top-p (1: off)")
    add("--top-k", type=int, default=20, help="regeneration top-k (0: off)")
    add("--first-turn-only", action="store_true", help="answer only the first user turn of multi-turn prompts")
    add("--cache-dtype", default="bfloat16", choices=("bfloat16", "float16"), help="storage dtype of target states")
    add(
        "--answers",
        type=Path,
        default=None,
        help="a directory of committed answers files (answers-*.npz, vlmspec.training.answers): their prompts are "
        "replayed instead of regenerated, and the answers this run regenerates are written there as the next file",
    )
    add(
        "--cache-contents",
        default="features",
        choices=("features", "tokens"),
        help="features: store the target's states (about 2(m+1)d bytes a token); tokens: store 9 bytes a token, "
        "regenerate through the target's fast runner and compute the features online while training",
    )
    add(
        "--regen-batch-size",
        type=int,
        default=16,
        help="requests the target's runner answers together (continuous batching; several times faster than 1)",
    )
    add(
        "--regen-dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="target dtype for regeneration only (default: --dtype); bfloat16 regenerates about 2x faster on a CPU",
    )
    add(
        "--cache-only",
        action="store_true",
        help="stop after writing the target cache (e.g. to build it in the background)",
    )
    add("--shard-size", type=int, default=64, help="sequences per shard (at most this much work is redone on resume)")
    add(
        "--window-anchors",
        type=int,
        default=None,
        help="window mode: fix this many anchors per sequence at cache time and keep only their windows",
    )
    add("--context-window", type=int, default=None, help="context tokens a block sees before its anchor (default: all)")


def _drafter_options(group) -> None:
    add = group.add_argument
    add("--block-size", type=int, default=7, help="gamma: tokens drafted per block")
    add("--draft-layers", type=int, default=2, help="decoder layers of the parallel backbone")
    add("--draft-hidden", type=int, default=None, help="drafter width (default: the target's)")
    add("--draft-heads", type=int, default=None, help="attention heads (default: width / head dim)")
    add("--draft-head-dim", type=int, default=None, help="head dim (default: 128, 64 below width 1024, 16 below 256)")
    add("--draft-intermediate", type=int, default=None, help="MLP width (default: 3 x drafter width)")
    add(
        "--draft-vocab",
        type=int,
        default=None,
        help="reduced draft vocabulary: the N most frequent answer tokens of the cache (default: the whole vocabulary)",
    )
    add("--head", default="vanilla", choices=("none", "vanilla", "gated", "rnn"), help="sequential head")
    add("--head-rank", type=int, default=256, help="rank r of the sequential head")
    add("--no-confidence-head", action="store_true", help="draft without a confidence head (no calibration)")
    add("--confidence-without-markov", action="store_true", help="confidence head over h_k only")
    add("--feature-layers", default=None, help="target layers to hook, e.g. 1,9,17,25,33 (default: 5 evenly spaced)")
    add("--position-rule", default="interpolate", choices=("interpolate", "temporal"), help="vision token positions")
    add(
        "--init-from-target",
        action="store_true",
        help="start the drafter's layers from the target's last decoder layers, in the target's layer shape, "
        "with the feature projection passing the deepest hooked layer through (vlmspec.training.warm_start)",
    )
    add(
        "--init-from",
        type=Path,
        default=None,
        help="start from this trained drafter (a drafter/ directory, e.g. a shipped half-precision one): its shape "
        "and draft vocabulary replace the shape options; the optimizer starts fresh",
    )


def _training_options(group) -> None:
    add = group.add_argument
    add("--steps", type=int, default=2000, help="optimizer steps")
    add("--batch-size", type=int, default=4, help="sequences (packed rows) per process per micro-step")
    add("--num-anchors", type=int, default=64, help="anchor blocks per sequence")
    add("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    add("--lr", type=float, default=6e-4, help="peak learning rate")
    add("--warmup-ratio", type=float, default=0.04, help="linear warm-up, as a fraction of --steps")
    add("--min-lr-ratio", type=float, default=0.0, help="cosine floor, as a fraction of --lr")
    add("--weight-decay", type=float, default=0.01)
    add("--max-grad-norm", type=float, default=1.0)
    add("--loss-weights", default="0.1,0.9,1.0", help="CE,TV,confidence")
    add("--loss-decay", type=float, default=4.0, help="position weights exp(-(k-1)/decay)")
    add(
        "--loss-focus",
        default="decay",
        choices=FOCUS_KINDS,
        help="first-error: also weight each position by the chance the block reaches it (no gradient)",
    )
    add("--chunk-tokens", type=int, default=1024, help="block positions per LM-head chunk (bounds memory)")
    add("--attention", default="auto", choices=("auto", "sdpa", "flex"), help="packed attention (auto: flex on CUDA)")
    add("--mixed-precision", default="auto", choices=("auto", "no", "bf16", "fp16"), help="auto: bf16 where supported")
    add("--eval-every", type=int, default=200, help="steps between evaluations on held-out cached sequences (0: end)")
    add("--eval-sequences", type=int, default=32, help="cached sequences held out for evaluation")
    add(
        "--eval-ids",
        type=Path,
        help="a file naming the held-out cached sequences, one id a line (a staged run's split: stable as its "
        "cache grows; their other turns are held out too); replaces --eval-sequences",
    )
    add(
        "--max-minutes",
        type=float,
        default=None,
        help="wall-clock budget of the training steps: once the pace is measured, the schedule is shortened to "
        "end in time (e.g. a lent GPU's minutes)",
    )
    add("--save-every", type=int, default=500, help="steps between checkpoints (0: end)")
    add("--log-every", type=int, default=10, help="steps between metrics.jsonl records")
    add("--num-workers", type=int, default=0, help="DataLoader workers per process")
    add("--seed", type=int, default=0)
    add("--resume", default="auto", help="auto (latest checkpoint in OUT), never, or a checkpoint directory")


def _heldout_options(group) -> None:
    add = group.add_argument
    add("--eval-max-new-tokens", type=int, default=128, help="answer length when measuring tau")
    add(
        "--eval-temperature",
        type=float,
        default=0.0,
        help="temperature of the held-out decoding and calibration (0: greedy); use the one you serve",
    )
    add("--skip-untrained-eval", action="store_true", help="do not measure the untrained drafter's tau")
    add("--skip-calibration", action="store_true", help="do not fit calibration.json")


# ----------------------------------------------------------------------------- configs


def target_dtype(choice: str, device: torch.device) -> str:
    if choice != "auto":
        return choice
    return "bfloat16" if device.type == "cuda" else "float32"


def drafter_config(args: argparse.Namespace, target) -> DSparkConfig:
    """The drafter's shape: the paper's defaults with every option applied."""
    overrides: dict[str, Any] = {
        "block_size": args.block_size,
        "num_layers": args.draft_layers,
        "head_kind": args.head,
        "head_rank": args.head_rank,
        "confidence_head": not args.no_confidence_head,
        "confidence_with_markov": not args.confidence_without_markov and args.head != "none",
        "position_rule": args.position_rule,
        "draft_vocab_size": args.draft_vocab,
    }
    optional = {
        "hidden_size": args.draft_hidden,
        "num_heads": args.draft_heads,
        "head_dim": args.draft_head_dim,
        "intermediate_size": args.draft_intermediate,
    }
    if args.init_from_target:  # the target's layer shape; explicit --draft-* options still win (and are refused)
        overrides.update(target_layer_shape(target))
    overrides.update({key: value for key, value in optional.items() if value is not None})
    if args.feature_layers:
        overrides["target_layer_ids"] = tuple(int(x) for x in args.feature_layers.split(","))
    if "hidden_size" in overrides and "intermediate_size" not in overrides:
        overrides["intermediate_size"] = 3 * overrides["hidden_size"]
    return DSparkConfig.for_target(target, **overrides)


def cache_spec(args: argparse.Namespace, target, config: DSparkConfig) -> CacheSpec:
    generation = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p if args.top_p < 1 else None,
        top_k=args.top_k or None,
        seed=args.seed,
        all_turns=not args.first_turn_only,
    )
    return CacheSpec(
        target=target_fingerprint(target),
        feature_layers=config.target_layer_ids if args.cache_contents == "features" else (),
        position_rule=config.position_rule,
        dtype=args.cache_dtype,
        generation=generation,
        anchors_per_sequence=args.window_anchors,
        context_window=args.context_window,
        block_size=config.block_size if args.window_anchors else None,
        contents=args.cache_contents,
    )


def train_config(args: argparse.Namespace) -> TrainConfig:
    try:
        ce, tv, confidence = (float(x) for x in args.loss_weights.split(","))
    except ValueError:
        raise ValueError(
            f"--loss-weights takes three numbers CE,TV,confidence (e.g. 0.1,0.9,1.0), got {args.loss_weights!r}"
        ) from None
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        num_anchors=args.num_anchors,
        grad_accum=args.grad_accum,
        lr=args.lr,
        warmup_ratio=args.warmup_ratio,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        loss=LossWeights(ce, tv, confidence, args.loss_decay, args.loss_focus),
        chunk_tokens=args.chunk_tokens,
        attention=args.attention,
        context_window=args.context_window,
        mixed_precision=args.mixed_precision,
        eval_every=args.eval_every,
        eval_sequences=args.eval_sequences,
        eval_ids=read_eval_ids(args.eval_ids),
        save_every=args.save_every,
        log_every=args.log_every,
        seed=args.seed,
        num_workers=args.num_workers,
        max_minutes=args.max_minutes,
    )


def read_eval_ids(path: Path | None) -> tuple[str, ...]:
    """The held-out sequence ids in ``path`` (one a line, blank lines ignored); () without a file."""
    if path is None:
        return ()
    if not path.is_file():
        raise FileNotFoundError(f"--eval-ids {path}: no such file; name a file with one cached sequence id a line")
    ids = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if not ids:
        raise ValueError(f"--eval-ids {path} names no sequence; put one cached sequence id on each line")
    return ids
