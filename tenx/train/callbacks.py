"""Built-in training callbacks: periodic validation and checkpointing."""

from __future__ import annotations

from typing import Any

from tenx.train.trainer import Callback, Trainer


class Validation(Callback):
    """Adds `val_loss` to the metrics every `every` steps and at the last step."""

    name = "validation"

    def __init__(self, every: int) -> None:
        self.every = every

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        step = trainer.step
        if (self.every and step % self.every == 0) or step == trainer.total_steps:
            val = trainer.validation_loss()
            if val is not None:
                metrics["val_loss"] = val


class Checkpointing(Callback):
    """Saves a checkpoint every `every` steps and at the end of training."""

    name = "checkpointing"

    def __init__(self, every: int, at_end: bool = True) -> None:
        self.every, self.at_end = every, at_end
        self.last_saved = -1

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.every and trainer.step % self.every == 0:
            trainer.save_checkpoint()
            self.last_saved = trainer.step

    def on_train_end(self, trainer: Trainer) -> None:
        if self.at_end and self.last_saved != trainer.step:
            trainer.save_checkpoint()
            self.last_saved = trainer.step
