"""The report of a data-mode study (tenx/scaling/derisk/data_multiplier.py): a Markdown table of the law and
each change's effective data multipliers with intervals, trends, price and verdict, and its plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from tenx.scaling.derisk.compute_multiplier import format_multiplier
from tenx.utils.io import save_png

SHOWN = (0.01, 100.0)
"""The multipliers the plot shows: interval bounds beyond (infinite ones too) run off its axis."""
OPEN = 3.0
"""The plot's axis spans interval bounds within this factor of their multiplier; wider ones are arrows."""


def format_data_derisk(result: dict[str, Any]) -> str:
    """The Markdown report: the baseline's law, each change's data multiplier per scale, trends, verdicts."""
    scales = result["budgets"]
    law = result["law"]
    first = result["changes"][0]["scales"] if result["changes"] else []
    head = " | ".join(
        f"C = {s:.2g} (N {p['params']:.3g}, {p['epochs']:.3g} epochs)" for s, p in zip(scales, first)
    ) or " | ".join(f"C = {s:.2g}" for s in scales)
    params = ", ".join(f"{k} {v:.4g}" for k, v in law["params"].items())
    lines = [
        "# Derisking report: effective data multipliers",
        "",
        f"Baseline law ({law['form']}): {params}; fitted to {law['n_points']} points (each the median of its "
        "seeds), largest error "
        f"{100 * result['law_max_abs_rel_error']:.2f}% of the held-out loss.",
        "",
        *[f"WARNING: {w}" for w in result.get("warnings") or []],
        *(
            [
                "",
                "The verdicts below rest on this law: read them as provisional until the warnings are gone.",
                "",
            ]
            if result.get("warnings")
            else []
        ),
        "| scale | params | tokens | unique tokens | epochs | held-out loss | law |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["baseline"], key=lambda r: (r["budget"], r["params"], r["tokens"], -r["epochs"])):
        lines.append(
            f"| {r['budget']:.2g} | {r['params']:.3g} | {r['tokens']:.3g} | {r['unique_tokens']:.3g} | "
            f"{r['epochs']:.3g} | {r['heldout_loss']:.4f} | {r['predicted']:.4f} |"
        )
    lines += [
        "",
        f"Effective data multiplier of each change (alone on the baseline) at "
        f"{result['compare_unique_tokens']:,} unique tokens, with 95% intervals: the factor of unique tokens "
        "the baseline would need, at the same epochs, to reach the change's held-out loss; > 1 is a gain. "
        f"Trend: the factor per decade of compute. Extrapolated to C = {result['target']:.2g}.",
        "",
        f"| change | {head} | trend per decade | at target | compute | verdict |",
        "|---" * (len(scales) + 5) + "|",
    ]
    for ch in result["changes"]:
        cells = " | ".join(
            format_multiplier(x, lo, hi) for x, lo, hi in zip(ch["multipliers"], ch["low"], ch["high"])
        )
        lo, hi = ch["slope_interval"]
        factor = [10 ** min(x, 300.0) if math.isfinite(x) else x for x in (ch["slope_per_decade"], lo, hi)]
        trend = f"{factor[0]:.3g}x [{factor[1]:.3g}, {factor[2]:.3g}]"
        price = f"{ch.get('compute_multiple', 1.0):.3g}x"
        lines.append(
            f"| {ch['name']} | {cells} | {trend} | {ch['at_target']:.2f} | {price} | **{ch['verdict']}** |"
        )
    notes = [f"- {ch['name']}: {n}" for ch in result["changes"] for n in ch.get("notes") or []]
    lines += [
        "",
        "Compute: each change's training FLOPs against one run of the baseline at the same point (an "
        "ensemble's K members; a distilled student's own run, its teacher's forward passes and the teacher's "
        "training; a planted win's extra tokens).",
        *(["", "Tuned per scale on the validation split:", *notes] if notes else []),
        "",
        "Seed noise (std of held-out loss over a run's seeds, nats/token; each size's intervals use its "
        "own, drawn as its degrees of freedom allow): "
        + ", ".join(
            f"C{s['budget']:.3g}: {s['sigma']:.4f} ({s['dof']} dof{'' if s['own'] else ', borrowed'})"
            for s in result.get("seed_sigma_by_scale", [])
        )
        + f"; pooled {result['seed_sigma']:.4f}.",
    ]
    return "\n".join(lines) + "\n"


def plot_data_report(result: dict[str, Any], out_png: str | Path) -> Path:
    """Left: the baseline's held-out loss against epochs per scale, with the law; right: multipliers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from tenx.scaling.fit import FitResult

    law = result["law"]
    fit = FitResult(law["law"], law["form"], law["params"], {}, np.zeros((0, len(law["params"]))), 0, 0.0)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.5), dpi=120)
    for size in sorted({(r["params"], r["tokens"]) for r in result["baseline"]}):
        rows = [r for r in result["baseline"] if (r["params"], r["tokens"]) == size]
        if len(rows) < 2:  # a single-epoch run of U tokens: a point of the fit, not of a curve
            continue
        (line,) = ax1.plot(
            [r["epochs"] for r in rows],
            [r["heldout_loss"] for r in rows],
            "o",
            label=f"N {size[0]:.3g}, D {size[1]:.3g}",
        )
        epochs = np.geomspace(1.0, max(r["epochs"] for r in rows) * 1.5, 60)
        ax1.plot(
            epochs,
            fit.predict(N=np.full_like(epochs, size[0]), D=np.full_like(epochs, size[1]), U=size[1] / epochs),
            "-",
            color=line.get_color(),
            lw=0.8,
        )
    ax1.set_xscale("log")
    ax1.set_xlabel("epochs (tokens / unique tokens) at the scale's compute")
    ax1.set_ylabel("held-out loss (nats/token)")
    ax1.set_title("baseline, with the data-constrained law")
    ax1.grid(alpha=0.3, which="both")
    # below the panel: inside it, the legend covered the longest runs' points
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=3)
    scales = np.array(result["budgets"])
    any_shown = False
    drawn = [1.0]  # the multipliers and interval bounds drawn: the axis spans them (within SHOWN)
    beyond: list[tuple[np.ndarray, np.ndarray, np.ndarray, Any]] = []  # each change's x, high, low, color
    past = False  # a bound drawn as an arrow past the axis
    for i, ch in enumerate(result["changes"]):
        y = np.array(ch["multipliers"])
        shown = np.isfinite(y) & (y > 0)  # an infinite multiplier (past the law's floor) has no point
        with np.errstate(invalid="ignore"):  # inf - inf: no bar, as nan_to_num says below
            low = np.clip(
                np.array(ch["low"], dtype=float), SHOWN[0], SHOWN[1]
            )  # an infinite bound: off the axis
            high = np.clip(np.array(ch["high"], dtype=float), SHOWN[0], SHOWN[1])
            err = np.clip(np.array([y - low, high - y]), 0, None)
        err = np.nan_to_num(err, nan=0.0, posinf=0.0)[:, shown]
        dodge = 1.04 ** (i - (len(result["changes"]) - 1) / 2)  # side by side: overlapping bars stay legible
        line = ax2.errorbar(scales[shown] * dodge, y[shown], yerr=err, fmt="o-", capsize=3, label=ch["name"])
        # the axis spans the points and the bounds within a factor OPEN of them; a bound beyond is drawn as
        # an arrow at the panel's edge (its figure is in the report), not as a bar that flattens the others
        near = (y[shown] + err[1] <= OPEN * y[shown], y[shown] - err[0] >= y[shown] / OPEN)
        drawn += [*y[shown], *(y[shown] + err[1])[near[0]], *(y[shown] - err[0])[near[1]]]
        beyond.append((scales[shown] * dodge, y[shown] + err[1], y[shown] - err[0], line[0].get_color()))
        any_shown |= bool(shown.any())
    ax2.axhline(1.0, color="k", lw=0.8)
    if any_shown:  # else an empty panel: every multiplier lies past the law's floor
        ax2.set_xscale("log")
        ax2.set_yscale("log", nonpositive="clip")
        bounds = np.array([v for v in drawn if v > 0])
        bottom, top = max(SHOWN[0], bounds.min() / 1.25), min(SHOWN[1], bounds.max() * 1.25)
        ax2.set_ylim(bottom, top)
        for x, high, low, color in beyond:
            up, down = high > top, low < bottom
            ax2.plot(x[up], np.full(up.sum(), top / 1.03), "^", color=color, ms=7)
            ax2.plot(x[down], np.full(down.sum(), bottom * 1.03), "v", color=color, ms=7)
            past |= bool(up.any() or down.any())
        ax2.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # crowded labels on a short decade
    ax2.set_xlabel(
        "training FLOPs of the scale"
        + ("\n(an arrow: the interval runs past the edge; report.md has its bound)" if past else "")
    )
    ax2.set_ylabel("effective data multiplier")
    ax2.set_title(f"at {result['compare_unique_tokens']:,} unique tokens")
    ax2.grid(alpha=0.3, which="both")
    # below the panel, as the left one's: inside it, the legend covered the smallest scale's bars
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=3)
    return save_png(fig, out_png)
