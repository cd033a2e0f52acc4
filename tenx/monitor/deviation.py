"""Watching a run against its prediction (prediction.json from `tenx predict`), step by step.

`PredictionWatch.observe(step, metrics)` returns the figures a logged step records and, when the run has
left the prediction's band for long enough, an `off-prediction` event:

- `pred_loss`, `pred_lower`, `pred_upper`: the prediction at this step (the band covers `level` of it);
- `pred_actual`: what is compared with it: the training loss averaged over the prediction's `window` (the
  predicted curve is smoothed the same way; one step's loss scatters by several percent), or the step's
  validation loss for a `val_loss` prediction (compared only at the steps that log one);
- `pred_dev`: the deviation in band units: log(actual / predicted) divided by the band's half-width in log
  space, on the side the actual lies. |pred_dev| <= 1 is inside the band; 2 is twice as far out as the band.

An **off-prediction** event is emitted when the deviation stays beyond the band on one side for
`persist` consecutive compared steps (a `val_loss` prediction: `min(persist, 2)` validations): it names
the direction (`above`: worse than predicted; `below`: better), the step the excursion began, and its size
(mean deviation in band units and in percent). A run that comes back inside the band emits
`on-prediction`, after which a new excursion can be reported.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from tenx.errors import ConfigError
from tenx.monitor.prediction_file import Prediction

VAL_PERSIST = 2
"""Consecutive validations beyond the band that make an off-prediction event (each is 0.1-0.5% noisy)."""


def check_target(prediction: Prediction, path: str, total_steps: int, tokens_per_step: int) -> None:
    """Refuse a prediction made for another run: its steps and tokens per step must be this run's."""
    steps = prediction.target.get("steps", prediction.step[-1])
    if steps != total_steps:
        raise ConfigError(
            f"monitor.prediction: {path} predicts a run of {steps} steps, this run has {total_steps}; run "
            "`tenx predict` for this config (with the same --set overrides)"
        )
    tps = prediction.target.get("tokens_per_step")
    if tps is not None and int(tps) != int(tokens_per_step):
        raise ConfigError(
            f"monitor.prediction: {path} predicts {tps} tokens per step, this run trains {tokens_per_step}; "
            "run `tenx predict` for this config (and --world-size)"
        )


class PredictionWatch:
    """Compares each logged step with a prediction and reports persistent excursions from its band."""

    def __init__(self, prediction: Prediction, persist: int = 50) -> None:
        if persist < 1:
            raise ConfigError(f"monitor.off_prediction_steps: must be >= 1, got {persist}")
        self.prediction = prediction
        self.val = prediction.quantity == "val_loss"
        self.window = 1 if self.val else max(1, prediction.window)
        self.persist = min(persist, VAL_PERSIST) if self.val else persist
        self._recent: deque[float] = deque(maxlen=self.window)
        self._run: list[tuple[int, float, float]] = []  # (step, deviation, relative error) beyond the band
        self._off = False

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self._recent), "run": self._run, "off": self._off}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._recent = deque(state.get("recent", []), maxlen=self.window)
        self._run = [tuple(x) for x in state.get("run", [])]  # type: ignore[misc]
        self._off = bool(state.get("off", False))

    def observe(self, step: int, metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any] | None]:
        """(figures to add to the step's metrics, an event to emit or None)."""
        if self.val:
            if "val_loss" not in metrics:
                return {}, None
            actual = float(metrics["val_loss"])
            at = self.prediction.at(step)
        else:
            loss = float(metrics.get("loss", math.nan))
            if not math.isfinite(loss):
                return {}, None  # the guard handles a non-finite step; it says nothing about the trend
            self._recent.append(loss)
            if len(self._recent) < self.window:
                return {}, None
            actual = sum(self._recent) / len(self._recent)
            at = self.prediction.at(step - (self.window - 1) // 2)  # the window's centre
        if at is None or not (at["loss"] > 0 and actual > 0):
            return {}, None
        dev = deviation(actual, at["loss"], at["lower"], at["upper"])
        figures = {
            "pred_loss": at["loss"],
            "pred_lower": at["lower"],
            "pred_upper": at["upper"],
            "pred_actual": actual,
            "pred_dev": dev,
        }
        return figures, self._track(step, dev, actual / at["loss"] - 1)

    def _track(self, step: int, dev: float, rel: float) -> dict[str, Any] | None:
        outside = abs(dev) > 1
        same_side = not self._run or (self._run[-1][1] > 0) == (dev > 0)
        if not outside or not same_side:
            back = self._off and not outside
            self._run = [(step, dev, rel)] if outside else []
            if back:
                self._off = False
                return {"kind": "on-prediction", "step": step, "deviation": round(dev, 3)}
            return None
        self._run.append((step, dev, rel))
        if self._off or len(self._run) < self.persist:
            return None
        self._off = True
        devs = [d for _, d, _ in self._run]
        rels = [r for _, _, r in self._run]
        return {
            "kind": "off-prediction",
            "step": step,
            "direction": "above" if dev > 0 else "below",
            "since_step": self._run[0][0],
            "steps": len(self._run),
            "deviation": round(sum(devs) / len(devs), 3),
            "relative": round(sum(rels) / len(rels), 5),
            "message": (
                f"loss {'above' if dev > 0 else 'below'} the prediction's band since step {self._run[0][0]}: "
                f"{100 * sum(rels) / len(rels):+.1f}% ({sum(devs) / len(devs):+.1f} band half-widths)"
            ),
        }


def deviation(actual: float, predicted: float, lower: float, upper: float) -> float:
    """log(actual / predicted) in units of the band's half-width (log space) on the actual's side."""
    d = math.log(actual / predicted)
    edge = upper if d > 0 else lower
    half = abs(math.log(edge / predicted)) if edge > 0 else 0.0
    if half <= 0:  # a band of zero width: any difference is far outside it
        return math.copysign(math.inf, d) if d else 0.0
    return d / half
