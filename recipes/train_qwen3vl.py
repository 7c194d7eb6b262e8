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
See recipes/README.md for every option and a CPU example. The options, and the configs they
build, are defined in recipes/train_options.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the recipe's helper modules (recipes/ is not a package)

import torch
from train_options import add_options, cache_spec, drafter_config, target_dtype, train_config

from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkProposer
from vlmspec.engine import SpecEngine
from vlmspec.loading import load_target
from vlmspec.targets.adapter import resolve_dtype
from vlmspec.training import (
    CacheSpec,
    TargetCache,
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
)
from vlmspec.training.answers import answer_files, answers_meta, cached_answers, load_answers, save_answers
from vlmspec.training.calibrate import write_report
from vlmspec.training.online import OnlineFeatures
from vlmspec.training.trainer import resolve_mixed_precision
from vlmspec.training.warm_start import init_from_target_layers

# ----------------------------------------------------------------------------- options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The recipe's options (recipes/train_options.py defines them)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_options(parser)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- pieces


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
