"""Trend detectors: slow, steady changes that no single step shows, each reported once as an event with
its evidence (the fitted rate, the window, the values at its ends).

| event kind | what | evidence |
|---|---|---|
| `drift` | the loss moves steadily away from the prediction (the deviation in band units, `pred_dev`, has a slope that carries it more than one band half-width over `window` steps, and it is outside the band now) | slope per 1000 steps, deviation now |
| `growth` | a per-layer statistic (`stats/attn_logit_max/L`, `stats/act_max/L`, `stats/act_rms/L`, `stats/grad_norm/L`) or the global `grad_norm` grows steadily: a log-linear fit over `window` steps multiplies it by `growth_factor` or more and explains most of its variance (R^2 >= 0.8) | factor over the window, R^2, first and last value |
| `straggler` | one rank's step time (`stats/step_time_s/rankR`) is `straggler_ratio` x the median of its peers in most of the last records | ratio, rank, peers' median |
| `throughput-drop` | tokens/s of the last tenth of the window is `throughput_drop` (a fraction) below the window's median | before, now, fraction |

Detectors ignore the first `window` steps and the first 10% of the run, where statistics move fast for
good reasons (the loss and the gradient norm fall, activations and attention logits settle after warmup).
A subject (a kind and a key) reports once; if the condition clears and returns, it reports again.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

GROWTH_STATS = ("attn_logit_max", "act_max", "act_rms", "grad_norm")
"""Per-layer statistics (`stats/<name>/<layer>`) the growth detector follows."""
RANK_TIME = "stats/step_time_s/rank"
"""Prefix of each rank's own step time (`stats/step_time_s/rankR`), what the straggler detector compares."""
MIN_POINTS = 6
"""Records a fit needs inside the window."""
R2_MIN = 0.8


@dataclass
class TrendConfig:
    """The detectors' thresholds (MonitorConfig's trend fields)."""

    window: int = 200
    growth_factor: float = 2.0
    straggler_ratio: float = 1.5
    throughput_drop: float = 0.3


def linear(steps: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope per step, R^2) of a least-squares line through (steps, y)."""
    x = steps - steps.mean()
    sxx = float(x @ x)
    if sxx == 0:
        return 0.0, 0.0
    slope = float(x @ (y - y.mean())) / sxx
    resid = y - y.mean() - slope * x
    syy = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(resid @ resid) / syy if syy > 0 else 0.0
    return slope, r2


def log_linear(steps: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """(slope of log value per step, R^2) of a least-squares line through log values."""
    return linear(steps, np.log(values))


class TrendDetectors:
    """Feed every step's metrics to `observe`; it returns the events to emit."""

    def __init__(self, cfg: TrendConfig, total_steps: int) -> None:
        self.cfg = cfg
        self.start = max(cfg.window, math.ceil(0.1 * total_steps))
        self.series: dict[str, deque[tuple[int, float]]] = {}
        self.active: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        return {"series": {k: list(v) for k, v in self.series.items()}, "active": sorted(self.active)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.series = {
            k: deque((int(s), float(v)) for s, v in pts) for k, pts in state.get("series", {}).items()
        }
        self.active = set(state.get("active", []))

    def _add(self, key: str, step: int, value: Any) -> bool:
        """Record a finite value; whether one was recorded."""
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        pts = self.series.setdefault(key, deque())
        pts.append((step, float(value)))
        while pts and pts[0][0] <= step - self.cfg.window:
            pts.popleft()
        return True

    def observe(self, step: int, metrics: dict[str, Any]) -> list[dict[str, Any]]:
        fresh = {
            key
            for key, value in metrics.items()
            if (key in ("pred_dev", "grad_norm", "tokens_per_s") or _followed_stat(key))
            and self._add(key, step, value)
        }
        if step < self.start or not fresh:
            return []
        # a detector's verdict changes only when its series does: statistics arrive every stats_every steps
        events: list[dict[str, Any]] = []
        if "pred_dev" in fresh:
            events += self._drift(step)
        events += self._growth(step, sorted(k for k in fresh if k == "grad_norm" or _followed_stat(k)))
        if any(k.startswith(RANK_TIME) for k in fresh):
            events += self._stragglers(step)
        if "tokens_per_s" in fresh:
            events += self._throughput(step)
        return events

    def _report(self, subject: str, firing: bool, event: dict[str, Any]) -> list[dict[str, Any]]:
        if not firing:
            self.active.discard(subject)
            return []
        if subject in self.active:
            return []
        self.active.add(subject)
        return [event]

    def _arrays(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        pts = self.series.get(key)
        if not pts or len(pts) < MIN_POINTS or pts[-1][0] - pts[0][0] < self.cfg.window // 2:
            return None
        arr = np.array(pts, dtype=float)
        return arr[:, 0], arr[:, 1]

    def _drift(self, step: int) -> list[dict[str, Any]]:
        got = self._arrays("pred_dev")
        if got is None:
            return []
        s, d = got
        slope, _ = linear(s, d)
        moved = slope * self.cfg.window
        now = float(d[-max(1, len(d) // 10) :].mean())
        firing = abs(moved) > 1 and abs(now) > 1 and (moved > 0) == (now > 0)
        return self._report(
            "drift",
            firing,
            {
                "kind": "drift",
                "step": step,
                "direction": "above" if now > 0 else "below",
                "slope_per_1000_steps": round(1000 * slope, 3),
                "deviation": round(now, 3),
                "window": self.cfg.window,
                "message": f"loss drifting {'above' if now > 0 else 'below'} the prediction: "
                f"{1000 * slope:+.2f} band half-widths per 1000 steps, now {now:+.1f}",
            },
        )

    def _growth(self, step: int, keys: list[str]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for key in keys:
            if key.startswith(RANK_TIME):
                continue
            got = self._arrays(key)
            if got is None or np.any(got[1] <= 0):
                continue
            s, v = got
            slope, r2 = log_linear(s, v)
            factor = math.exp(slope * self.cfg.window)
            firing = factor >= self.cfg.growth_factor and r2 >= R2_MIN
            out += self._report(
                f"growth:{key}",
                firing,
                {
                    "kind": "growth",
                    "step": step,
                    "key": key,
                    "factor": round(factor, 3),
                    "r2": round(r2, 3),
                    "first": round(float(v[0]), 6),
                    "last": round(float(v[-1]), 6),
                    "window": self.cfg.window,
                    "message": f"{key} grew {factor:.1f}x over {self.cfg.window} steps (R^2 {r2:.2f})",
                },
            )
        return out

    def _stragglers(self, step: int) -> list[dict[str, Any]]:
        prefix = RANK_TIME
        ranks = sorted(k for k in self.series if k.startswith(prefix))
        if len(ranks) < 2:
            return []
        recent = {k: [v for _, v in list(self.series[k])[-MIN_POINTS:]] for k in ranks}
        if min(len(v) for v in recent.values()) < MIN_POINTS // 2:
            return []
        out: list[dict[str, Any]] = []
        for k in ranks:
            peers = [statistics.median(recent[o]) for o in ranks if o != k]
            median = statistics.median(peers)
            slow = sum(v >= self.cfg.straggler_ratio * median for v in recent[k])
            firing = median > 0 and slow > len(recent[k]) // 2
            ratio = statistics.median(recent[k]) / median if median > 0 else math.inf
            rank = k.removeprefix(prefix)
            out += self._report(
                f"straggler:{rank}",
                firing,
                {
                    "kind": "straggler",
                    "step": step,
                    "rank": int(rank) if rank.isdigit() else rank,
                    "ratio": round(ratio, 3),
                    "peers_median_s": round(median, 6),
                    "message": f"rank {rank} takes {ratio:.1f}x its peers' step time",
                },
            )
        return out

    def _throughput(self, step: int) -> list[dict[str, Any]]:
        got = self._arrays("tokens_per_s")
        if got is None:
            return []
        v = got[1]
        tail = max(3, len(v) // 10)
        before, now = float(np.median(v[:-tail])), float(np.median(v[-tail:]))
        drop = 1 - now / before if before > 0 else 0.0
        return self._report(
            "throughput",
            drop >= self.cfg.throughput_drop,
            {
                "kind": "throughput-drop",
                "step": step,
                "before": round(before, 1),
                "now": round(now, 1),
                "drop": round(drop, 3),
                "message": f"tokens/s fell {100 * drop:.0f}%: {before:,.0f} -> {now:,.0f}",
            },
        )


def _followed_stat(key: str) -> bool:
    parts = key.split("/")
    return (len(parts) == 3 and parts[0] == "stats" and parts[1] in GROWTH_STATS) or key.startswith(RANK_TIME)
