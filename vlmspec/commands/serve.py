"""``vlmspec serve``: the OpenAI-compatible HTTP server over the batched engine, and its scheduler defaults."""

from __future__ import annotations

import argparse
import os

from vlmspec.commands.options import build_engine, integer, number, target_options
from vlmspec.server.limits import RequestLimits
from vlmspec.serving.admission import DEFAULT_PREFILL_STEP_S
from vlmspec.serving.memory import parse_kv_cache_memory
from vlmspec.targets.inputs import ImageLimits

API_KEY_VARIABLE = "VLMSPEC_API_KEY"


def add_serve(commands) -> None:
    p = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat completions) over the batched engine",
        description="Serve /v1/chat/completions, /v1/models, /health and /metrics. Without --scheduler: for the "
        "reference pair, sps with its measured cost curve and calibration, drafting while one request runs; for "
        "another DSpark drafter, threshold; for prompt lookup, none (verify every draft). Every request is held to "
        "the limits below before the work it would cause (see docs/serving.md, 'Limits').",
    )
    target_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=integer(1, 65535), default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the --target name)")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE) or None,
        help=f"clients must send 'Authorization: Bearer KEY' to every endpoint but /health, else HTTP 401 "
        f"(default: ${API_KEY_VARIABLE}; unset: no key, for a server on the loopback interface)",
    )
    p.add_argument(
        "--max-batch-size", type=integer(1), default=32, help="requests decoded at once (rows of the batched forward)"
    )
    p.add_argument(
        "--max-queued", type=integer(0), default=64, help="requests waiting for a row beyond those; more get HTTP 429"
    )
    p.add_argument(
        "--speculate-up-to",
        type=integer(1),
        default=None,
        help="draft only while at most this many requests run; above, verify the anchors alone (default: always "
        "draft). On a CPU, where a big batch is compute-bound, 1-2 keeps serving at the target alone's speed",
    )
    p.add_argument(
        "--prefill-step-s",
        type=number(0, above=True),
        default=DEFAULT_PREFILL_STEP_S,
        help="while requests decode, a step prefills as much prompt as this many seconds allow at the prefill speed "
        "the server measures on its own steps: a long prompt runs in chunks between decode steps instead of "
        f"stalling them (default: {DEFAULT_PREFILL_STEP_S})",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=integer(1),
        default=None,
        help="a fixed number of prompt tokens a step prefills while requests decode, instead of --prefill-step-s",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt in full (default: a prompt that starts as an earlier one did, such as the next "
        "turn of a chat about the same image or a shared system prompt, reuses its KV blocks)",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run prompts through the decode step's kernels (16 tokens of a request a forward), so that a turn that "
        "reuses cached KV answers bit for bit as a fresh server would (default: on in bfloat16 on AVX512-BF16, where "
        "it costs no measurable prefill time; off in float32, where long prefills take up to twice as long and "
        "answers agree without it)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_kv_cache_memory,
        default=None,
        help="most memory the KV cache may hold: bytes (268435456, 256MB, 2GiB) or a fraction of RAM (0.25). A "
        "request joins when its prompt's KV blocks fit; a running one that runs short is preempted and recomputed "
        "later; one whose prompt + max_tokens could never fit gets HTTP 400 (default: half the RAM available at "
        "start)",
    )

    p.add_argument(
        "--default-max-tokens", type=integer(1), default=256, help="when a request sets no max_tokens (default 256)"
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a folder whose image files requests may name by path (default: only base64 data: URLs)",
    )
    limits = p.add_argument_group("request limits", "each one answers HTTP 4xx naming its flag, before the work")
    limits.add_argument(
        "--max-request-bytes",
        type=integer(1),
        default=RequestLimits.max_body_bytes,
        help=f"largest request body; more get HTTP 413, reading stops there (default {RequestLimits.max_body_bytes:,}:"
        " 50 MiB)",
    )
    limits.add_argument(
        "--max-images-per-request",
        type=integer(1),
        default=RequestLimits.max_images,
        help=f"most images one request may send; more get HTTP 400 (default {RequestLimits.max_images})",
    )
    limits.add_argument(
        "--max-request-pixels",
        type=integer(1),
        default=RequestLimits.max_total_pixels,
        help="most pixels a request's images may have together, read from their headers before any is decoded; "
        f"more get HTTP 400 (default {RequestLimits.max_total_pixels:,})",
    )
    limits.add_argument(
        "--max-image-bytes",
        type=integer(1),
        default=ImageLimits.max_bytes,
        help=f"largest encoded image a request may send, checked before decoding; more get HTTP 400 "
        f"(default {ImageLimits.max_bytes:,}: 20 MiB)",
    )
    limits.add_argument(
        "--max-image-pixels",
        type=integer(1),
        default=ImageLimits.max_pixels,
        help=f"most pixels (width x height) an image may have, read from its header before decoding; more get "
        f"HTTP 400 (default {ImageLimits.max_pixels:,}; Qwen-VL processors scale images down to 12.8-16.8 MP)",
    )
    limits.add_argument(
        "--max-prompt-tokens",
        type=integer(1),
        default=None,
        help="most prompt tokens (vision tokens included) a request may send; more get HTTP 400 "
        "(default: the model's context less one)",
    )
    limits.add_argument(
        "--max-stop-strings",
        type=integer(1),
        default=RequestLimits.max_stop_strings,
        help=f"most stop strings a request may send (default {RequestLimits.max_stop_strings}, as OpenAI)",
    )
    limits.add_argument(
        "--max-stop-length",
        type=integer(1),
        default=RequestLimits.max_stop_length,
        help=f"longest stop string, in characters (default {RequestLimits.max_stop_length})",
    )
    limits.add_argument(
        "--max-choices",
        type=integer(1),
        default=RequestLimits.max_choices,
        help=f"largest n (choices per request; each takes a place of --max-batch-size + --max-queued) "
        f"(default {RequestLimits.max_choices})",
    )
    limits.add_argument(
        "--max-logit-bias",
        type=integer(1),
        default=RequestLimits.max_logit_bias,
        help=f"most tokens a logit_bias may name (default {RequestLimits.max_logit_bias})",
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
    image_limits = ImageLimits(max_bytes=args.max_image_bytes, max_pixels=args.max_image_pixels)
    limits = RequestLimits(
        max_body_bytes=args.max_request_bytes,
        max_images=args.max_images_per_request,
        max_total_pixels=args.max_request_pixels,
        max_prompt_tokens=args.max_prompt_tokens,
        max_stop_strings=args.max_stop_strings,
        max_stop_length=args.max_stop_length,
        max_choices=args.max_choices,
        max_logit_bias=args.max_logit_bias,
    )
    _serving_defaults(args)
    engine = build_engine(
        args,
        BatchEngine,
        max_batch_size=args.max_batch_size,
        speculate_up_to=args.speculate_up_to,
        prefill_step_s=args.prefill_step_s,
        max_prefill_tokens=args.max_prefill_tokens,
        kv_cache_memory=args.kv_cache_memory,
        prefix_caching=args.prefix_caching,
        batch_invariant=args.batch_invariant,
    )
    name = args.served_model_name or Path(str(args.target)).name
    cap = "always" if args.speculate_up_to is None else f"up to {args.speculate_up_to} running"
    config = ServerConfig(
        model_name=name,
        max_queued=args.max_queued,
        default_max_tokens=args.default_max_tokens,
        allowed_media=media,
        image_limits=image_limits,
        limits=limits,
        api_key=args.api_key,
    )
    key = "an API key" if args.api_key else "no API key"
    print(
        f"serving {name!r} (drafter {args.drafter}, scheduler {args.scheduler}, drafting {cap}, {key}) "
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
