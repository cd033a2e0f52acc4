"""What follows from a fitted law and a table of runs: the compute-optimal frontier (N, D and loss for a
budget, and its inverse), runs grouped by compute budget, IsoFLOP minima (Chinchilla approach 2), the
best loss per budget, and the leave-largest-out check of an extrapolation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tenx.errors import ConfigError, DataError, TenxError
from tenx.scaling.fit.laws import LAWS, FitResult, fit_chinchilla, fit_compute, fit_data_constrained
from tenx.scaling.fit.solver import with_serial_blas
from tenx.scaling.table import Points, Table


def _frontier_coefficients(values: np.ndarray) -> tuple[np.ndarray, ...]:
    """Columns E, A, B, alpha, beta -> (E, G, K, gamma, alpha, beta) of the compute-optimal frontier.

    N_opt = G (C/6)^(beta/(alpha+beta)), D_opt = (C/6)/N_opt and L_opt = E + K (C/6)^-gamma with
    G = (alpha A / (beta B))^(1/(alpha+beta)), K = A G^-alpha + B G^beta, gamma = alpha beta / (alpha+beta).
    """
    E, A, B, alpha, beta = (values[:, i] for i in range(5))
    with np.errstate(divide="ignore", invalid="ignore"):
        G = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
        K = A * G**-alpha + B * G**beta
        gamma = alpha * beta / (alpha + beta)
    return E, G, K, gamma, alpha, beta


def compute_optimal(fit: FitResult, C: float) -> dict[str, Any]:
    """Compute-optimal N, D and loss for budget C (FLOPs = 6ND) of a chinchilla or data-constrained fit."""
    if fit.law not in ("chinchilla", "data-constrained"):
        raise TenxError(f"compute_optimal: needs a chinchilla or data-constrained fit, not {fit.law!r}")
    if not C > 0:
        raise ConfigError(f"compute_optimal: budget C must be positive, got {C}")

    def allocate(values: np.ndarray) -> np.ndarray:
        E, G, K, gamma, alpha, beta = _frontier_coefficients(values[:, :5])
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            N = G * (C / 6) ** (beta / (alpha + beta))
            return np.column_stack([N, C / (6 * N), E + K * (C / 6) ** -gamma])

    point = allocate(np.array([list(fit.params.values())]))[0]
    out: dict[str, Any] = {"C": C, "N": float(point[0]), "D": float(point[1]), "loss": float(point[2])}
    out["tokens_per_param"] = out["D"] / out["N"] if out["N"] > 0 else math.inf
    if not (math.isfinite(out["N"]) and math.isfinite(out["D"]) and out["N"] > 0):
        out["degenerate"] = (
            f"alpha={fit.params['alpha']:.3g}, A={fit.params['A']:.3g}: in this fit loss does not fall with "
            "model size, so there is no compute-optimal size; add larger models or more budgets"
        )
    ok = np.all(np.isfinite(fit.samples), axis=1) if len(fit.samples) else np.zeros(0, bool)
    if ok.any():
        q = 100 * (1 - fit.level) / 2
        with np.errstate(invalid="ignore"):  # an infinite N of a degenerate refit: the interval says inf
            low, high = np.nanpercentile(allocate(fit.samples[ok]), [q, 100 - q], axis=0)
        for i, key in enumerate(("N", "D", "loss")):
            out[f"{key}_interval"] = [float(low[i]), float(high[i])]
    return out


def data_limited_optimal(fit: FitResult, C: float, U: float, *, points: int = 801) -> dict[str, Any]:
    """The N (and D = C/(6N), epochs D/U) of lowest loss for budget C when only U tokens are unique, from a
    data-constrained fit; intervals from its bootstrap samples (each sample's own optimum)."""
    if fit.law != "data-constrained":
        raise TenxError(f"data_limited_optimal: needs a data-constrained fit, not {fit.law!r}")
    if not (C > 0 and math.isfinite(C)) or not (U > 0 and math.isfinite(U)):
        raise ConfigError(f"data_limited_optimal: C and U must be positive numbers, got C={C}, U={U}")
    free = compute_optimal(fit, C)["N"]
    centre = free if math.isfinite(free) and free > 0 else math.sqrt(C / 120)
    # a data limit only pushes N up (fewer tokens, fewer repeats): search from N*/100 to 10^4 N*
    grid = np.geomspace(centre / 100, centre * 1e4, points)
    values = np.array([list(fit.params.values())])
    ok = np.all(np.isfinite(fit.samples), axis=1) if len(fit.samples) else np.zeros(0, bool)
    if ok.any():
        values = np.vstack([values, fit.samples[ok]])
    with np.errstate(over="ignore", invalid="ignore"):
        loss = np.exp(fit._log_predict(values, grid, C / (6 * grid), None, U))  # (S, M)
    best = np.nanargmin(np.where(np.isfinite(loss), loss, np.inf), axis=1)
    # refine each optimum by a parabola through its grid neighbours (in log N)
    inner = np.clip(best, 1, points - 2)
    rows = np.arange(len(values))
    y0, y1, y2 = (loss[rows, inner + k] for k in (-1, 0, 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        shift = np.where(y0 - 2 * y1 + y2 > 0, 0.5 * (y0 - y2) / (y0 - 2 * y1 + y2), 0.0)
    step = math.log(grid[1] / grid[0])
    N = np.exp(np.log(grid[inner]) + np.clip(shift, -1, 1) * step)
    N = np.where(best == inner, N, grid[best])
    D = C / (6 * N)
    with np.errstate(over="ignore", invalid="ignore"):
        L = np.exp(fit._log_predict(values, N, D, None, U)).diagonal()
    out: dict[str, Any] = {"C": C, "U": U, "N": float(N[0]), "D": float(D[0]), "epochs": float(D[0] / U)}
    out["loss"] = float(L[0])
    out["at_edge"] = bool(best[0] in (0, points - 1))
    if len(values) > 1:
        q = 100 * (1 - fit.level) / 2
        for key, v in (("N", N[1:]), ("D", D[1:]), ("epochs", D[1:] / U), ("loss", L[1:])):
            low, high = np.nanpercentile(v, [q, 100 - q])
            out[f"{key}_interval"] = [float(low), float(high)]
    return out


def compute_for_loss(fit: FitResult, loss: float) -> float:
    """The compute C at which the fitted law reaches `loss` (on the compute-optimal frontier); inf if loss <= E."""
    E = fit.params["E"]
    if loss <= E:
        return math.inf
    if fit.law == "compute":
        return float((fit.params["A"] / (loss - E)) ** (1 / fit.params["alpha"]))
    _, _, K, gamma, _, _ = _frontier_coefficients(
        np.array([[fit.params[k] for k in ("E", "A", "B", "alpha", "beta")]])
    )
    return float(6 * (K[0] / (loss - E)) ** (1 / gamma[0]))


def budget_groups(points: Points, tolerance: float = 0.05) -> list[np.ndarray]:
    """Indices of runs sharing a compute budget: the `budget` column, else C within `tolerance` decades."""
    if len(points) and np.all(np.isfinite(points.budget)):
        keys = points.budget
        return [np.flatnonzero(keys == k) for k in np.unique(keys)]
    order = np.argsort(points.C, kind="stable")
    log_c = np.log10(points.C[order])
    groups: list[list[int]] = []
    first = -math.inf
    for i, lc in zip(order, log_c):
        if lc - first > tolerance:
            groups.append([])
            first = lc
        groups[-1].append(int(i))
    return [np.array(g) for g in groups]


def budget_of(points: Points, index: np.ndarray) -> float:
    """The compute budget of the runs `index`: their `budget` column, else the geometric mean of their C."""
    if np.all(np.isfinite(points.budget[index])):
        return float(points.budget[index][0])
    return float(np.exp(np.mean(np.log(points.C[index]))))


@with_serial_blas
def isoflop_minima(table: Table | Points) -> dict[str, Any]:
    """Approach 2: per budget, the minimum of a parabola in log N; then N* = k C^a and D* = k' C^b."""
    points = table.fit if isinstance(table, Table) else table
    budgets: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for index in budget_groups(points):
        C = budget_of(points, index)
        N, L = points.N[index], points.L[index]
        if not np.all(np.isfinite(N)) or len(np.unique(N)) < 3:
            skipped.append({"C": C, "runs": int(len(index)), "reason": "fewer than 3 distinct model sizes"})
            continue
        x = np.log(N)
        curvature, slope, intercept = np.polyfit(x, L, 2)
        if curvature <= 0:
            skipped.append({"C": C, "runs": int(len(index)), "reason": "loss is not convex in log N here"})
            continue
        x_opt = -slope / (2 * curvature)
        N_opt = float(math.exp(x_opt))
        budgets.append(
            {
                "C": C,
                "runs": int(len(index)),
                "N_opt": N_opt,
                "D_opt": C / (6 * N_opt),
                "loss_opt": float(intercept - slope**2 / (4 * curvature)),
                "extrapolated": bool(not x.min() <= x_opt <= x.max()),
            }
        )
    out: dict[str, Any] = {"budgets": budgets, "skipped": skipped}
    # A minimum outside the sizes tried is the parabola's guess, not a measurement: it stays out of the law.
    inside = [b for b in budgets if not b["extrapolated"]]
    if len({b["C"] for b in inside}) >= 2:
        logC = np.log([b["C"] for b in inside])
        a, log_k = np.polyfit(logC, np.log([b["N_opt"] for b in inside]), 1)
        # D* = C/(6 N*), so its exponent is 1 - a and its coefficient 1/(6k).
        out.update(
            {
                "n_budgets_fitted": len(inside),
                "N_exponent": float(a),
                "N_coefficient": float(math.exp(log_k)),
                "D_exponent": float(1 - a),
                "D_coefficient": float(1 / (6 * math.exp(log_k))),
            }
        )
    return out


def best_per_budget(points: Points) -> tuple[np.ndarray, np.ndarray]:
    """(C, best loss) per budget group: what L(C) describes is the best loss a budget can buy."""
    groups = budget_groups(points)
    C = np.array([budget_of(points, g) for g in groups])
    L = np.array([points.L[g].min() for g in groups])
    return C, L


def fit_points(points: Points, law: str, **options: Any) -> FitResult:
    """`law` fitted to a table's runs (L(C) to the best run per budget); `options` are the fit functions'
    (FitConfig's fields), tie_exponents dropped for the laws other than chinchilla, excess_params for those
    other than data-constrained."""
    if law != "compute" and not (np.all(np.isfinite(points.N)) and np.all(np.isfinite(points.D))):
        raise DataError(f"{law} fit: every run needs params and tokens (--params-column, --tokens-column)")
    if law != "data-constrained":
        options.pop("excess_params", None)
    if law == "chinchilla":
        return fit_chinchilla(points.N, points.D, points.L, **options)
    options.pop("tie_exponents", None)
    if law == "compute":
        return fit_compute(*best_per_budget(points), **options)
    if law == "data-constrained":
        if not np.all(np.isfinite(points.U)):
            raise DataError("data-constrained fit: every run needs a unique-tokens value (--unique-column)")
        return fit_data_constrained(points.N, points.D, points.U, points.L, **options)
    raise ConfigError(f"--law {law!r}: choose one of {', '.join(LAWS)}")


def prediction_rows(
    fit: FitResult, points: Points, rows: Sequence[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Predicted vs actual loss for each point, with the bootstrap interval and relative error."""
    if not len(points):
        return []
    kw: dict[str, Any] = {"C": points.C} if fit.law == "compute" else {"N": points.N, "D": points.D}
    if fit.law == "data-constrained":
        kw["U"] = points.U
    pred = np.atleast_1d(fit.predict(**kw))
    low, high = fit.predict_interval(**kw)
    out = []
    for i in range(len(points)):
        row: dict[str, Any] = {
            "params": float(points.N[i]),
            "tokens": float(points.D[i]),
            "flops": float(points.C[i]),
            "actual": float(points.L[i]),
            "predicted": float(pred[i]),
            "low": float(np.atleast_1d(low)[i]),
            "high": float(np.atleast_1d(high)[i]),
            "rel_error": float(pred[i] / points.L[i] - 1),
        }
        if rows is not None and "name" in rows[i]:
            row["name"] = str(rows[i]["name"])
        out.append(row)
    return out


def at_budget(fit: FitResult, points: Points, index: np.ndarray) -> dict[str, Any]:
    """A compute law's prediction at one budget against the best loss observed there."""
    budget = budget_of(points, index)
    best = float(points.L[index].min())
    predicted = float(fit.predict(C=budget))
    low, high = fit.predict_interval(C=budget)
    return {
        "C": budget,
        "runs": int(len(index)),
        "best_observed": best,
        "predicted": predicted,
        "low": low,
        "high": high,
        "rel_error": predicted / best - 1,
    }


@with_serial_blas
def leave_largest_out(table: Table | Points, law: str, **options: Any) -> dict[str, Any]:
    """Refit without the largest compute budget's runs and report how well they are predicted (`options`
    as for `fit_points`)."""
    points = table.fit if isinstance(table, Table) else table
    rows = table.fit_rows if isinstance(table, Table) else None
    groups = budget_groups(points)
    largest = max(groups, key=lambda g: budget_of(points, g))
    keep = np.ones(len(points), dtype=bool)
    keep[largest] = False
    budget = budget_of(points, largest)
    try:
        fit = fit_points(points.take(keep), law, **options)
    except DataError as e:
        return {"budget": budget, "skipped": f"too few runs left to fit: {e}"}
    left = points.take(~keep)
    left_rows = [rows[i] for i in largest] if rows is not None else None
    out: dict[str, Any] = {
        "budget": budget,
        "n_fit": int(keep.sum()),
        "fit": fit.to_dict(),
        "rows": prediction_rows(fit, left, left_rows),
    }
    if law == "compute":
        out["at_budget"] = at_budget(fit, left, np.arange(len(left)))
        out["max_abs_rel_error"] = abs(out["at_budget"]["rel_error"])
    else:
        out["max_abs_rel_error"] = max(abs(r["rel_error"]) for r in out["rows"])
    return out
