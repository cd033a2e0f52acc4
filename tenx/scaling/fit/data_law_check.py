"""Muennighoff et al. (2023)'s published runs as a check of the data-constrained fit, and the regimes their
law cannot describe.

`data_law_check` reads a run table in the datablations format (columns run_name, params, tokens,
unique_tokens, val_loss, seed_or_variant, dedup_data: the 308 final losses of huggingface/datablations'
utils/parametric_fit.ipynb, 7M to 8.7B parameters, 1 to 9000 epochs; tests/data/datablations/README.md),
fits the law (`fit_points`, the fit `tenx fit --law data-constrained` makes) on every model size below the
largest and predicts the largest size's runs. How the runs are read:

- the runs trained on deduplicated data (dedup_data True) are left out, as the notebook leaves them out: they
  saw other data;
- one configuration (params, tokens, unique tokens) trained with several seeds is one run, its loss the mean
  of the seeds' (seeds="rows" keeps each seed a run of its own, as the notebook does); a shape variant
  (seed_or_variant "opt") is another model and stays a run of its own;
- the largest size's compute-optimal runs are those at its largest token count (8.7B: 178B tokens, 20.5
  tokens per parameter, 1 to 13.7 epochs); `worst` is over them, `worst_all` over all of its runs.

`regime_warnings` names the runs the law cannot describe, for this check and for `tenx fit`: runs below 5
tokens per parameter (far from trained, their loss depends on the schedule more than on N and D: in these
runs an 8.7B model on 12B tokens does worse than a 4.2B one), and runs whose loss rises again with more
epochs on the same parameters and unique tokens (overfitting: the law's loss never rises with epochs).

The default options were chosen by `leave_one_size_out` alone, inside the sizes below the largest (the
largest plays no part): each size of 100M parameters or more with two or more scored runs is predicted from
every other size below the largest, on its runs in the regime of the runs to predict (5 or more tokens per
parameter, no rising loss, at most as many epochs as the most repeated compute-optimal run of the largest
size), and the options with the lowest mean of the sizes' worst errors win. On the 308 runs (232 after
dedup runs are left out and seeds averaged), of 16 combinations of excess_params, huber_delta 1e-3 or 1e-2
and leaving out the runs below 5 tokens per parameter and the rising runs, the lowest mean (2.41%) is the
excess-parameters term with both kinds of runs left out, huber_delta 1e-3; it predicts the eight
compute-optimal 8.7B runs within 1.37%. The law without R*_N does best at 2.71% (8.7B: 3.50%);
tenx fit's run rule (--max-residual 0.05) stands down on these runs and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tenx.errors import ConfigError, DataError
from tenx.scaling.fit.frontier import fit_points
from tenx.scaling.fit.solver import with_serial_blas
from tenx.scaling.table import Points, read_table

MIN_TOKENS_PER_PARAM = 5.0
"""Runs below this many training tokens per parameter are outside what the law describes."""
RISE_TOLERANCE = 0.01
"""A run's loss rises again when it exceeds a run with fewer epochs by more than this fraction: above the
usual seed noise (the seeds of one datablations configuration spread by 0.1-0.2% at 2.8B, 0.5-2.6% at
4.2B)."""
MIN_SCORED_PARAMS = 1e8
"""leave_one_size_out scores the sizes from 100M parameters up: below, the runs are a handful of tiny models
whose losses (5 to 8 nats) are far from the regime asked about."""
LISTED = 6
"""Runs a warning names before it says how many more there are."""


@dataclass
class Regimes:
    """Which runs of a table lie outside the law's regime."""

    tokens_per_param: np.ndarray
    few_tokens: np.ndarray
    """True where a run has fewer than the minimum tokens per parameter."""
    rising: dict[int, int]
    """Run index -> the run with fewer epochs (same parameters and unique tokens) whose loss it exceeds."""


def find_regimes(
    points: Points,
    *,
    min_tokens_per_param: float = MIN_TOKENS_PER_PARAM,
    rise_tolerance: float = RISE_TOLERANCE,
) -> Regimes:
    """The runs below `min_tokens_per_param` and those whose loss rises again with more epochs: above the
    lowest loss of the runs with the same parameters and unique tokens and fewer tokens, by more than
    `rise_tolerance` (a fraction). Runs without unique tokens (NaN) are never rising."""
    ratio = points.D / points.N
    rising: dict[int, int] = {}
    for i in range(len(points)):
        fewer = np.flatnonzero(
            (points.N == points.N[i]) & (points.U == points.U[i]) & (points.D < points.D[i])
        )
        if len(fewer):
            j = int(fewer[np.argmin(points.L[fewer])])
            if points.L[i] > points.L[j] * (1 + rise_tolerance):
                rising[i] = j
    return Regimes(ratio, np.isfinite(ratio) & (ratio < min_tokens_per_param), rising)


def run_label(row: dict[str, Any], N: float, D: float, U: float) -> str:
    """A run's name in warnings: its `name` or `run_name` column, else its params and tokens."""
    name = row.get("name") or row.get("run_name")
    if name:
        return str(name)
    return f"N={N:.3g} D={D:.3g}" + (f" U={U:.3g}" if np.isfinite(U) else "")


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:LISTED])
    return shown + (f" and {len(items) - LISTED} more" if len(items) > LISTED else "")


def _epochs(points: Points, i: int) -> float:
    return float(points.D[i] / min(points.U[i], points.D[i]))


def regime_warnings(
    points: Points,
    labels: Sequence[str] | None = None,
    *,
    min_tokens_per_param: float = MIN_TOKENS_PER_PARAM,
    rise_tolerance: float = RISE_TOLERANCE,
) -> list[str]:
    """One sentence per regime the data-constrained law cannot describe that some runs are in, naming them:
    fewer than `min_tokens_per_param` tokens per parameter, and loss rising again with more epochs."""
    if labels is None:
        labels = [run_label({}, n, d, u) for n, d, u in zip(points.N, points.D, points.U)]
    found = find_regimes(points, min_tokens_per_param=min_tokens_per_param, rise_tolerance=rise_tolerance)
    out = []
    few = np.flatnonzero(found.few_tokens).tolist()
    if len(few):
        named = [f"{labels[i]} ({found.tokens_per_param[i]:.2g})" for i in few]
        out.append(
            f"{len(few)} runs below {min_tokens_per_param:g} tokens/param: {_listed(named)}; the law "
            f"describes runs of {min_tokens_per_param:g} or more tokens per parameter: far from trained, a "
            "run's loss depends on its schedule more than on N and D (a larger model can do worse than a "
            "smaller one on the same tokens), so the law's figures for these runs are not to be trusted; "
            f"leave them out of the fit (tenx fit --min-tokens-per-param {min_tokens_per_param:g})"
        )
    if found.rising:
        named = [
            f"{labels[i]} ({points.L[i]:.4g} after {_epochs(points, i):.4g} epochs, above {labels[j]}'s "
            f"{points.L[j]:.4g} after {_epochs(points, j):.4g})"
            for i, j in sorted(found.rising.items())
        ]
        out.append(
            f"{len(found.rising)} runs whose loss rises again with more epochs on the same parameters and "
            f"unique tokens (overfitting): {_listed(named)}; the law's loss never rises with epochs, so it "
            "does not model overfitting and predicts these runs too low: leave them out of the fit"
        )
    return out


def _mean_over_seeds(rows: Sequence[dict[str, Any]], points: Points) -> tuple[list[str], Points]:
    """One run per configuration and variant: the seeds of one configuration averaged, named by the run
    without a seed where the table has it."""
    groups: dict[tuple[float, float, float, str], list[int]] = {}
    for i, row in enumerate(rows):
        variant = str(row.get("seed_or_variant") or "")
        key = (points.N[i], points.D[i], points.U[i], "" if variant.startswith("seed") else variant)
        groups.setdefault(key, []).append(i)
    labels, index, losses = [], [], []
    for members in groups.values():
        plain = [i for i in members if not str(rows[i].get("seed_or_variant") or "").startswith("seed")]
        first = (plain or members)[0]
        labels.append(run_label(rows[first], points.N[first], points.D[first], points.U[first]))
        index.append(first)
        losses.append(float(np.mean(points.L[members])))
    merged = points.take(np.array(index))
    merged.L = np.array(losses)
    return labels, merged


def _predicted(fit: Any, points: Points, index: np.ndarray) -> np.ndarray:
    """The fit's loss for the runs at `index`."""
    return np.atleast_1d(fit.predict(N=points.N[index], D=points.D[index], U=points.U[index]))


@with_serial_blas
def data_law_check(
    csv_path: str | Path,
    *,
    excess_params: bool = True,
    huber_delta: float = 1e-3,
    exclude_few_tokens: bool = True,
    exclude_rising: bool = True,
    seeds: str = "mean",
    min_tokens_per_param: float = MIN_TOKENS_PER_PARAM,
    rise_tolerance: float = RISE_TOLERANCE,
    min_scored_params: float = MIN_SCORED_PARAMS,
) -> dict[str, Any]:
    """Fit the data-constrained law on every size below the largest of a datablations-format CSV; predict
    the largest size's runs; score the fit by leave-one-size-out below the largest (module doc).

    Options: `excess_params` and `huber_delta` are the fit's (FitConfig); with `exclude_few_tokens` the runs
    below `min_tokens_per_param`, with `exclude_rising` the runs whose loss rises again (by more than
    `rise_tolerance`) are left out of every fit; `seeds` is "mean" or "rows"; leave-one-size-out scores the
    sizes of `min_scored_params` or more.

    Returns `worst` (the largest |error| over the largest size's compute-optimal runs; errors are fractions,
    predicted / observed - 1), `worst_all` (over all its runs), `runs` (each largest-size run: name, params,
    tokens, unique_tokens, epochs, observed, predicted, error, compute_optimal, warnings),
    `leave_one_size_out` ({size: worst |error|}), its mean, and the sizes it could not fit without with the
    reason (`leave_one_size_out_skipped`), `warnings` (`regime_warnings` of every run), the `fit` and the
    options.
    """
    if seeds not in ("mean", "rows"):
        raise ConfigError(f"data_law_check: seeds must be 'mean' or 'rows', got {seeds!r}")
    table = read_table(
        csv_path, loss_column="val_loss", unique_column="unique_tokens", filters=["dedup_data=False"]
    )
    rows, points = table.fit_rows, table.fit
    if seeds == "mean":
        labels, points = _mean_over_seeds(rows, points)
    else:
        labels = [run_label(r, n, d, u) for r, n, d, u in zip(rows, points.N, points.D, points.U)]
    found = find_regimes(points, min_tokens_per_param=min_tokens_per_param, rise_tolerance=rise_tolerance)
    sizes = np.unique(points.N)
    if len(sizes) < 3:
        raise DataError(f"{csv_path}: {len(sizes)} model sizes; need 3 or more (2 to fit, 1 to predict)")
    largest = points.N == sizes[-1]
    rising = np.isin(np.arange(len(points)), list(found.rising))
    usable = ~(found.few_tokens & exclude_few_tokens) & ~(rising & exclude_rising)
    options = {"excess_params": excess_params, "huber_delta": huber_delta, "bootstrap": 0}

    def fit_without(size_mask: np.ndarray) -> Any:
        return fit_points(points.take(usable & ~size_mask & ~largest), "data-constrained", **options)

    fit = fit_without(np.zeros(len(points), dtype=bool))
    big = np.flatnonzero(largest)
    predicted = _predicted(fit, points, big)
    errors = predicted / points.L[big] - 1
    optimal = points.D[big] == points.D[big].max()
    runs = []
    for k, i in enumerate(big.tolist()):
        notes = []
        if found.few_tokens[i]:
            notes.append(f"below {min_tokens_per_param:g} tokens/param ({found.tokens_per_param[i]:.2g})")
        if i in found.rising:
            j = found.rising[i]
            notes.append(f"loss rises again with more epochs: above {labels[j]}'s {points.L[j]:.4g}")
        runs.append(
            {
                "name": labels[i],
                "params": float(points.N[i]),
                "tokens": float(points.D[i]),
                "unique_tokens": float(points.U[i]),
                "epochs": _epochs(points, i),
                "observed": float(points.L[i]),
                "predicted": float(predicted[k]),
                "error": float(errors[k]),
                "compute_optimal": bool(optimal[k]),
                "warnings": notes,
            }
        )
    max_epochs = max(_epochs(points, i) for i in big[optimal].tolist())
    in_regime = ~found.few_tokens & ~rising
    in_regime &= points.D / np.minimum(points.U, points.D) <= max_epochs * (1 + 1e-9)
    loso: dict[float, float] = {}
    skipped: dict[float, str] = {}
    for size in sizes[:-1]:
        scored = np.flatnonzero((points.N == size) & in_regime)
        if size < min_scored_params or len(scored) < 2:
            continue
        try:
            inner = fit_without(points.N == size)
        except DataError as e:
            skipped[float(size)] = str(e)
            continue
        loso[float(size)] = float(np.max(np.abs(_predicted(inner, points, scored) / points.L[scored] - 1)))
    return {
        "worst": float(np.max(np.abs(errors[optimal]))),
        "worst_all": float(np.max(np.abs(errors))),
        "runs": runs,
        "leave_one_size_out": loso,
        "leave_one_size_out_mean": float(np.mean(list(loso.values()))) if loso else None,
        "leave_one_size_out_skipped": skipped,
        "warnings": regime_warnings(
            points, labels, min_tokens_per_param=min_tokens_per_param, rise_tolerance=rise_tolerance
        ),
        "largest": float(sizes[-1]),
        "n_runs": len(points),
        "n_fit": int((usable & ~largest).sum()),
        "fit": fit.to_dict(),
        "options": {
            "excess_params": excess_params,
            "huber_delta": huber_delta,
            "exclude_few_tokens": exclude_few_tokens,
            "exclude_rising": exclude_rising,
            "seeds": seeds,
            "min_tokens_per_param": min_tokens_per_param,
            "rise_tolerance": rise_tolerance,
            "min_scored_params": min_scored_params,
            "scored_max_epochs": max_epochs,
        },
    }
