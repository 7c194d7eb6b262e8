"""Train the 10x plan's reference drafter on one GPU, from what the repository carries.

    python recipes/gpu_train_reference.py --target DIR --prompts FILE --out DIR   # on the GPU machine

The 10x plan (recipes/continue_10x.sh) trains the DSpark drafter for 40,000 steps of one
sequence with up to 128 anchor blocks (5.1M blocks) on one CPU core, about 11 hours. On a
GPU the same blocks go through in 1,250 steps of 32 sequences (the same learning rate
schedule; on one H200, 1.05-1.22 s a step: more than a session's 15 device minutes, hence
``--max-minutes``), with features computed online by the target
and the committed answers (``--answers``, recipes/data/reference-10x) replayed into a
tokens-only cache, so nothing is regenerated. The drafter starts from ``--init-from``
(the committed one) and the held-out tau before and after is in ``OUT/report.json``.

What it needs on that machine (the device tool carries at most 64 MiB a call, the tree
included): the target (SmolLM2's GGUF, 94 MiB), the drafter to start from, the tokens-only
cache, the prompt file and the pictures its image prompts name. recipes/gpu_stage.py carries
them over back-to-back calls and recipes/gpu_device_call.sh runs each call;
recipes/README.md ("On a GPU") has the commands and what a run measured. ``--max-minutes``
fits the schedule to the lease; ``--plan PATH`` adds up what one call would carry.

The test suite runs this script on a CPU at toy scale (tiny target, a few steps).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository and the recipes importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_qwen3vl  # noqa: E402 - the recipe this script sizes for a GPU

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20  # bytes the device tool carries per call, the working tree included
# The 10x plan's blocks (40,000 steps x 1 sequence) in GPU-sized steps.
PLAN_SEQUENCES, GPU_BATCH = 40_000, 32
EVAL_IDS = "eval-ids.txt"  # in an answers directory: the cached sequences its runs hold out, by id
STATE = REPO / "recipes" / "reference_10x.state"  # how many training prompts the committed answers cover


def gpu_options(args: argparse.Namespace) -> list[str]:
    """train_qwen3vl.py options: the 10x plan's data, shape and schedule, with a GPU-sized batch."""
    steps = args.steps or PLAN_SEQUENCES // args.batch_size
    return [
        *("--target", str(args.target), "--prompts", str(args.prompts), "--out", str(args.out)),
        *("--num-prompts", str(args.num_prompts)),
        *("--answers", str(args.answers), "--cache", str(args.cache), "--cache-contents", "tokens"),
        *("--heldout-prompts", str(args.heldout_prompts), "--max-new-tokens", str(args.max_new_tokens)),
        *("--temperature", "0", "--steps", str(steps), "--batch-size", str(args.batch_size)),
        *("--num-anchors", "128", "--lr", "1e-3", "--warmup-ratio", "0.01", "--loss-focus", "first-error"),
        *("--eval-every", str(max(steps // 8, 1)), "--save-every", "0", "--log-every", str(max(steps // 50, 1))),
        *("--eval-max-new-tokens", "64", *heldout_options(args)),
        *(("--init-from", str(args.init_from)) if args.init_from else ()),
        *(("--max-minutes", str(args.max_minutes)) if args.max_minutes else ()),
        *args.recipe_options,
    ]


def answered_prompts(state: Path = STATE) -> int:
    """The training prompts the committed answers cover (``REGENERATED_PROMPTS`` of the 10x run's state file)."""
    for line in state.read_text().splitlines():
        if line.startswith("REGENERATED_PROMPTS="):
            return int(line.split("=", 1)[1].split("#", 1)[0])
    raise ValueError(f"{state} has no REGENERATED_PROMPTS line; pass --num-prompts")


def heldout_options(args: argparse.Namespace) -> tuple[str, ...]:
    """The held-out split: the answers' named sequences (``eval-ids.txt``, the staged run's) if they name any."""
    named = args.answers / EVAL_IDS
    return ("--eval-ids", str(named)) if named.is_file() else ("--eval-sequences", str(args.eval_sequences))


def carry_plan(paths: Sequence[Path], repo: Path = REPO) -> dict[str, Any]:
    """Bytes a device call would carry: the working tree (tracked and untracked, not ignored) plus ``paths``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    tree = sum((repo / name.decode()).stat().st_size for name in listed if name and (repo / name.decode()).is_file())
    extra = {str(path): sum(f.stat().st_size for f in _files(path)) for path in paths}
    total = tree + sum(extra.values())
    return {"tree": tree, "carried": extra, "total": total, "limit": CARRY_LIMIT, "fits": total <= CARRY_LIMIT}


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target: a saved directory carried along, or tiny:...")
    parser.add_argument("--prompts", type=Path, required=True, help="the mix's prompts.jsonl (images beside it)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--answers", type=Path, default=REPO / "recipes" / "data" / "reference-10x")
    parser.add_argument("--cache", type=Path, default=None, help="tokens-only cache (default OUT/cache)")
    parser.add_argument("--init-from", type=Path, default=None, help="drafter to start from (the committed one)")
    parser.add_argument("--batch-size", type=int, default=GPU_BATCH, help="sequences a step")
    parser.add_argument("--steps", type=int, default=None, help="default: the 10x plan's 40,000 sequences")
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="training prompts (default: those the committed answers cover, so nothing is regenerated)",
    )
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="wall-clock budget of the training steps (the lease's minutes)"
    )
    parser.add_argument("--heldout-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--eval-sequences", type=int, default=32, help=f"held out at random when the answers hold no {EVAL_IDS}"
    )
    parser.add_argument(
        "--plan", action="append", type=Path, default=[], help="only add up what a device call would carry"
    )
    parser.add_argument("recipe_options", nargs="*", help="more train_qwen3vl.py options, after --")
    args = parser.parse_args(argv)
    args.cache = args.cache or args.out / "cache"
    args.num_prompts = args.num_prompts or answered_prompts()
    return args


def main(argv: Sequence[str] | None = None, *, target=None) -> dict[str, Any]:
    """Train (or, with ``--plan``, only report the carry); ``target`` as in train_qwen3vl.main."""
    args = parse_args(argv)
    if args.plan:
        plan = carry_plan(args.plan)
        print(
            f"a device call would carry {plan['total'] / 2**20:.1f} MiB (tree {plan['tree'] / 2**20:.1f} MiB) "
            f"of at most {plan['limit'] / 2**20:.0f} MiB: {'fits' if plan['fits'] else 'does NOT fit'}"
        )
        return plan
    return train_qwen3vl.main(gpu_options(args), target=target)


if __name__ == "__main__":
    main()
