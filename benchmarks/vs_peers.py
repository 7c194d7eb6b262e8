"""vlmspec against what a user would run instead, in one run: transformers, llama.cpp and vLLM's CPU build.

transformers runs plain and with its prompt lookup (``prompt_lookup_num_tokens=10``,
``max_matching_ngram_size=2``, the values of its documentation's example); llama.cpp's
``llama-server`` plain, with its n-gram speculation (``--spec-type ngram-simple`` and
``ngram-mod``, where the build has them) and on Q8_0 weights (lossy: what many users run);
vLLM plain and with its n-gram speculation.

Batch 1, greedy, the held-out text mix (the first GSM8K and MT-Bench questions, which
no drafter trained on: ``vlmspec.data.heldout`` splits them, and the benchmark and
``recipes/reference_prompts.py`` take their prompts through it).
Every variant answers the same prompt tokens; the vlmspec variants, ``generate()`` and the
llama.cpp servers take turns question by question (so a slow minute of the shared machine
hits all of them), and vLLM runs afterwards in its own venv (``benchmarks/vllm_peer.py``).

llama.cpp's weights are the reference target's own language model (``vlmspec.llama_cpp``: a
Llama-shaped folder with its 49,156-row vocabulary, so the token ids are the same), converted
by llama.cpp's ``convert_hf_to_gguf.py`` to F32 or BF16 as the run's dtype, and Q8_0 by
``llama-quantize``; cached under ``runs/llamacpp-peer/gguf`` (``benchmarks/llama_cpp_peer.py``).
Its prompts go to ``/completion`` as token ids (``temperature`` 0, ``cache_prompt`` false,
``n_predict`` = ``--max-new-tokens``; EOS ends an answer, as in every other row), timed by the
client from request to answer. A peer that is not there (llama.cpp not built, vLLM not
installable) is skipped with the reason in the table's notes.

```bash
python -m benchmarks.vs_peers --dtype float32 --out runs/vs-peers/float32
python -m benchmarks.vs_peers --dtype bfloat16 --out runs/vs-peers/bfloat16
python -m benchmarks.vs_peers --images 4 --out runs/vs-peers/images   # image questions: TTFT and tok/s
```

Identity is reported as the runner issue defines it: each variant's tokens against
``generate()``'s and against vlmspec's target alone, and at the first difference, whether it
is a numerical tie (the target's own top-2 logit margin there below ``--tie-margin``).
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks import llama_cpp_peer
from benchmarks.common import markdown_table, peer_logs_dir, prepare_out_dir, run_order, write_json, write_text
from benchmarks.identity import identity_report
from benchmarks.image_peers import run_images
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
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp peers")
    parser.add_argument(
        "--llama-cpp", default=None, help="llama.cpp folder (default: $LLAMA_CPP_DIR, else runs/llamacpp)"
    )
    parser.add_argument("--no-quantized", action="store_true", help="skip llama.cpp's Q8_0 row")
    parser.add_argument(
        "--images",
        type=int,
        default=0,
        help="instead: N image questions (scikit-image photos), time to first token and tok/s against "
        "transformers and llama.cpp's multimodal path (benchmarks/image_peers.py)",
    )
    parser.add_argument("--image-max-side", type=int, default=448, help="--images: the photos' longest side, pixels")
    parser.add_argument(
        "--tie-margin",
        type=float,
        default=None,
        help="top-2 logit margin that counts as a tie (default: the forwards' measured logit differences, "
        "about 1e-4 in float32 and 0.6 in bfloat16 on the reference target: 1e-3 and 1.0)",
    )
    parser.add_argument(
        "--previous-drafter",
        type=Path,
        default=None,
        help="also run DSpark every round and the defaults with this DSpark drafter directory (its own "
        "calibration), e.g. the one a retrained drafter replaces: before and after in the same run",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature instead of greedy (every row: vlmspec, llama.cpp with top-k and min-p off); "
        "transformers' rows and the identity columns are left out, and a greedy target-alone row is added",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    parser.add_argument("--seed", type=int, default=0, help="with --temperature: question i samples with seed + i")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every question N times, one round of all questions after another, the engines in another order "
        "each time; tok/s pools the runs (this machine's speed moves by a fifth within minutes)",
    )
    parser.add_argument("--out", default="runs/vs-peers")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.tie_margin is None:
        args.tie_margin = 1e-3 if args.dtype == "float32" else 1.0
    torch.set_num_threads(args.threads)
    if args.images:
        return run_images(args)
    from vlmspec import SpecEngine
    from vlmspec.loading import load_target
    from vlmspec.reference import reference_drafter_dir

    out = prepare_out_dir(args.out)
    tasks = [t for path in args.prompt_set or PROMPT_SETS for t in prompt_set_tasks(path, args.num_questions)]
    target = load_target("reference", dtype=args.dtype)
    engine, dspark, dspark_alone = drafter_engines(target, reference_drafter_dir("reference"))
    inputs = [target.build_inputs(None, task.prompt) for task in tasks]
    prompt_ids = [x.input_ids[0].tolist() for x in inputs]

    def hf_generate(**options):
        def run(i: int) -> list[int]:
            return target.generate_greedy(inputs[i], args.max_new_tokens, **options)

        return run

    def vlmspec_run(decode: str, speculative: bool, host: SpecEngine = engine, sampled: bool = True):
        def run(i: int) -> list[int]:
            target.decode = decode
            task = tasks[i]
            options = sampling(args, i) if sampled else None
            return host.generate(
                None, task.prompt, max_new_tokens=args.max_new_tokens, speculative=speculative, **(options or {})
            )

        return run

    greedy = sampling(args, 0) is None
    variants = {
        "transformers generate()": hf_generate(),
        "transformers prompt lookup": hf_generate(prompt_lookup_num_tokens=10, max_matching_ngram_size=2),
        "vlmspec target alone (reference forward)": vlmspec_run("reference", False),
    }
    if not greedy:  # transformers' rows here decode greedily: in a sampled run the greedy target alone stands in
        variants = {GREEDY_ALONE: vlmspec_run("fast", False, sampled=False)}
    variants |= {
        ALONE: vlmspec_run("fast", False),
        DSPARK_EVERY_ROUND: vlmspec_run("fast", True, dspark),
        DSPARK_ALONE: vlmspec_run("fast", True, dspark_alone),
        DEFAULTS: vlmspec_run("fast", True),
    }
    if args.previous_drafter is not None:
        old_defaults, old_dspark, _ = drafter_engines(target, args.previous_drafter)
        variants[f"{DSPARK_EVERY_ROUND} (previous drafter)"] = vlmspec_run("fast", True, old_dspark)
        variants[f"{DEFAULTS} (previous drafter)"] = vlmspec_run("fast", True, old_defaults)
    skipped: dict[str, str] = {}
    servers = [] if args.no_llama_cpp else start_llama_servers(target, args, out, skipped)
    for name, server in servers:
        variants[name] = llama_run(server, prompt_ids, args.max_new_tokens, lambda i: sampling(args, i))
    try:
        for run in variants.values():  # warm-up: first-call costs (packing the weights, allocators)
            run(0)
        runs = [{name: {"tokens": [], "seconds": [], "tau": []} for name in variants} for _ in tasks]
        for k in range(args.rounds):
            if k:  # llama-server's n-gram-mod keeps what it saw across requests: every round starts it afresh
                restart_llama_servers(servers, variants)
            for i, _ in enumerate(tasks):
                for name in run_order(list(variants), i * args.rounds + k):
                    tick = time.perf_counter()
                    output = variants[name](i)
                    runs[i][name]["seconds"].append(time.perf_counter() - tick)
                    record(runs[i][name], output)
                print(f"[vs-peers] {round_name(k, args.rounds)}question {i + 1}/{len(tasks)} done", flush=True)
        results = {name: {"tokens": [], "seconds": [], "tau": []} for name in variants}
        for question in runs:
            for name, run in question.items():
                pool_runs(results[name], run)
    finally:
        for _, server in servers:
            server.stop()
    target.decode = "fast"
    for name, server in servers:
        results[name]["command"] = server.command

    if not args.no_vllm:
        results.update(vllm_rows(prompt_ids, args, out, skipped))

    reference = results["transformers generate()"]["tokens"] if greedy else None
    alone = results[ALONE]["tokens"]
    rows, report = [], {}
    best_llama = best_of(results, lambda n: n.startswith("llama.cpp") and n != llama_cpp_peer.LOSSY_ROW)
    best_vllm = best_of(results, lambda n: n.startswith("vLLM"))
    for name, r in results.items():
        speed = tok_per_s(r)
        if not greedy:  # sampled answers differ by design: speed and tau only
            rows.append([name, speed, None, speed / best_llama if best_llama else None, None, mean_tau(r), "-", "-"])
            report[name] = {**r, "tok_per_s": speed}
            continue
        identity = identity_report(target, inputs, reference, r["tokens"], args.tie_margin)
        own = identity_report(target, inputs, alone, r["tokens"], args.tie_margin)  # against vlmspec's target alone
        tau = mean_tau(r)
        rows.append(
            [
                name,
                speed,
                speed / tok_per_s(results["transformers generate()"]),
                speed / best_llama if best_llama else None,
                speed / best_vllm if best_vllm else None,
                tau,
                f"{identity['identical']}/{len(tasks)} (+{identity['ties']})",
                f"{own['identical']}/{len(tasks)} (+{own['ties']})",
            ]
        )
        report[name] = {**r, "tok_per_s": speed, "identity": identity, "identity_to_target_alone": own}
    table = markdown_table(HEADERS, rows)
    by_class = per_class_table(tasks, results)
    notes = "".join(f"\n- {peer} skipped: {why}" for peer, why in skipped.items())
    notes += "".join(
        f"\n- {name}: {r['repeats_differ']} of its repeated runs answered otherwise than its first"
        for name, r in results.items()
        if r.get("repeats_differ")
    )
    print(f"{table}\n\n{by_class}{notes}")
    write_text(
        out / "table.md",
        f"dtype {args.dtype}, {len(tasks)} questions{runs_note(args.rounds)}, batch 1, {decoding_name(args)}, "
        f"{args.max_new_tokens} new tokens; "
        f"llama.cpp tok/s: client wall time, prefill included{notes}\n\n{table}\n\n"
        f"tok/s per prompt class (ratio to vlmspec's target alone)\n\n{by_class}\n",
    )
    write_json(out / "results.json", {"args": vars(args), "skipped": skipped, "results": report})
    return out


DSPARK_EVERY_ROUND = "vlmspec + DSpark every round, SPS"
DEFAULTS = "vlmspec defaults: n-gram + corpus + DSpark, drafting policy, SPS"
DSPARK_ALONE = "vlmspec + DSpark alone, drafting policy, SPS (reference-dspark)"


def drafter_engines(target, drafter_dir: Path):
    """(defaults, DSpark every round, DSpark alone under the drafting policy) around the DSpark drafter in
    ``drafter_dir``, its calibration in the scheduler.

    The reference pair's serving defaults: SPS on the target's curve measured on this machine, the drafter's calibrated
    confidences; the defaults add n-gram and corpus copies under the drafting policy; DSpark alone is what
    ``reference-dspark`` loads (the policy, no copies), with measured drafting costs.
    Prefix caching is off: every question is a new prompt, and a repeated one (the warm-up, ``--rounds``,
    the target alone and the defaults sharing an engine) must not find its prefill cached.
    """
    from vlmspec import SpecEngine
    from vlmspec.drafters.base import Proposer
    from vlmspec.drafters.dspark import DSparkProposer
    from vlmspec.loading import model_proposer, reference_alone, reference_hybrid
    from vlmspec.reference import machine_sps_table, reference_drafter_dir
    from vlmspec.scheduling.factory import build_scheduler

    if not (Path(drafter_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{drafter_dir} holds no DSpark drafter (config.json); pass a saved drafter directory")
    scheduler = build_scheduler("sps", sps=machine_sps_table(target), calibration=drafter_dir)

    def proposer() -> (
        DSparkProposer
    ):  # one per engine: a proposer keeps its requests' drafting state (the default dtype)
        return model_proposer(drafter_dir, target)

    drafter = "reference-dspark" if Path(drafter_dir) == reference_drafter_dir("reference-dspark") else str(drafter_dir)

    def engine(proposer: Proposer) -> SpecEngine:
        return SpecEngine(target, proposer, scheduler, prefix_caching=False)

    defaults = engine(reference_hybrid(proposer(), target, drafter=drafter))
    alone = engine(reference_alone(proposer(), target, drafter=drafter))
    return defaults, engine(proposer()), alone


HEADERS = [
    "engine",
    "tok/s",
    "vs generate()",
    "vs best exact llama.cpp",
    "vs best vLLM",
    "tau",
    "= generate() (+ ties)",
    "= vlmspec target alone (+ ties)",
]


def record(result: dict, output) -> None:
    """One answer into its row: vlmspec's GenerationResult, a token list, or a llama-server answer (a dict)."""
    if isinstance(output, dict):  # llama.cpp: the client's wall time replaces the loop's (they differ by the HTTP hop)
        result["seconds"][-1] = output["wall_s"]
        result["tokens"].append(list(output["tokens"]))
        result.setdefault("timings", []).append(output["timings"])
        return
    tokens = output if isinstance(output, list) else output.token_ids
    result["tokens"].append(list(tokens))
    if not isinstance(output, list):
        result["tau"].append(output.stats.tau)
        result.setdefault("sources", []).append(output.stats.rounds_by_source)


def restart_llama_servers(servers: list, variants: dict) -> None:
    """Stop and start every llama-server, then warm each up on question 0 as before the first round."""
    for name, server in servers:
        server.stop()
        server.start()
        variants[name](0)


def round_name(k: int, rounds: int) -> str:
    return "" if rounds == 1 else f"round {k + 1}/{rounds}, "


def pool_runs(result: dict, runs: dict) -> None:
    """One question's runs (``--rounds``) into its row as one entry: the first run's answer, the mean run's
    seconds (so tok/s pools every run) and tau; ``repeats_differ`` counts the runs whose answer was not the
    first's (a greedy engine repeats its answer; a sampled one draws with the question's seed each time)."""
    first, rounds = runs["tokens"][0], len(runs["tokens"])
    result["tokens"].append(first)
    result["seconds"].append(sum(runs["seconds"]) / rounds)  # the mean run: tok/s of every run pooled
    if runs["tau"]:
        result["tau"].append(sum(runs["tau"]) / len(runs["tau"]))
    for key in ("timings", "sources"):
        if key in runs:
            result.setdefault(key, []).append(runs[key][0])
    differ = sum(tokens != first for tokens in runs["tokens"][1:])
    result["repeats_differ"] = result.get("repeats_differ", 0) + differ


def best_of(results: dict, picked) -> float | None:
    """The highest tok/s among the rows whose name ``picked`` accepts (None when there is none)."""
    return max((tok_per_s(r) for n, r in results.items() if picked(n)), default=None)


def start_llama_servers(target, args, out: Path, skipped: dict[str, str]) -> list:
    """One running ``llama-server`` per llama.cpp row (plain, n-gram types, Q8_0); none, with the reason, if missing."""
    try:
        llama_cpp = llama_cpp_peer.locate_llama_cpp(args.llama_cpp)
        ggufs = llama_cpp_peer.reference_ggufs(target, args.dtype, llama_cpp, quantized=not args.no_quantized)
    except (ValueError, RuntimeError, OSError) as err:
        skipped["llama.cpp"] = str(err).splitlines()[0]
        print(f"[vs-peers] llama.cpp rows skipped: {skipped['llama.cpp']}", flush=True)
        return []
    binary = llama_cpp.binary("llama-server")
    servers = []
    try:
        for i, (name, server_args) in enumerate(llama_cpp_peer.peer_rows(ggufs, binary, args.threads).items()):
            server = llama_cpp_peer.LlamaServer(
                binary, server_args, work_dir=peer_logs_dir(out, "llama-cpp"), name=f"row{i}"
            )
            servers.append((name, server.start()))
    except BaseException:
        for _, server in servers:
            server.stop()
        raise
    return servers


def llama_run(server, prompt_ids: list[list[int]], max_new_tokens: int, sampling_of=lambda i: None):
    def run(i: int) -> dict:
        return server.complete(prompt_ids[i], max_new_tokens, sampling_of(i))

    return run


def sampling(args: argparse.Namespace, question: int) -> dict[str, float] | None:
    """Question ``question``'s sampling options (temperature, top_p, seed), or None for greedy decoding."""
    if args.temperature <= 0:
        return None
    return {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed + question}


def decoding_name(args: argparse.Namespace) -> str:
    return "greedy" if args.temperature <= 0 else f"sampled (temperature {args.temperature}, top-p {args.top_p})"


def runs_note(rounds: int) -> str:
    return "" if rounds == 1 else f" run {rounds} times each (engines in a new order each time; tok/s pools the runs)"


def mean_tau(result: dict) -> float | None:
    return sum(result["tau"]) / len(result["tau"]) if result.get("tau") else None


def vllm_rows(prompt_ids: list[list[int]], args, out: Path, skipped: dict[str, str]) -> dict[str, dict]:
    """vLLM plain and with n-gram speculation; none, with the reason, when it cannot be installed or run."""
    from vlmspec.reference import reference_target_dir

    rows = {}
    for ngram in (False, True):
        name = f"vLLM {'n-gram speculation' if ngram else 'plain'}"
        try:
            found = run_vllm(
                reference_target_dir(),
                prompt_ids,
                max_new_tokens=args.max_new_tokens,
                dtype=args.dtype,
                ngram=ngram,
                threads=args.threads,
                work_dir=peer_logs_dir(out, "vllm"),
            )
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            skipped[name] = str(err).splitlines()[0]
            print(f"[vs-peers] {name} skipped: {skipped[name]}", flush=True)
            continue
        rows[name] = {"tokens": found["tokens"], "seconds": found["seconds"], "acceptance": found["acceptance"]}
    return rows


ALONE = "vlmspec target alone (fast runner)"
GREEDY_ALONE = "vlmspec target alone (fast runner), greedy"


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


if __name__ == "__main__":
    main()
