"""Checks of the reference target: held-out easy-vqa accuracy, text logits against SmolLM2, step costs.

Part of ``recipes/build_reference_target.py`` (recipes/ is not a package: the recipe imports this
module after putting recipes/ on ``sys.path``). :func:`evaluate` also probes accuracy while
phase 2 trains.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from reference_target_data import Example
from tqdm import tqdm

from vlmspec.engine import SpecEngine
from vlmspec.targets import QwenVLTarget
from vlmspec.targets.inputs import TargetInputs

TEXT_CHECK_PROMPTS = ("What is the capital of France? Answer in one sentence.", "Write a haiku about rain.")


# ------------------------------------------------------------------------ evaluation
def normalise(text: str) -> str:
    """Case, final period and a leading article do not count: "A circle." answers "what shape ...?"."""
    words = text.strip().lower().rstrip(".").split()
    if len(words) > 1 and words[0] in ("a", "an", "the"):
        words = words[1:]
    return " ".join(words)


def evaluate(target: QwenVLTarget, examples: list[Example], *, progress: bool = True) -> dict:
    """Greedy answers through vlmspec's engine (target alone); exact match after :func:`normalise`."""
    engine = SpecEngine(target)
    hits: dict[str, list[bool]] = defaultdict(list)
    failures = []
    for example in tqdm(examples, desc="evaluate", disable=not progress, mininterval=5.0):
        with Image.open(example.image) as image:
            text = engine.generate(image.convert("RGB"), example.prompt, max_new_tokens=12, speculative=False).text
        correct = normalise(text) == normalise(example.answer)
        hits[example.kind].append(correct)
        if not correct and len(failures) < 20:
            failures.append(
                {"image": Path(example.image).name, "prompt": example.prompt, "expected": example.answer, "got": text}
            )
    accuracy = {kind: round(sum(v) / len(v), 4) for kind, v in sorted(hits.items())}
    questions = [h for kind, v in hits.items() if kind != "caption" for h in v]
    accuracy["questions"] = round(sum(questions) / max(1, len(questions)), 4)
    counts = {kind: len(v) for kind, v in sorted(hits.items())}
    return {"accuracy": accuracy, "counts": counts, "failures": failures}


@torch.no_grad()
def text_check(target: QwenVLTarget, gguf_path: Path) -> dict:
    """Text-only logits of the target vs transformers' own GGUF load of SmolLM2 (must be equal)."""
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).eval()
    vocab = original.config.vocab_size
    worst, prompts = 0.0, []
    for prompt in TEXT_CHECK_PROMPTS:
        inputs = target.build_inputs(None, prompt)
        ids = inputs.input_ids
        positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(4, 1, -1)
        ours = target.model(input_ids=ids, position_ids=positions).logits[0].float()  # [L, V + 4]
        theirs = original(input_ids=ids).logits[0].float()  # [L, V]
        worst = max(worst, (ours[:, :vocab] - theirs).abs().max().item())
        top = theirs[-1].topk(5)
        prompts.append(
            {
                "prompt": prompt,
                "top5_ids": top.indices.tolist(),
                "top5_logits": top.values.tolist(),
                "min_top_logit": theirs.max(-1).values.min().item(),
                "new_rows_max_abs_logit": ours[:, vocab:].abs().max().item(),
            }
        )
    return {"max_abs_logit_difference": worst, "prompts": prompts}


def step_costs(
    model_dir: Path, dtypes: Sequence[str] = ("float32", "bfloat16"), context: int = 300, repeats: int = 12
) -> dict[str, dict[str, float]]:
    """Median wall time of a 1-token decode step and of an 8-token verify at ``context`` tokens.

    Measured through the adapter's prefill / verify / rollback API: each verify is rolled
    back entirely, so every measurement sees the same context length.
    """
    costs = {}
    for dtype in dtypes:
        target = QwenVLTarget.from_pretrained(model_dir, dtype=dtype)
        words = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)
        ids = torch.tensor([target.tokenizer(words, add_special_tokens=False).input_ids[:context]])  # [1, context]
        state, _ = target.prefill(TargetInputs(input_ids=ids, model_kwargs={"input_ids": ids}, num_images=0))
        costs[dtype] = {f"{n}_token_ms": _median_ms(target, state, n, repeats) for n in (1, 8)}
        costs[dtype]["context"] = state.length
        del target
    return costs


def _median_ms(target: QwenVLTarget, state, n: int, repeats: int) -> float:
    tokens = list(range(1000, 1000 + n))
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        target.verify(state, tokens)
        times.append(time.perf_counter() - started)
        target.rollback(state, 0)
    return round(1000 * sorted(times[2:])[repeats // 2], 1)
