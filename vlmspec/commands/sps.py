"""The target's SPS curve: ``vlmspec profile`` measures it, ``vlmspec simulate`` writes the scheduler simulator over it."""

from __future__ import annotations

from vlmspec.commands.options import drafter_dtype_option, integer, target_options
from vlmspec.scheduling.profiling import PRESETS


# ----------------------------------------------------------------------------------- profile
def add_profile(commands) -> None:
    p = commands.add_parser("profile", help="measure the target's SPS curve for the hardware-aware schedulers")
    target_options(p, drafter=False)
    p.add_argument("--out", required=True, help="where to write the table (JSON); a PNG plot is written beside it")
    p.add_argument(
        "--max-tokens", type=integer(1), default=16, help="largest number of tokens in one forward (one request)"
    )
    p.add_argument(
        "--requests",
        default=None,
        help="comma-separated numbers of concurrent requests, e.g. 1,4,16,32: time the batched (ragged) "
        "verification forward of each, for BatchEngine's schedulers",
    )
    p.add_argument("--gamma", type=integer(1), default=7, help="drafts per request at most (with --requests)")
    p.add_argument(
        "--drafter",
        default=None,
        help="also time this drafter's round (a reference drafter name or a DSpark drafter directory) beside the "
        "target's one-token step; the table carries it for the drafting policy (one request, without --requests)",
    )
    drafter_dtype_option(p)
    p.add_argument("--context-length", type=integer(1), default=256, help="tokens already in the cache while timing")
    p.add_argument("--warmup", type=integer(0), default=3)
    p.add_argument("--repeats", type=integer(1), default=10)
    p.set_defaults(run=_run_profile)


def _run_profile(args) -> int:
    from pathlib import Path

    from vlmspec.loading import load_target
    from vlmspec.scheduling.profiling import plot_sps
    from vlmspec.targets.profile import profile_target, profile_target_batched

    if args.requests and args.drafter:
        raise ValueError("--drafter times one request's round: profile it without --requests")
    target = load_target(
        args.target,
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
        device=args.device,
        decode=args.decode,
    )
    if args.requests:
        requests = _int_list(args.requests, "--requests")
        table = profile_target_batched(
            target,
            requests=requests,
            gamma=args.gamma,
            context_length=args.context_length,
            warmup=args.warmup,
            repeats=args.repeats,
        )
        curves, labels = list(table.curves), [f"{r} requests" for r in table.requests]
    else:
        table = profile_target(
            target,
            max_tokens=args.max_tokens,
            context_length=args.context_length,
            warmup=args.warmup,
            repeats=args.repeats,
        )
        if args.drafter:
            from vlmspec.loading import model_proposer
            from vlmspec.targets.profile import profile_draft_round

            table = table.with_drafting(
                profile_draft_round(
                    target,
                    model_proposer(args.drafter, target, dtype=args.drafter_dtype),
                    drafter=args.drafter,
                    context_length=args.context_length,
                    warmup=args.warmup,
                    repeats=max(args.repeats, 15),
                )
            )
        curves, labels = [table], [table.meta.model]
    path = table.save(args.out)
    if getattr(table, "drafting", None) is not None:
        timing = table.drafting
        for source, steps in timing.steps().items():
            print(
                f"{timing.drafter} ({source}): {1e3 * timing.round_s[source]:.2f} ms a round = {steps:.3f} target steps"
            )
    for curve, label in zip(curves, labels):
        if len(curves) > 1:
            print(label)
        for tokens, sps in zip(curve.tokens, curve.steps_per_s):
            print(f"{tokens:4d} tokens: {sps:8.2f} steps/s")
    try:
        print(f"wrote {path} and {plot_sps(curves, Path(path).with_suffix('.png'), labels=labels)}")
    except ImportError:
        print(f"wrote {path} (install matplotlib for the plot)")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes positive integers separated by commas, e.g. 1,4,16,32; got {text!r}")
    return values


# ---------------------------------------------------------------------------------- simulate
def add_simulate(commands) -> None:
    p = commands.add_parser(
        "simulate",
        help="write the interactive scheduler simulator page (self-contained HTML)",
        description="Write the scheduler simulator for an SPS table: a preset, or one measured with `vlmspec "
        "profile --target reference --out sps.json` (the bundled real-weights target; any --target works).",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--sps", help="an SPS table written by `vlmspec profile`")
    source.add_argument("--preset", choices=PRESETS, help=f"a named SPS curve: {', '.join(PRESETS)} (default: cpu)")
    p.add_argument("--gamma", type=integer(1, 16), default=None, help="draft positions to show (up to 16)")
    p.add_argument("--out", default="scheduler-simulator.html")
    p.add_argument("--open", action="store_true", help="open the page in a browser")
    p.set_defaults(run=_run_simulate)


def _run_simulate(args) -> int:
    from vlmspec.simulate import load_table_for_simulator, write_simulator

    preset = args.preset if (args.preset or args.sps) else "cpu"
    table = load_table_for_simulator(args.sps, preset)
    print(f"wrote {write_simulator(args.out, table, gamma=args.gamma, open_browser=args.open)}")
    return 0
