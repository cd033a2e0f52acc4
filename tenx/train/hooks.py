"""The trainer's hook points. Side concerns (metrics, checkpoints, validation, fault injection) are Callbacks.

Five hooks, called in this order: on_train_start once (after any resume); then per step on_step_start
(before the step's math) and on_step_end (after the optimizer step, with the step's metrics); then
on_train_end once. state_dict/load_state_dict put a callback's state into every checkpoint. Callbacks
never touch gradients or the optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tenx.train.trainer import Trainer


class Callback:
    """A side concern of training. Override any hook; keep state in state_dict for exact resume."""

    name = "callback"

    def on_train_start(self, trainer: Trainer) -> None:
        """Called once before the first step (after any resume)."""

    def on_step_start(self, trainer: Trainer) -> None:
        """Called before each step's math; `trainer.step` is still the previous step."""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        """Called after each optimizer step; earlier callbacks may have added to `metrics`."""

    def on_train_end(self, trainer: Trainer) -> None:
        """Called once after the last step."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
