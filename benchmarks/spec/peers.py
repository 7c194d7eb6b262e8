"""transformers' own ``generate`` on the same model and inputs: plain, with prompt lookup, with an assistant model.

These are what a user would pick instead of vlmspec. A configuration transformers refuses
is recorded on its :class:`Peer` (status and reason), not skipped silently.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import Timer
from benchmarks.spec.runs import RunRecord, Settings
from benchmarks.spec.workloads import Task


@dataclass
class Peer:
    """A transformers ``generate`` configuration run beside ours; ``status`` records refusals."""

    name: str
    description: str
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"  # "ok" | "refused" | "not run"
    detail: str = ""

    @property
    def active(self) -> bool:
        return self.status == "ok"

    def refuse(self, detail: str) -> None:
        self.status, self.detail = "refused", detail


def hf_generate_kwargs(engine, settings: Settings) -> dict[str, Any]:
    """Keyword arguments that make ``model.generate`` sample exactly what vlmspec samples.

    A checkpoint's generation_config may carry its own temperature, top-k/top-p or a
    repetition penalty; every one of them is overridden so that all variants draw from
    the same distribution and stop on the same tokens.
    """
    eos = list(engine.target.eos_token_ids)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos[0],
        repetition_penalty=1.0,
        num_beams=1,
        do_sample=not settings.greedy,
    )
    if settings.greedy:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(temperature=settings.temperature, top_k=settings.top_k or 0, top_p=settings.top_p or 1.0)
    return kwargs


def run_hf(engine, task: Task, settings: Settings, peer: Peer, *, seed: int) -> RunRecord:
    """transformers' ``generate`` on the same model and inputs, timed like ``run_engine``."""
    import torch

    kwargs = {**hf_generate_kwargs(engine, settings), **peer.generate_kwargs}
    torch.manual_seed(seed)  # transformers samples from the global generator
    with Timer() as timer:
        inputs = engine.target.build_inputs(task.image_arg, task.prompt)
        with torch.inference_mode():
            output = engine.target.model.generate(**inputs.model_kwargs, **kwargs)
        tokens = output[0, inputs.length :].tolist()  # inside the timer: waits for a GPU to finish
    eos = set(engine.target.eos_token_ids)
    finish = "eos" if tokens and tokens[-1] in eos else "length"
    text = engine.target.tokenizer.decode(tokens, skip_special_tokens=True)
    return RunRecord(peer.name, timer.seconds, tokens, text, finish)


def build_peers(engine, args: argparse.Namespace) -> list[Peer]:
    """The transformers configurations to compare against, per ``--peers`` and ``--assistant``."""
    wanted = {p.strip() for p in args.peers.split(",") if p.strip()} - {"none"}
    unknown = wanted - {"prompt-lookup", "assistant"}
    if unknown:
        raise ValueError(
            f"--peers {args.peers!r}: unknown peer(s) {', '.join(sorted(unknown))}; use prompt-lookup, assistant or none"
        )
    if not wanted:
        return []
    peers = [Peer("hf-generate", "transformers generate(), target alone")]
    if "prompt-lookup" in wanted:
        k = args.prompt_lookup_num_tokens or args.max_draft_tokens
        peers.append(
            Peer(
                "hf-prompt-lookup",
                f"generate(prompt_lookup_num_tokens={k}, max_matching_ngram_size={args.max_ngram})",
                {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": args.max_ngram},
            )
        )
    if "assistant" in wanted:
        peers.append(assistant_peer(engine, args.assistant, args.target))
    return peers


def assistant_peer(engine, assistant: str, target: str) -> Peer:
    """``generate(assistant_model=...)``: a smaller model of the target's family; loading problems are recorded."""
    if assistant == "none" or (assistant == "auto" and not target.startswith(("tiny:", "small:"))):
        return Peer(
            "hf-assistant",
            "generate(assistant_model=...)",
            status="not run",
            detail="no assistant given: pass --assistant DIR (a smaller Qwen-VL checkpoint of the same family)",
        )
    try:
        model, description = _load_assistant(engine, assistant)
    except Exception as err:  # noqa: BLE001 - any loading failure is a result to report
        return Peer(
            "hf-assistant", f"generate(assistant_model={assistant})", status="refused", detail=describe_error(err)
        )
    return Peer("hf-assistant", f"generate(assistant_model={description})", {"assistant_model": model})


def _load_assistant(engine, assistant: str) -> tuple[Any, str]:
    """The assistant model (on the target's device and dtype) and a short description of it."""
    family = engine.target.family
    if assistant in ("auto", "tiny"):
        from vlmspec.targets.tiny import tiny_model

        model = tiny_model(family, hidden_size=32, num_layers=2, seed=1).to(engine.target.dtype)
        return model, f"tiny random {family}, hidden 32, 2 layers"
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = Path(assistant)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--assistant {assistant!r} is not a saved model directory (no config.json); pass one or 'none'"
        )
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=engine.target.dtype, local_files_only=True)
    except ValueError:  # a text-only assistant; transformers decides whether it may assist a VLM
        model = AutoModelForCausalLM.from_pretrained(path, dtype=engine.target.dtype, local_files_only=True)
    return model.to(engine.target.device).eval(), path.name


def describe_error(err: BaseException) -> str:
    """``"TypeName: first line of the message"``, cut at 400 characters: one readable line per failure."""
    lines = str(err).strip().splitlines() or [""]
    first = lines[0] if len(lines[0]) <= 400 else lines[0][:400] + " ..."
    return f"{type(err).__name__}: {first}"
