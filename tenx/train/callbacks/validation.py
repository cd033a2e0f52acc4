"""Validation: `val_loss` in the metrics every N steps and at the last step."""

from __future__ import annotations

from typing import Any

from tenx.train.hooks import Callback, TrainerView


class Validation(Callback):
    """Adds `val_loss` to the metrics every `every` steps and at the last step."""

    name = "validation"

    def __init__(self, every: int) -> None:
        self.every = every

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        step = trainer.step
        if (self.every and step % self.every == 0) or step == trainer.total_steps:
            val = trainer.validation_loss()
            if val is not None:
                metrics["val_loss"] = val
