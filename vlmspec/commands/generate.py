"""``vlmspec generate`` (one prompt through the speculative engine) and ``vlmspec demo`` (the README's main job)."""

from __future__ import annotations

import sys

from vlmspec.commands.options import (
    DRAFTER_HELP,
    TARGET_HELP,
    build_engine,
    drafter_dtype_option,
    generation_options,
    integer,
    reference_defaults,
    request_options,
    scheduler_options,
    target_options,
)
from vlmspec.demo import DEMO_PROMPT, DEMO_TEXT_PROMPT, format_stats, open_image


# ---------------------------------------------------------------------------------- generate
def add_generate(commands) -> None:
    p = commands.add_parser("generate", help="answer a prompt (with images) through the speculative engine")
    target_options(p)
    p.add_argument("--image", action="append", default=[], help="image file (repeatable; omit for text only)")
    p.add_argument("--prompt", required=True, help="the question or instruction")
    generation_options(p)
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the target alone and print the speedup; exits 1 if a greedy answer differs from it",
    )
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    p.set_defaults(run=_run_generate)


def _run_generate(args) -> int:
    options = request_options(args)  # before loading anything: a bad option fails at once
    engine = build_engine(args)
    images = args.image or None
    if args.stream:
        stream = engine.stream(images, args.prompt, options=options)
        for piece in stream:
            print(piece, end="", flush=True)
        print()
        result = stream.result
    else:
        result = engine.generate(images, args.prompt, options=options)
        print(result.text)
    baseline = engine.generate(images, args.prompt, options=options, speculative=False) if args.compare else None
    print(format_stats(result, baseline), file=sys.stderr)
    if baseline is not None and options.greedy and baseline.token_ids != result.token_ids:
        # Greedy speculation promises the target's own tokens: a difference is a failure, not a footnote.
        first = next(
            (i for i, (a, b) in enumerate(zip(baseline.token_ids, result.token_ids)) if a != b),
            min(len(baseline.token_ids), len(result.token_ids)),
        )
        print(
            f"error: the greedy output differs from the target alone's at token {first} "
            f"({len(result.token_ids)} tokens against {len(baseline.token_ids)}), so there is no speedup to "
            "compare. In bfloat16 this is usually a numerical tie between two tokens; --dtype float32 "
            "checks it. Otherwise please report it with this command line.",
            file=sys.stderr,
        )
        return 1
    return 0


# -------------------------------------------------------------------------------------- demo
def add_demo(commands) -> None:
    p = commands.add_parser(
        "demo", help="the README's main job: an image question and a text question, speculative vs target alone"
    )
    p.add_argument("--target", default="reference", help=TARGET_HELP)
    p.add_argument("--drafter", default="reference", help=DRAFTER_HELP)
    drafter_dtype_option(p)
    scheduler_options(p)
    # The reference pair verifies a draft only when it pays on this CPU (an 8-token forward costs ~2 steps).
    p.set_defaults(scheduler=None)  # sps on the reference target (its curve ships), else none: see _run_demo
    p.add_argument("--image", default=None, help="an image file (default: a held-out easy-vqa test image)")
    p.add_argument("--prompt", default=DEMO_PROMPT, help="the first question about the image")
    p.add_argument(
        "--text-prompt",
        default=DEMO_TEXT_PROMPT,
        help="a second, text-only request with a longer answer ('' to skip it)",
    )
    p.add_argument("--max-new-tokens", type=integer(1), default=128)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="float32 is exact on every CPU; bfloat16 is faster but not bit-exact (see the README)",
    )
    p.add_argument(
        "--repeats", type=integer(1), default=3, help="timed runs of each; the fastest counts (a shared CPU is noisy)"
    )
    p.add_argument(
        "--out", default=None, help="a JSON file for the printed figures, with the run's command, commit, date and CPU"
    )
    p.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    from vlmspec.demo import DEMO_IMAGE_ID, demo_image, run_demo
    from vlmspec.engine import SpecEngine
    from vlmspec.loading import load_proposer, load_target
    from vlmspec.scheduling.factory import build_scheduler

    image = open_image(args.image) if args.image else demo_image()
    if args.scheduler is None:  # the shipped SPS curves are the reference target's; another target verifies all
        args.scheduler = "sps" if args.target == "reference" or args.sps is not None else "none"
    target = load_target(args.target, dtype=args.dtype)
    scheduler = build_scheduler(args.scheduler, threshold=args.threshold, **reference_defaults(args, target))
    engine = SpecEngine(target, load_proposer(args.drafter, target, drafter_dtype=args.drafter_dtype), scheduler)
    print(f"target: {args.target}   drafter: {args.drafter}   scheduler: {args.scheduler}   dtype: {args.dtype}\n")
    requests = [(image, args.prompt)] + ([(None, args.text_prompt)] if args.text_prompt else [])
    settings = {name: getattr(args, name) for name in ("target", "drafter", "scheduler", "dtype", "max_new_tokens")}
    return run_demo(
        engine,
        requests,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        out=args.out,
        settings={**settings, "repeats": args.repeats, "image": args.image or f"easy-vqa test image {DEMO_IMAGE_ID}"},
    )
