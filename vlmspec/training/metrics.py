"""What a training run records: loss windows summed over micro-batches and processes, the metrics log, peak memory.

``LossWindow`` adds each micro-batch's loss sums and reports their means over the window, all
processes summed first (``accelerator.reduce``), so a record means the same with one process or
many. ``MetricsLog`` appends the records, train and eval, to ``metrics.jsonl`` from the main
process only.
"""

from __future__ import annotations

import json
import resource
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from vlmspec.training.losses import LossSums, LossWeights


class MetricsLog:
    """``output_dir/metrics.jsonl``: one JSON record a line, written by the main process only."""

    def __init__(self, accelerator, output_dir: str | Path) -> None:
        self.accelerator = accelerator
        self.path = Path(output_dir) / "metrics.jsonl"

    def write(self, record: dict[str, Any]) -> None:
        if self.accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated accelerator memory (CUDA), or the process's peak resident set size (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def detached(sums: LossSums) -> LossSums:
    """The sums cut from the autograd graph: a window keeps them past the step without keeping its graph."""
    return LossSums(**{f.name: getattr(sums, f.name).detach() for f in fields(sums)})


class LossWindow:
    """Sums of loss terms and diagnostics over several micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, sums: LossSums, weights: LossWeights) -> None:
        values = {f.name: getattr(sums, f.name).float() for f in fields(sums)}
        values["loss"] = sums.combined(weights).float()
        for key, value in values.items():
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def summary(self, accelerator) -> dict[str, Any]:
        """Means over the window, summed across processes first."""
        if not self.sums:
            return {}
        s = {key: accelerator.reduce(value, reduction="sum") for key, value in self.sums.items()}
        weight = float(s["weight"].clamp(min=1e-9))
        count = s["count"].clamp(min=1)
        return {
            "loss": float(s["loss"]) / weight,
            "ce": float(s["ce"]) / weight,
            "tv": float(s["tv"]) / weight,
            "confidence": float(s["bce"]) / weight,
            "expected_tau": float(s["expected_tau"]) / max(float(s["full_blocks"]), 1.0),
            "greedy_tau": float(s["greedy_tau"]) / max(float(s["full_blocks"]), 1.0),
            "acceptance_by_position": (s["acceptance"] / count).tolist(),
            "top1_by_position": (s["top1"] / count).tolist(),
            "blocks": int(s["count"][0]),
        }
