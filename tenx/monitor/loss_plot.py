"""Loss-curve plots from metrics.jsonl."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from tenx.monitor.metrics_file import read_metrics
from tenx.utils.io import save_png


def plot_loss_curve(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    """Train loss per step and validation loss where evaluated, in nats/token, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r["tokens"] for r in records], [r["loss"] for r in records], lw=0.8, label="train")
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["tokens"] for r in val], [r["val_loss"] for r in val], "o-", ms=3, label="validation")
    return _save(fig, ax, "tokens", "loss (nats/token)", title, out_png)


def plot_prediction(
    prediction: Any, out_png: str | Path, metrics_path: str | Path | None = None, title: str = ""
) -> Path:
    """A predicted loss curve (tenx.monitor.prediction_file.Prediction) with its band, and, if a run's
    metrics.jsonl is given, its actual loss: the training loss smoothed over the prediction's window, or
    the validation losses as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    val = prediction.quantity == "val_loss"
    column = "val_loss" if val else "loss"
    if metrics_path is not None and Path(metrics_path).is_file():
        records = [r for r in read_metrics(metrics_path) if column in r and "step" in r]
        steps = [r["step"] for r in records]
        losses = [r[column] for r in records]
        if records and val:
            ax.plot(steps, losses, "o", ms=3, color="black", label="actual validation loss")
        elif records:
            ax.plot(steps, losses, lw=0.5, alpha=0.35, color="tab:gray", label="actual (per step)")
            half = max(1, prediction.window) // 2  # centred, as the law's smoothed points are
            sums = [0.0, *itertools.accumulate(losses)]
            smooth = [
                (sums[min(len(losses), i + half + 1)] - sums[max(0, i - half)])
                / (min(len(losses), i + half + 1) - max(0, i - half))
                for i in range(len(losses))
            ]
            ax.plot(steps, smooth, lw=1.2, color="black", label=f"actual (mean of {2 * half + 1} steps)")
    upto = prediction.source.get("upto_step")
    if isinstance(upto, int) and upto < prediction.step[-1]:
        ax.axvline(upto, color="tab:red", lw=0.8, ls="--", label=f"fitted up to step {upto}")
    level = round(100 * prediction.level)
    ax.fill_between(
        prediction.step,
        prediction.lower,
        prediction.upper,
        alpha=0.25,
        color="tab:blue",
        label=f"{level}% band",
    )
    ax.plot(prediction.step, prediction.loss, lw=1.5, color="tab:blue", label="predicted")
    lo = min(prediction.lower)
    hi = max(prediction.upper[len(prediction.upper) // 10 :] or prediction.upper)
    ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.15 * (hi - lo))
    what = "validation" if val else "training"
    return _save(fig, ax, "step", f"{what} loss (nats/token)", title, out_png)


def plot_curve_predictions(
    curves: list[dict[str, Any]], out_png: str | Path, title: str = "", ylabel: str = "loss (nats/token)"
) -> Path:
    """Several predicted curves on one log-step axis, each with its band and, where known, its observed
    losses as points. Each dict: name, steps, loss, lower, upper, and optionally observed_steps and
    observed (NaN where nothing was observed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    named = len(curves) <= 8  # a legend of many runs would hide the curves
    lows, highs = [], []
    for i, c in enumerate(curves):
        color = colors[i % len(colors)]
        ax.fill_between(c["steps"], c["lower"], c["upper"], alpha=0.18, color=color, lw=0)
        label = f"{c['name']} (predicted)" if named else ("predicted (lines, 95% bands)" if i == 0 else None)
        ax.plot(c["steps"], c["loss"], lw=1.3, color=color, label=label)
        obs_steps, obs = c.get("observed_steps"), c.get("observed")
        if obs_steps is not None and obs is not None:
            pairs = [(s, v) for s, v in zip(obs_steps, obs) if math.isfinite(v)]
            if pairs:
                ax.plot(*zip(*pairs), "o", ms=2.2, color=color, alpha=0.8)
        tail = len(c["loss"]) // 10
        lows.append(min(c["lower"]))
        highs.append(max(c["upper"][tail:] or c["upper"]))
    if lows:
        lo, hi = min(lows), max(highs)
        ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.1 * (hi - lo))
    ax.set_xscale("log")
    ax.plot([], [], "o", ms=2.2, color="gray", label="observed")
    return _save(fig, ax, "step", ylabel, title, out_png)


def _save(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, out_png: str | Path) -> Path:
    """Label, grid and legend the axes, write the figure as a PNG and close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return save_png(fig, out_png)
