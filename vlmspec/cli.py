"""The ``vlmspec`` command: generate, demo, serve, profile, simulate.

Every subcommand is a thin layer over the library; ``vlmspec COMMAND --help`` lists its options.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vlmspec.demo import DEMO_PROMPT, DEMO_TEXT_PROMPT, format_stats, open_image
from vlmspec.scheduling.factory import SCHEDULERS, describe_schedulers
from vlmspec.scheduling.profiling import PRESETS
from vlmspec.targets.adapter import DECODE_MODES
from vlmspec.targets.inputs import ImageLimits
from vlmspec.types import RequestOptions

# What --target and --drafter take, named the same in every command's --help (vlmspec.loading knows them).
TARGET_HELP = (
    "'reference' (the bundled real-weights target: SmolLM2-135M in a Qwen2-VL), a Qwen-VL model directory "
    "(with config.json), or tiny:FAMILY for a random tiny model (qwen2_vl, qwen2_5_vl, qwen3_vl)"
)
DRAFTER_HELP = (
    "'reference' (the bundled pair's default: n-gram copies and its DSpark drafter under the drafting policy), "
    "'reference-dspark' (that DSpark drafter alone), 'reference-dflash' (a bundled DFlash drafter), "
    "'prompt-lookup' (n-gram copies from the prompt), 'none' (the target alone) or a DSpark drafter directory"
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"vlmspec {args.command}: error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlmspec",
        description="Lossless speculative decoding for Qwen-VL models.",
        epilog=f"--target: {TARGET_HELP}. --drafter: {DRAFTER_HELP}. Try: vlmspec demo",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands)
    _add_demo(commands)
    _add_serve(commands)
    _add_profile(commands)
    _add_simulate(commands)
    _add_export(commands)
    return parser


# ---------------------------------------------------------------------------------- generate
def _add_generate(commands) -> None:
    p = commands.add_parser("generate", help="answer a prompt (with images) through the speculative engine")
    _target_options(p)
    p.add_argument("--image", action="append", default=[], help="image file (repeatable; omit for text only)")
    p.add_argument("--prompt", required=True, help="the question or instruction")
    _generation_options(p)
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the target alone and print the speedup; exits 1 if a greedy answer differs from it",
    )
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    p.set_defaults(run=_run_generate)


def _run_generate(args) -> int:
    options = _request_options(args)  # before loading anything: a bad option fails at once
    engine = _engine(args)
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
def _add_demo(commands) -> None:
    p = commands.add_parser(
        "demo", help="the README's main job: an image question and a text question, speculative vs target alone"
    )
    p.add_argument("--target", default="reference", help=TARGET_HELP)
    p.add_argument("--drafter", default="reference", help=DRAFTER_HELP)
    _scheduler_options(p)
    # The reference pair verifies a draft only when it pays on this CPU (an 8-token forward costs ~2 steps).
    p.set_defaults(scheduler=None)  # sps on the reference target (its curve ships), else none: see _run_demo
    p.add_argument("--image", default=None, help="an image file (default: a held-out easy-vqa test image)")
    p.add_argument("--prompt", default=DEMO_PROMPT, help="the first question about the image")
    p.add_argument(
        "--text-prompt",
        default=DEMO_TEXT_PROMPT,
        help="a second, text-only request with a longer answer ('' to skip it)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="float32 is exact on every CPU; bfloat16 is faster but not bit-exact (see the README)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each; the fastest counts (a shared CPU is noisy)"
    )
    p.add_argument(
        "--out", default=None, help="a JSON file for the printed figures, with the run's command, commit, date and CPU"
    )
    p.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    from vlmspec.demo import DEMO_IMAGE_ID, demo_image, run_demo
    from vlmspec.engine import SpecEngine
    from vlmspec.scheduling.factory import build_scheduler

    image = open_image(args.image) if args.image else demo_image()
    if args.scheduler is None:  # the shipped SPS curves are the reference target's; another target verifies all
        args.scheduler = "sps" if args.target == "reference" or args.sps is not None else "none"
    scheduler = build_scheduler(args.scheduler, threshold=args.threshold, **_reference_defaults(args))
    engine = SpecEngine.from_pretrained(args.target, drafter=args.drafter, scheduler=scheduler, dtype=args.dtype)
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


def _reference_defaults(args) -> dict:
    """The SPS table and calibration for the scheduler: the ones measured for the reference pair, unless given.

    With another target and no ``--sps``, a hardware-aware scheduler is refused with the command that measures one.
    A scheduler that reads confidences sees them calibrated: ``--calibration``, or a reference drafter's own.
    """
    from vlmspec.reference import REFERENCE_DRAFTERS, reference_drafter_dir, reference_sps_table

    needs_table = args.scheduler in ("sps", "prefix", "lagged-topk")
    if needs_table and args.sps is None and args.target != "reference":
        raise ValueError(
            f"--scheduler {args.scheduler} needs the target's cost curve: measure it with `vlmspec profile "
            f"--target {args.target} --out sps.json` and add --sps sps.json (or use --scheduler threshold or none)"
        )
    options = {"sps": args.sps or (reference_sps_table(args.dtype) if needs_table else None)}
    if args.calibration is not None:
        options["calibration"] = args.calibration
    elif args.scheduler != "none" and args.drafter in REFERENCE_DRAFTERS:
        options["calibration"] = reference_drafter_dir(args.drafter)
    return options


# ------------------------------------------------------------------------------------- serve
def _add_serve(commands) -> None:
    p = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat completions) over the batched engine",
        description="Serve /v1/chat/completions, /v1/models, /health and /metrics. Without --scheduler: for the "
        "reference pair, sps with its measured cost curve and calibration, drafting while one request runs; for "
        "another DSpark drafter, threshold; for prompt lookup, none (verify every draft).",
    )
    _target_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the --target name)")
    p.add_argument(
        "--max-batch-size", type=int, default=32, help="requests decoded at once (rows of the batched forward)"
    )
    p.add_argument(
        "--max-queued", type=int, default=64, help="requests waiting for a row beyond those; more get HTTP 429"
    )
    p.add_argument(
        "--speculate-up-to",
        type=int,
        default=None,
        help="draft only while at most this many requests run; above, verify the anchors alone (default: always "
        "draft). On a CPU, where a big batch is compute-bound, 1-2 keeps serving at the target alone's speed",
    )
    p.add_argument("--default-max-tokens", type=int, default=256, help="when a request sets no max_tokens")
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a folder whose image files requests may name by path (default: only base64 data: URLs)",
    )
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=ImageLimits.max_bytes,
        help=f"largest encoded image a request may send, checked before decoding; more get HTTP 400 "
        f"(default {ImageLimits.max_bytes:,}: 20 MiB)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=ImageLimits.max_pixels,
        help=f"most pixels (width x height) an image may have, read from its header before decoding; more get "
        f"HTTP 400 (default {ImageLimits.max_pixels:,}; Qwen-VL processors scale images down to 12.8-16.8 MP)",
    )
    # Verifying every draft is the slowest choice for a drafter with a confidence head (see the README).
    p.set_defaults(run=_run_serve, scheduler=None)


def _run_serve(args) -> int:
    from pathlib import Path

    from vlmspec.server import ServerConfig, serve
    from vlmspec.serving import BatchEngine

    media = Path(args.allowed_local_media_path) if args.allowed_local_media_path else None
    if media is not None and not media.is_dir():
        raise FileNotFoundError(f"--allowed-local-media-path {str(media)!r} is not a folder")
    if args.max_queued < 0:
        raise ValueError(f"--max-queued must be >= 0, got {args.max_queued}")
    for flag, value in (("--max-image-bytes", args.max_image_bytes), ("--max-image-pixels", args.max_image_pixels)):
        if value <= 0:
            raise ValueError(f"{flag} must be a positive number, got {value}")
    image_limits = ImageLimits(max_bytes=args.max_image_bytes, max_pixels=args.max_image_pixels)
    _serving_defaults(args)
    engine = _engine(args, BatchEngine, max_batch_size=args.max_batch_size, speculate_up_to=args.speculate_up_to)
    name = args.served_model_name or Path(str(args.target)).name
    cap = "always" if args.speculate_up_to is None else f"up to {args.speculate_up_to} running"
    config = ServerConfig(
        model_name=name,
        max_queued=args.max_queued,
        default_max_tokens=args.default_max_tokens,
        allowed_media=media,
        image_limits=image_limits,
    )
    print(
        f"serving {name!r} (drafter {args.drafter}, scheduler {args.scheduler}, drafting {cap}) "
        f"on http://{args.host}:{args.port}/v1"
    )
    serve(engine, config, host=args.host, port=args.port)
    return 0


def _serving_defaults(args) -> None:
    """The scheduler, and when to draft, that ``vlmspec serve`` picks when the flags leave them open.

    The reference pair: SPS argmax with its measured single-request cost curve, drafting only while one
    request runs (the curve describes one request; a batch needs ``--sps`` from ``vlmspec profile
    --requests``). Another DSpark drafter: the threshold scheduler. Prompt lookup has no confidences:
    every draft is verified.
    """
    from vlmspec.reference import REFERENCE_DRAFTERS

    if args.scheduler is None:
        if args.target == "reference" and args.drafter in REFERENCE_DRAFTERS and args.sps is None:
            args.scheduler = "sps"
            args.speculate_up_to = args.speculate_up_to or 1
        else:
            args.scheduler = "none" if args.drafter in ("none", "prompt-lookup") else "threshold"


# ----------------------------------------------------------------------------------- profile
def _add_profile(commands) -> None:
    p = commands.add_parser("profile", help="measure the target's SPS curve for the hardware-aware schedulers")
    _target_options(p, drafter=False)
    p.add_argument("--out", required=True, help="where to write the table (JSON); a PNG plot is written beside it")
    p.add_argument("--max-tokens", type=int, default=16, help="largest number of tokens in one forward (one request)")
    p.add_argument(
        "--requests",
        default=None,
        help="comma-separated numbers of concurrent requests, e.g. 1,4,16,32: time the batched (ragged) "
        "verification forward of each, for BatchEngine's schedulers",
    )
    p.add_argument("--gamma", type=int, default=7, help="drafts per request at most (with --requests)")
    p.add_argument("--context-length", type=int, default=256, help="tokens already in the cache while timing")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.set_defaults(run=_run_profile)


def _run_profile(args) -> int:
    from pathlib import Path

    from vlmspec.loading import load_target
    from vlmspec.scheduling.profiling import plot_sps
    from vlmspec.targets.profile import profile_target, profile_target_batched

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
        curves, labels = [table], [table.meta.model]
    path = table.save(args.out)
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
def _add_simulate(commands) -> None:
    p = commands.add_parser(
        "simulate",
        help="write the interactive scheduler simulator page (self-contained HTML)",
        description="Write the scheduler simulator for an SPS table: a preset, or one measured with `vlmspec "
        "profile --target reference --out sps.json` (the bundled real-weights target; any --target works).",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--sps", help="an SPS table written by `vlmspec profile`")
    source.add_argument("--preset", choices=PRESETS, help=f"a named SPS curve: {', '.join(PRESETS)} (default: cpu)")
    p.add_argument("--gamma", type=int, default=None, help="draft positions to show (up to 16)")
    p.add_argument("--out", default="scheduler-simulator.html")
    p.add_argument("--open", action="store_true", help="open the page in a browser")
    p.set_defaults(run=_run_simulate)


def _run_simulate(args) -> int:
    from vlmspec.simulate import load_table_for_simulator, write_simulator

    preset = args.preset if (args.preset or args.sps) else "cpu"
    table = load_table_for_simulator(args.sps, preset)
    print(f"wrote {write_simulator(args.out, table, gamma=args.gamma, open_browser=args.open)}")
    return 0


# ------------------------------------------------------------------------------------ export
def _add_export(commands) -> None:
    p = commands.add_parser(
        "export", help="write a DSpark drafter in a serving engine's checkpoint layout, or as GGUF for llama.cpp"
    )
    p.add_argument(
        "drafter",
        help="'reference' or 'reference-dspark' (the bundled DSpark drafter), 'reference-dflash' (the bundled "
        "DFlash drafter) or a saved DSpark drafter directory",
    )
    p.add_argument(
        "out",
        help="directory to write (config.json, model.safetensors, vlmspec.json; gguf: target-*.gguf, drafter-*.gguf)",
    )
    p.add_argument(
        "--format",
        required=True,
        choices=("deepspec", "speculators", "dflash", "gguf"),
        help="deepspec (vLLM/SGLang DSpark), speculators (vLLM's training library), dflash (z-lab), or gguf: the "
        "target's language model and the drafter for llama-server --spec-type draft-dspark (docs/llama-cpp.md)",
    )
    p.add_argument(
        "--target",
        default=None,
        help="the target, needed for the LM head rows of a reduced draft vocabulary ('reference' by default for "
        f"the reference drafters): {TARGET_HELP}",
    )
    p.add_argument(
        "--verifier", default=None, help="the target's path or hub id, recorded where the format has a field"
    )
    p.add_argument(
        "--allow-inexact",
        action="store_true",
        help="write even where the format's model computes something else (listed as NOT EXACT)",
    )
    p.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="the row a learned MASK vector is exported as (mask_embedding.pt); default: the last vocabulary row",
    )
    p.add_argument(
        "--llama-cpp",
        default=None,
        help="gguf: a llama.cpp checkout (convert_hf_to_gguf.py, build/bin); default $LLAMA_CPP_DIR",
    )
    p.add_argument("--outtype", default="f32", help="gguf: the converter's --outtype (f32, bf16, f16, q8_0)")
    p.set_defaults(run=_run_export)


def _run_export(args) -> int:
    from vlmspec.drafters.export import export_drafter
    from vlmspec.reference import REFERENCE_DRAFTERS, reference_drafter_dir

    is_reference = args.drafter in REFERENCE_DRAFTERS
    source = reference_drafter_dir(args.drafter) if is_reference else args.drafter
    target_spec = args.target or ("reference" if is_reference else None)
    if args.format == "gguf":
        return _run_export_gguf(args, source, target_spec)
    options = dict(strict=not args.allow_inexact, verifier=args.verifier, mask_token_id=args.mask_token_id)
    try:  # the target is loaded only when the export needs it (a reduced draft vocabulary's LM head rows)
        report = export_drafter(source, args.out, args.format, **options)
    except ValueError as err:
        if target_spec is None or "target=" not in str(err):
            raise
        from vlmspec.loading import load_target

        report = export_drafter(source, args.out, args.format, target=load_target(target_spec), **options)
    print(report.summary())
    return 0


def _run_export_gguf(args, source, target_spec: str | None) -> int:
    """The target's language model and the drafter as GGUF files, converted by the user's llama.cpp."""
    from vlmspec.llama_cpp import LlamaCpp, export_gguf
    from vlmspec.loading import load_target

    if target_spec is None:
        raise ValueError("--format gguf writes the target's language model too: pass --target (the drafter's target)")
    llama_cpp = LlamaCpp.locate(args.llama_cpp)
    target = load_target(target_spec, dtype="float32")
    exported = export_gguf(
        source, args.out, target=target, llama_cpp=llama_cpp, outtype=args.outtype, mask_token_id=args.mask_token_id
    )
    print(exported.summary())
    return 0


# ----------------------------------------------------------------------------------- helpers
def _target_options(p: argparse.ArgumentParser, drafter: bool = True) -> None:
    p.add_argument("--target", required=True, help=TARGET_HELP)
    if drafter:
        p.add_argument("--drafter", default="prompt-lookup", help=f"{DRAFTER_HELP} (default: prompt-lookup)")
        _scheduler_options(p)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--attn-implementation", default="sdpa", choices=("sdpa", "eager", "flash_attention_2"))
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--decode",
        default="fast",
        choices=DECODE_MODES,
        help="decode/verify forward: 'fast' (vlmspec's packed decoder and CPU kernel) or 'reference' (transformers' own forward)",
    )


def _scheduler_options(p: argparse.ArgumentParser) -> None:
    """--scheduler by its factory name (vlmspec.scheduling.build_scheduler), and the options the schedulers take."""
    p.add_argument(
        "--scheduler",
        default="none",
        choices=SCHEDULERS,
        help=f"how many drafts to verify per round: {describe_schedulers()}",
    )
    p.add_argument("--threshold", type=float, default=0.5, help="confidence threshold (threshold scheduler)")
    p.add_argument("--sps", default=None, help="SPS table JSON or preset (sps, prefix, lagged-topk schedulers)")
    p.add_argument(
        "--calibration",
        default=None,
        help="a drafter directory or calibration.json: the scheduler sees calibrated confidences "
        "(with a reference drafter, its own calibration is the default)",
    )


def _generation_options(p: argparse.ArgumentParser) -> None:
    """The request options (vlmspec.types.RequestOptions): one not given keeps RequestOptions' default."""
    default = RequestOptions()
    unset = argparse.SUPPRESS  # absent from args unless given, so the defaults live in RequestOptions only
    p.add_argument("--max-new-tokens", type=int, default=unset, help=f"default {default.max_new_tokens}")
    p.add_argument("--temperature", type=float, default=unset, help=f"0 = greedy (default {default.temperature})")
    p.add_argument("--top-k", type=int, default=unset, help="keep the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float, default=unset, help="nucleus sampling mass in (0, 1] (default: all)")
    p.add_argument("--seed", type=int, default=unset, help=f"seeds sampling (default {default.seed})")
    p.add_argument("--stop", action="append", default=unset, help="stop string (repeatable)")


def _request_options(args) -> RequestOptions:
    """The request options given on the command line, the others at their defaults."""
    given = {name: getattr(args, name) for name in RequestOptions.names() if hasattr(args, name)}
    return RequestOptions.build(**given)


def _engine(args, engine_class=None, **options):
    """The engine the target options describe: a SpecEngine, or ``engine_class`` (BatchEngine) with ``options``."""
    from vlmspec.engine import SpecEngine
    from vlmspec.scheduling.factory import build_scheduler

    scheduler = build_scheduler(args.scheduler, threshold=args.threshold, **_reference_defaults(args))
    drafter = None if args.drafter == "none" else args.drafter
    return (engine_class or SpecEngine).from_pretrained(
        args.target,
        drafter=drafter,
        scheduler=scheduler,
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
        device=args.device,
        decode=args.decode,
        **options,
    )


if __name__ == "__main__":
    sys.exit(main())
