"""How much faster, and is it really lossless? Speculative decoding vs the target alone, on real workloads.

One command runs the same questions through

* ``target``    - the target alone, through vlmspec's own loop (``speculative=False``): the fair baseline;
* ``vlmspec``   - ``SpecEngine`` with the chosen drafter (prompt lookup or a DSpark checkpoint) and scheduler;
* ``hf-generate``, ``hf-prompt-lookup``, ``hf-assistant`` - transformers' own ``generate`` on the same
  model: plain, with ``prompt_lookup_num_tokens``, and with a small ``assistant_model``. These are
  what a user would pick instead; a configuration transformers refuses is reported, not skipped.

Variants run interleaved question by question (``run_order``: every pair runs in both orders), with identical settings and
seeds, so every ratio is measured within one run. Every timing is wall clock from (image, prompt)
to generated token ids, input processing included, for all variants alike.

Workloads: an MMBench TSV (``--mmbench``), prompt sets such as ``../shared/data/prompts/mt-bench.jsonl``
(``--prompt-set``, first turn of each held-out entry: ``vlmspec.data.heldout``), and image
questions on real images (``--vqa``: easy-vqa shapes with one-word answers, scikit-image
photographs with open, long answers; none of them a picture the drafter trained on).

Reported per question and in total: output identity with the target alone (greedy: must be
zero differences; each difference is printed with its question), tau, acceptance by draft
position, tokens per second and speedups, the time split (prefill / draft / verify / engine
overhead / input processing), and answer accuracy (MMBench: the extracted option letter).
Outputs in ``--out``: ``results.json`` (every number), ``results.md`` (tables) and PNG plots.
The exit status is 1 when a greedy run shows any difference from the target alone.

Example (a tiny random target; mechanics only, its speed says nothing)::

    python -m benchmarks.mmbench_spec --target tiny:qwen2_vl --mmbench tests/fixtures/mmbench_mini.tsv \\
        --prompt-set ../shared/data/prompts/mt-bench.jsonl --vqa --num-questions 4 --out runs/demo
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python benchmarks/x.py): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import log, prepare_out_dir
from benchmarks.spec.loop import Benchmark
from benchmarks.spec.peers import build_peers
from benchmarks.spec.report import build_report, render_summary, write_report
from benchmarks.spec.runs import Settings, load_engine
from benchmarks.spec.workloads import Task, easy_vqa_tasks, mmbench_tasks, prompt_set_tasks, skimage_open_tasks
from vlmspec.data.mmbench import RowProblem
from vlmspec.scheduling.factory import SCHEDULERS, describe_schedulers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mmbench_spec",
        description=__doc__.split("\n\n")[0] + " Runs the target alone, vlmspec and transformers' assisted "
        "generation on the same questions, interleaved, and writes results.json, results.md and PNG plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = parser.add_argument_group("models")
    model.add_argument(
        "--target",
        required=True,
        help="directory of a saved Qwen-VL model, or tiny:FAMILY (qwen2_vl, qwen2_5_vl, qwen3_vl) for a random tiny one",
    )
    model.add_argument(
        "--drafter", default="prompt-lookup", help="'prompt-lookup' or the directory of a saved DSpark drafter"
    )
    model.add_argument(
        "--scheduler",
        default="none",
        choices=SCHEDULERS,
        help=f"how many drafts to verify per round: {describe_schedulers()}",
    )
    model.add_argument(
        "--scheduler-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="option for the scheduler, e.g. threshold=0.6 (repeatable)",
    )
    model.add_argument("--max-draft-tokens", type=int, default=8, help="prompt lookup: tokens drafted per round")
    model.add_argument(
        "--max-ngram",
        type=int,
        default=3,
        help="prompt lookup: longest n-gram matched (also transformers' max_matching_ngram_size)",
    )
    model.add_argument("--min-ngram", type=int, default=1, help="prompt lookup: shortest n-gram matched")
    model.add_argument("--dtype", default="float32", help="target dtype (float32, bfloat16, float16)")
    model.add_argument("--attn-implementation", default="sdpa", help="sdpa, eager or flash_attention_2")
    model.add_argument("--device", default="cpu", help="torch device of the target")

    data = parser.add_argument_group("workloads (at least one)")
    data.add_argument("--mmbench", type=Path, help="an MMBench TSV (e.g. tests/fixtures/mmbench_mini.tsv)")
    data.add_argument(
        "--prompt-set",
        type=Path,
        action="append",
        default=[],
        help='a {"turns": [...]} JSONL prompt set, e.g. ../shared/data/prompts/gsm8k.jsonl (repeatable; first turns only)',
    )
    data.add_argument(
        "--vqa",
        action="store_true",
        help="add image questions on real images: easy-vqa shapes and open questions on scikit-image photographs",
    )
    data.add_argument("--num-questions", type=int, default=20, help="questions per workload")
    data.add_argument(
        "--image-max-side",
        type=int,
        default=448,
        help="shrink images whose longer side exceeds this (pixels); 0 keeps them as they are",
    )

    gen = parser.add_argument_group("generation (identical for every variant)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs must be identical)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0, help="question i uses seed + i in every variant")

    peers = parser.add_argument_group("transformers peers")
    peers.add_argument(
        "--peers", default="prompt-lookup,assistant", help="comma list of prompt-lookup, assistant; or none"
    )
    peers.add_argument(
        "--prompt-lookup-num-tokens",
        type=int,
        default=None,
        help="transformers' prompt_lookup_num_tokens (None: same as --max-draft-tokens)",
    )
    peers.add_argument(
        "--assistant",
        default="auto",
        help="assistant model for generate(assistant_model=...): a directory, 'tiny' (random tiny model of the target's family), 'none', or 'auto' (tiny for tiny targets, none otherwise)",
    )

    run = parser.add_argument_group("run")
    run.add_argument(
        "--out", type=Path, required=True, help="output directory for results.json, results.md and the plots"
    )
    run.add_argument("--warmup", type=int, default=1, help="untimed runs of every variant before measuring")
    run.add_argument(
        "--repeats", type=int, default=1, help="timed runs of every variant per question; the fastest is reported"
    )
    run.add_argument("--threads", type=int, default=None, help="torch CPU threads (None: torch's choice)")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def validate_args(args: argparse.Namespace) -> Settings:
    """Check the arguments that argparse cannot; returns the generation settings."""
    if not (args.mmbench or args.prompt_set or args.vqa):
        raise ValueError("no workload chosen: pass --mmbench FILE.tsv, --prompt-set FILE.jsonl and/or --vqa")
    for name in ("num_questions", "max_new_tokens", "max_draft_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.image_max_side < 0:
        raise ValueError("--warmup and --image-max-side must be >= 0")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    return Settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)


def collect_tasks(args: argparse.Namespace) -> tuple[list[Task], list[RowProblem]]:
    """All workloads' tasks in a fixed order, plus MMBench rows that were skipped."""
    max_side = args.image_max_side or None
    tasks: list[Task] = []
    problems: list[RowProblem] = []
    if args.mmbench:
        mm, problems = mmbench_tasks(args.mmbench, args.num_questions, max_side)
        tasks += mm
        for p in problems:
            log(f"skipped MMBench row index {p.index} (line {p.line}): {p.message}")
    for path in args.prompt_set:
        tasks += prompt_set_tasks(path, args.num_questions)
    if args.vqa:
        tasks += easy_vqa_tasks(args.num_questions) + skimage_open_tasks(args.num_questions, max_side)
    if not tasks:
        raise ValueError("the chosen workloads hold no usable questions; see the skipped rows above")
    return tasks, problems


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (1 when a greedy run differs from the target alone)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:  # problems with what the user passed end here, with the message and the usage
        settings = validate_args(args)
        out = prepare_out_dir(args.out)
        tasks, problems = collect_tasks(args)
        engine = load_engine(args)
        peers = build_peers(engine, args)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    bench = Benchmark(engine, settings, peers, repeats=args.repeats, show_progress=not args.no_progress)
    bench.warm_up(tasks[0], args.warmup)
    results = bench.run(tasks)
    report = build_report(args, settings, bench, problems)
    paths = write_report(report, results, peers, out)
    print(render_summary(report, peers))
    print("\n".join(f"wrote {p}" for p in paths))
    return 1 if settings.greedy and report["verdict"]["differences"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
