"""vlmspec drafters in llama.cpp on this CPU: identical greedy output, the same acceptance by position, tok/s.

For each drafter (default: the bundled DSpark drafter and the bundled headless "DFlash" one), on
the held-out text prompts (the first N of GSM8K, MT-Bench and code-maths, which no reference
drafter trained on), greedy, float32, batch 1, ``--max-new-tokens`` each:

* ``vlmspec export DRAFTER OUT --format gguf`` (``vlmspec.llama_cpp.export_gguf``): the reference
  target's language model as a Llama GGUF (its own 49,156-row vocabulary) and the drafter GGUF,
  both converted by the user's llama.cpp (``--llama-cpp DIR`` / ``$LLAMA_CPP_DIR``, default
  ``runs/llamacpp``);
* ``llama-server`` alone, and with the drafter: ``--spec-type draft-dspark``, ``--spec-draft-n-max``
  = the block size, ``--spec-draft-p-min 0``, so every draft is verified. A headless drafter also
  runs as ``draft-dflash`` (z-lab's slots: draft k read at anchor + k), which settles by
  measurement which slot convention the drafter has;
* vlmspec: the target alone, and ``SpecEngine(target, DSparkProposer)`` with the default scheduler
  (``VerifyAll``: every draft of every round verified, nothing skipped).

Identity: each llama.cpp variant's tokens against ``llama-server`` alone; at a first difference,
whether it is a numerical tie (``benchmarks.identity.identity_report``: the target's own top-2
logit margin there below ``--tie-margin``, 1e-3 in float32, the rule of the vs-peers tables).
Acceptance by position: for draft position k, the share of rounds with drafts whose draft k was
accepted (llama.cpp: ``/metrics`` ``spec_decode_num_accepted_tokens_per_pos_total{position=k-1}``
over ``spec_decode_num_drafts_total``; vlmspec: ``SpecStats.accepted_by_position`` over the rounds
that verified a draft: a request's last token, with no room left to draft, is no round on either side),
with the two-proportion z of their difference. Timings are indicative only: the CPU is shared.

```bash
python -m benchmarks.interop --out docs/results/interop           # both drafters, 4 prompts per set
```

vLLM's CPU build, the other peer, is measured by ``benchmarks/vllm_export.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import markdown_table, prepare_out_dir, write_json, write_text
from benchmarks.identity import identity_report
from benchmarks.llama_cpp_peer import DEFAULT_LLAMA_CPP, run_llama_server, server_version
from benchmarks.spec.workloads import prompt_set_tasks

PROMPT_SETS = (
    "../shared/data/prompts/gsm8k.jsonl",
    "../shared/data/prompts/mt-bench.jsonl",
    "benchmarks/data/code-maths.jsonl",
)
DRAFTERS = ("reference-dspark", "reference-dflash")
ALONE = "llama.cpp alone"
NOISE_Z = 3.0  # |z| above this at any position is more than sampling noise (7 positions, ~1% family-wise)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-cpp", default=None, help="llama.cpp folder (default: $LLAMA_CPP_DIR, else runs/llamacpp)"
    )
    parser.add_argument("--drafter", action="append", help=f"drafter names or directories (default: {DRAFTERS})")
    parser.add_argument(
        "--prompt-set", action="append", help="JSONL prompt sets (default: GSM8K, MT-Bench, code-maths)"
    )
    parser.add_argument("--num-questions", type=int, default=4, help="first N held-out questions of each set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tie-margin", type=float, default=1e-3, help="top-2 logit margin that counts as a tie")
    parser.add_argument("--out", default="runs/interop", help="where results.json and table.md go")
    parser.add_argument("--work-dir", default="runs/interop/work", help="GGUF files and server logs (large)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Path:
    from vlmspec.llama_cpp import LlamaCpp, export_gguf
    from vlmspec.loading import load_target
    from vlmspec.reference import REFERENCE_DRAFTERS, reference_drafter_dir

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    llama_cpp = LlamaCpp.locate(args.llama_cpp or os.environ.get("LLAMA_CPP_DIR") or DEFAULT_LLAMA_CPP)
    server = llama_cpp.binary("llama-server")
    out, work = prepare_out_dir(args.out), prepare_out_dir(args.work_dir)
    tasks = [t for path in args.prompt_set or PROMPT_SETS for t in prompt_set_tasks(path, args.num_questions)]
    target = load_target("reference", dtype="float32")
    inputs = [target.build_inputs(None, task.prompt) for task in tasks]
    prompt_ids = [x.input_ids[0].tolist() for x in inputs]

    results: dict[str, dict] = {}
    acceptance: dict[str, dict] = {}
    for name in args.drafter or DRAFTERS:
        source = reference_drafter_dir(name) if name in REFERENCE_DRAFTERS else Path(name)
        exported = export_gguf(source, work / "gguf" / Path(name).name, target=target, llama_cpp=llama_cpp)
        print(exported.summary(), flush=True)
        if ALONE not in results:
            results[ALONE] = llama_run(server, exported, None, prompt_ids, args, work)
            results["vlmspec target alone"] = vlmspec_run(target, None, tasks, args.max_new_tokens)
        spark = f"vlmspec + {name}"
        results[spark] = vlmspec_run(target, source, tasks, args.max_new_tokens)
        for spec_type in spec_types(exported.report.directory):
            row = f"llama.cpp + {name} ({spec_type})"
            results[row] = llama_run(server, exported, spec_type, prompt_ids, args, work)
            acceptance[row] = compare_acceptance(results[spark]["stats"], results[row]["counters"])

    identity = {
        name: identity_report(target, inputs, results[ALONE]["tokens"], r["tokens"], args.tie_margin)
        for name, r in results.items()
    }
    header = (
        f"reference target, {len(tasks)} held-out text prompts ({', '.join(Path(p).stem for p in args.prompt_set or PROMPT_SETS)}; "
        f"first {args.num_questions} each), {args.max_new_tokens} new tokens, float32 (GGUF f32), batch 1, greedy, "
        f"{args.threads} threads; llama.cpp from {llama_cpp.source.resolve()} ({server_version(server)}). "
        "Timings are indicative: the 2-core CPU is shared."
    )
    text = f"{header}\n\n{results_table(results, identity, len(tasks))}\n\n{acceptance_tables(acceptance)}\n"
    print(text)
    write_text(out / "table.md", text)
    write_json(
        out / "results.json", {"args": vars(args), "results": results, "identity": identity, "acceptance": acceptance}
    )
    return out


def spec_types(drafter_hf_dir: Path) -> list[str]:
    """``draft-dspark`` always (the vlmspec slot convention); a headless drafter also as ``draft-dflash``."""
    exported = json.loads((drafter_hf_dir / "config.json").read_text())
    headless = int(exported.get("markov_rank", 0)) == 0
    return ["draft-dspark", "draft-dflash"] if headless else ["draft-dspark"]


# ---------------------------------------------------------------------------------- runs
def llama_run(server: Path, exported: Any, spec_type: str | None, prompts: list[list[int]], args, work: Path) -> dict:
    """llama-server alone (``spec_type`` None) or with the exported drafter as ``spec_type``."""
    server_args = exported.server_args(args.threads, spec_type)
    name = "alone" if spec_type is None else f"{exported.drafter.stem}-{spec_type}"
    print(f"[interop] llama-server {name} ...", flush=True)
    found = run_llama_server(
        server, server_args, prompts, max_new_tokens=args.max_new_tokens, work_dir=work / "logs", name=name
    )
    found["spec_type"] = spec_type
    return found


def vlmspec_run(target: Any, drafter_dir: Path | None, tasks: list, max_new_tokens: int) -> dict:
    """vlmspec's greedy tokens, seconds and pooled statistics: the target alone (None) or DSpark verifying every draft."""
    from vlmspec import SpecEngine
    from vlmspec.loading import load_proposer
    from vlmspec.types import SpecStats

    engine = SpecEngine(target, load_proposer(drafter_dir, target))  # default scheduler: VerifyAll
    speculative = drafter_dir is not None
    engine.generate(None, tasks[0].prompt, max_new_tokens=4, speculative=speculative)  # warm-up
    tokens, seconds, stats = [], [], []
    print(f"[interop] vlmspec {'+ ' + drafter_dir.name if speculative else 'target alone'} ...", flush=True)
    for task in tasks:
        tick = time.perf_counter()
        output = engine.generate(None, task.prompt, max_new_tokens=max_new_tokens, speculative=speculative)
        seconds.append(time.perf_counter() - tick)
        tokens.append(list(output.token_ids))
        stats.append(output.stats)
    merged = SpecStats.merge(stats)
    return {"tokens": tokens, "seconds": seconds, "stats": merged.as_dict() | _counts(merged)}


def _counts(stats: Any) -> dict:
    """Accepted counts by position and the rounds that verified a draft: llama.cpp counts a verification step
    only when there is a draft (its last token of a request, with no room left to draft, is a plain decode)."""
    drafting = stats.verified_by_position[0] if stats.verified_by_position else 0
    return {"accepted_by_position_counts": list(stats.accepted_by_position), "drafting_rounds": drafting}


# ---------------------------------------------------------------------------------- acceptance
def compare_acceptance(vlmspec_stats: dict, llama_counters: dict) -> dict:
    """Per draft position: the share of rounds that accepted it on each side, and the two-proportion z."""
    rounds_v, rounds_l = vlmspec_stats["drafting_rounds"], llama_counters["spec_decode_num_drafts_total"]
    counts_v, counts_l = vlmspec_stats["accepted_by_position_counts"], llama_counters["accepted_per_pos"]
    positions = []
    for k in range(max(len(counts_v), len(counts_l))):
        share_v = (counts_v[k] if k < len(counts_v) else 0) / rounds_v if rounds_v else float("nan")
        share_l = (counts_l[k] if k < len(counts_l) else 0) / rounds_l if rounds_l else float("nan")
        positions.append(
            {
                "position": k + 1,
                "vlmspec": share_v,
                "llama.cpp": share_l,
                "z": two_proportion_z(share_v, rounds_v, share_l, rounds_l),
            }
        )
    worst = max((abs(p["z"]) for p in positions if not math.isnan(p["z"])), default=float("nan"))
    return {
        "rounds": {"vlmspec": rounds_v, "llama.cpp": rounds_l},
        "accepted_per_round": {
            "vlmspec": sum(counts_v) / rounds_v if rounds_v else float("nan"),
            "llama.cpp": sum(counts_l) / rounds_l if rounds_l else float("nan"),
        },
        "positions": positions,
        "max_abs_z": worst,
        "within_noise": bool(worst <= NOISE_Z),
    }


def two_proportion_z(p1: float, n1: int, p2: float, n2: int) -> float:
    """(p1 - p2) over the standard error of the difference of two independent proportions (0 when both are certain)."""
    if not n1 or not n2:
        return float("nan")
    se = math.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2)
    return 0.0 if se == 0 else (p1 - p2) / se


# ---------------------------------------------------------------------------------- report
def results_table(results: dict[str, dict], identity: dict[str, dict], num_prompts: int) -> str:
    """Markdown: tok/s (prefill included; pooled and the median prompt's), identity with llama.cpp alone (+ ties),
    rounds with drafts and accepted drafts per round."""
    rows = []
    for name, r in results.items():
        same = identity[name]
        accepted = _accepted_per_round(r)
        identical = f"{same['identical']}/{num_prompts} (+{same['ties']} ties)"
        rows.append([name, tok_per_s(r), median_tok_per_s(r), identical, *accepted])
    headers = ["engine", "tok/s", "median tok/s", "= llama.cpp alone", "rounds with drafts", "accepted / round"]
    return markdown_table(headers, rows)


def _accepted_per_round(result: dict) -> list:
    if "counters" in result and result.get("spec_type"):
        c = result["counters"]
        steps = c["spec_decode_num_drafts_total"]
        return [int(steps), c["spec_decode_num_accepted_tokens_total"] / steps if steps else None]
    stats = result.get("stats", {})
    if stats.get("drafting_rounds"):
        return [stats["drafting_rounds"], stats["accepted"] / stats["drafting_rounds"]]
    return [None, None]


def acceptance_tables(acceptance: dict[str, dict]) -> str:
    """One markdown table per llama.cpp variant: share of rounds accepting draft k, both sides, and z."""
    parts = []
    for name, a in acceptance.items():
        rows = [[p["position"], p["vlmspec"], p["llama.cpp"], p["z"]] for p in a["positions"]]
        rows.append(["per round", a["accepted_per_round"]["vlmspec"], a["accepted_per_round"]["llama.cpp"], None])
        verdict = (
            "within noise" if a["within_noise"] else f"NOT within noise (max |z| {a['max_abs_z']:.1f} > {NOISE_Z})"
        )
        title = (
            f"**{name}** against vlmspec, acceptance by position ({a['rounds']['vlmspec']} / "
            f"{int(a['rounds']['llama.cpp'])} rounds): {verdict}"
        )
        table = markdown_table(["draft position", "vlmspec", "llama.cpp", "z"], rows, digits=3)
        parts.append(f"{title}\n\n{table}")
    return "\n\n".join(parts)


def tok_per_s(result: dict) -> float:
    """All tokens over all seconds (prefill included)."""
    return sum(len(t) for t in result["tokens"]) / sum(result["seconds"])


def median_tok_per_s(result: dict) -> float:
    """The median prompt's tokens per second: robust to the minutes when other jobs take the shared CPU."""
    return statistics.median(len(t) / s for t, s in zip(result["tokens"], result["seconds"]))


if __name__ == "__main__":
    main()
