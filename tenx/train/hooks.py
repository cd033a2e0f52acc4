"""The trainer's named hook events. Every side concern of training is a Callback; the loop calls these.

Called in this order (`trainer` is the Trainer; hooks are typed loosely so this module imports nothing of
the trainer and every layer above it can implement them):

| event | when | used by |
|---|---|---|
| `on_train_start(trainer)` | once, after any resume and before the first step | metrics, ledger, watchdog |
| `on_step_start(trainer)` | before each step's math (`trainer.step` is still the previous step) | faults |
| `pre_optim_step(trainer)` | gradients are reduced across ranks and groups; before clipping and the optimizer step | consistency digests, per-module statistics |
| `on_step_end(trainer, metrics)` | after the optimizer step, with the step's metrics (earlier callbacks may add to them) | validation, checkpointing, metrics, progress |
| `post_checkpoint_saved(trainer, tmp_dir, step)` | a checkpoint's files and manifest are written and fsynced, just before the rename that publishes it; on the writer thread when saves are asynchronous | fault injection |
| `post_state_loaded(trainer, source)` | the training state was replaced: `source` is `"resume"`, `"rollback"` or `"heal"` | consistency (forgets digests of the old state) |
| `on_error(trainer, error)` | an exception is leaving the loop (before `close`) | triage, ledger |
| `on_train_end(trainer)` | once, after the last step | checkpointing (final save), metrics |
| `close(trainer)` | always, last, also after an error | releases files, threads, hooks |

`state_dict`/`load_state_dict` put a callback's state into every checkpoint (JSON). Callbacks never
change gradients or the optimizer; they read the trainer and add to `metrics`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HOOK_EVENTS = (
    "on_train_start",
    "on_step_start",
    "pre_optim_step",
    "on_step_end",
    "post_checkpoint_saved",
    "post_state_loaded",
    "on_error",
    "on_train_end",
    "close",
)


class Callback:
    """A side concern of training. Override any event; keep state in state_dict for exact resume."""

    name = "callback"

    def on_train_start(self, trainer: Any) -> None:
        """Once before the first step (after any resume)."""

    def on_step_start(self, trainer: Any) -> None:
        """Before each step's math; `trainer.step` is still the previous step."""

    def pre_optim_step(self, trainer: Any) -> None:
        """Gradients are reduced across ranks and groups; clipping and the optimizer step come next."""

    def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        """After each optimizer step; earlier callbacks may have added to `metrics`."""

    def post_checkpoint_saved(self, trainer: Any, tmp_dir: Path, step: int) -> None:
        """A checkpoint of `step` is complete in `tmp_dir`, not yet published (writer thread if async)."""

    def post_state_loaded(self, trainer: Any, source: str) -> None:
        """The training state was replaced by a resume, a rollback or a heal from a peer group."""

    def on_error(self, trainer: Any, error: BaseException) -> None:
        """An exception is leaving the training loop."""

    def on_train_end(self, trainer: Any) -> None:
        """Once after the last step."""

    def close(self, trainer: Any) -> None:
        """Always, last: release what the callback holds."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
