"""What the subcommands share: the --target/--drafter help, the option groups, and the engine they describe.

``vlmspec generate``, ``demo`` and ``serve`` build their engine here (:func:`build_engine`), with the
scheduler defaults measured for the reference pair (:func:`reference_defaults`); ``profile`` takes
the target options alone.
"""

from __future__ import annotations

import argparse
import math

from vlmspec.scheduling.factory import SCHEDULERS, describe_schedulers
from vlmspec.targets.adapter import DECODE_MODES
from vlmspec.types import RequestOptions

# What --target and --drafter take, named the same in every command's --help (vlmspec.loading knows them).
TARGET_HELP = (
    "'reference' (the bundled real-weights target: SmolLM2-135M in a Qwen2-VL), a Qwen-VL model directory "
    "(with config.json), or tiny:FAMILY for a random tiny model (qwen2_vl, qwen2_5_vl, qwen3_vl)"
)
DRAFTER_HELP = (
    "'reference' (the bundled pair's default: n-gram copies and its DSpark drafter under the drafting policy), "
    "'reference-dspark' (that DSpark drafter alone, drafting where it pays), 'reference-dflash' (a bundled DFlash drafter), "
    "'prompt-lookup' (n-gram copies from the prompt), 'none' (the target alone) or a DSpark drafter directory"
)


def integer(low: int | None = None, high: int | None = None):
    """An argparse ``type``: an integer in [low, high]; anything else exits 2 with the range it must lie in."""
    wanted = _range("an integer", low, high)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def number(low: float | None = None, high: float | None = None, *, above: bool = False):
    """An argparse ``type``: a finite number in [low, high] (``above``: low itself excluded); else exits 2."""
    wanted = _range("a finite number", low, high, above)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        below = low is not None and (value <= low if above else value < low)
        if not math.isfinite(value) or below or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def _range(kind: str, low, high, above: bool = False) -> str:
    if low is not None and high is not None:
        return f"{kind} in {'(' if above else '['}{low}, {high}]"
    if low is not None:
        return f"{kind} {'>' if above else '>='} {low}"
    return kind if high is None else f"{kind} <= {high}"


def target_options(p: argparse.ArgumentParser, drafter: bool = True) -> None:
    p.add_argument("--target", required=True, help=TARGET_HELP)
    if drafter:
        p.add_argument("--drafter", default="prompt-lookup", help=f"{DRAFTER_HELP} (default: prompt-lookup)")
        drafter_dtype_option(p)
        scheduler_options(p)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--attn-implementation", default="sdpa", choices=("sdpa", "eager", "flash_attention_2"))
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--decode",
        default="fast",
        choices=DECODE_MODES,
        help="decode/verify forward: 'fast' (vlmspec's packed decoder and CPU kernel) or 'reference' (transformers' own forward)",
    )


def drafter_dtype_option(p: argparse.ArgumentParser) -> None:
    """--drafter-dtype: what a DSpark drafter drafts in (vlmspec.loading.drafting_dtype picks when absent)."""
    p.add_argument(
        "--drafter-dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="the dtype a DSpark drafter drafts in (default: bfloat16 beside a float32 target on a CPU with "
        "AVX512-BF16, where a round takes about half the time; else the target's dtype)",
    )


def scheduler_options(p: argparse.ArgumentParser) -> None:
    """--scheduler by its factory name (vlmspec.scheduling.build_scheduler), and the options the schedulers take."""
    p.add_argument(
        "--scheduler",
        default="none",
        choices=SCHEDULERS,
        help=f"how many drafts to verify per round: {describe_schedulers()}",
    )
    p.add_argument(
        "--threshold", type=number(0, 1), default=0.5, help="confidence threshold in [0, 1] (threshold scheduler)"
    )
    p.add_argument("--sps", default=None, help="SPS table JSON or preset (sps, prefix, lagged-topk schedulers)")
    p.add_argument(
        "--calibration",
        default=None,
        help="a drafter directory or calibration.json: the scheduler sees calibrated confidences "
        "(with a reference drafter, its own calibration is the default)",
    )


def generation_options(p: argparse.ArgumentParser) -> None:
    """The request options (vlmspec.types.RequestOptions): one not given keeps RequestOptions' default."""
    default = RequestOptions()
    unset = argparse.SUPPRESS  # absent from args unless given, so the defaults live in RequestOptions only
    p.add_argument("--max-new-tokens", type=integer(1), default=unset, help=f"default {default.max_new_tokens}")
    p.add_argument("--temperature", type=number(0), default=unset, help=f"0 = greedy (default {default.temperature})")
    p.add_argument("--top-k", type=integer(1), default=unset, help="keep the k likeliest tokens (default: all)")
    p.add_argument(
        "--top-p", type=number(0, 1, above=True), default=unset, help="nucleus sampling mass in (0, 1] (default: all)"
    )
    p.add_argument(
        "--seed", type=integer(-(2**63), 2**64 - 1), default=unset, help=f"seeds sampling (default {default.seed})"
    )
    p.add_argument("--stop", action="append", default=unset, help="stop string (repeatable)")


def request_options(args) -> RequestOptions:
    """The request options given on the command line, the others at their defaults."""
    given = {name: getattr(args, name) for name in RequestOptions.names() if hasattr(args, name)}
    return RequestOptions.build(**given)


def build_engine(args, engine_class=None, **options):
    """The engine the target options describe: a SpecEngine, or ``engine_class`` (BatchEngine) with ``options``.

    The target loads first, so the scheduler's cost curve can be the one of this machine
    (:func:`reference_defaults`).
    """
    from vlmspec.engine import SpecEngine
    from vlmspec.loading import load_proposer, load_target
    from vlmspec.scheduling.factory import build_scheduler

    target = load_target(
        args.target,
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
        device=args.device,
        decode=args.decode,
    )
    scheduler = build_scheduler(args.scheduler, threshold=args.threshold, **reference_defaults(args, target))
    proposer = load_proposer(None if args.drafter == "none" else args.drafter, target, drafter_dtype=args.drafter_dtype)
    return (engine_class or SpecEngine)(target, proposer, scheduler, **options)


def reference_defaults(args, target=None) -> dict:
    """The SPS table and calibration for the scheduler: the ones measured for the reference pair, unless given.

    The reference pair's table is its curve on this machine when ``target`` (the loaded reference target) is
    given (:func:`vlmspec.reference.machine_sps_table`: the shipped one if it was measured on this CPU and a
    spot check agrees, else measured now), else the shipped one.

    With another target and no ``--sps``, a hardware-aware scheduler is refused with the command that measures one.
    A scheduler that reads confidences sees them calibrated: ``--calibration``, or a reference drafter's own.
    """
    from vlmspec.reference import REFERENCE_DRAFTERS, machine_sps_table, reference_drafter_dir, reference_sps_table

    needs_table = args.scheduler in ("sps", "prefix", "lagged-topk")
    if needs_table and args.sps is None and args.target != "reference":
        raise ValueError(
            f"--scheduler {args.scheduler} needs the target's cost curve: measure it with `vlmspec profile "
            f"--target {args.target} --out sps.json` and add --sps sps.json (or use --scheduler threshold or none)"
        )
    options = {"sps": args.sps}
    if needs_table and args.sps is None:  # the reference target (checked above)
        options["sps"] = machine_sps_table(target) if target is not None else reference_sps_table(args.dtype)
    if args.calibration is not None:
        options["calibration"] = args.calibration
    elif args.scheduler != "none" and args.drafter in REFERENCE_DRAFTERS:
        options["calibration"] = reference_drafter_dir(args.drafter)
    return options
