"""Training throughput: supervised block positions per second for each storage and precision choice.

The reference drafter's shape (hidden 576, 2 layers, block 7, Markov head rank 64, draft
vocabulary 8,192, 5 hooked layers) trains on the same sequences of a reference-target
cache under each variant, one process per variant (so thread counts and autocast never
leak between them), the variants in turn:

* ``stored``: features read from a cache that stores them (6.9 KB a token);
* ``online``: a tokens-only cache (9 B a token) whose features the bfloat16 copy of the
  target computes while training reads it (:class:`vlmspec.training.online.OnlineFeatures`);
* ``fp32`` or ``bf16`` autocast for the drafter's step;
* 1 or 2 torch threads;
* anchor blocks per sequence (and so per online forward and per optimizer step).

Training time includes loading batches (so the online forward is counted) and excludes
set-up. The source cache may be of either kind, and still being built: its committed
shards are read, and the first ``--sequences`` of them are copied into the two caches
compared (the stored features computed as :class:`OnlineFeatures` computes them).

    python -m benchmarks.training_throughput --cache ~/.cache/vlmspec/runs/reference-10x/cache \
        --out runs/training_throughput
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import environment_info, log, markdown_table, prepare_out_dir, write_json, write_text

VARIANTS = (
    "stored-fp32-t1",
    "online-fp32-t1",
    "stored-bf16-t1",
    "online-bf16-t1",
    "stored-bf16-t1-a64",
    "online-bf16-t1-a64",
    "online-bf16-t1-a128",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", type=Path, required=True, help="a cache of the reference target (either kind)")
    parser.add_argument("--out", type=Path, default=Path("runs/training_throughput"))
    parser.add_argument("--sequences", type=int, default=40, help="sequences copied from the cache")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per variant (batch 1)")
    parser.add_argument("--num-anchors", type=int, default=32, help="anchor blocks per sequence")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="STORAGE-PRECISION-tTHREADS[-aANCHORS] (anchors default: --num-anchors), comma-separated",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def reference_pair(dtype: str = "float32"):
    """The reference target and the reference drafter's configuration (random weights: costs, not tau)."""
    from vlmspec.drafters.dspark import DSparkConfig
    from vlmspec.loading import load_target

    target = load_target("reference", dtype=dtype)
    config = DSparkConfig.for_target(target, block_size=7, num_layers=2, head_rank=64, draft_vocab_size=8192)
    return target, config


def prepare_caches(source: Path, out: Path, sequences: int) -> dict[str, Path]:
    """The first ``sequences`` of ``source`` as a tokens-only cache and as a cache with the features stored."""
    from vlmspec.training.cache import TargetCache, open_cache_dir
    from vlmspec.training.online import OnlineFeatures

    caches = {"online": out / "tokens-cache", "stored": out / "stored-cache"}
    if all((path / "index.json").is_file() for path in caches.values()):
        return caches
    source_cache = TargetCache(source, require_complete=False)
    if len(source_cache) < sequences:
        raise ValueError(f"{source} has {len(source_cache)} committed sequences; pass --sequences {len(source_cache)}")
    open_cache_dir(caches["online"], dataclasses.replace(source_cache.spec, feature_layers=(), contents="tokens"))
    write_sequences(caches["online"], [tokens_only(source_cache[i]) for i in range(sequences)])
    target, config = reference_pair("bfloat16")  # the copy that regenerates computes the stored features too
    online = OnlineFeatures(TargetCache(caches["online"]), target, config.target_layer_ids)
    open_cache_dir(caches["stored"], online.spec)
    write_sequences(caches["stored"], [online[i] for i in range(sequences)])
    return caches


def tokens_only(sequence):
    """A cached sequence without its stored states (what a tokens-only cache holds)."""
    empty = torch.zeros(0, dtype=torch.long)
    return dataclasses.replace(
        sequence,
        features=sequence.features[:0, :0],
        feature_index=empty,
        last_hidden=sequence.last_hidden[:0],
        hidden_index=empty,
    )


def write_sequences(directory: Path, sequences: list) -> None:
    from vlmspec.training.cache import ShardWriter
    from vlmspec.training.cache_build import finalize_cache

    writer = ShardWriter(directory, "r0")
    for sequence in sequences:
        writer.add(sequence)
    writer.flush()
    finalize_cache(directory)


def run_worker(args: argparse.Namespace) -> None:
    """One variant in this process: train ``--steps`` steps and print the throughput as JSON."""
    from vlmspec.drafters.dspark import DSparkDrafter
    from vlmspec.training import TargetCache, TrainConfig, Trainer
    from vlmspec.training.online import OnlineFeatures
    from vlmspec.training.vocabulary import answer_token_counts, draft_vocabulary

    storage, precision, threads, *anchors = args.worker.split("-")
    num_anchors = int(anchors[0][1:]) if anchors else args.num_anchors
    torch.set_num_threads(int(threads[1:]))
    caches = prepare_caches(args.cache, args.out, args.sequences)
    target, config = reference_pair()
    cache = TargetCache(caches[storage])
    data = (
        cache if storage == "stored" else OnlineFeatures(cache, reference_pair("bfloat16")[0], config.target_layer_ids)
    )
    torch.manual_seed(0)
    drafter = DSparkDrafter.from_target(target, config)
    counts = answer_token_counts(cache, target.vocab_size)
    drafter.set_draft_vocabulary(draft_vocabulary(counts, 8192, always=target.eos_token_ids))
    training = TrainConfig(
        steps=args.steps,
        batch_size=1,
        num_anchors=num_anchors,
        lr=1e-3,
        chunk_tokens=512,
        eval_every=0,
        eval_sequences=0,
        save_every=0,
        log_every=args.steps,
        mixed_precision="bf16" if precision == "bf16" else "no",
    )
    started = time.perf_counter()
    summary = Trainer(drafter.train(), data, args.out / args.worker, training).train()
    print(
        json.dumps(
            {
                "variant": args.worker,
                "blocks_per_s": summary.blocks_per_second,
                "positions_per_s": summary.blocks_per_second * config.block_size,
                "seconds_per_step": summary.train_seconds / summary.steps,
                "wall_s": time.perf_counter() - started,
                "peak_memory_mb": summary.peak_memory_mb,
                "last_loss": summary.last_loss,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    out = prepare_out_dir(args.out)
    log(f"caches of {args.sequences} sequences from {args.cache}")
    prepare_caches(args.cache, out, args.sequences)
    results = []
    for variant in args.variants.split(","):
        command = [sys.executable, "-m", "benchmarks.training_throughput", "--worker", variant]
        command += ["--cache", str(args.cache), "--out", str(out), "--sequences", str(args.sequences)]
        command += ["--steps", str(args.steps), "--num-anchors", str(args.num_anchors)]
        log(f"variant {variant}")
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"variant {variant} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = results[0]["positions_per_s"]
    rows = [
        [r["variant"], r["blocks_per_s"], r["positions_per_s"], r["positions_per_s"] / base, r["peak_memory_mb"]]
        for r in results
    ]
    table = markdown_table(["variant", "blocks/s", "block positions/s", f"x {results[0]['variant']}", "peak MB"], rows)
    print(table)
    write_text(out / "training_throughput.md", table + "\n")
    write_json(
        out / "training_throughput.json",
        {"args": {k: str(v) for k, v in vars(args).items()}, "environment": environment_info(), "results": results},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
