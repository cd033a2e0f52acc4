"""`tenx predict --curves FIT --target TARGET --out DIR`: anyone's curves (curve tables,
tenx.scaling.curve.curve_table) fitted and another table's runs predicted, each on its own schedule and size.

Writes DIR/prediction.json (the first target run, the format a run is watched against; with several runs,
each one's under DIR/runs/NAME/), DIR/prediction.csv (`run,step,loss,lower,upper`, one line per target row
past warmup) and DIR/prediction.png; target rows with a loss are compared with the prediction.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np

from tenx.errors import TenxError
from tenx.monitor.loss_plot import plot_curve_predictions
from tenx.monitor.prediction_file import Prediction, write_prediction
from tenx.scaling.curve import DEFAULT_LAW, CurvePrediction, predict_curve
from tenx.scaling.curve.curve_table import curve_regime_warnings, read_curve_table
from tenx.scaling.predict import (
    PREDICTION,
    PREDICTION_PNG,
    _to_prediction,
    check_bootstrap,
    check_out_dir,
    curve_fit_of,
)
from tenx.utils.io import atomic_write_text, check_output_file

PREDICTION_CSV = "prediction.csv"
"""`tenx predict --curves`: every target row past warmup, `run,step,loss,lower,upper`."""


def predict_from_curves(
    fit_table: Any,
    target_table: Any,
    *,
    law: str = DEFAULT_LAW,
    bootstrap: int = 30,
    split: str | None = None,
) -> tuple[list[tuple[Any, Prediction, CurvePrediction]], Any, list[str]]:
    """Fit `law` to the curves of `fit_table` (tenx.scaling.curve.curve_table) and predict every run of
    `target_table` on its own schedule and size. Returns ([(target run, prediction, curve)], the fit, the
    regime warnings of both tables)."""
    split = fit_table.pick_split(split)
    fit, fit_runs = curve_fit_of(fit_table, law=law, bootstrap=bootstrap, split=split)
    targets = target_table.select(split)
    largest = max(fit.sizes)
    out = []
    for run in targets:
        schedule = run.schedule()
        cp = predict_curve(fit, schedule, run.params)
        source = {
            "kind": "curves",
            "curves": str(fit_table.path),
            "runs": len(fit.curves),
            "size_law": fit.size_law,
            "largest_fitted_params": largest,
            "extrapolation_in_params": run.params / largest,
            "window_sigma": fit.window_sigma,
        }
        target = {"run": run.run, "table": str(target_table.path), "steps": run.last_step}
        target["tokens_per_step"] = run.tokens_per_step
        quantity = "val_loss" if run.split == "val" else "loss"
        out.append((run, _to_prediction(cp, 1, source, target, quantity), cp))
    warnings = curve_regime_warnings(fit_runs, "fitted") + curve_regime_warnings(targets, "predicted")
    return out, fit, warnings


def target_rows(run: Any, cp: CurvePrediction) -> list[dict[str, Any]]:
    """`run,step,loss,lower,upper` of each of the target run's rows past warmup (and its observed loss)."""
    first = cp.steps[0]
    rows = []
    for step, observed in zip(run.steps, run.loss):
        if step < first:
            continue
        i = int(step) - first
        rows.append(
            {
                "run": run.run,
                "step": int(step),
                "loss": cp.loss[i],
                "lower": cp.lower[i],
                "upper": cp.upper[i],
                "observed": float(observed),
            }
        )
    return rows


def write_prediction_csv(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """prediction.csv (run,step,loss,lower,upper), atomically."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["run", "step", "loss", "lower", "upper"])
    for r in rows:
        writer.writerow([r["run"], r["step"], *(f"{r[k]:.6g}" for k in ("loss", "lower", "upper"))])
    atomic_write_text(path, buf.getvalue())
    return Path(path)


def observed_errors(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Mean and worst relative error, and band coverage, over the rows that have an observed loss."""
    seen = [r for r in rows if np.isfinite(r["observed"])]
    if not seen:
        return None
    err = np.array([r["loss"] / r["observed"] - 1 for r in seen])
    inside = np.array([r["lower"] <= r["observed"] <= r["upper"] for r in seen])
    return {
        "rows": len(seen),
        "mean": float(np.abs(err).mean()),
        "worst": float(np.abs(err).max()),
        "coverage": float(inside.mean()),
    }


def run_files(out_dir: Path, names: list[str], force: bool) -> list[Path]:
    """DIR/runs/NAME/prediction.json of each run, NAME its name made safe for a path (a second run whose
    name makes the same one gets a numbered suffix); an existing file only with `force`."""
    paths, taken = [], set()
    for name in names:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name).lstrip(".") or "run"
        unique, n = safe, 1
        while unique in taken:
            n += 1
            unique = f"{safe}-{n}"
        taken.add(unique)
        path = out_dir / "runs" / unique / PREDICTION
        try:
            check_output_file(path, force=force)
        except TenxError as e:
            raise TenxError(f"-o {out_dir}: {e}") from None
        paths.append(path)
    return paths


def run_predict_table(
    curves: str | Path,
    target: str | Path,
    out: str | Path,
    law: str = DEFAULT_LAW,
    bootstrap: int = 30,
    split: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """`tenx predict --curves FIT --target TARGET --out DIR`: fit, predict, write the three files, and return
    {"prediction" (the first run's), "paths", "text", "warnings"}. Existing outputs are replaced only with
    `force`; neither table is ever an output."""
    check_bootstrap(bootstrap)
    out_dir = check_out_dir(out, None, force)
    try:
        check_output_file(out_dir / PREDICTION_CSV, force=force, inputs=(curves, target))
    except TenxError as e:
        raise TenxError(f"-o {out}: {e}") from None
    fit_table, target_table = read_curve_table(curves), read_curve_table(target)
    results, fit, warnings = predict_from_curves(
        fit_table, target_table, law=law, bootstrap=bootstrap, split=split
    )
    # prediction.json holds the first run; with several, each run's is under runs/NAME/ as well
    per_run = run_files(out_dir, [run.run for run, _, _ in results], force) if len(results) > 1 else []
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_by_run = [target_rows(run, cp) for run, _, cp in results]
    paths: dict[str, Path] = {
        "csv": write_prediction_csv(out_dir / PREDICTION_CSV, [r for rows in rows_by_run for r in rows])
    }
    paths["prediction"] = write_prediction(out_dir / PREDICTION, results[0][1])
    for path, (_, prediction, _) in zip(per_run, results):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_prediction(path, prediction)
    plotted = [
        {
            "name": run.run,
            "steps": cp.steps,
            "loss": cp.loss,
            "lower": cp.lower,
            "upper": cp.upper,
            "observed_steps": run.steps.tolist(),
            "observed": run.loss.tolist(),
        }
        for run, _, cp in results
    ]
    what = "validation" if results[0][0].split == "val" else "training"
    title = f"{Path(target).name} predicted from {len(fit.curves)} runs of {Path(curves).name} ({law})"
    paths["plot"] = plot_curve_predictions(
        plotted, out_dir / PREDICTION_PNG, title, f"{what} loss (nats/token)"
    )
    lines = [f"WARNING: {w}" for w in warnings]
    largest = max(fit.sizes)
    lines.append(
        f"fitted {law} ({fit.size_law} sizes) to {len(fit.curves)} runs of {curves}; predicted "
        f"{len(results)} run(s) of {target}:"
    )
    for (run, prediction, _), rows in zip(results, rows_by_run):
        f = prediction.final
        errors = observed_errors(rows)
        seen = (
            f"; observed rows: mean error {100 * errors['mean']:.2f}%, worst {100 * errors['worst']:.2f}%, "
            f"{100 * errors['coverage']:.0f}% inside the band"
            if errors
            else ""
        )
        lines.append(
            f"  {run.run}: step {f['step']} loss {f['loss']:.4f} ({round(100 * prediction.level)}% band "
            f"{f['lower']:.4f} .. {f['upper']:.4f}), {run.params / largest:.2g}x the largest fitted size{seen}"
        )
    lines += [f"prediction: {paths['prediction']}", f"table: {paths['csv']}", f"plot: {paths['plot']}"]
    return {"prediction": results[0][1], "paths": paths, "text": "\n".join(lines), "warnings": warnings}
