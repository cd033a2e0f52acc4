"""The training loop's side concerns that are callbacks, one file each, on the hook events of
tenx/train/hooks.py; each reads the trainer only through `TrainerView` (declared there).

Checkpointing (when to save), validation, metrics and progress, the step and crash records, the
prequential code length, the statistics inside the model, the watch against prediction, the replica
consistency check and fault injection. Not here, because the loop drives them itself at fixed places
(hooks.py says why): the goodput ledger, the watchdog, the checkpointer's poll, the rollback, the stop
signals and the replica groups' attach and close."""

from tenx.train.callbacks.checkpointing import Checkpointing
from tenx.train.callbacks.consistency import ConsistencyCheck
from tenx.train.callbacks.faults import FaultInjector, build_injector
from tenx.train.callbacks.metrics import MetricsLogger, Progress
from tenx.train.callbacks.validation import Validation

__all__ = [
    "Checkpointing",
    "ConsistencyCheck",
    "FaultInjector",
    "MetricsLogger",
    "Progress",
    "Validation",
    "build_injector",
]
