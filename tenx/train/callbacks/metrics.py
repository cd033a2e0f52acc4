"""Metrics sinks: one JSON line per step (RUN_DIR/metrics.jsonl), TensorBoard scalars, and a progress display."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from tenx.monitor.metrics_file import read_metrics
from tenx.train.hooks import Callback, TrainerView
from tenx.utils.io import atomic_write_text


class MetricsLogger(Callback):
    """Appends each step's metrics to RUN_DIR/metrics.jsonl (the trainer's `rundir`) and, optionally, to
    TensorBoard."""

    name = "metrics"

    def __init__(self, tensorboard: bool = True) -> None:
        self.tensorboard = tensorboard
        self._file: Any = None
        self._writer: Any = None
        self._last_step = 0

    def on_train_start(self, trainer: TrainerView) -> None:
        path = trainer.rundir.metrics
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            # After a resume, drop records past the checkpoint: those steps are trained again.
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= trainer.step]
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(path, "a")
        self._last_step = trainer.step
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(trainer.rundir.tensorboard), purge_step=trainer.step + 1)

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        if metrics["step"] <= self._last_step:  # after a rollback: the steps are trained again
            path = trainer.rundir.metrics
            self._file.close()
            kept = [r for r in read_metrics(path) if r.get("step", 0) < metrics["step"]]
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
            self._file = open(path, "a")
        self._last_step = metrics["step"]
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._writer.add_scalar(
                        f"train/{key}" if not key.startswith("val") else key, value, metrics["step"]
                    )

    def on_train_end(self, trainer: TrainerView) -> None:
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress(Callback):
    """A tqdm bar with loss, tokens/s, MFU and ETA on a terminal; a line every N steps elsewhere."""

    name = "progress"

    def __init__(self, print_every: int = 50) -> None:
        self.print_every = print_every
        self._bar: Any = None
        self._t0 = 0.0
        self._start_step = 0
        self._watch: dict[str, float] = {}  # the latest pred_* figures

    def on_train_start(self, trainer: TrainerView) -> None:
        self._t0, self._start_step = time.perf_counter(), trainer.step
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=trainer.total_steps, initial=trainer.step, unit="step", dynamic_ncols=True)

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        mfu = metrics.get("mfu")
        shown = (
            f"{100 * mfu:.1f}%" if mfu is not None else "unknown (a step above the peak: FLOPs or peak wrong)"
        )
        text = f"loss {metrics['loss']:.4f} | {metrics['tokens_per_s']:,.0f} tok/s | mfu {shown}"
        if "val_loss" in metrics:
            text += f" | val {metrics['val_loss']:.4f}"
        self._watch.update({k: v for k, v in metrics.items() if k.startswith("pred_")})
        if "pred_dev" in self._watch:  # against the prediction (monitor.prediction), in band half-widths
            text += f" | vs pred {self._watch['pred_dev']:+.1f}"
        if "pred_final_self" in self._watch:
            text += f" | final {self._watch['pred_final_self']:.4f}"
            if "pred_final" in self._watch:
                text += f" (pred {self._watch['pred_final']:.4f})"
        if self._bar is not None:
            self._bar.total = trainer.total_steps  # a wall-clock budget re-plans the run's length
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)
            return
        step = metrics["step"]
        if step % self.print_every == 0 or step == trainer.total_steps or "val_loss" in metrics:
            elapsed = time.perf_counter() - self._t0
            done = step - self._start_step
            eta = elapsed / done * (trainer.total_steps - step) if done else 0.0
            print(
                f"step {step}/{trainer.total_steps} | {text} | eta {_eta(eta)}", file=sys.stderr, flush=True
            )

    def on_train_end(self, trainer: TrainerView) -> None:
        if self._bar is not None:
            self._bar.close()
