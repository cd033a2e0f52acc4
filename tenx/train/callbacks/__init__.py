"""The training loop's side concerns, one file each; every one is a Callback on the hook events of
tenx/train/hooks.py."""

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
