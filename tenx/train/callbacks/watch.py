"""Watching the run: its loss against prediction.json (monitor.prediction) and the trend detectors.

Runs on rank 0 after every callback that adds figures to a step's metrics (validation, model statistics,
extra callbacks) and before the metrics are written, so `pred_*` figures land in metrics.jsonl and its
events in events.jsonl at the step they concern. tenx/monitor/deviation.py and tenx/monitor/trends.py hold
the logic and say what each figure and event means.
"""

from __future__ import annotations

import sys
from typing import Any

from tenx.errors import ConfigError, TenxError
from tenx.monitor.config import MonitorConfig
from tenx.monitor.deviation import PredictionWatch, check_target
from tenx.monitor.prediction_file import read_prediction, write_prediction
from tenx.monitor.trends import TrendConfig, TrendDetectors
from tenx.train.hooks import Callback, TrainerView


class Watch(Callback):
    """`pred_*` figures and off-prediction events (with a prediction), and trend events."""

    name = "watch"

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.prediction: PredictionWatch | None = None
        self.trends: TrendDetectors | None = None
        self._pending: dict[str, Any] = {}
        if cfg.prediction:
            try:
                self._loaded = read_prediction(cfg.prediction)
            except (OSError, TenxError) as e:
                raise ConfigError(f"monitor.prediction: {e}") from None

    def on_train_start(self, trainer: TrainerView) -> None:
        if self.cfg.prediction:
            check_target(self._loaded, self.cfg.prediction, trainer.total_steps, trainer.tokens_per_step)
            # the run directory keeps the prediction it is watched against (the dashboard reads it there)
            write_prediction(trainer.rundir.prediction, self._loaded)
            state = self._pending.get("prediction")
            self.prediction = PredictionWatch(self._loaded, self.cfg.off_prediction_steps)
            if state:
                self.prediction.load_state_dict(state)
        if self.cfg.trends:
            self.trends = TrendDetectors(
                TrendConfig(
                    self.cfg.trend_window,
                    self.cfg.growth_factor,
                    self.cfg.straggler_ratio,
                    self.cfg.throughput_drop,
                ),
                trainer.total_steps,
            )
            if self._pending.get("trends"):
                self.trends.load_state_dict(self._pending["trends"])

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        step = int(metrics.get("step", trainer.step))
        events: list[dict[str, Any]] = []
        if self.prediction is not None:
            figures, event = self.prediction.observe(step, metrics)
            metrics.update(figures)
            if step == trainer.total_steps or "pred_final_self" in metrics:
                metrics["pred_final"] = self.prediction.prediction.final["loss"]
            if event:
                events.append(event)
        if self.trends is not None:
            events += self.trends.observe(step, metrics)
        for event in events:
            fields = {k: v for k, v in event.items() if k not in ("kind", "step")}
            trainer.events.emit(event["kind"], event["step"], **fields)
            if "message" in event:
                print(f"tenx: {event['kind']} at step {event['step']}: {event['message']}", file=sys.stderr)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.prediction is not None:
            out["prediction"] = self.prediction.state_dict()
        if self.trends is not None:
            out["trends"] = self.trends.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state)  # a resume: applied at on_train_start, once the run's length is known
        if self.prediction is not None and "prediction" in state:  # a rollback mid-run
            self.prediction.load_state_dict(state["prediction"])
        if self.trends is not None and "trends" in state:
            self.trends.load_state_dict(state["trends"])
