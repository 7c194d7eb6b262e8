"""Training checkpoints: what one holds, where it goes, how a run resumes from it.

A checkpoint is ``output_dir/checkpoints/step-NNNNNNN``: ``accelerator.save_state`` (the model's
weights in safetensors, the optimizer, the scheduler, every RNG state and the registered
:class:`TrainState`, i.e. the data position), plus ``drafter/``, a drafter directory
``DSparkDrafter.from_pretrained`` loads. The newest ``keep`` checkpoints stay. Loading one restores
all of it, so a resumed run continues with the same batches and the same losses.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn


@dataclass
class TrainState:
    """Where training stands; saved with every checkpoint (accelerate custom state)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of the current epoch already consumed
    blocks: int = 0  # anchor blocks trained on (all processes)
    train_seconds: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class Checkpoints:
    """Saves and restores a run's checkpoints under ``output_dir``; ``state`` is registered to travel with them."""

    def __init__(self, accelerator, output_dir: str | Path, keep: int, state: TrainState) -> None:
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.keep = keep
        accelerator.register_for_checkpointing(state)

    def save(self, step: int, module: nn.Module, final: bool = False) -> Path:
        """Save the full training state under ``checkpoints/step-N`` and the drafter under ``.../drafter``.

        ``module`` is the prepared training module (its ``drafter`` is saved). With ``final=True``
        the drafter also goes to ``output_dir/drafter``, which is returned; else the checkpoint is.
        """
        accelerator = self.accelerator
        directory = self.output_dir / "checkpoints" / f"step-{step:07d}"
        accelerator.wait_for_everyone()
        if not (directory / "model.safetensors").is_file():  # the end of a run may coincide with a periodic save
            accelerator.save_state(str(directory))
        if accelerator.is_main_process:
            drafter = accelerator.unwrap_model(module).drafter
            drafter.save_pretrained(directory / "drafter")
            self._prune()
            if final:
                drafter.save_pretrained(self.output_dir / "drafter")
        accelerator.wait_for_everyone()
        return self.output_dir / "drafter" if final else directory

    def load(self, directory: str | Path) -> None:
        """Restore weights, optimizer, scheduler, RNG states and the data position."""
        directory = Path(directory)
        if not (directory / "model.safetensors").is_file() and not any(directory.glob("model*.safetensors")):
            raise ValueError(
                f"{directory} is not a training checkpoint (no model.safetensors); pass a checkpoints/step-N directory"
            )
        self.accelerator.load_state(str(directory))

    def _prune(self) -> None:
        checkpoints = sorted((self.output_dir / "checkpoints").glob("step-*"))
        for old in checkpoints[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest ``checkpoints/step-N`` under ``output_dir``, or None."""
    checkpoints = sorted((Path(output_dir) / "checkpoints").glob("step-*"))
    return checkpoints[-1] if checkpoints else None
