"""The target's forward, term by term: T_step and T_verify(n) for each way the runner can run it.

The performance model's target terms (docs/design.md §21) on the reference target, in one
run, for every backend the runner has on this machine:

* ``reference``: transformers' own eager forward (``decode="reference"``);
* ``fast, oneDNN/ATen``: the packed decoder with the AVX2 kernel turned off, its linears
  through oneDNN's reordered weights (float32) or ATen (bfloat16 without AVX-512);
* ``fast, kernel``: the packed decoder over vlmspec's matrix-vector kernel
  (``vlmspec/kernels/cpu_kernels.py``), the default where it builds: its AVX-512 (and
  AVX512-BF16) form where the CPU has it, and on such CPUs also ``fast, kernel (AVX2)``,
  the same kernels held to AVX2 (``VLMSPEC_CPU_ISA=avx2``), to show what AVX-512 moves
  (held to AVX2 the linears are not packed, so the Python reference runs the layers).
  Where the packed decoder runs all its layers in one native call (Qwen2-VL and
  Qwen2.5-VL on packed AVX-512 linears: ``PackedDecoder.native``), ``fast, vlmspec kernel,
  Python layer loop`` runs the Python reference, the same kernels one Python-level call at a
  time, to show what the native step moves (the ``layers`` column says which ran). The native step has one
  form, one parallel region for the whole step (issue #43 removed the fork-join form, a
  parallel region per kernel call, and its ``fork-join layer loop`` configuration: the team
  step was measured faster, docs/design.md §21.1).

Each configuration is profiled ``--rounds`` times in turn (A, B, C, A, B, C, ...), so a
slow minute of the shared machine hits all of them, and the median of its rounds is
reported. A second table times the linear layers alone (every weight of the model once,
as a step reads them) in GB/s, which is the term the kernel moves.

```bash
python -m benchmarks.target_step --out runs/target-step
```
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.common import markdown_table, plot_lines, prepare_out_dir, run_order, timed, write_json, write_text

TOKEN_COUNTS = (1, 2, 4, 8)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"), help="default: both")
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="profiles of each configuration, interleaved")
    parser.add_argument("--repeats", type=int, default=8, help="timed forwards per token count and profile")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--config", action="append", choices=tuple(CONFIGS), help="forwards to time (default: every one this CPU has)"
    )
    parser.add_argument("--out", default="runs/target-step")
    return parser.parse_args(argv)


# name -> (decode mode, kernel on, ISA the kernel may use: "native" or "avx2", decoder layer sequence:
# "native" (one call for all layers, where the decoder has it) or "python" (the Python reference))
CONFIGS = {
    "reference (transformers eager)": ("reference", True, "native", "python"),
    "fast, oneDNN/ATen linears": ("fast", False, "native", "native"),
    "fast, vlmspec kernel (AVX2)": ("fast", True, "avx2", "native"),
    "fast, vlmspec kernel": ("fast", True, "native", "native"),
    "fast, vlmspec kernel, Python layer loop": ("fast", True, "native", "python"),
}


@contextmanager
def kernel_enabled(enabled: bool, isa: str = "native") -> Iterator[None]:
    """Turn vlmspec's CPU kernel on or off (and hold it to AVX2) for the linears packed inside this block."""
    from vlmspec.kernels import cpu_kernels

    settings = {cpu_kernels.KERNEL_ENV: "1" if enabled else "0", cpu_kernels.ISA_ENV: isa}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    cpu_kernels.kernel_available.cache_clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        cpu_kernels.kernel_available.cache_clear()


def step_times(
    target, decode: str, kernel: bool, isa: str, layers: str, args: argparse.Namespace
) -> tuple[dict[int, float], str, str]:
    """T_verify(n) in seconds for n in TOKEN_COUNTS (the runner's forward, as `vlmspec profile` times it).

    Also returns the linears' backend and the layer sequence that ran (``native`` or ``python``).
    """
    from vlmspec.targets.profile import profile_target

    target.decode = decode
    with kernel_enabled(kernel, isa):
        target.to_device(target.device)  # drops the packed weights: repacked for this backend
        backend, loop = "transformers", "python"
        if decode == "fast":
            decoder = target.packed_decoder()
            if layers == "python":
                decoder.native = None  # the same packed weights, one Python-level call per kernel
            backend, loop = decoder.backend, "python" if decoder.native is None else layers
        table = profile_target(
            target, max_tokens=max(TOKEN_COUNTS), context_length=args.context_length, warmup=2, repeats=args.repeats
        )
    return {n: 1.0 / table.sps(n) for n in TOKEN_COUNTS}, backend, loop


def linear_pass_seconds(target, kernel: bool, isa: str, rows: int) -> float:
    """One pass of ``rows`` rows through every packed linear of the model (the weights a step reads)."""
    with kernel_enabled(kernel, isa):
        target.to_device(target.device)
        decoder = target.packed_decoder()
        linears = [lin for layer in decoder.layers for lin in (layer.qkv, layer.out, layer.gate_up, layer.down)]
        linears.append(decoder.head)
        inputs = {lin: torch.randn(rows, lin.in_features, dtype=target.dtype) for lin in linears}

        def one_pass() -> None:
            for lin in linears:
                lin(inputs[lin])

        one_pass()
        return min(timed(one_pass) for _ in range(5))


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from vlmspec.loading import load_target

    out = prepare_out_dir(args.out)
    from vlmspec.kernels.cpu_kernels import cpu_has_avx512

    default = [name for name, (_, _, isa, _) in CONFIGS.items() if isa == "native" or cpu_has_avx512()]
    configs = {name: CONFIGS[name] for name in args.config or default}
    report: dict = {"configs": {}, "linears": {}}
    step_rows, linear_rows, series = [], [], {}
    for dtype in args.dtype or ("float32", "bfloat16"):
        target = load_target("reference", dtype=dtype)
        weight_bytes = _linear_weight_bytes(target)
        runs: dict[str, list[dict[int, float]]] = {name: [] for name in configs}
        backends: dict[str, str] = {}
        loops: dict[str, str] = {}
        for round_index in range(args.rounds):
            for name in run_order(list(configs), round_index):
                times, backends[name], loops[name] = step_times(target, *configs[name], args)
                runs[name].append(times)
            print(f"[target-step] {dtype}: round {round_index + 1}/{args.rounds} done", flush=True)
        for name, samples in runs.items():
            median = {n: statistics.median(s[n] for s in samples) for n in TOKEN_COUNTS}
            report["configs"][f"{dtype} / {name}"] = {
                "backend": backends[name],
                "layers": loops[name],
                "seconds": median,
            }
            step_rows.append(
                [
                    dtype,
                    name,
                    backends[name],
                    loops[name],
                    *(median[n] * 1e3 for n in TOKEN_COUNTS),
                    median[8] / median[1],
                ]
            )
            series[f"{dtype}: {name}"] = (list(TOKEN_COUNTS), [median[n] * 1e3 for n in TOKEN_COUNTS])
        # The Python layer loop reads the same linears as the native one: timed once.
        linear_configs = {name: c for name, c in configs.items() if c[0] == "fast" and c[3] == "native"}
        for name, (_, kernel, isa, _) in linear_configs.items():
            for rows in (1, 8):
                seconds = linear_pass_seconds(target, kernel, isa, rows)
                label = name.removeprefix("fast, ")
                linear_rows.append([dtype, label, rows, seconds * 1e3, weight_bytes / seconds / 1e9])
                report["linears"][f"{dtype} / {label} / {rows} rows"] = seconds
        target.decode = "fast"

    step_table = markdown_table(
        ["dtype", "forward", "linears", "layers", *(f"T({n}) ms" for n in TOKEN_COUNTS), "T(8) / T(1)"], step_rows
    )
    linear_table = markdown_table(["dtype", "linears", "rows", "all linears ms", "GB/s"], linear_rows)
    text = (
        "## The runner's forward, per backend (reference target, "
        f"{args.context_length} cached tokens, median of {args.rounds} interleaved profiles)\n\n"
        f"{step_table}\n\n## Every linear layer once (the weights one step reads)\n\n{linear_table}\n"
    )
    print(text)
    write_text(out / "target_step.md", text)
    write_json(out / "target_step.json", report)
    plot_lines(
        out / "target_step.png",
        series,
        title="Target forward time by tokens verified",
        xlabel="tokens in the forward (n)",
        ylabel="T_verify(n), ms",
    )
    return out


def _linear_weight_bytes(target) -> int:
    text = target.model.model.language_model
    layers = sum(p.numel() * p.element_size() for n, p in text.layers.named_parameters() if "proj" in n)
    head = target.model.get_output_embeddings().weight
    return layers + head.numel() * head.element_size()


if __name__ == "__main__":
    main()
