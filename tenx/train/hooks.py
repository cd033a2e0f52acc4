"""The trainer's named hook events, the Callback that implements them, and the view of the trainer it gets.

The loop calls these in this order (`trainer` is a `TrainerView`, below):

| event | when | used by |
|---|---|---|
| `on_train_start(trainer)` | once, after any resume and before the first step | metrics, progress, watch, checkpointing, faults, step record, prequential |
| `on_step_start(trainer)` | before each step's math (`trainer.step` is still the previous step) | faults, statistics |
| `pre_optim_step(trainer)` | gradients are reduced across ranks and groups; before clipping and the optimizer step | consistency digests, per-module statistics |
| `on_step_end(trainer, metrics)` | after the optimizer step, with the step's metrics (earlier callbacks may add to them) | validation, step record, prequential, watch, metrics, W&B sink, progress, checkpointing |
| `post_checkpoint_saved(trainer, tmp_dir, step)` | a checkpoint's files and manifest are written and fsynced, just before the rename that publishes it; on the writer thread when saves are asynchronous | fault injection |
| `post_state_loaded(trainer, source)` | the training state was replaced: `source` is `"resume"`, `"rollback"` or `"heal"` | consistency (forgets digests of the old state), statistics |
| `on_error(trainer, error)` | an exception is leaving the loop (before `close`) | crash record, faults |
| `on_train_end(trainer)` | once, after the last step | checkpointing (final save), metrics, prequential |
| `close(trainer)` | always, last, also after an error | releases files, threads, hooks |

`state_dict`/`load_state_dict` put a callback's state into every checkpoint (JSON). Callbacks never
change gradients or the optimizer; they read the trainer and add to `metrics`.

Not every side concern is a callback. The loop (tenx/train/trainer.py `fit`) drives six itself, because
each must run at one fixed place relative to all callbacks, or owns the process rather than the step:
the goodput ledger (it times the loop, the saves and the rollbacks from inside them), the watchdog (a
thread started after every `on_train_start` and fed after every end-of-step action), the checkpointer's
poll (a failed background save surfaces after the step's callbacks, one of which may have saved), the
rollback (it replaces the training state after every `on_step_end`, then sends `post_state_loaded`), the
stop signals (SIGTERM/SIGINT handlers, agreed by every rank at one step, then a save and exit) and the
replica groups' attach and close (they receive the trainer's state before the first event).

`TrainerView` is all a callback may read of the trainer: every name it lists, nothing else
(tests/test_callback_contract.py holds the callbacks of tenx to it). The Trainer satisfies it structurally.

The view is flat (`trainer.loader`, not `trainer.parts.data.loader`) on purpose. tenx/train/parts.py builds
the parts in groups (`Parts`: shape, data, trained, flops, checkpoints, services), which is how they are
made and replaced together; a reader wants the thing, not where it was built. About 130 reads of
`trainer.NAME` in callbacks, tests and benches, and 170 in the trainer and its state, name parts this way,
and a group in each would say nothing they need. `TrainerParts` (parts.py) gives each flat name one home in
`Parts` (a `Part` descriptor reads and writes the grouped field, so the two never disagree), and this view
lists the ones a callback may read.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the types of the view only; at run time this module imports nothing of tenx
    import torch

    from tenx.checkpoint import AsyncCheckpointer
    from tenx.data.loader import TokenLoader, TokenStream
    from tenx.model.config import ModelConfig
    from tenx.model.transformer import Transformer
    from tenx.monitor.events import EventLog
    from tenx.parallel.replicas import Replicas
    from tenx.rundir import RunDir

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


class TrainerView(Protocol):
    """What a callback reads of the trainer (tenx.train.trainer.Trainer), with its types.

    Callbacks only read these (and call the methods); they replace none of them.
    """

    # ----- where and how the run runs
    rundir: RunDir
    run_dir: Path
    """`rundir.root`."""
    rank: int
    world_size: int
    """Ranks of this job (replica groups not counted)."""
    device: torch.device
    strategy: str
    """How the model is spread over the ranks: "none", "ddp" or "fsdp"."""
    replicas: Replicas | None
    """The torchft replica groups; None without them."""
    events: EventLog

    # ----- progress
    step: int
    """Steps completed (during a step: the previous one)."""
    total_steps: int
    tokens_per_step: int
    rollbacks: int
    """Rollbacks so far in this process."""
    data_skips: list[list[int]]
    """Loader position ranges [start, end) skipped after rollbacks, this run's whole history."""
    in_flight: dict[str, Any]
    """The step being taken: `step`, loader `position` [start, end), this rank's `windows` and every
    rank's per micro-batch (`all`)."""

    # ----- data
    data_manifest: dict[str, Any]
    """The training data's manifest.json."""
    train_stream: TokenStream
    val_stream: TokenStream | None
    loader: TokenLoader

    # ----- model
    model_cfg: ModelConfig
    raw_model: Transformer
    """The transformer itself (under FSDP2 its parameters are DTensor shards)."""
    model: torch.nn.Module
    """What forward and backward run through: the DDP wrapper, the FSDP2-sharded model or the model."""

    # ----- checkpoints
    checkpointer: AsyncCheckpointer
    memory_checkpointer: AsyncCheckpointer | None
    """The in-memory tier (checkpoint.memory_every); None without it."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward passes' mixed-precision context."""
        ...

    def validation_loss(self) -> float | None:
        """Mean loss over the validation split (None without one); collective under FSDP."""
        ...

    def save_checkpoint(self, tier: str = "disk") -> float:
        """Save the training state (every rank, collective); returns the seconds the loop was blocked."""
        ...

    def agree(self, value: int) -> int:
        """Rank 0's `value` on every rank."""
        ...

    def state_replaced(self, source: str) -> None:
        """Send every callback `post_state_loaded(source)`: a callback replaced the weights (e.g. --init-from)."""
        ...


class Callback:
    """A side concern of training. Override any event; keep state in state_dict for exact resume."""

    name = "callback"

    def on_train_start(self, trainer: TrainerView) -> None:
        """Once before the first step (after any resume)."""

    def on_step_start(self, trainer: TrainerView) -> None:
        """Before each step's math; `trainer.step` is still the previous step."""

    def pre_optim_step(self, trainer: TrainerView) -> None:
        """Gradients are reduced across ranks and groups; clipping and the optimizer step come next."""

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        """After each optimizer step; earlier callbacks may have added to `metrics`."""

    def post_checkpoint_saved(self, trainer: TrainerView, tmp_dir: Path, step: int) -> None:
        """A checkpoint of `step` is complete in `tmp_dir`, not yet published (writer thread if async)."""

    def post_state_loaded(self, trainer: TrainerView, source: str) -> None:
        """The training state was replaced by a resume, a rollback or a heal from a peer group."""

    def on_error(self, trainer: TrainerView, error: BaseException) -> None:
        """An exception is leaving the training loop."""

    def on_train_end(self, trainer: TrainerView) -> None:
        """Once after the last step."""

    def close(self, trainer: TrainerView) -> None:
        """Always, last: release what the callback holds."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, saved in every checkpoint."""
        return {}

    def provenance(self) -> dict[str, Any]:
        """Fields this callback adds to run.json (rank 0 writes it as training starts): what the run is
        made of that the config does not say, such as where `--init-from` weights came from."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
