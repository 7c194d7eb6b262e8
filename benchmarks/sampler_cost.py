"""The sampler's cost per token: sampled against greedy target alone, native sampler against the PyTorch reference.

Issue #43's bar: the sampled target alone at 0.95x the greedy target alone or better. Two
tables, on the reference target (bfloat16 by default), held-out code and maths prompts
(``benchmarks/data/code-maths.jsonl``):

* **whole generations**: the target alone (``speculative=False``) generating up to
  ``--max-new-tokens`` tokens, greedy, then sampled (temperature 0.7, top-p 0.8 by default)
  through the native sampler (``vlmspec/kernels/cpu_sampling.cpp``) and through the PyTorch
  reference (``vlmspec.sampling.reference_target_probs``), interleaved (``run_order``),
  median decode tokens/s per mode (the prefill left out: a sampled answer may stop early at
  EOS) and its ratio to greedy;
* **the sampler alone**: verification of one token (``vlmspec.verify.verify``, as the target
  alone calls it each step) on the target's own logits of those generations, per token, so
  the term is seen without the forward's noise: greedy (an argmax), sampled native, sampled
  reference, with the mean number of tokens the warpers keep.

Run from the repository root (the numbers mean something only on a quiet machine)::

    python -m benchmarks.sampler_cost --out runs/sampler-cost
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.common import markdown_table, prepare_out_dir, run_order, timed, write_json, write_text
from vlmspec import sampling
from vlmspec.types import DraftBlock, SamplingParams

PROMPTS = Path(__file__).with_name("data") / "code-maths.jsonl"
MODES = ("greedy", "sampled, native", "sampled, reference")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="reference", help="a target name for vlmspec.loading.load_target")
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"), help="default: bfloat16")
    parser.add_argument("--prompts", type=int, default=4, help="first N prompts of code-maths.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--rounds", type=int, default=3, help="generations of each prompt and mode, interleaved")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/sampler-cost")
    return parser.parse_args(argv)


@contextmanager
def sampler(mode: str):
    """Run the sampler of ``mode``: the native kernel where it applies, or the PyTorch reference."""
    applies = sampling.native_sampling_applies
    if mode.endswith("reference"):
        sampling.native_sampling_applies = lambda tensor: False
    try:
        yield
    finally:
        sampling.native_sampling_applies = applies


def load_prompts(count: int) -> list[str]:
    lines = PROMPTS.read_text().splitlines()[:count]
    return [json.loads(line)["turns"][0] for line in lines]


def generation_rates(engine, prompts: list[str], params: SamplingParams, args: argparse.Namespace) -> dict:
    """Decode tokens/s of the target alone per mode (after the prefill's first token; per prompt x round),
    the tokens each generation made, and the token ids of the first round's greedy runs."""
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    lengths: dict[str, list[int]] = {mode: [] for mode in MODES}
    generated: list[list[int]] = []
    engine.generate(None, prompts[0], max_new_tokens=8, speculative=False)  # warm up: kernels, packed weights
    for round_index in range(args.rounds):
        for p, prompt in enumerate(prompts):
            for mode in run_order(list(MODES), round_index * len(prompts) + p):
                extra = {} if mode == "greedy" else dict(temperature=params.temperature, top_p=params.top_p)
                with sampler(mode):
                    result = engine.generate(
                        None, prompt, max_new_tokens=args.max_new_tokens, speculative=False, seed=round_index, **extra
                    )
                # decode steps only: a sampled answer may end early at EOS, and the prefill must not weigh more then
                stats = result.stats
                rates[mode].append((stats.new_tokens - 1) / max(stats.total_s - stats.prefill_s, 1e-9))
                lengths[mode].append(stats.new_tokens)
                if mode == "greedy" and round_index == 0:
                    generated.append(result.token_ids)
    return {"rates": rates, "lengths": lengths, "generated": generated}


def target_logits(target, prompts: list[str], generated: list[list[int]]) -> torch.Tensor:  # [T, V] float32
    """The target's logits at every generated position (one transformers forward per prompt)."""
    rows = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, generated, strict=True):
            inputs = target.build_inputs(None, prompt)
            ids = torch.cat((inputs.input_ids, torch.tensor([tokens], dtype=torch.long)), dim=1)
            logits = target.model(input_ids=ids).logits[0, inputs.length - 1 : -1]  # [len(tokens), V]
            rows.append(logits.float())
    return torch.cat(rows)


def per_token_costs(logits: torch.Tensor, params: SamplingParams, rounds: int) -> dict[str, float]:
    """Median seconds of one token's verification (gamma 0, as the target alone) per mode."""
    from vlmspec.verify import verify

    block = DraftBlock(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    generator = [torch.Generator().manual_seed(0)]
    costs = {}
    for mode in MODES:
        mode_params = SamplingParams() if mode == "greedy" else params
        with sampler(mode):
            times = []
            for _ in range(rounds):
                for row in logits:
                    step = row.reshape(1, 1, -1)
                    times.append(timed(lambda step=step, p=mode_params: verify(block, step, p, generator)))
        costs[mode] = statistics.median(times)
    return costs


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from vlmspec.engine import SpecEngine
    from vlmspec.loading import load_target

    if not sampling.native_sampling_applies(torch.zeros(1)):
        raise SystemExit("the native sampler is unavailable here (vlmspec's CPU kernel did not build)")
    out = prepare_out_dir(args.out)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    prompts = load_prompts(args.prompts)
    report: dict = {"params": {"temperature": args.temperature, "top_p": args.top_p}, "dtypes": {}}
    generation_rows, sampler_rows = [], []
    for dtype in args.dtype or ("bfloat16",):
        target = load_target(args.target, dtype=dtype)
        engine = SpecEngine(target, None)
        runs = generation_rates(engine, prompts, params, args)
        medians = {mode: statistics.median(rates) for mode, rates in runs["rates"].items()}
        logits = target_logits(target, prompts, runs["generated"])
        costs = per_token_costs(logits, params, rounds=args.rounds)
        kept = (sampling.reference_target_probs(logits, params) > 0).sum(-1).float()
        for mode in MODES:
            mean_length = statistics.mean(runs["lengths"][mode])
            generation_rows.append([dtype, mode, medians[mode], medians[mode] / medians["greedy"], mean_length])
            extra = costs[mode] - costs["greedy"]
            sampler_rows.append([dtype, mode, costs[mode] * 1e3, extra * 1e3])
        report["dtypes"][dtype] = {
            "decode_tokens_per_s": runs["rates"],
            "new_tokens": runs["lengths"],
            "median_tokens_per_s": medians,
            "verify_one_token_s": costs,
            "kept_tokens_mean": float(kept.mean()),
            "kept_tokens_max": int(kept.max()),
            "positions": int(logits.shape[0]),
        }
        print(f"[sampler-cost] {dtype} done", flush=True)
    setting = f"temperature {args.temperature}, top-p {args.top_p}"
    text = (
        f"## Target alone, up to {args.max_new_tokens} new tokens ({args.target}, {setting}; median decode "
        f"tokens/s, the prefill left out, of {args.prompts} code-maths prompts x {args.rounds} interleaved rounds)\n\n"
        + markdown_table(["dtype", "mode", "decode tokens/s", "vs greedy", "mean tokens"], generation_rows)
        + f"\n\n## One token's verification on the target's own logits (median per token, {setting})\n\n"
        + markdown_table(["dtype", "mode", "ms / token", "sampler's cost over greedy, ms"], sampler_rows)
        + "\n\nTokens the warpers keep: "
        + ", ".join(
            f"{d}: mean {r['kept_tokens_mean']:.1f}, max {r['kept_tokens_max']}" for d, r in report["dtypes"].items()
        )
        + "\n"
    )
    print(text)
    write_text(out / "sampler_cost.md", text)
    write_json(out / "sampler_cost.json", report)
    return out


if __name__ == "__main__":
    main()
