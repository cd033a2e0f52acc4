"""The whole `tenx fit` analysis of a run table: which runs to fit, the fit, its predictions of held-out runs
and of a target, leave-largest-out, IsoFLOP minima, the compute-optimal point; the JSON report, its plot and
its readable summary."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from tenx.errors import ConfigError, DataError
from tenx.scaling.fit.data_law_check import regime_warnings, run_label
from tenx.scaling.fit.frontier import (
    at_budget,
    budget_groups,
    compute_optimal,
    fit_points,
    isoflop_minima,
    leave_largest_out,
    prediction_rows,
)
from tenx.scaling.fit.laws import LAWS, PARAM_BOUNDS, POWER_FORM, TIED_FORM, FitResult
from tenx.scaling.fit.plots import plot_fit
from tenx.scaling.fit.solver import with_serial_blas
from tenx.scaling.table import Points, Table, read_table
from tenx.utils.io import atomic_write_json, check_output_file

_TARGET_KEYS = {
    "n": "N",
    "params": "N",
    "d": "D",
    "tokens": "D",
    "c": "C",
    "flops": "C",
    "u": "U",
    "unique": "U",
}


def parse_target(spec: str | dict[str, float]) -> dict[str, float]:
    """'N=1e9,D=2e10' or 'C=1e21' (U= for data-constrained) -> {'N': 1e9, 'D': 2e10}; ConfigError otherwise."""
    if isinstance(spec, dict):
        items = [(str(k), str(v)) for k, v in spec.items()]
    else:
        items = []
        for part in (p for p in re.split(r"[,\s]+", spec.strip()) if p):
            key, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(
                    f"--target {spec!r}: expected KEY=VALUE pairs such as N=1e9,D=2e10 or C=1e21"
                )
            items.append((key, value))
    target: dict[str, float] = {}
    for key, value in items:
        name = _TARGET_KEYS.get(key.strip().lower())
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if name is None or not (math.isfinite(number) and number > 0):
            raise ConfigError(
                f"--target {spec!r}: bad {key}={value}; keys are N (params), D (tokens), C (FLOPs) and U "
                "(unique tokens), each a positive number, e.g. N=1e9,D=2e10 or C=1e21"
            )
        target[name] = number
    if not target or ("C" not in target and not {"N", "D"} <= target.keys()):
        raise ConfigError(f"--target {spec!r}: give N and D (e.g. N=1e9,D=2e10) or C (e.g. C=1e21)")
    return target


def _predict_target(fit: FitResult, target: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = dict(target)
    if fit.law == "compute" or {"N", "D"} <= target.keys() or {"N", "C"} <= target.keys():
        kw = {k: target.get(k) for k in ("N", "D", "C", "U")}
        if fit.law == "compute" and "C" not in target:
            kw["C"] = 6 * target["N"] * target["D"]
            out["C"] = kw["C"]
        out["predicted"] = fit.predict(**kw)
        out["low"], out["high"] = fit.predict_interval(**kw)
    if "C" in target and fit.law != "compute" and "N" not in target:
        out["compute_optimal"] = compute_optimal(fit, target["C"])
        out["predicted"] = out["compute_optimal"]["loss"]
        out["low"], out["high"] = out["compute_optimal"].get("loss_interval", [math.nan, math.nan])
    return out


def _jsonable(obj: Any) -> Any:
    """Numbers as plain floats (NaN and infinities as null: JSON has neither); containers recursively."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def _at_bound(value: float, bound: float) -> bool:
    return abs(value - bound) <= 1e-6 if bound == 0 else abs(value / bound - 1) <= 1e-3


def fit_warnings(report: dict[str, Any]) -> list[str]:
    """What makes a fit's figures untrustworthy, each in a sentence: a parameter at the end of the range
    the fit allows it (the runs did not determine it), an interval of no width or one spanning the whole
    range, too few runs for the parameters, a leave-largest-out that could not run, a target far beyond
    the runs. `report` is run_fit's (its `fit` a FitResult.to_dict())."""
    fit = report["fit"]
    params, intervals = fit["params"], fit["intervals"]
    out = []
    n_params = {POWER_FORM: 2, TIED_FORM: 4}.get(fit["form"], len(params))  # E is 0 in the power form
    if report["n_fit"] < 2 * n_params:
        out.append(
            f"{report['n_fit']} runs fitted for {n_params} parameters: too few to determine them (aim for "
            "2 runs per parameter or more, over more model sizes and budgets); read every figure below as "
            "a rough guess"
        )
    for name, (lo_bound, hi_bound) in PARAM_BOUNDS.items():
        if name not in params or (name == "E" and fit["form"] == POWER_FORM):
            continue
        value = params[name]
        for bound, side in ((lo_bound, "lowest"), (hi_bound, "highest")):
            if _at_bound(value, bound):
                out.append(
                    f"{name} = {value:.4g} is the {side} value the fit allows: the runs do not determine "
                    f"{name}, and predictions away from the runs follow the bound, not the data"
                )
    if fit.get("n_bootstrap"):
        for name, (lo, hi) in intervals.items():
            if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
                out.append(f"{name}'s interval is not finite: bootstrap refits diverged")
            elif hi - lo <= 1e-9 * max(abs(lo), abs(hi), 1e-300):
                out.append(
                    f"{name}'s interval [{lo:.4g}, {hi:.4g}] has no width: every bootstrap refit gave the same "
                    "value (a bound of the fit), which is no sign of certainty"
                )
            elif name in PARAM_BOUNDS and all(_at_bound(v, b) for v, b in zip((lo, hi), PARAM_BOUNDS[name])):
                out.append(
                    f"{name}'s interval [{lo:.4g}, {hi:.4g}] spans every value the fit allows: the runs do "
                    f"not determine {name}"
                )
    llo = report.get("leave_largest_out")
    if llo and "skipped" in llo:
        out.append(f"leave-largest-out was not run: {llo['skipped']}; the fit's extrapolation is untested")
    target = report.get("target")
    if target:
        c_target = target.get("C") or 6 * target.get("N", 0) * target.get("D", 0)
        c_max = report.get("max_flops") or 0
        if c_max > 0 and c_target > 1000 * c_max:
            out.append(
                f"the target's compute C={c_target:.3g} is {c_target / c_max:,.0f}x the largest run's: an "
                "extrapolation that far rests on the law's form, not on the runs"
            )
    return out


def _table_regime_warnings(table: Table) -> list[str]:
    """`regime_warnings` of every row of the table, fitted and held out, named as the table names them."""
    parts = (table.fit, table.holdout)
    points = Points(
        *(np.concatenate([getattr(p, k) for p in parts]) for k in ("N", "D", "L", "C", "U", "budget"))
    )
    rows = table.fit_rows + table.holdout_rows
    labels = [run_label(r, n, d, u) for r, n, d, u in zip(rows, points.N, points.D, points.U)]
    return regime_warnings(points, labels)


def _point_residuals(fit: FitResult, points: Points) -> np.ndarray:
    """log(actual / predicted) of each run."""
    kw: dict[str, Any] = {"N": points.N, "D": points.D}
    if fit.law == "data-constrained":
        kw["U"] = points.U
    return np.log(points.L / np.atleast_1d(fit.predict(**kw)))


def select_runs(
    table: Table, law: str, *, min_tokens_per_param: float = 0.0, max_residual: float = 0.05, **kw: Any
) -> tuple[np.ndarray, list[str | None]]:
    """Which fit rows to fit: (keep mask, reason each left-out row was left out).

    Rows below `min_tokens_per_param` go first. Then, for the laws of N and D, the runs more than
    `max_residual` (in log loss) off a fit to the rest are left out, refitting until the set is stable: a run
    that far off a law the others follow to ~1% failed (an unconverged schedule, a bad eval), and one such run
    moves a small fit's extrapolation by several percent even under the Huber loss. The rule stands down when
    it would leave out more than a fifth of the runs: then the law, not the runs, is at fault.
    """
    points = table.fit
    reasons: list[str | None] = [None] * len(points)
    ratio = points.D / points.N
    short = np.isfinite(ratio) & (ratio < min_tokens_per_param)
    for i in np.flatnonzero(short):
        reasons[i] = f"fewer than {min_tokens_per_param:g} tokens per parameter"
    keep = ~short
    if not keep.any():
        raise DataError(
            f"{table.path}: every fit row has fewer than {min_tokens_per_param:g} tokens per parameter; "
            "lower --min-tokens-per-param"
        )
    # L(C) is fitted to the best run per budget, which other runs are above by design: no residual rule.
    if max_residual <= 0 or law == "compute":
        return keep, reasons
    quick = {**kw, "bootstrap": 0}
    current = keep
    for _ in range(10):
        try:
            residuals = _point_residuals(fit_points(points.take(current), law, **quick), points)
        except DataError:
            break
        proposal = keep & (np.abs(residuals) <= max_residual)
        if proposal.sum() < 0.8 * keep.sum():
            break
        if np.array_equal(proposal, current):
            break
        current = proposal
    for i in np.flatnonzero(keep & ~current):
        reasons[i] = f"more than {max_residual:g} off the fit in log loss"
    return current, reasons


@with_serial_blas
def leave_largest_size_out(
    table: Table,
    law: str = "chinchilla",
    *,
    score_tokens_per_param: float = 20.0,
    min_tokens_per_param: float = 0.0,
    max_residual: float = 0.05,
    **kw: Any,
) -> dict[str, Any]:
    """Cross-validation inside the fit rows: fit every model size but the largest, predict the largest.

    The smaller sizes' rows are fitted as `run_fit` fits rows (the same `select_runs`, then `law` with `kw`,
    without bootstrap); the largest size's rows with at least `score_tokens_per_param` tokens per parameter
    (the regime the fit will be asked about) are predicted. Returns those predictions (`rows`) and their
    root-mean-square relative error (`rms_rel_error`), the score by which variants of a fit are compared on
    the small runs alone.
    """
    points = table.fit
    sizes = np.unique(points.N)
    if len(sizes) < 3:
        raise DataError(
            f"leave-largest-size-out: {len(sizes)} model sizes in the fit rows; need 3 or more "
            "(2 to fit, 1 to predict)"
        )
    largest = points.N == sizes[-1]
    scored = largest & (points.D >= score_tokens_per_param * points.N * (1 - 1e-9))
    if not scored.any():
        raise DataError(
            f"leave-largest-size-out: no run of the largest size has {score_tokens_per_param:g} or more "
            "tokens per parameter to score"
        )
    inner = table.with_fit_rows(~largest)
    quick = {**kw, "bootstrap": 0}
    keep, _ = select_runs(
        inner, law, min_tokens_per_param=min_tokens_per_param, max_residual=max_residual, **quick
    )
    fit = fit_points(inner.fit.take(keep), law, **quick)
    rows = prediction_rows(fit, points.take(scored), [r for r, s in zip(table.fit_rows, scored) if s])
    errors = np.array([r["rel_error"] for r in rows])
    return {
        "size": float(sizes[-1]),
        "n_fit": int(keep.sum()),
        "fit": fit.to_dict(),
        "rows": rows,
        "rms_rel_error": float(np.sqrt(np.mean(errors**2))),
    }


@with_serial_blas
def run_fit(
    path_or_table: str | Path | Table,
    *,
    law: str = "chinchilla",
    target: str | dict[str, float] | None = None,
    out_dir: str | Path | None = None,
    json_out: str | Path | None = None,
    bootstrap: int = 200,
    seed: int = 0,
    plot: bool = True,
    huber_delta: float = 1e-3,
    tie_exponents: bool = False,
    excess_params: bool = False,
    joint: bool = False,
    min_tokens_per_param: float = 0.0,
    max_residual: float = 0.05,
    force: bool = False,
    **table_kw: Any,
) -> dict[str, Any]:
    """Fit a law to a run table; predict its holdout rows and target; write the report JSON and a PNG.

    A `json_out` that exists is replaced only with `force`, and never when it is the run table itself (the
    default path, OUT/INPUT_fit_LAW.json, is this command's own and rewritten each time).
    Returns the report as written, plus `result`: the FitResult itself (with its bootstrap samples).
    """
    if law not in LAWS:
        raise ConfigError(f"--law {law!r}: choose one of {', '.join(LAWS)}")
    if min_tokens_per_param < 0:
        raise ConfigError(f"--min-tokens-per-param: must be >= 0, got {min_tokens_per_param}")
    if max_residual < 0:
        raise ConfigError(f"--max-residual: must be >= 0 (0: keep every run), got {max_residual}")
    parsed_target = parse_target(target) if target is not None else None
    table = path_or_table if isinstance(path_or_table, Table) else read_table(path_or_table, **table_kw)
    source = Path(table.path)
    base = Path(out_dir) if out_dir is not None else source.parent
    stem = f"{source.stem}_fit_{law}"
    json_path = check_output_file(
        json_out if json_out is not None else base / f"{stem}.json",
        force=force or json_out is None,
        flag="--json",
        inputs=(source,),
    )
    kw: dict[str, Any] = {"bootstrap": bootstrap, "seed": seed, "huber_delta": huber_delta}
    if law == "chinchilla":
        kw["tie_exponents"] = tie_exponents
    if excess_params:
        if law != "data-constrained":
            raise ConfigError("--excess-params: only with --law data-constrained (Muennighoff et al.'s R*_N)")
        kw["excess_params"] = True
    if joint:
        if law != "data-constrained":
            raise ConfigError(
                "--joint: only with --law data-constrained (the two stages it replaces are that law's)"
            )
        kw["joint"] = True
    keep, reasons = select_runs(
        table, law, min_tokens_per_param=min_tokens_per_param, max_residual=max_residual, **kw
    )
    excluded = ~keep
    kept = table.with_fit_rows(keep)
    fit = fit_points(kept.fit, law, **kw)
    predictions = prediction_rows(fit, table.holdout, table.holdout_rows)
    report: dict[str, Any] = {
        "input": table.path,
        "law": law,
        "columns": table.columns,
        "holdout": table.holdout_expr,
        "min_tokens_per_param": min_tokens_per_param,
        "max_residual": max_residual,
        "n_rows": len(table.rows),
        "n_fit": len(kept.fit),
        "excluded": [
            {**row, "reason": reasons[i]}
            for row, i in zip(
                prediction_rows(
                    fit, table.fit.take(excluded), [r for r, e in zip(table.fit_rows, excluded) if e]
                ),
                np.flatnonzero(excluded),
            )
        ],
        "fit": fit.to_dict(
            samples=True
        ),  # the bootstrap fits: `tenx plan choose` reads its intervals from them
        "predictions": predictions,
        "max_abs_rel_error": max((abs(p["rel_error"]) for p in predictions), default=None),
        "leave_largest_out": leave_largest_out(kept, law, **kw) if len(budget_groups(kept.fit)) > 1 else None,
        # IsoFLOP profiles need one data regime per budget; repeated-data runs mix several
        "isoflop": isoflop_minima(kept)
        if law != "data-constrained" and np.all(np.isfinite(kept.fit.N))
        else None,
        "target": _predict_target(fit, parsed_target) if parsed_target else None,
        "max_flops": float(max(np.max(kept.fit.C), np.max(table.holdout.C, initial=0.0))),
    }
    report["warnings"] = fit_warnings(report)
    # the runs outside what the law describes: only L(N, D, U) knows epochs (and 5 tokens/param is its bound)
    report["regime_warnings"] = _table_regime_warnings(table) if law == "data-constrained" else []
    if law == "compute" and len(table.holdout):
        report["holdout_budgets"] = [at_budget(fit, table.holdout, g) for g in budget_groups(table.holdout)]
    if law != "compute":
        budget = parsed_target.get("C") if parsed_target else None
        if budget is None and parsed_target:
            budget = 6 * parsed_target["N"] * parsed_target["D"]
        if budget is None:
            budget = float(max(np.max(kept.fit.C), np.max(table.holdout.C, initial=0.0)))
        report["compute_optimal"] = compute_optimal(fit, budget)
    report["plot"] = None
    if plot:
        report["plot"] = str(
            plot_fit(
                fit,
                kept.fit,
                table.holdout,
                base / f"{stem}.png",
                target=parsed_target,
                excluded=table.fit.take(excluded),
                title=f"{source.name}: {law} fit",
            )
        )
    report["json"] = str(json_path)
    atomic_write_json(json_path, _jsonable(report))
    report["result"] = fit
    return report


def _fmt_interval(lo: float | None, hi: float | None) -> str:
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return ""
    return f"  [{lo:.4g}, {hi:.4g}]"


def _fmt_loss(loss: float) -> str:
    """A loss with 4 decimals; a tiny one (a broken fit's) with its digits, never `0.0000`."""
    return f"{loss:.4f}" if abs(loss) >= 0.01 or loss == 0 else f"{loss:.3g}"


def format_fit(report: dict[str, Any]) -> str:
    """A readable summary of `run_fit`'s report: parameters, predictions, leave-largest-out, target; a line
    `WARNING: ...` for each regime the law cannot describe that some runs are in (`regime_warnings`)."""
    fit = report["fit"]
    lines = [
        f"{report['law']} fit of {report['input']}: {fit['form']}",
        f"  {report['n_fit']} runs fitted, {len(report['excluded'])} left out; {fit['n_bootstrap']} bootstrap "
        f"fits; residual rms {fit['residual_rms']:.4f} (log loss)",
    ]
    for p in report["excluded"]:
        label = p.get("name") or f"N={p['params']:.3g} D={p['tokens']:.3g}"
        lines.append(f"    left out {label} (loss {p['actual']:.4f}): {p['reason']}")
    warnings = report.get("warnings") or []
    if warnings:
        lines.append("  WARNING: this fit is not to be trusted as it stands:")
        lines += [f"    - {w}" for w in warnings]
    lines += [f"WARNING: {w}" for w in report.get("regime_warnings") or []]
    level = round(100 * fit["level"])
    lines.append(f"  parameters ({level}% intervals):")
    for name, value in fit["params"].items():
        lo, hi = fit["intervals"][name]
        lines.append(f"    {name:>9} = {value:.4g}{_fmt_interval(lo, hi)}")
    if report["predictions"]:
        lines.append(f"  held-out runs ({report['holdout']}):")
        for p in report["predictions"]:
            label = p.get("name") or f"N={p['params']:.3g} D={p['tokens']:.3g}"
            lines.append(
                f"    {label}: actual {p['actual']:.4f}  predicted {p['predicted']:.4f}"
                f"{_fmt_interval(p['low'], p['high'])}  error {100 * p['rel_error']:+.2f}%"
            )
    for b in report.get("holdout_budgets", []):
        lines.append(
            f"    budget C={b['C']:.3g} ({b['runs']} runs): best {b['best_observed']:.4f}  predicted "
            f"{b['predicted']:.4f}{_fmt_interval(b['low'], b['high'])}  error {100 * b['rel_error']:+.2f}%"
        )
    llo = report.get("leave_largest_out")
    if llo and "skipped" not in llo:
        lines.append(
            f"  leave-largest-out (budget C={llo['budget']:.3g}, {len(llo['rows'])} runs): "
            f"max |error| {100 * llo['max_abs_rel_error']:.2f}%"
        )
    elif llo:
        lines.append(f"  leave-largest-out (budget C={llo['budget']:.3g}): not run: {llo['skipped']}")
    elif llo is None:
        lines.append("  leave-largest-out: not run: the fitted runs span one budget")
    if report.get("target"):
        t = report["target"]
        keys = ", ".join(f"{k}={t[k]:.3g}" for k in ("N", "D", "C", "U") if k in t)
        if t.get("predicted") is not None:
            lines.append(
                f"  target {keys}: loss {_fmt_loss(t['predicted'])}{_fmt_interval(t.get('low'), t.get('high'))}"
            )
    co = report.get("compute_optimal")
    if co and co.get("degenerate"):
        lines.append(f"  compute-optimal at C={co['C']:.3g}: none: {co['degenerate']}")
    elif co:
        lines.append(
            f"  compute-optimal at C={co['C']:.3g}: N={co['N']:.3g} D={co['D']:.3g} "
            f"({co['tokens_per_param']:.1f} tokens/param) loss {_fmt_loss(co['loss'])}"
        )
    iso = report.get("isoflop")
    if iso and "N_exponent" in iso:
        lines.append(
            f"  IsoFLOP minima ({len(iso['budgets'])} budgets): N* ~ C^{iso['N_exponent']:.3f}, "
            f"D* ~ C^{iso['D_exponent']:.3f}"
        )
    lines.append(f"  wrote {report['json']}" + (f" and {report['plot']}" if report.get("plot") else ""))
    return "\n".join(lines)
