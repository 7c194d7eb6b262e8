"""Drafter cost: where a DSpark drafting round spends its time, and what it costs against the target.

Part 1 times one drafting round, stage by stage, for each sequential head kind, block
size gamma (4, 7, 16 by default) and batch (1 and 8): appending the newly committed
span to the draft context cache, the backbone pass over the block, the LM head over all
gamma positions (one GEMM), the head's left-to-right sampling loop, and the confidence
head. The sequential head's share is ``head loop / round``; kind ``none`` (DFlash, no
sequential head) is the reference, where the "loop" is one vectorised draw.

Part 2 times one target step on the same small Qwen-VL config through the engine's
target adapter (a 1-token forward with the drafter's feature hooks, then a rollback) and
a (gamma + 1)-token verify, in the same loop as the batch-1 drafting rounds (head kinds
interleaved), and reports drafter round / target step at batch 1.

Part 3 times the round the engine runs, ``DSparkProposer.propose`` for one request (the
native round of :mod:`vlmspec.drafters.dspark.native` where it applies), beside the
target's one-token step in one alternating loop
(:func:`vlmspec.targets.profile.profile_draft_round`, what the drafting policy reads):
``T_draft / T(1)`` per head kind, and for ``--drafter NAME`` (e.g. ``reference-dspark``
with ``--target reference``) that trained drafter.

Sizes (defaults): a random-init Qwen2.5-VL shaped target, hidden 512, 8 layers, the real
Qwen vocabulary (151,669 rows), context ~300 tokens; the drafter as
``DSparkConfig.for_target`` makes it (hidden 512, 2 layers, 5 hooked layers, rank 256).
``--target reference`` times the bundled real-weights target instead, and
``--draft-vocab N`` a reduced draft vocabulary of N ids (the reference drafter's shape:
``--target reference --rank 64 --draft-vocab 8192 --gammas 7``). Drafter weights are
random: the numbers are costs, not acceptance. Each cell is the median over
``--repeats`` rounds after one warm-up; temperature 1 (the sampling path: a softmax and
an inverse-CDF draw per step) unless ``--temperature 0``.

Run from the repository root::

    python -m benchmarks.drafter_cost --out runs/drafter_cost
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import (
    environment_info,
    log,
    markdown_table,
    plot_stacked_bars,
    prepare_out_dir,
    run_order,
    write_json,
    write_text,
)
from vlmspec.drafters.dspark import HEAD_KINDS, DraftContextCache, DSparkConfig, DSparkDrafter
from vlmspec.targets.ragged import RaggedBatch

STAGES = ("append", "backbone", "lm_head", "head_loop", "confidence")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/drafter_cost"), help="output directory")
    parser.add_argument("--gammas", default="4,7,16", help="comma-separated block sizes")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--heads", default=",".join(HEAD_KINDS), help=f"head kinds among {HEAD_KINDS}")
    parser.add_argument("--rank", type=int, default=256, help="sequential head rank r")
    parser.add_argument(
        "--target", default=None, help="'reference' for the bundled real-weights target (default: random)"
    )
    parser.add_argument("--draft-vocab", type=int, default=None, help="reduced draft vocabulary size (default: all)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="target and drafters")
    parser.add_argument("--hidden", type=int, default=512, help="target (and drafter) hidden size")
    parser.add_argument("--layers", type=int, default=8, help="target decoder layers")
    parser.add_argument("--context", type=int, default=300, help="context tokens already in the caches")
    parser.add_argument("--span", type=int, default=3, help="tokens committed per round (appended to the draft cache)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy drafting")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per cell (median reported)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 avoids wake-up stalls on shared CPUs)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--drafter", default=None, help="also time this drafter's engine round (a name or a directory), part 3"
    )
    parser.add_argument("--engine-repeats", type=int, default=21, help="part 3: alternated rounds and steps timed")
    return parser.parse_args(argv)


def build_target(args: argparse.Namespace):
    from vlmspec.loading import load_target
    from vlmspec.targets import QwenVLTarget

    if args.target:
        return load_target(args.target, dtype=args.dtype)
    from vlmspec.targets.tiny import qwen_tokenizer, tiny_model, tiny_processor

    model = tiny_model(
        "qwen2_5_vl", seed=args.seed, dtype=getattr(torch, args.dtype), hidden_size=args.hidden, num_layers=args.layers
    )
    name = f"qwen2_5_vl-h{args.hidden}-l{args.layers}"
    return QwenVLTarget(model, tiny_processor("qwen2_5_vl", qwen_tokenizer()), name=name)


def build_drafter(target, head_kind: str, gamma: int, rank: int, draft_vocab: int | None) -> DSparkDrafter:
    config = DSparkConfig.for_target(
        target,
        block_size=gamma,
        head_kind=head_kind,
        head_rank=rank,
        confidence_with_markov=head_kind != "none",
        draft_vocab_size=draft_vocab,
    )
    drafter = DSparkDrafter.from_target(target, config).eval()
    if draft_vocab:  # the cost does not depend on which ids: take the first ones
        drafter.set_draft_vocabulary(torch.arange(draft_vocab))
    return drafter


def _tick() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


@torch.inference_mode()
def time_round(
    drafter: DSparkDrafter,
    cache: DraftContextCache,
    features: torch.Tensor,  # [B, span, F] features of the newly committed span
    positions: torch.Tensor,  # [B, span] their positions
    temperature: float,
    generator: torch.Generator,
) -> dict[str, float]:
    """One drafting round, stage by stage (the same calls as ``DSparkDrafter.draft``), in seconds."""
    batch = features.shape[0]
    anchors = torch.randint(0, 1000, (batch,), generator=generator)
    anchor_positions = positions[:, -1] + 1
    times = {}
    t0 = _tick()
    cache.append(drafter.context_kv(features, positions))
    t1 = _tick()
    hidden = drafter.block_hidden(anchors[:, None], anchor_positions[:, None], cache.layers())[:, 0]
    t2 = _tick()
    base = drafter.base_logits(hidden)
    t3 = _tick()
    sample = drafter.head.sample(hidden, base, anchors, drafter.draft_token_ids, temperature, generator)
    if sample.probs is not None:
        drafter.scatter_to_target(sample.probs)
    t4 = _tick()
    prev = torch.cat((anchors[:, None], sample.tokens[:, :-1]), dim=1)
    confidence = drafter.confidences(hidden, prev)
    if confidence is not None:
        torch.sigmoid(confidence)
    t5 = _tick()
    for name, start, end in zip(STAGES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
        times[name] = end - start
    return times


def measure(target, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Median stage times per (head kind, gamma, batch), and target forwards timed in the same loop.

    Head kinds run interleaved (``run_order`` each round), and at batch 1 every round
    also times one target step and one (gamma + 1)-token verify, so that drift on a
    shared machine hits all variants alike and ratios compare numbers taken together.
    """
    gen = torch.Generator().manual_seed(args.seed)
    heads = args.heads.split(",")
    rows, target_samples = [], {}
    target_state = open_target_request(target, args)
    width = len(target_state.feature_layers) * target.hidden_size
    for gamma in [int(g) for g in args.gammas.split(",")]:
        drafters = {kind: build_drafter(target, kind, gamma, args.rank, args.draft_vocab) for kind in heads}
        for batch in [int(b) for b in args.batches.split(",")]:
            caches = {}
            for kind, drafter in drafters.items():
                caches[kind] = DraftContextCache()
                context = torch.randn(batch, args.context, width, generator=gen)
                caches[kind].append(drafter.context_kv(context, torch.arange(args.context).expand(batch, -1)))
            samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in heads}
            start = args.context
            for step in range(args.repeats + 1):  # round 0 is a warm-up
                positions = torch.arange(start, start + args.span).expand(batch, -1)
                features = torch.randn(batch, args.span, width, generator=gen)
                start += args.span
                for kind in run_order(heads, step):
                    times = time_round(drafters[kind], caches[kind], features, positions, args.temperature, gen)
                    if step:
                        samples[kind].append(times)
                if batch == 1:
                    for n in (1, gamma + 1):
                        seconds = time_target_forward(target_state, n)
                        if step:
                            target_samples.setdefault(n, []).append(seconds)
            for kind in heads:
                median = {stage: statistics.median(s[stage] for s in samples[kind]) for stage in STAGES}
                round_s = sum(median.values())
                rows.append(
                    {
                        "head": kind,
                        "gamma": gamma,
                        "batch": batch,
                        "round_s": round_s,
                        "head_share": median["head_loop"] / round_s,
                        "lm_head_share": median["lm_head"] / round_s,
                        **{f"{stage}_s": seconds for stage, seconds in median.items()},
                    }
                )
                log(
                    f"{kind:8s} gamma {gamma:2d} batch {batch}: round {1e3 * round_s:7.1f} ms, "
                    f"head loop {100 * median['head_loop'] / round_s:4.1f}%"
                )
        del drafters, caches
    target_times = {n: statistics.median(v) for n, v in sorted(target_samples.items())}
    return rows, {"context": int(target_state.lengths[0]), "forward_s": target_times}


def engine_rounds(target, args: argparse.Namespace) -> list[dict]:
    """Part 3: the engine's round for one request (the proposer's, native where it applies) against T(1)."""
    from vlmspec.drafters.dspark import DSparkProposer
    from vlmspec.loading import model_proposer
    from vlmspec.targets.profile import profile_draft_round

    proposers = {
        f"{kind} g{gamma}": DSparkProposer(build_drafter(target, kind, gamma, args.rank, args.draft_vocab))
        for gamma in [int(g) for g in args.gammas.split(",")]
        for kind in args.heads.split(",")
    }
    if args.drafter:
        proposers[args.drafter] = model_proposer(args.drafter, target)
    rows = []
    for name, proposer in proposers.items():
        native = proposer._native.available()
        timing = profile_draft_round(
            target, proposer, drafter=name, context_length=args.context, span=args.span, repeats=args.engine_repeats
        )
        rows.append(
            {
                "drafter": name,
                "native": native,
                "round_s": timing.round_s["model"],
                "step_s": timing.step_s,
                "draft_steps": timing.steps()["model"],
            }
        )
        log(f"{name:20s}: engine round {1e3 * timing.round_s['model']:6.2f} ms = {timing.steps()['model']:.3f} T(1)")
    return rows


def open_target_request(target, args: argparse.Namespace) -> RaggedBatch:
    """The runner with one row of ~``args.context`` prompt tokens and the default drafter's feature hooks."""
    prompt = " ".join(["the picture shows a small boat on a calm lake"] * max(args.context // 10, 1))
    layers = DSparkConfig.for_target(target).target_layer_ids
    batch = RaggedBatch(target, feature_layers=layers)
    batch.prefill([target.build_inputs(None, prompt).input_ids[0]])  # the runner's own prefill, as a host's
    return batch


@torch.inference_mode()
def time_target_forward(batch: RaggedBatch, n: int) -> float:
    """Seconds for one n-token target forward of the runner (features hooked) and the rollback that undoes it."""
    t0 = _tick()
    batch.verify(torch.full((1, n), 785, dtype=torch.long), torch.tensor([n]))
    batch.advance([0])
    return _tick() - t0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = prepare_out_dir(args.out)
    torch.manual_seed(args.seed)
    target = build_target(args)
    layers = DSparkConfig.for_target(target).target_layer_ids
    rows, target_times = measure(target, args)
    engine = engine_rounds(target, args)
    step_s = target_times["forward_s"][1]
    for row in rows:
        row["round_over_target_step"] = row["round_s"] / step_s if row["batch"] == 1 else None

    head_table = markdown_table(
        [
            "head",
            "gamma",
            "batch",
            "round ms",
            "head loop ms",
            "head share",
            "LM head share",
            "backbone ms",
            "append ms",
            "round / target step",
        ],
        [
            [
                r["head"],
                r["gamma"],
                r["batch"],
                1e3 * r["round_s"],
                1e3 * r["head_loop_s"],
                r["head_share"],
                r["lm_head_share"],
                1e3 * r["backbone_s"],
                1e3 * r["append_s"],
                r["round_over_target_step"],
            ]
            for r in rows
        ],
    )
    target_table = markdown_table(
        ["target forward", "ms", "x one step"],
        [[f"{n} token(s)", 1e3 * t, t / step_s] for n, t in target_times["forward_s"].items()],
    )
    engine_table = markdown_table(
        ["drafter", "native round", "round ms", "target step ms", "T_draft / T(1)"],
        [[r["drafter"], r["native"], 1e3 * r["round_s"], 1e3 * r["step_s"], r["draft_steps"]] for r in engine],
    )
    env = environment_info()
    header = (
        f"# DSpark drafter cost\n\nTarget {target.name} (vocabulary {target.vocab_size}), context "
        f"{target_times['context']} tokens, drafter rank {args.rank}, draft vocabulary "
        f"{args.draft_vocab or target.vocab_size}, {len(layers)} hooked layers {layers}, "
        f"temperature {args.temperature}, {args.threads} thread(s), median of {args.repeats} rounds. "
        f"Machine: {env['processor']}, {env['cpu_count']} CPUs, torch {env['torch']}.\n"
    )
    write_text(
        out / "drafter_cost.md",
        f"{header}\n## Drafting round\n\n{head_table}\n\n## Target\n\n{target_table}\n\n"
        f"## The engine's round (one request, alternated with the target's step)\n\n{engine_table}\n",
    )
    write_json(
        out / "drafter_cost.json",
        {
            "args": vars(args),
            "environment": env,
            "feature_layers": layers,
            "target": target_times,
            "rounds": rows,
            "engine_rounds": engine,
        },
    )
    for batch in sorted({r["batch"] for r in rows}):
        chosen = [r for r in rows if r["batch"] == batch]
        plot_stacked_bars(
            out / f"drafter_round_batch{batch}.png",
            [f"{r['head']} g{r['gamma']}" for r in chosen],
            {stage: [1e3 * r[f"{stage}_s"] for r in chosen] for stage in STAGES},
            title=f"DSpark drafting round by stage, batch {batch}",
            ylabel="ms",
        )
    print(header)
    print(head_table)
    print()
    print(target_table)
    print()
    print(engine_table)


if __name__ == "__main__":
    main()
