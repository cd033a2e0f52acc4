"""Measuring the curve laws on real runs: cross-schedule, leave-largest-out across sizes, self-extrapolation.

Every error is the absolute relative error of the loss averaged over windows of `window` consecutive
records after warmup (one step's loss scatters by 5% at these batch sizes; a 25-step window brings that
to about 1%), predicted against observed; `max` and `mean` are over the windows of the held-out curves.
Coverage is the fraction of those windows whose observed mean lies inside the prediction's band.

The protocol (`protocol`) is read off the runs' configs:
- cross-schedule: at each model size that has cosine runs and runs of another schedule, fit the cosine
  runs and predict the others;
- leave-largest-out: fit every run of the other sizes (the size law needs 3 of them) and predict the
  largest size's runs, whatever their schedule;
- leave-largest-budget-out (runs with FLOPs, such as a ladder's): fit every run of the smaller budgets and
  predict the top budget's runs (longer training of sizes seen below it);
- self-extrapolation: fit the first `fraction` of each run and predict the rest, with the law's shape
  under a soft prior from a fit of every other run (a ladder that did not see this run), and with no
  prior at all (every parameter free: what the prior is for).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tenx.errors import ConfigError
from tenx.scaling.curve.extrapolate import CurvePrediction, extrapolate_run, predict_curve
from tenx.scaling.curve.fitting import fit_curves
from tenx.scaling.curve.schedule import Curve

WINDOW = 25


def curve_error(
    prediction: CurvePrediction, curve: Curve, window: int = WINDOW, start: int = 0
) -> dict[str, Any]:
    """Errors of `prediction` against the observed records of `curve` from step `start` (and after warmup):
    max and mean absolute relative error of window means, the band's coverage, and the final window's
    relative error."""
    first = max(start, prediction.steps[0])
    keep = curve.steps >= first
    steps, loss = curve.steps[keep], curve.loss[keep]
    if len(steps) < window:
        raise ConfigError(
            f"curve {curve.name}: {len(steps)} records from step {first}; measuring needs at least {window}"
        )
    index = steps - prediction.steps[0]
    pred, lower, upper = (np.asarray(v)[index] for v in (prediction.loss, prediction.lower, prediction.upper))
    errors, covered = [], []
    for i in range(0, len(steps) - window + 1, window):
        part = slice(i, i + window)
        observed = loss[part].mean()
        errors.append(pred[part].mean() / observed - 1)
        covered.append(lower[part].mean() <= observed <= upper[part].mean())
    last = slice(len(steps) - window, len(steps))
    final = pred[last].mean() / loss[last].mean() - 1
    e = np.abs(errors)
    return {
        "curve": curve.name,
        "max": float(e.max()),
        "mean": float(e.mean()),
        "final": float(final),
        "coverage": float(np.mean(covered)),
        "windows": len(e),
    }


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"curves": []}
    weights = np.array([r["windows"] for r in rows], dtype=float)
    return {
        "max": max(r["max"] for r in rows),
        "mean": float(np.average([r["mean"] for r in rows], weights=weights)),
        "max_final": max(abs(r["final"]) for r in rows),
        "coverage": float(np.average([r["coverage"] for r in rows], weights=weights)),
        "curves": rows,
    }


def split_error(
    law: str, train: Sequence[Curve], test: Sequence[Curve], window: int = WINDOW, **options: Any
) -> dict[str, Any]:
    """Fit `law` to `train` and measure its predictions of `test` (fit_curves options pass through)."""
    fit = fit_curves(train, law, **options)
    rows = [curve_error(predict_curve(fit, c.schedule, c.params), c, window) for c in test]
    return {"train": [c.name for c in train], **_summary(rows)}


def self_extrapolation_error(
    law: str,
    curves: Sequence[Curve],
    fraction: float = 0.3,
    priors: dict[str, Any] | None = None,
    window: int = WINDOW,
    bootstrap: int = 20,
) -> dict[str, Any]:
    """Extrapolate each curve from its first `fraction` of steps (with its prior from `priors`, by curve
    name; {} for none) and measure the rest of the curve and the final loss. A fit that predicts a
    non-positive loss counts as an error of 100%. A curve whose first `fraction` holds too few records
    after warmup to fit (a validation curve of a run that warms up over most of it) is listed under
    `skipped` with the reason."""
    rows, skipped = [], {}
    for c in curves:
        cut = int(round(fraction * c.schedule.steps))
        prior = (priors or {}).get(c.name, {})
        try:
            prediction, _ = extrapolate_run(c.upto(cut), law, prior=prior, bootstrap=bootstrap)
        except ConfigError as e:
            if "records after warmup" not in str(e):
                raise
            skipped[c.name] = str(e)
            continue
        rows.append(curve_error(prediction, c, window, start=cut + 1))
    return {"fraction": fraction, **_summary(rows), "skipped": skipped}


def _schedule_of(curve: Curve) -> str:
    optim = curve.config.get("optim", {})
    name = str(optim.get("schedule", curve.schedule.source))
    return f"{name}-{optim.get('decay_fraction')}" if name == "wsd" else name


def protocol(curves: Sequence[Curve]) -> dict[str, Any]:
    """The splits of the module docstring, as curve names."""
    sizes = sorted({c.params for c in curves})
    cross = []
    for n in sizes:
        at = [c for c in curves if c.params == n]
        cosine = [c.name for c in at if _schedule_of(c) == "cosine"]
        other = [c.name for c in at if _schedule_of(c) != "cosine"]
        if cosine and other:
            cross.append({"train": cosine, "test": other})
    largest = {
        "train": [c.name for c in curves if c.params != sizes[-1]],
        "test": [c.name for c in curves if c.params == sizes[-1]],
    }
    out: dict[str, Any] = {"cross_schedule": cross, "leave_largest_out": largest}
    groups = curves_by_budget(curves)
    if len(groups) >= 2:
        out["leave_largest_budget_out"] = {
            "train": [n for g in groups[:-1] for n in g],
            "test": groups[-1],
        }
    return out


def curves_by_budget(curves: Sequence[Curve], tolerance: float = 0.05) -> list[list[str]]:
    """Names of the curves that share a training budget (FLOPs within `tolerance`), by budget, smallest
    first: a ladder's rungs. Curves without FLOPs (no run.json) belong to none."""
    known = sorted((c for c in curves if c.flops), key=lambda c: float(c.flops or 0))
    groups: list[list[Curve]] = []
    for c in known:
        if groups and float(c.flops or 0) <= float(groups[-1][0].flops or 0) * (1 + tolerance):
            groups[-1].append(c)
        else:
            groups.append([c])
    return [[c.name for c in g] for g in groups]


def benchmark(
    curves: Sequence[Curve],
    laws: Sequence[str] = ("power", "tissue", "tissue-rate", "tissue-paper", "mpl"),
    fractions: Sequence[float] = (0.3,),
    bootstrap: int = 20,
    window: int = WINDOW,
) -> dict[str, Any]:
    """Every measurement of the module docstring for each law: plain data, JSON-serialisable."""
    by_name = {c.name: c for c in curves}
    splits = protocol(curves)
    out: dict[str, Any] = {"protocol": splits, "window": window, "laws": {}}

    def error(law: str, split: dict[str, list[str]], **options: Any) -> dict[str, Any]:
        """`split_error` of `law` on a split of the protocol (curve names: train, test)."""
        train, test = ([by_name[n] for n in split[part]] for part in ("train", "test"))
        return split_error(law, train, test, window, bootstrap=bootstrap, **options)

    for law in laws:
        cross = [error(law, s) for s in splits["cross_schedule"]]
        lo = splits["leave_largest_out"]
        sizes = len({by_name[n].params for n in lo["train"]})
        largest = (
            error(law, lo, size_law="power")
            if sizes >= 3
            else {"skipped": f"{sizes} sizes below the largest; the size law needs 3"}
        )
        priors = {c.name: fit_curves([o for o in curves if o is not c], law, bootstrap=0) for c in curves}
        out["laws"][law] = {
            "cross_schedule": _summary([r for s in cross for r in s["curves"]]),
            "leave_largest_out": largest,
            "self_extrapolation_prior": {
                f"{f:g}": self_extrapolation_error(law, curves, f, priors, window, bootstrap)
                for f in fractions
            },
            "self_extrapolation_free": {
                f"{f:g}": self_extrapolation_error(law, curves, f, {}, window, bootstrap) for f in fractions
            },
        }
    return out
