"""``vlmspec export``: a DSpark drafter in a serving engine's checkpoint layout, or as GGUF files for llama.cpp."""

from __future__ import annotations

from vlmspec.commands.options import TARGET_HELP, integer


def add_export(commands) -> None:
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
        type=integer(0),
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
