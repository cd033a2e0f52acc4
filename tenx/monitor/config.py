"""The `[monitor]` section of a run config: watching a run against its prediction, statistics inside the
model, and the trend detectors. docs/monitoring.md explains each figure and event."""

from __future__ import annotations

from dataclasses import dataclass

from tenx.config import field


@dataclass
class MonitorConfig:
    """What the run watches while it trains, beyond its loss."""

    prediction: str = field(
        "",
        help="a prediction.json (tenx predict) to watch the run against: every logged step records the "
        "predicted loss, its band and the deviation in band units; empty: none",
    )
    off_prediction_steps: int = field(
        50,
        ge=1,
        help="consecutive steps beyond the prediction's band that make an off-prediction event",
    )
    extrapolate_every: int = field(
        200,
        ge=0,
        help="refit the run's own curve every N steps and log its self-extrapolated final loss (0: never)",
    )
    stats_every: int = field(
        100, ge=0, help="statistics inside the model (per layer, logits, attention) every N steps (0: never)"
    )
    trends: bool = field(True, help="run the trend detectors (drift, growth, stragglers, throughput)")
    trend_window: int = field(200, ge=10, help="steps of history a trend detector fits its slope over")
    growth_factor: float = field(
        2.0,
        gt=1,
        help="a per-layer statistic (attention logit, activation, gradient norm) that grows steadily by this "
        "factor over trend_window steps is an event",
    )
    straggler_ratio: float = field(
        1.5, gt=1, help="a rank whose step time is this many times the median of its peers is a straggler"
    )
    throughput_drop: float = field(
        0.3,
        gt=0,
        lt=1,
        help="tokens/s falling by this fraction below its running median over trend_window steps is an event",
    )
