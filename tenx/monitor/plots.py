"""Loss-curve plots from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from tenx.monitor.metrics import read_metrics


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
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
