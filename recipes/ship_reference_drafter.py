"""Copy a drafter trained for the reference target into the package, in half precision.

``recipes/train_qwen3vl.py --out RUN`` leaves ``RUN/drafter`` (float32 weights, config,
calibration) and ``RUN/report.json``. This writes ``vlmspec/assets/reference-drafter/NAME/``
with the weights stored in float16 (half the bytes; the engine casts them back to the
target's dtype when it loads them), the config, the calibration, and ``training.json``:
the run's report, so that the numbers that came with the weights stay beside them.

    python recipes/ship_reference_drafter.py --run runs/reference-drafter/dspark --name dspark
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the package importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmspec.drafters.dspark import DSparkDrafter
from vlmspec.reference import REFERENCE_DRAFTERS, load_reference_target

ASSETS = Path(__file__).resolve().parents[1] / "vlmspec" / "assets" / "reference-drafter"
KEPT_FILES = ("calibration.json",)  # beside the weights; calibration_rounds.npz stays in the run


def ship(run: Path, name: str, dtype: torch.dtype = torch.float16) -> Path:
    source = run / "drafter"
    if not (source / "model.safetensors").is_file():
        raise FileNotFoundError(f"{source} has no trained drafter; run recipes/train_qwen3vl.py --out {run} first")
    target = load_reference_target()
    drafter = DSparkDrafter.from_pretrained(source, target=target)
    out = ASSETS / name
    if out.exists():
        shutil.rmtree(out)
    drafter.save_pretrained(out, dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    config["target_name"] = "reference"  # not the build machine's cache path
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in KEPT_FILES:
        if (source / file).is_file():
            shutil.copy2(source / file, out / file)
    report = json.loads((run / "report.json").read_text()) if (run / "report.json").is_file() else {}
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out}: {size / 2**20:.1f} MiB of {str(dtype).removeprefix('torch.')} weights")
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="the --out directory of recipes/train_qwen3vl.py")
    parser.add_argument(
        "--name",
        required=True,
        choices=sorted(set(REFERENCE_DRAFTERS.values())),
        help="dspark (the default 'reference' drafter) or dflash (the ablation)",
    )
    args = parser.parse_args(argv)
    return ship(args.run, args.name)


if __name__ == "__main__":
    main()
