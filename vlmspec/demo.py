"""``vlmspec demo``: the reference pair on an image question and a text question, against what a user has.

For each request it prints the answer, tau, acceptance by position and the time split,
then the speed of the speculative engine against the target alone (the same engine with
nothing drafted) and against transformers' own ``generate()`` on the same model, all
three interleaved in one process and the fastest of ``repeats`` runs kept for each.
All three are timed over the same work (:data:`TIMING`). With ``out`` it writes every
printed figure, with its provenance (command, commit, date, CPU, threads), to a JSON
file, so a figure quoted elsewhere can be traced to the run that printed it.
It fails (exit 1) if the speculative answer differs from the target alone's.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEMO_PROMPT = "Describe the image."
# A GSM8K-style question outside the prompts the reference drafter trained on.
DEMO_TEXT_PROMPT = (
    "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them and "
    "gives 5 to her neighbours. How many muffins are left? Explain step by step."
)
DEMO_IMAGE_ID = 4  # easy-vqa test image: a red circle
# What every timing covers, the same for the three ways: the processor (tokenizing, resizing
# images) runs before each clock starts; the prefill, vision tower included, and every
# decoding step are inside it.
TIMING = (
    "timing: each way from the processed prompt and images to the last token "
    "(prefill with the vision tower and decoding timed; the processor not timed)"
)


def run_demo(
    engine,
    requests: Sequence[tuple[Any, str]],
    *,
    max_new_tokens: int = 128,
    repeats: int = 3,
    out: str | Path | None = None,
    settings: dict[str, Any] | None = None,
) -> int:
    """Answer each (image or None, prompt) and print the comparison; 1 if an answer differs from the target alone.

    ``out``: a JSON file to write the printed figures to, with ``settings`` (what was run)
    and the run's provenance.
    """
    if out is not None and Path(out).is_dir():  # refused before the minutes of timing, not after
        raise ValueError(f"--out {str(out)!r} is a folder; give a file path such as {str(Path(out) / 'demo.json')!r}")
    print(f"{TIMING}\n")
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
    if out is not None:
        print(f"results: {write_results(out, runs, settings or {})}")
    if any(run.spec.token_ids != run.alone.token_ids for run in runs):
        print("ERROR: the speculative output differs from the target alone", file=sys.stderr)
        return 1
    return 0


class TimedRuns:
    """One request three ways: speculative, the target alone, and transformers' generate() (seconds, tokens)."""

    def __init__(
        self, prompt: str, has_image: bool, spec, alone, generate_s: float, generate_tokens: list[int]
    ) -> None:
        self.prompt, self.has_image = prompt, has_image
        self.spec, self.alone = spec, alone
        self.generate_s, self.generate_tokens = generate_s, generate_tokens

    @property
    def generate_tokens_per_s(self) -> float:
        return len(self.generate_tokens) / self.generate_s

    def record(self) -> dict[str, Any]:
        """The request's printed figures as plain JSON values (a speedup between different outputs is None)."""
        identical = self.spec.token_ids == self.alone.token_ids
        generate_identical = self.generate_tokens == self.alone.token_ids
        spec_tok_s = self.spec.stats.tokens_per_s
        return {
            "prompt": self.prompt,
            "image": self.has_image,
            "answer": self.spec.text,
            "identical_to_target_alone": identical,
            "generate_identical_to_target_alone": generate_identical,
            "speedup_vs_target_alone": spec_tok_s / self.alone.stats.tokens_per_s if identical else None,
            "speedup_vs_generate": spec_tok_s / self.generate_tokens_per_s if generate_identical else None,
            "speculative": _finite(self.spec.stats.as_dict()),
            "target_alone": _finite(self.alone.stats.as_dict()),
            "generate": {
                "new_tokens": len(self.generate_tokens),
                "total_s": self.generate_s,
                "tokens_per_s": self.generate_tokens_per_s,
            },
        }

    def against_generate(self) -> str:
        tokens_per_s = self.generate_tokens_per_s
        if self.generate_tokens != self.alone.token_ids:  # e.g. bfloat16: another order of sums, another tie-break
            return f"transformers generate(): {tokens_per_s:.1f} tok/s   speedup: not comparable   output: DIFFERENT"
        speedup = self.spec.stats.tokens_per_s / tokens_per_s
        return f"transformers generate(): {tokens_per_s:.1f} tok/s   speedup: {speedup:.2f}x   output: identical"


def timed_runs(engine, image, prompt: str, max_new_tokens: int, repeats: int) -> TimedRuns:
    """The fastest of ``repeats`` interleaved runs of each way (a load change on the machine hits all three)."""
    options = dict(prompt=prompt, max_new_tokens=max_new_tokens)
    # Processed once, outside generate()'s clock: the engine's clock also starts after processing (TIMING).
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
        tokens = engine.target.generate_greedy(inputs, max_new_tokens)
        if (seconds := time.perf_counter() - tick) < generate_s:
            generate_s, generate_tokens = seconds, tokens
    return TimedRuns(prompt, image is not None, best[True], best[False], generate_s, generate_tokens)


def overall(runs: Sequence[TimedRuns]) -> str:
    """All requests together: tokens per second of each way, and tau over every round."""
    o = overall_figures(runs)
    return (
        f"overall: {o['tokens']} tokens   tau: {o['tau']:.2f}   speculative {o['speculative_tok_s']:.1f} tok/s   "
        f"target alone {o['target_alone_tok_s']:.1f} tok/s ({o['speedup_vs_target_alone']:.2f}x)   "
        f"transformers generate() {o['generate_tok_s']:.1f} tok/s ({o['speedup_vs_generate']:.2f}x)"
    )


def overall_figures(runs: Sequence[TimedRuns]) -> dict[str, float]:
    """The pooled figures ``overall`` prints: tokens per second of each way and the speedups, tau over every round."""
    from vlmspec.types import SpecStats

    tokens = sum(run.spec.stats.new_tokens for run in runs)
    spec_s = sum(run.spec.stats.total_s for run in runs)
    alone_s = sum(run.alone.stats.total_s for run in runs)
    generate_tokens = sum(len(run.generate_tokens) for run in runs)
    generate_s = sum(run.generate_s for run in runs)
    return {
        "tokens": tokens,
        "tau": SpecStats.merge(run.spec.stats for run in runs).tau,
        "speculative_tok_s": tokens / spec_s,
        "target_alone_tok_s": tokens / alone_s,
        "speedup_vs_target_alone": alone_s / spec_s,
        "generate_tok_s": generate_tokens / generate_s,
        "speedup_vs_generate": generate_s / generate_tokens * tokens / spec_s,
    }


def write_results(path: str | Path, runs: Sequence[TimedRuns], settings: dict[str, Any]) -> Path:
    """Write the demo's figures, its settings and the run's provenance to ``path`` (JSON); returns the path."""
    from vlmspec.provenance import provenance

    path = Path(path)
    document = {
        "provenance": provenance(),
        "settings": settings,
        "timing": TIMING,
        "requests": [run.record() for run in runs],
        "overall": overall_figures(runs) if len(runs) > 1 else None,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities (e.g. the acceptance of a position never verified) as None: JSON has no NaN."""
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


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
