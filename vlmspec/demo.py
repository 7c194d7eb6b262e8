"""``vlmspec demo``: the reference pair on an image question and a text question, against what a user has.

For each request it prints the answer, tau, acceptance by position and the time split,
then the speed of the speculative engine against the target alone (the same engine with
nothing drafted) and against transformers' own ``generate()`` on the same model, all
three interleaved in one process and the fastest of ``repeats`` runs kept for each.
It fails (exit 1) if the speculative answer differs from the target alone's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

DEMO_PROMPT = "Describe the image."
# A GSM8K-style question outside the prompts the reference drafter trained on.
DEMO_TEXT_PROMPT = (
    "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them and "
    "gives 5 to her neighbours. How many muffins are left? Explain step by step."
)
DEMO_IMAGE_ID = 4  # easy-vqa test image: a red circle


def run_demo(engine, requests: Sequence[tuple[Any, str]], *, max_new_tokens: int = 128, repeats: int = 3) -> int:
    """Answer each (image or None, prompt) and print the comparison; 1 if an answer differs from the target alone."""
    runs = []
    for image, prompt in requests:
        run = timed_runs(engine, image, prompt, max_new_tokens, repeats)
        shown = "[image] " if image is not None else ""
        print(
            f"Q: {shown}{prompt}\nA: {run.spec.text}\n{format_stats(run.spec, run.alone)}\n{run.against_generate()}\n"
        )
        runs.append(run)
    if len(runs) > 1:
        print(overall(runs))
    if any(run.spec.token_ids != run.alone.token_ids for run in runs):
        print("ERROR: the speculative output differs from the target alone", file=sys.stderr)
        return 1
    return 0


class TimedRuns:
    """One request three ways: speculative, the target alone, and transformers' generate() (seconds, tokens)."""

    def __init__(self, spec, alone, generate_s: float, generate_tokens: list[int]) -> None:
        self.spec, self.alone = spec, alone
        self.generate_s, self.generate_tokens = generate_s, generate_tokens

    def against_generate(self) -> str:
        tokens_per_s = len(self.generate_tokens) / self.generate_s
        if self.generate_tokens != self.alone.token_ids:  # e.g. bfloat16: another order of sums, another tie-break
            return f"transformers generate(): {tokens_per_s:.1f} tok/s   speedup: not comparable   output: DIFFERENT"
        speedup = self.spec.stats.tokens_per_s / tokens_per_s
        return f"transformers generate(): {tokens_per_s:.1f} tok/s   speedup: {speedup:.2f}x   output: identical"


def timed_runs(engine, image, prompt: str, max_new_tokens: int, repeats: int) -> TimedRuns:
    """The fastest of ``repeats`` interleaved runs of each way (a load change on the machine hits all three)."""
    options = dict(prompt=prompt, max_new_tokens=max_new_tokens)
    inputs = engine.target.build_inputs(image, prompt)
    engine.generate(image, **options)  # warm-up, so no timed run pays first-call costs
    engine.target.generate_greedy(inputs, max_new_tokens)
    best: dict[bool, Any] = {}
    generate_s, generate_tokens = float("inf"), []
    for _ in range(max(1, repeats)):
        for speculative in (False, True):
            result = engine.generate(image, **options, speculative=speculative)
            if speculative not in best or result.stats.total_s < best[speculative].stats.total_s:
                best[speculative] = result
        tick = time.perf_counter()
        tokens = engine.target.generate_greedy(engine.target.build_inputs(image, prompt), max_new_tokens)
        if (seconds := time.perf_counter() - tick) < generate_s:
            generate_s, generate_tokens = seconds, tokens
    return TimedRuns(best[True], best[False], generate_s, generate_tokens)


def overall(runs: Sequence[TimedRuns]) -> str:
    """All requests together: tokens per second of each way, and tau over every round."""
    from vlmspec.types import SpecStats

    tokens = sum(run.spec.stats.new_tokens for run in runs)
    spec_s = sum(run.spec.stats.total_s for run in runs)
    alone_s = sum(run.alone.stats.total_s for run in runs)
    tau = SpecStats.merge(run.spec.stats for run in runs).tau
    generate_tokens = sum(len(run.generate_tokens) for run in runs)
    generate_s = sum(run.generate_s for run in runs)
    return (
        f"overall: {tokens} tokens   tau: {tau:.2f}   speculative {tokens / spec_s:.1f} tok/s   target alone "
        f"{tokens / alone_s:.1f} tok/s ({alone_s / spec_s:.2f}x)   transformers generate() "
        f"{generate_tokens / generate_s:.1f} tok/s ({generate_s / generate_tokens * tokens / spec_s:.2f}x)"
    )


def demo_image():
    """A held-out easy-vqa test image (a 64 x 64 shape the reference target never saw in training)."""
    try:
        from easy_vqa import get_test_image_paths
    except ImportError as err:
        raise ImportError("the demo image comes from the easy-vqa package: pip install easy-vqa") from err
    return open_image(get_test_image_paths()[DEMO_IMAGE_ID])


def open_image(path):
    """An image file as an RGB PIL image."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def format_stats(result, baseline=None) -> str:
    """A short human summary of one generation (and the speedup over the target alone, if given)."""
    s = result.stats
    accept = ", ".join(f"{a:.2f}" for a in s.acceptance_by_position[:8]) or "-"
    lines = [
        f"tokens: {s.new_tokens} ({result.finish_reason})   rounds: {s.rounds}   tau: {s.tau:.2f}   "
        f"mean verified drafts/round: {s.mean_verified_length:.2f}",
        f"acceptance by position: {accept}",
        f"time: total {s.total_s:.3f}s = prefill {s.prefill_s:.3f} + draft {s.draft_s:.3f} + verify {s.verify_s:.3f} "
        f"+ engine {s.other_s:.3f}   ({s.tokens_per_s:.1f} tok/s)",
    ]
    if baseline is not None:
        b = baseline.stats
        if baseline.token_ids != result.token_ids:  # a speed ratio between two different answers means nothing
            lines.append(f"target alone: {b.tokens_per_s:.1f} tok/s   speedup: not comparable   output: DIFFERENT")
        else:
            speedup = s.tokens_per_s / b.tokens_per_s if b.tokens_per_s else float("nan")
            lines.append(f"target alone: {b.tokens_per_s:.1f} tok/s   speedup: {speedup:.2f}x   output: identical")
    return "\n".join(lines)
