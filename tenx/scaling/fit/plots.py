"""The picture of a scaling fit: runs, fitted curves, and the extrapolation to held-out runs with its band."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tenx.scaling.fit.frontier import best_per_budget, compute_optimal
from tenx.utils.io import save_png

if TYPE_CHECKING:
    from tenx.scaling.fit.laws import FitResult
    from tenx.scaling.table import Points


def _curve_span(lo: float, hi: float, n: int = 120) -> np.ndarray:
    return np.geomspace(lo, hi, n)


def _target_loss(fit: FitResult, target: dict[str, float]) -> float | None:
    """The fit's predicted loss at the target (None when it has none or it is not a finite number)."""
    if fit.law == "compute":
        c = target.get("C", 6 * target.get("N", 0) * target.get("D", 0))
        loss = fit.predict(C=c)
    elif "N" in target and ("D" in target or "C" in target):
        loss = fit.predict(N=target["N"], D=target.get("D"), C=target.get("C"), U=target.get("U"))
    else:
        loss = compute_optimal(fit, target["C"])["loss"]
    return float(loss) if np.isfinite(loss) else None


def plot_fit(
    fit: FitResult,
    fitted: Points,
    holdout: Points,
    out_png: str | Path,
    *,
    target: dict[str, float] | None = None,
    excluded: Points | None = None,
    title: str = "",
) -> Path:
    """Loss against training compute: fitted runs, one fitted curve per model size, held-out runs and the
    target with the bootstrap band of their extrapolation; saved (atomically) as a PNG."""

    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c_all = np.concatenate([fitted.C, holdout.C, excluded.C if excluded is not None else []])
    c_hi = float(c_all.max())
    if target:
        c_hi = max(c_hi, target.get("C", 6 * target.get("N", 0) * target.get("D", 0)))
    cmap = plt.get_cmap("viridis")
    c_t = target.get("C", 6 * target.get("N", 0) * target.get("D", 0)) if target else None
    c_lo, c_data = float(c_all.min()), float(c_all.max())
    sizes_key: list[float] = []
    if fit.law != "compute":
        sizes_key = sorted(set(np.concatenate([fitted.N, holdout.N]).tolist()))
        if target and "N" in target:
            sizes_key = sorted({*sizes_key, target["N"]})

    def draw(ax: Any, key: bool) -> None:
        if fit.law == "compute":
            grid = _curve_span(float(c_all.min()) / 1.5, c_hi * 1.5)
            ax.plot(grid, fit.predict(C=grid), color="C0", lw=1.5, label=f"fit: {fit.form}")
            low, high = fit.predict_interval(C=grid)
            ax.fill_between(grid, low, high, color="C0", alpha=0.2, lw=0, label=f"{fit.level:.0%} band")
            ax.scatter(fitted.C, fitted.L, s=18, facecolor="none", edgecolor="C0", zorder=3, label="runs")
            best_c, best_l = best_per_budget(fitted)
            ax.scatter(best_c, best_l, s=18, color="C0", zorder=3, label="best run per budget (fitted)")
        else:
            sizes = np.unique(np.concatenate([fitted.N, holdout.N]))
            if target and "N" in target:
                sizes = np.unique(np.append(sizes, target["N"]))
            log_n = np.log(sizes)
            span = max(float(np.ptp(log_n)), 1e-9)

            def color(n: float) -> Any:
                return cmap(0.85 * (np.log(n) - log_n.min()) / span)

            # one curve per model size (per size and unique-token budget for the data-constrained law)
            dc = fit.law == "data-constrained"
            runs = [(n, u if dc else np.nan, d) for n, u, d in zip(fitted.N, fitted.U, fitted.D)]
            runs += [(n, u if dc else np.nan, d) for n, u, d in zip(holdout.N, holdout.U, holdout.D)]
            if target and {"N", "D"} <= target.keys():
                runs.append((target["N"], target.get("U", target["D"]) if dc else np.nan, target["D"]))
            fitted_sizes = set(fitted.N.tolist())
            for n, u in sorted({(n, u) for n, u, _ in runs}, key=lambda k: (k[0], np.nan_to_num(k[1]))):
                d_vals = np.array([d for nn, uu, d in runs if nn == n and (uu == u or np.isnan(u))])
                d = _curve_span(float(d_vals.min()) / 1.5, float(d_vals.max()) * 1.5, 60)
                kw: dict[str, Any] = {"U": u} if dc else {}
                extrapolated = n not in fitted_sizes
                ax.plot(
                    6 * n * d,
                    fit.predict(N=n, D=d, **kw),
                    color=color(n),
                    lw=1.2,
                    ls="--" if extrapolated else "-",
                )
                if extrapolated:
                    low, high = fit.predict_interval(N=n, D=d, **kw)
                    ax.fill_between(6 * n * d, low, high, color=color(n), alpha=0.2, lw=0)
            ax.scatter(
                fitted.C, fitted.L, s=18, c=[color(n) for n in fitted.N], zorder=3, label="fitted runs"
            )
            # the key to the colours: one entry per model size (8 of them, evenly spread, when there are more)
            keyed = (
                sizes_key
                if len(sizes_key) <= 8
                else [sizes_key[round(i)] for i in np.linspace(0, len(sizes_key) - 1, 8)]
            )
            for n in keyed:
                ax.plot([], [], color=color(n), lw=2, label=f"N = {n:.3g} parameters")
            if fit.law == "chinchilla":
                grid = _curve_span(float(c_all.min()), c_hi * 1.5, 40)
                frontier = [compute_optimal(fit, float(c)) for c in grid]
                ax.plot(grid, [f["loss"] for f in frontier], color="k", lw=1, ls=":", label="compute-optimal")
        if len(holdout):
            ax.scatter(
                holdout.C,
                holdout.L,
                s=70,
                marker="*",
                color="C3",
                edgecolor="k",
                zorder=4,
                label="held-out runs",
            )
            if fit.law == "compute":
                predicted = fit.predict(C=holdout.C)
                low, high = fit.predict_interval(C=holdout.C)
            else:
                kw = {"U": holdout.U} if fit.law == "data-constrained" else {}
                predicted = fit.predict(N=holdout.N, D=holdout.D, **kw)
                low, high = fit.predict_interval(N=holdout.N, D=holdout.D, **kw)
            yerr = np.array([predicted - low, high - predicted])
            ax.errorbar(
                holdout.C,
                predicted,
                yerr=np.where(np.isfinite(yerr), yerr, 0),
                fmt="o",
                mfc="none",
                color="C3",
                capsize=3,
                zorder=4,
                label="predicted",
            )
        if excluded is not None and len(excluded):
            ax.scatter(excluded.C, excluded.L, s=22, marker="x", color="0.55", zorder=2, label="left out")
        if target:
            c_t = target.get("C", 6 * target.get("N", 0) * target.get("D", 0))
            ax.axvline(c_t, color="C1", lw=1, ls="-.", label="target")
        ax.set_xscale("log")
        ax.set_yscale("log")
        # a loss axis spans well under a decade: plain numbers read better than powers of ten
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
        ax.set_xlabel(
            "training compute C = 6ND (FLOPs)" if fit.law != "compute" else "training compute C (FLOPs)"
        )
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title or f"{fit.law} fit")
        ax.grid(alpha=0.3, which="both")
        if key:
            ax.legend(fontsize=8)

    # a target far beyond the runs gets its own panel, so the runs are not squashed into a corner
    far = c_t is not None and c_t > 30 * c_data
    fig, axes = plt.subplots(1, 2 if far else 1, figsize=(13 if far else 8, 5), dpi=120, squeeze=False)
    losses = np.concatenate([fitted.L, holdout.L, excluded.L if excluded is not None else []])
    for i, ax in enumerate(axes[0]):
        draw(ax, key=i == 0)
        shown = losses
        if i == len(axes[0]) - 1 and target:  # the target's predicted loss, when it is a plausible one
            predicted = _target_loss(fit, target)
            if predicted is not None and predicted >= losses.min() / 3:
                shown = np.append(losses, predicted)
        ax.set_ylim(float(shown.min()) / 1.12, float(shown.max()) * 1.08)
        if far and i == 0:
            ax.set_xlim(c_lo / 2, c_data * 2)
            ax.set_title("the runs and the fit")
        elif far:
            ax.set_title(f"extrapolation to the target C={c_t:.3g}")
    if far:
        fig.suptitle(title or f"{fit.law} fit")
    return save_png(fig, out_png)
