"""The step record and the crash record: what `tenx replay` and `tenx triage` start from.

Rank 0 appends one line per completed step to RUN_DIR/steps.jsonl: the step's loss and gradient norm
(exact: JSON keeps a float's every bit), a digest of both, whether the guard skipped it, and the data it
read (loader positions [start, end) and every rank's window ids per micro-batch), with the number of data
skips and rollbacks in effect, so a replay can follow the same timeline after rollbacks and restarts. A
line is one `write` (no fsync: a killed process loses nothing it wrote; only a machine crash can).

Every rank whose training loop raises records a `crash` event first: the exception, its message, the
innermost frames, the full traceback and the data in flight.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import xxhash

from tenx.train.hooks import Callback, TrainerView
from tenx.utils.io import append_line, json_line, read_jsonl

MAX_FRAMES = 12
"""Innermost frames kept in a crash record."""


def step_digest(loss: float, grad_norm: float) -> str:
    """A 64-bit digest of the exact bits of a step's loss and gradient norm (hex); every NaN counts as one
    (JSON keeps no NaN payload)."""
    values = [math.nan if math.isnan(v) else float(v) for v in (loss, grad_norm)]
    return xxhash.xxh64(struct.pack("<dd", *values)).hexdigest()


def frame_name(filename: str, lineno: int | None, function: str) -> str:
    """`package/relative/path.py:LINE in FUNCTION`, shortened below site-packages or the tenx checkout."""
    path = Path(filename)
    parts = path.parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            parts = parts[parts.index(anchor) + 1 :]
            break
    else:
        if "tenx" in parts:
            parts = parts[len(parts) - 1 - parts[::-1].index("tenx") :]
        else:
            parts = parts[-2:]
    return f"{'/'.join(parts)}:{lineno} in {function}"


def error_frames(error: BaseException, limit: int = MAX_FRAMES) -> list[str]:
    """The traceback's innermost `limit` frames, innermost first."""
    frames = traceback.extract_tb(error.__traceback__)
    return [frame_name(f.filename, f.lineno, f.name) for f in reversed(frames)][:limit]


class StepRecord(Callback):
    """Writes steps.jsonl (rank 0) and a `crash` event for an exception leaving the loop (every rank)."""

    name = "step_record"

    def __init__(self) -> None:
        self.path: Path | None = None

    def on_train_start(self, trainer: TrainerView) -> None:
        if trainer.rank == 0:
            self.path = trainer.rundir.steps

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        if self.path is None:
            return
        flight = trainer.in_flight
        loss, grad_norm = float(metrics["loss"]), float(metrics.get("grad_norm", float("nan")))
        record = {
            "step": trainer.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "digest": step_digest(loss, grad_norm),
            "skipped": metrics.get("skipped"),
            "lr": metrics.get("lr"),
            "total_steps": trainer.total_steps,
            "threads": torch.get_num_threads(),  # a matmul's blocking, so its bits, may depend on it
            "position": flight.get("position"),
            "windows": flight.get("all"),
            "skips": len(trainer.data_skips),
            "rollbacks": trainer.rollbacks,
            "pid": os.getpid(),
            "time": time.time(),
        }
        append_line(self.path, json_line(record), sync=False)

    def on_error(self, trainer: TrainerView, error: BaseException) -> None:
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            return  # a requested stop, recorded as `stopped`
        flight = trainer.in_flight
        mid_step = flight.get("step", trainer.step + 1) > trainer.step
        windows = flight.get("windows") or []
        try:
            data = trainer.loader.describe_windows(windows)
        except (IndexError, ValueError):
            data = [{"window": int(w)} for w in windows]
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        trainer.events.emit(
            "crash",
            flight.get("step", trainer.step + 1) if mid_step else trainer.step,
            rank=trainer.rank,
            host=socket.gethostname(),
            phase="step" if mid_step else "after-step",
            exception=type(error).__name__,
            message=str(error)[:2000],
            frames=error_frames(error),
            traceback=text[-8000:],
            data=data,
            position=flight.get("position"),
        )


def read_steps(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a steps.jsonl, in the order written (torn lines skipped)."""
    return [r for r in read_jsonl(path, torn="any", missing_ok=True) if isinstance(r.get("step"), int)]
