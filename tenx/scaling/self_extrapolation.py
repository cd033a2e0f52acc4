"""The run's own self-extrapolated final loss, refitted as it trains (`monitor.extrapolate_every`).

A callback for `tenx train` and the quickstart (it lives here, above the training layer, because the
fit is tenx.scaling.curve's): every `extrapolate_every` steps, rank 0 fits the run's curve so far
(`extrapolate_run`, the law `EXTRAPOLATION_LAW`, its shape under the default priors) on a background
thread, so the loop never waits for it, and the next step's metrics carry

- `pred_final_self`, `pred_final_self_lower`, `pred_final_self_upper`: the run's final loss as its curve
  so far predicts it, with the 95% band;
- `pred_final_self_step`: the last step the fit saw.

With a validation-loss prediction (monitor.prediction of quantity `val_loss`) the fit follows the
validation curve, so both finals are comparable; otherwise the training loss.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from tenx.errors import ConfigError
from tenx.monitor.metrics_file import read_metrics
from tenx.monitor.prediction_file import read_prediction
from tenx.rundir import RunDir
from tenx.scaling.curve import EXTRAPOLATION_LAW, curve_from_records, extrapolate_run, schedule_from_config
from tenx.train.config import RunConfig
from tenx.train.hooks import Callback, TrainerView

MIN_RECORDS = {"loss": 40, "val_loss": 3}
"""Records after warmup before a first fit (fewer cannot separate the level from the decay)."""


class SelfExtrapolation(Callback):
    """Refit the run's curve every `every` steps in the background; log the predicted final loss."""

    name = "self-extrapolation"

    def __init__(self, cfg: RunConfig, params: int | None = None) -> None:
        self.cfg = cfg
        self.every = cfg.monitor.extrapolate_every
        self.params = params
        self.quantity = "loss"
        if cfg.monitor.prediction:
            try:
                if read_prediction(cfg.monitor.prediction).quantity == "val_loss":
                    self.quantity = "val_loss"
            except Exception:  # the Watch callback reports a bad prediction file with its name
                pass
        self.records: list[dict[str, Any]] = []
        self.result: dict[str, float] | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._schedule: Any = None

    def on_train_start(self, trainer: TrainerView) -> None:
        if trainer.rank != 0 or not self.every:
            self.every = 0
            return
        try:
            self._schedule = schedule_from_config(
                self.cfg.optim, trainer.total_steps, trainer.tokens_per_step
            )
        except ConfigError:  # a run too short to have a curve after warmup: nothing to extrapolate
            self.every = 0
            return
        if self.params is None:
            self.params = sum(p.numel() for p in trainer.model.parameters())
        metrics = trainer.rundir.metrics
        if trainer.step and metrics.exists():  # a resumed run: its curve so far
            self.records = [
                self._keep(r)
                for r in read_metrics(metrics)
                if r.get("step", 0) <= trainer.step and self._has(r)
            ]

    def _has(self, record: dict[str, Any]) -> bool:
        return self.quantity in record and "skipped" not in record

    def _keep(self, record: dict[str, Any]) -> dict[str, Any]:
        return {k: record[k] for k in ("step", "tokens", "lr", self.quantity)}

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        if not self.every:
            return
        if self.result is not None:
            metrics.update(self.result)
            self.result = None
        if self.error is not None:  # a fit that failed: said once, the run goes on
            print(f"tenx: self-extrapolation skipped: {self.error}", file=sys.stderr)
            self.error = None
        if self._has(metrics):
            self.records.append(self._keep(metrics))
        step = int(metrics.get("step", trainer.step))
        busy = self._thread is not None and self._thread.is_alive()
        if step % self.every or busy or step >= trainer.total_steps:
            return
        after = sum(r["step"] >= self._schedule.first_step for r in self.records)
        if after < MIN_RECORDS[self.quantity]:
            return
        records = list(self.records)
        self._thread = threading.Thread(
            target=self._fit, args=(records, step), daemon=True, name="tenx-extrap"
        )
        self._thread.start()

    def _fit(self, records: list[dict[str, Any]], step: int) -> None:
        try:
            curve = curve_from_records(
                records, "run", float(self.params or 1), self._schedule, quantity=self.quantity
            )
            prediction, _ = extrapolate_run(curve, EXTRAPOLATION_LAW, bootstrap=0)
            self.result = {
                "pred_final_self": prediction.final_loss,
                "pred_final_self_lower": prediction.lower[-1],
                "pred_final_self_upper": prediction.upper[-1],
                "pred_final_self_step": step,
            }
        except Exception as e:  # reported on the next step (on_step_end); the run goes on
            self.error = f"{type(e).__name__}: {e}"

    def on_train_end(self, trainer: TrainerView) -> None:
        if self._thread is not None:
            self._thread.join(timeout=60)

    def close(self, trainer: TrainerView) -> None:
        self.on_train_end(trainer)


def watch_callbacks(cfg: RunConfig) -> list[Callback]:
    """The callbacks `tenx train` adds from this layer: the self-extrapolation, when enabled."""
    return [SelfExtrapolation(cfg)] if cfg.monitor.extrapolate_every else []


def summary_fields(run_dir: Any) -> dict[str, Any]:
    """The watch's figures for a run's summary: the prediction's final loss, the run's own latest
    self-extrapolation, and the off-prediction events (from metrics.jsonl and events.jsonl)."""
    from tenx.monitor.events import read_events

    rd = RunDir(run_dir)
    out: dict[str, Any] = {}
    if rd.metrics.exists():
        for record in read_metrics(rd.metrics):
            for key in ("pred_final", "pred_final_self", "pred_dev"):
                if key in record:
                    out[key] = record[key]
    off = [e for e in read_events(run_dir) if e.get("kind") == "off-prediction"] if rd.events.exists() else []
    if "pred_final" in out or off:
        out["off_prediction_events"] = len(off)
    return out
