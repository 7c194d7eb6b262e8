"""vlmspec against what a user would run instead, in one run: transformers' generate() and vLLM's CPU build.

transformers runs plain and with its prompt lookup (``prompt_lookup_num_tokens=10``,
``max_matching_ngram_size=2``, the values of its documentation's example); vLLM plain and
with its n-gram speculation.

Batch 1, greedy, the held-out text mix (the first GSM8K and MT-Bench questions, which
no drafter trained on: ``vlmspec.data.heldout`` splits them, and the benchmark and
``recipes/reference_prompts.py`` take their prompts through it).
Every variant answers the same prompt tokens; the vlmspec variants and ``generate()``
take turns question by question (so a slow minute of the shared machine hits all of
them), and vLLM runs afterwards in its own venv (``benchmarks/vllm_peer.py``).

```bash
python -m benchmarks.vs_vllm --dtype float32 --out runs/vs-vllm/float32
python -m benchmarks.vs_vllm --dtype bfloat16 --out runs/vs-vllm/bfloat16
```

Identity is reported as the runner issue defines it: each variant's tokens against
``generate()``'s, and at the first difference, whether it is a numerical tie (the
target's own top-2 logit margin there below ``--tie-margin``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.common import markdown_table, prepare_out_dir, rotated, write_json, write_text
from benchmarks.spec.workloads import prompt_set_tasks
from benchmarks.vllm_peer import run_vllm

PROMPT_SETS = ("../shared/data/prompts/gsm8k.jsonl", "../shared/data/prompts/mt-bench.jsonl")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompt-set", action="append", help="JSONL prompt sets (default: GSM8K and MT-Bench)")
    parser.add_argument("--num-questions", type=int, default=4, help="first N questions of each set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM peers")
    parser.add_argument(
        "--tie-margin",
        type=float,
        default=None,
        help="top-2 logit margin that counts as a tie (default: the forwards' measured logit differences, "
        "about 1e-4 in float32 and 0.6 in bfloat16 on the reference target: 1e-3 and 1.0)",
    )
    parser.add_argument("--out", default="runs/vs-vllm")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.tie_margin is None:
        args.tie_margin = 1e-3 if args.dtype == "float32" else 1.0
    torch.set_num_threads(args.threads)
    from vlmspec import SpecEngine
    from vlmspec.loading import load_proposer, load_target
    from vlmspec.reference import reference_drafter_dir, reference_sps_table, reference_target_dir
    from vlmspec.scheduling.factory import build_scheduler

    out = prepare_out_dir(args.out)
    tasks = [t for path in args.prompt_set or PROMPT_SETS for t in prompt_set_tasks(path, args.num_questions)]
    target = load_target("reference", dtype=args.dtype)
    # The reference pair's serving defaults: SPS on this dtype's measured curve, calibrated confidences;
    # the default drafter ("reference": n-gram copies and DSpark under the drafting policy), and DSpark alone.
    scheduler = build_scheduler(
        "sps", sps=reference_sps_table(args.dtype), calibration=reference_drafter_dir("reference")
    )
    engine = SpecEngine(target, load_proposer("reference", target), scheduler)
    dspark = SpecEngine(target, load_proposer("reference-dspark", target), scheduler)
    inputs = [target.build_inputs(None, task.prompt) for task in tasks]

    def hf_generate(**options):
        def run(i: int) -> list[int]:
            return target.generate_greedy(inputs[i], args.max_new_tokens, **options)

        return run

    def vlmspec_run(decode: str, speculative: bool, host: SpecEngine = engine):
        def run(i: int) -> list[int]:
            target.decode = decode
            task = tasks[i]
            return host.generate(None, task.prompt, max_new_tokens=args.max_new_tokens, speculative=speculative)

        return run

    variants = {
        "transformers generate()": hf_generate(),
        "transformers prompt lookup": hf_generate(prompt_lookup_num_tokens=10, max_matching_ngram_size=2),
        "vlmspec target alone (reference forward)": vlmspec_run("reference", False),
        ALONE: vlmspec_run("fast", False),
        "vlmspec + DSpark every round, SPS": vlmspec_run("fast", True, dspark),
        "vlmspec defaults: n-gram + corpus + DSpark, drafting policy, SPS": vlmspec_run("fast", True),
    }
    for run in variants.values():  # warm-up: first-call costs (packing the weights, allocators)
        run(0)
    results = {name: {"tokens": [], "seconds": [], "tau": []} for name in variants}
    for i, _ in enumerate(tasks):
        for name in rotated(list(variants), i):
            tick = time.perf_counter()
            output = variants[name](i)
            results[name]["seconds"].append(time.perf_counter() - tick)
            tokens = output if isinstance(output, list) else output.token_ids
            results[name]["tokens"].append(list(tokens))
            if not isinstance(output, list):
                results[name]["tau"].append(output.stats.tau)
                results[name].setdefault("sources", []).append(output.stats.rounds_by_source)
        print(f"[vs-vllm] question {i + 1}/{len(tasks)} done", flush=True)
    target.decode = "fast"

    if not args.no_vllm:
        prompt_ids = [x.input_ids[0].tolist() for x in inputs]
        for ngram in (False, True):
            name = f"vLLM {'n-gram speculation' if ngram else 'plain'}"
            found = run_vllm(
                reference_target_dir(),
                prompt_ids,
                max_new_tokens=args.max_new_tokens,
                dtype=args.dtype,
                ngram=ngram,
                threads=args.threads,
                work_dir=out / "vllm",
            )
            results[name] = {"tokens": found["tokens"], "seconds": found["seconds"], "acceptance": found["acceptance"]}

    reference = results["transformers generate()"]["tokens"]
    alone = results[ALONE]["tokens"]
    rows, report = [], {}
    best_peer = max(
        (tok_per_s(r) for n, r in results.items() if n.startswith("vLLM")),
        default=None,
    )
    for name, r in results.items():
        identity = identity_report(target, inputs, reference, r["tokens"], args.tie_margin)
        own = identity_report(target, inputs, alone, r["tokens"], args.tie_margin)  # against vlmspec's target alone
        speed = tok_per_s(r)
        tau = sum(r["tau"]) / len(r["tau"]) if r.get("tau") else None
        rows.append(
            [
                name,
                speed,
                speed / tok_per_s(results["transformers generate()"]),
                speed / best_peer if best_peer else None,
                tau,
                f"{identity['identical']}/{len(tasks)} (+{identity['ties']})",
                f"{own['identical']}/{len(tasks)} (+{own['ties']})",
            ]
        )
        report[name] = {**r, "tok_per_s": speed, "identity": identity, "identity_to_target_alone": own}
    headers = [
        "engine",
        "tok/s",
        "vs generate()",
        "vs best vLLM",
        "tau",
        "= generate() (+ ties)",
        "= vlmspec target alone (+ ties)",
    ]
    table = markdown_table(headers, rows)
    by_class = per_class_table(tasks, results)
    print(f"{table}\n\n{by_class}")
    write_text(
        out / "table.md",
        f"dtype {args.dtype}, {len(tasks)} questions, batch 1, greedy\n\n{table}\n\n"
        f"tok/s per prompt class (ratio to vlmspec's target alone)\n\n{by_class}\n",
    )
    write_json(out / "results.json", {"args": vars(args), "results": report})
    return out


ALONE = "vlmspec target alone (fast runner)"


def per_class_table(tasks, results: dict) -> str:
    """Each engine's tok/s on each prompt class, with its ratio to vlmspec's target alone on that class."""
    classes = sorted({task.group for task in tasks})
    rows = []
    for name, r in results.items():
        row = [name]
        for group in classes:
            picked = [i for i, task in enumerate(tasks) if task.group == group]
            speed = tok_per_s(_subset(r, picked))
            row.append(f"{speed:.1f} ({speed / tok_per_s(_subset(results[ALONE], picked)):.2f}x)")
        rows.append(row)
    return markdown_table(["engine", *classes], rows)


def _subset(result: dict, picked: list[int]) -> dict:
    return {"tokens": [result["tokens"][i] for i in picked], "seconds": [result["seconds"][i] for i in picked]}


def tok_per_s(result: dict) -> float:
    return sum(len(t) for t in result["tokens"]) / sum(result["seconds"])


def identity_report(target, inputs, reference: list[list[int]], tokens: list[list[int]], margin: float) -> dict:
    """Outputs equal to ``reference``; for the others, whether the first difference sits at a numerical tie."""
    identical, ties, divergences = 0, 0, []
    for x, ref, got in zip(inputs, reference, tokens):
        if ref == got:
            identical += 1
            continue
        at = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        top2 = top2_margin(target, x.input_ids[0].tolist() + ref[:at])
        ties += int(top2 < margin)
        divergences.append({"position": at, "top2_margin": top2})
    return {"identical": identical, "ties": ties, "divergences": divergences}


@torch.inference_mode()
def top2_margin(target, ids: list[int]) -> float:
    """The target's own top-2 logit margin for the token after ``ids`` (transformers' forward)."""
    logits = target.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
    best = torch.topk(logits, 2).values
    return float(best[0] - best[1])


if __name__ == "__main__":
    main()
