"""Simulated serving: how the verification schedulers trade draft tokens for throughput.

R concurrent requests (1 to 128 by default) each draft gamma tokens per engine step;
their confidences are drawn from recorded rounds. Every scheduler sees the same draws
(common random numbers) and decides how many draft tokens each request verifies; the
step then costs ``1 / SPS(B)`` seconds with ``B = sum_r (1 + l_r)`` tokens in flight.

Two accountings of the committed tokens per step (anchors' recovered/bonus tokens plus
accepted drafts):

* expected: ``R + sum_r sum_{j <= l_r} a[r, j]`` (what the schedulers optimise; exact if
  the confidences are calibrated);
* Monte Carlo: ``R + sum_r min(l_r, n_r)`` with ``n_r`` the accepted length realised in
  the recorded round that was drawn.

Reported per SPS curve, concurrency and scheduler: system throughput (committed tokens
per second), tokens per step per request, and the average verification budget per
request (draft tokens verified per step: docs/design.md §12.4, the paper's Figure 8).

Inputs (each optional; the output says which were used):

* ``--records FILE``: rounds saved by ``vlmspec.scheduling.RoundRecorder`` (JSON or NPZ;
  format in :mod:`vlmspec.scheduling.calibration`). Without it: the documented synthetic
  generator ``vlmspec.scheduling.synthetic_records`` (calibrated by construction).
* ``--calibration DIR``: a ``calibration.json`` (STS) applied to recorded confidences.
* ``--sps FILE``: an SPS table measured on this machine (``vlmspec profile``). Without
  it: the ``cpu`` preset (the shape in environment-notes.md). The ``gpu_like`` preset
  (synthetic) is always simulated too.

Run from the repository root::

    python -m benchmarks.scheduler_sim --out runs/scheduler_sim
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from vlmspec.scheduling import (
    Calibration,
    RoundRecords,
    Scheduler,
    SPSTable,
    build_scheduler,
    plot_sps,
    sps_preset,
    synthetic_records,
)
from vlmspec.scheduling.base import prefix_survival

# The schedulers a serving engine would batch, by their vlmspec.scheduling.build_scheduler names:
# none (VerifyAll), threshold (ThresholdScheduler), prefix (PrefixScheduler, Algorithm 1) and
# lagged-topk (LaggedTopKScheduler). sps (SPSArgmaxScheduler) plans one request alone.
SCHEDULER_NAMES = ("none", "threshold", "prefix", "lagged-topk")


@dataclass
class Cell:
    """One (curve, concurrency, scheduler) result, averaged over the simulated steps."""

    curve: str
    concurrency: int
    scheduler: str
    budget_per_request: float  # draft tokens verified per request per step
    tokens_in_flight: float  # mean B
    tokens_per_step_expected: float  # committed tokens per request per step
    tokens_per_step_mc: float
    throughput_expected: float  # committed tokens per second, whole system
    throughput_mc: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/scheduler_sim"), help="output directory")
    parser.add_argument("--records", type=Path, help="recorded rounds (.json/.npz from RoundRecorder)")
    parser.add_argument("--calibration", type=Path, help="directory holding calibration.json (or the file)")
    parser.add_argument("--sps", type=Path, help="SPS table measured on this machine (JSON from `vlmspec profile`)")
    parser.add_argument("--gamma", type=int, default=7, help="block size of the synthetic rounds (default 7)")
    parser.add_argument("--synthetic-rounds", type=int, default=20000, help="synthetic rounds to draw from")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128", help="comma-separated R values")
    parser.add_argument("--steps", type=int, default=200, help="simulated engine steps per (curve, R, scheduler)")
    parser.add_argument("--threshold", type=float, default=0.6, help="ThresholdScheduler's confidence threshold")
    parser.add_argument("--lag", type=int, default=2, help="LaggedTopKScheduler's lag in steps")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# -- inputs -------------------------------------------------------------------------------------


def load_rounds(args: argparse.Namespace, generator: torch.Generator) -> tuple[RoundRecords, torch.Tensor, list[str]]:
    """(records, confidences the schedulers see [N, gamma], notes about where they came from)."""
    notes = []
    if args.records is not None:
        records = RoundRecords.load(args.records)
        notes.append(f"confidences: {len(records)} recorded rounds from {args.records} (gamma={records.gamma})")
        censored = float(
            ((records.num_accepted == records.num_verified) & (records.num_verified < records.num_drafted))
            .float()
            .mean()
        )
        if censored > 0:
            notes.append(
                f"{censored:.1%} of recorded rounds stop at an unverified position: Monte Carlo undercounts them"
            )
    else:
        records = synthetic_records(args.synthetic_rounds, args.gamma, generator=generator)
        notes.append(
            f"confidences: SYNTHETIC ({args.synthetic_rounds} rounds from vlmspec.scheduling.synthetic_records, "
            f"gamma={args.gamma}, calibrated by construction); pass --records for recorded rounds"
        )
    confidences = records.confidences
    if args.calibration is not None:
        calibration = Calibration.load(args.calibration)
        confidences = calibration.apply(confidences)
        notes.append(
            f"calibration: temperatures {[round(t, 3) for t in calibration.temperatures]} from {args.calibration}"
        )
    elif args.records is not None:
        notes.append("calibration: none; recorded confidences are used raw (expected numbers trust them)")
    return records, confidences, notes


def load_curves(args: argparse.Namespace, max_tokens: int) -> tuple[dict[str, SPSTable], list[str]]:
    if args.sps is not None:
        curves = {"measured": SPSTable.load(args.sps)}
        notes = [f"SPS 'measured': {args.sps} ({curves['measured'].meta.model} on {curves['measured'].meta.device})"]
    else:
        curves = {"cpu_preset": sps_preset("cpu", max_tokens)}
        notes = ["SPS 'cpu_preset': the cpu preset (environment-notes.md shape), no measured table given (--sps)"]
    curves["gpu_like"] = sps_preset("gpu_like", max_tokens)
    notes.append("SPS 'gpu_like': synthetic preset (flat-ish while memory-bound, decaying past about 256 tokens)")
    for name, table in curves.items():
        if table.max_tokens < max_tokens or table.min_tokens > 1:
            raise SystemExit(
                f"SPS curve {name!r} covers {table.min_tokens}..{table.max_tokens} tokens but the largest "
                f"concurrency needs 1..{max_tokens}; profile further or lower --concurrency"
            )
    return curves, notes


def make_schedulers(table: SPSTable, args: argparse.Namespace) -> dict[str, Scheduler]:
    """Fresh instances by name (LaggedTopKScheduler keeps state across steps)."""
    return {name: build_scheduler(name, threshold=args.threshold, sps=table, lag=args.lag) for name in SCHEDULER_NAMES}


# -- simulation --------------------------------------------------------------------------------


def simulate(
    scheduler: Scheduler,
    table: SPSTable,
    records: RoundRecords,
    confidences: torch.Tensor,
    concurrency: int,
    steps: int,
    seed: int,
) -> dict[str, float]:
    """Run ``steps`` engine steps; every scheduler gets the same draws for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    survival_all = prefix_survival(confidences.double().numpy(), records.num_drafted.numpy())  # [N, gamma]
    realised = records.num_accepted.numpy()  # [N]
    totals = {"budget": 0.0, "tokens_in_flight": 0.0, "expected": 0.0, "mc": 0.0, "seconds": 0.0}
    for _ in range(steps):
        rows = torch.randint(0, len(records), (concurrency,), generator=generator)  # [R]
        lengths = scheduler.schedule(confidences[rows], records.num_drafted[rows]).numpy()  # [R]
        survival = survival_all[rows.numpy()]  # [R, gamma]
        verified_mask = np.arange(records.gamma)[None, :] < lengths[:, None]  # [R, gamma]
        tokens_in_flight = concurrency + int(lengths.sum())
        totals["budget"] += lengths.mean()
        totals["tokens_in_flight"] += tokens_in_flight
        totals["expected"] += concurrency + float((survival * verified_mask).sum())
        totals["mc"] += concurrency + float(np.minimum(lengths, realised[rows.numpy()]).sum())
        totals["seconds"] += 1.0 / table.sps(tokens_in_flight)
    return {
        "budget_per_request": totals["budget"] / steps,
        "tokens_in_flight": totals["tokens_in_flight"] / steps,
        "tokens_per_step_expected": totals["expected"] / steps / concurrency,
        "tokens_per_step_mc": totals["mc"] / steps / concurrency,
        "throughput_expected": totals["expected"] / totals["seconds"],
        "throughput_mc": totals["mc"] / totals["seconds"],
    }


def run(args: argparse.Namespace) -> tuple[list[Cell], list[str], dict[str, SPSTable]]:
    concurrency = sorted({int(r) for r in args.concurrency.split(",")})
    if not concurrency or concurrency[0] < 1:
        raise SystemExit(f"--concurrency must list integers >= 1, got {args.concurrency!r}")
    records, confidences, notes = load_rounds(args, torch.Generator().manual_seed(args.seed))
    curves, curve_notes = load_curves(args, concurrency[-1] * (1 + records.gamma))
    cells = []
    for curve, table in curves.items():
        for index, r in enumerate(concurrency):
            for name, scheduler in make_schedulers(table, args).items():
                result = simulate(scheduler, table, records, confidences, r, args.steps, seed=args.seed * 1000 + index)
                cells.append(Cell(curve, r, name, **result))
    return cells, notes + curve_notes, curves


# -- outputs ------------------------------------------------------------------------------------


def markdown_table(cells: list[Cell]) -> str:
    verify_all = {(c.curve, c.concurrency): c.throughput_expected for c in cells if c.scheduler == "none"}
    lines = [
        "| SPS curve | R | scheduler | budget / req | B | tok/step/req exp | tok/step/req MC "
        "| system tok/s exp | system tok/s MC | vs none (verify all) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        ratio = c.throughput_expected / verify_all[(c.curve, c.concurrency)]
        lines.append(
            f"| {c.curve} | {c.concurrency} | {c.scheduler} | {c.budget_per_request:.2f} | {c.tokens_in_flight:.0f} | "
            f"{c.tokens_per_step_expected:.2f} | {c.tokens_per_step_mc:.2f} | {c.throughput_expected:.1f} | "
            f"{c.throughput_mc:.1f} | {ratio:.2f}x |"
        )
    return "\n".join(lines)


def plot_results(cells: list[Cell], out: Path) -> list[Path]:
    from matplotlib.figure import Figure

    curves = list(dict.fromkeys(c.curve for c in cells))
    fig = Figure(figsize=(11, 4 * len(curves)), layout="constrained")
    axes = fig.subplots(len(curves), 2, squeeze=False)
    for row, curve in enumerate(curves):
        for name in SCHEDULER_NAMES:
            mine = [c for c in cells if c.curve == curve and c.scheduler == name]
            xs = [c.concurrency for c in mine]
            axes[row, 0].plot(xs, [c.throughput_expected for c in mine], marker="o", label=name)
            axes[row, 1].plot(xs, [c.tokens_per_step_expected for c in mine], marker="o", label=name)
        axes[row, 0].set(
            title=f"{curve}: system throughput", xlabel="concurrent requests R", ylabel="tokens / s (expected)"
        )
        axes[row, 1].set(
            title=f"{curve}: per-request tokens per step", xlabel="concurrent requests R", ylabel="tokens / step"
        )
    for ax in axes.reshape(-1):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    throughput_png = out / "throughput.png"
    fig.savefig(throughput_png, dpi=110)

    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    styles = {"prefix": ("-", "o", 6), "lagged-topk": ("--", "x", 8), "threshold": (":", "s", 5)}
    for index, (color, curve) in enumerate(zip(("tab:blue", "tab:red", "tab:green"), curves)):
        for name, (line, marker, size) in styles.items():
            if name == "threshold" and index > 0:
                continue  # the threshold ignores the SPS curve: one line for all
            mine = [c for c in cells if c.curve == curve and c.scheduler == name]
            ax.plot(
                [c.concurrency for c in mine],
                [c.budget_per_request for c in mine],
                linestyle=line,
                marker=marker,
                markersize=size,
                fillstyle="none",
                color="grey" if name == "threshold" else color,
                label="threshold (any curve)" if name == "threshold" else f"{curve} / {name}",
            )
    ax.set(
        title="verification budget as load rises",
        xlabel="concurrent requests R",
        ylabel="draft tokens verified / request / step",
    )
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    budget_png = out / "budget.png"
    fig.savefig(budget_png, dpi=110)
    return [throughput_png, budget_png]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cells, notes, curves = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(cells)
    header = "\n".join(f"- {note}" for note in notes)
    (args.out / "table.md").write_text(f"# Scheduler simulation\n\n{header}\n\n{table}\n")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    document = {
        "config": config,
        "notes": notes,
        "cells": [asdict(c) for c in cells],
        "sps_curves": {name: t.to_dict()["meta"] for name, t in curves.items()},
    }
    (args.out / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    pngs = plot_results(cells, args.out)
    pngs.append(plot_sps(list(curves.values()), args.out / "sps_curves.png", labels=list(curves)))
    print(header + "\n\n" + table)
    print(f"\nwrote {args.out / 'table.md'}, {args.out / 'results.json'}, " + ", ".join(str(p) for p in pngs))


if __name__ == "__main__":
    main()
