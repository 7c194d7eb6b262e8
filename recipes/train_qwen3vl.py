"""Train and calibrate a DSpark drafter for a Qwen-VL target, in one command.

    python recipes/train_qwen3vl.py --target path/to/Qwen3-VL-2B-Instruct \\
        --prompts ../shared/data/prompts/mt-bench.jsonl --prompts ../shared/data/prompts/gsm8k.jsonl \\
        --out runs/qwen3vl-2b-dspark

    accelerate launch --multi_gpu --num_processes 8 recipes/train_qwen3vl.py ...   # the same, on 8 GPUs

Steps: (1) the target regenerates answers to the prompts and a target cache is written
(resumable; ``--cache`` to share one between runs); (2) the drafter trains on it with the
paper's defaults (gamma 7, 2 layers, vanilla Markov head rank 256, confidence head with
the Markov feature, lr 6e-4, 4% warm-up, losses 0.1 CE + 0.9 TV + 1.0 BCE, decay 4);
(3) the trained drafter decodes held-out prompts through SpecEngine: tau is measured
(greedy output checked identical to the target alone) and the confidence head is
calibrated (``calibration.json``). The drafter lands in ``OUT/drafter``, loadable with
``SpecEngine.from_pretrained(TARGET, drafter="OUT/drafter")``; ``OUT/report.json`` holds
the numbers. Running the same command again resumes an interrupted cache or training.
See recipes/README.md for every option and a CPU example.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkProposer
from vlmspec.engine import SpecEngine
from vlmspec.loading import load_target
from vlmspec.targets.adapter import resolve_dtype
from vlmspec.training import (
    CacheSpec,
    GenerationConfig,
    LossWeights,
    TargetCache,
    TrainConfig,
    Trainer,
    answer_token_counts,
    build_cache,
    calibrate,
    coverage,
    draft_vocabulary,
    estimate_cache_size,
    finalize_cache,
    latest_checkpoint,
    load_prompt_sources,
    open_cache_dir,
    run_heldout,
    split_prompts,
    target_fingerprint,
)
from vlmspec.training.answers import answer_files, answers_meta, cached_answers, load_answers, save_answers
from vlmspec.training.calibrate import write_report
from vlmspec.training.losses import FOCUS_KINDS
from vlmspec.training.online import OnlineFeatures
from vlmspec.training.trainer import resolve_mixed_precision
from vlmspec.training.warm_start import init_from_target_layers, target_layer_shape

# ----------------------------------------------------------------------------- options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    _data_options(parser.add_argument_group("target, data and output"))
    _cache_options(parser.add_argument_group("regeneration and cache"))
    _drafter_options(parser.add_argument_group("drafter"))
    _training_options(parser.add_argument_group("training"))
    _heldout_options(parser.add_argument_group("held-out measurement and calibration"))
    return parser.parse_args(argv)


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


# ----------------------------------------------------------------------------- pieces


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
        save_every=args.save_every,
        log_every=args.log_every,
        seed=args.seed,
        num_workers=args.num_workers,
    )


def new_drafter(target, config: DSparkConfig, seed: int, from_target_layers: bool = False) -> DSparkDrafter:
    """A freshly initialised drafter; the init is seeded so a resumed run rebuilds the same one.

    ``from_target_layers``: warm-start its layers from the target's last ones (``--init-from-target``).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DSparkDrafter.from_target(target, config)
    if from_target_layers:
        init_from_target_layers(drafter, target)
    return drafter


def build_target_cache(args, accelerator, target, items, spec: CacheSpec, cache_dir: Path) -> dict[str, Any]:
    """Write (or resume, or reuse) the target cache; every process regenerates its share of the prompts."""
    if accelerator.is_main_process:
        open_cache_dir(cache_dir, spec)
        print(estimate_cache_size(target, items, spec).describe(), flush=True)
    accelerator.wait_for_everyone()
    stored = load_answers(answer_files(args.answers), answers_meta(spec)) if args.answers is not None else {}
    report = build_cache(
        regeneration_target(args, target, accelerator),
        items,
        cache_dir,
        spec,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        shard_size=args.shard_size,
        batch_size=args.regen_batch_size,
        show_progress=accelerator.is_local_main_process,
        answers=stored,
    )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        counts = finalize_cache(cache_dir)["counts"]
        if args.answers is not None:
            export_new_answers(TargetCache(cache_dir), stored, args.answers, spec)
        print(
            f"target cache: {counts['sequences']} sequences, {counts['tokens']:,} tokens, "
            f"{counts['bytes'] / 2**20:.1f} MiB ({counts['bytes_per_sequence'] / 2**10:.1f} KiB per sequence)",
            flush=True,
        )
    accelerator.wait_for_everyone()
    return {
        "regenerated_prompts": report.prompts_done - report.prompts_replayed,
        "replayed_prompts": report.prompts_replayed,
        "regeneration_seconds": report.seconds,
    }


def export_new_answers(cache: TargetCache, stored: dict, directory: Path, spec: CacheSpec) -> Path | None:
    """Write the cache's answers that ``directory``'s files lack as its next ``answers-NNNNN.npz`` (none: None)."""
    new = {key: tokens for key, tokens in cached_answers(cache).items() if key not in stored}
    if not new:
        return None
    path = save_answers(directory / f"answers-{len(answer_files(directory)):05d}.npz", new, answers_meta(spec))
    print(f"answers: {len(new):,} new answers -> {path} ({path.stat().st_size / 2**20:.1f} MiB)", flush=True)
    return path


def choose_draft_vocabulary(drafter: DSparkDrafter, cache: TargetCache, target) -> dict[str, Any]:
    """Give the drafter the cache's most frequent answer tokens (EOS always) as its draft vocabulary."""
    counts = answer_token_counts(cache, target.vocab_size)
    ids = draft_vocabulary(counts, drafter.config.draft_vocab_size, always=target.eos_token_ids)
    drafter.set_draft_vocabulary(ids)
    share = coverage(counts, ids)
    print(
        f"draft vocabulary: {ids.numel():,} of {target.vocab_size:,} ids cover {share:.2%} of the answer tokens",
        flush=True,
    )
    return {"size": ids.numel(), "answer_token_coverage": share}


def regeneration_target(args: argparse.Namespace, target, accelerator):
    """The target that regenerates answers: ``target`` itself, or a copy loaded in ``--regen-dtype``.

    The cache's target fingerprint is rounded through bfloat16, so a cache written by the
    bfloat16 copy serves training against the float32 one (the same weights).
    """
    if args.regen_dtype is None or resolve_dtype(args.regen_dtype) == target.dtype:
        return target
    return load_target(
        args.target, dtype=args.regen_dtype, attn_implementation=args.attn_implementation, device=accelerator.device
    )


def resume_point(args: argparse.Namespace, out: Path, config: DSparkConfig) -> Path | None:
    """The checkpoint to resume from (``--resume``), refusing one written for another drafter shape."""
    if args.resume == "never":
        return None
    checkpoint = latest_checkpoint(out) if args.resume == "auto" else Path(args.resume)
    if checkpoint is None:
        return None
    saved = DSparkConfig.load(checkpoint / "drafter")
    if saved.to_dict() != config.to_dict():
        raise ValueError(
            f"{checkpoint} holds a drafter of another shape than the options ask for; pass the same drafter "
            "options, --resume never (start over) or another --out"
        )
    return checkpoint


def measure_heldout(engine: SpecEngine, items, args: argparse.Namespace, label: str):
    """Greedy (by default) decoding of the held-out prompts: tau and identity with the target alone."""
    run = run_heldout(
        engine, items, max_new_tokens=args.eval_max_new_tokens, temperature=args.eval_temperature, seed=args.seed
    )
    outcome = {True: "identical to the target alone", False: "DIFFERENT from the target alone", None: "sampled"}
    print(f"{label}: tau {run.tau:.3f} over {run.rounds} rounds; output {outcome[run.identical_to_target]}", flush=True)
    return run


def finish(args, target, out: Path, drafter_dir: Path, heldout_items, report: dict[str, Any]) -> None:
    """Main process: measure the trained drafter, calibrate it, save the target if asked, write the report."""
    if args.save_target or args.target.startswith("tiny:"):
        target.save_pretrained(out / "target")  # SpecEngine.from_pretrained(OUT/target, drafter=OUT/drafter)
    if heldout_items:
        trained = DSparkDrafter.from_pretrained(drafter_dir, target=target)
        run = measure_heldout(SpecEngine(target, DSparkProposer(trained)), heldout_items, args, "trained drafter")
        report["trained"] = run.as_dict()
        if not args.skip_calibration and trained.config.confidence_head:
            report["calibration"] = list(calibrate(run, drafter_dir).temperatures)
    path = write_report(out / "report.json", report)
    print(f"drafter: {drafter_dir}   report: {path}", flush=True)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None, *, target=None) -> dict[str, Any]:
    """Run the recipe; ``target`` is an already loaded QwenVLTarget to use instead of loading ``--target``."""
    args = parse_args(argv)
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    train_items, heldout_items = split_prompts(  # bad prompt files and options fail before the target loads
        load_prompt_sources(args.prompts), args.num_prompts, args.heldout_prompts, args.seed
    )
    training = train_config(args)
    accelerator = _accelerator(args)
    if target is None:
        target = load_target(
            args.target,
            dtype=target_dtype(args.dtype, accelerator.device),
            attn_implementation=args.attn_implementation,
            device=accelerator.device,
        )
    target.model.requires_grad_(False)
    # A warm start (--init-from) keeps the trained drafter's shape, hooked layers and draft vocabulary.
    config = DSparkConfig.load(args.init_from) if args.init_from is not None else drafter_config(args, target)
    report: dict[str, Any] = {
        "target": args.target,
        "drafter_config": config.to_dict(),
        "init_from_target": args.init_from_target,
        "loss_focus": args.loss_focus,
        "train_prompts": len(train_items),
        "heldout_prompts": len(heldout_items),
    }

    cache_dir = Path(args.cache) if args.cache else out / "cache"
    spec = cache_spec(args, target, config)
    report["cache"] = build_target_cache(args, accelerator, target, train_items, spec, cache_dir)
    cache = TargetCache(cache_dir)
    report["cache"].update(cache.manifest["counts"])
    if args.cache_only:
        return report
    # A tokens-only cache gets its features from the copy of the target that regenerated it (same rounding).
    if cache.spec.stores_features:
        data = cache
    else:
        data = OnlineFeatures(cache, regeneration_target(args, target, accelerator), config.target_layer_ids)

    if args.init_from is not None:
        drafter = DSparkDrafter.from_pretrained(args.init_from, target=target)
    else:
        drafter = new_drafter(target, config, args.seed, from_target_layers=args.init_from_target)
    if config.draft_vocab_size is not None and args.init_from is None:
        report["draft_vocabulary"] = choose_draft_vocabulary(drafter, cache, target)
    if accelerator.is_main_process and heldout_items and not args.skip_untrained_eval:
        untrained = measure_heldout(
            SpecEngine(target, DSparkProposer(drafter)), heldout_items, args, "untrained drafter"
        )
        report["untrained"] = untrained.as_dict()
    accelerator.wait_for_everyone()

    trainer = Trainer(drafter.train(), data, out, training, accelerator)
    summary = trainer.train(resume_from=resume_point(args, out, config))
    report["training"] = vars(summary)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        report["seconds_before_heldout"] = time.perf_counter() - started
        finish(args, target, out, Path(summary.drafter_dir), heldout_items, report)
    accelerator.wait_for_everyone()
    return report


def _accelerator(args: argparse.Namespace):
    """The process group: generous barrier timeouts, since processes wait for each other's cache shares."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    return Accelerator(
        mixed_precision=resolve_mixed_precision(args.mixed_precision),
        gradient_accumulation_steps=args.grad_accum,
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=args.dist_timeout))],
    )


if __name__ == "__main__":
    main()
