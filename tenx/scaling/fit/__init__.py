"""Scaling-law fits with bootstrap intervals: Chinchilla L(N, D), compute L(C), data-constrained L(N, D, U).

Every law here is fitted the way Hoffmann et al. (2022, approach 3) fit L(N, D), with the corrections of
Besiroglu et al. (2024): the Huber loss of log-loss residuals, summed over runs, minimised by L-BFGS-B from a
grid of starting points run to a tight tolerance (the original stopped early), and confidence intervals from
a bootstrap over runs (the original's were implausibly narrow). Predicted log loss is a log-sum-exp of terms
that are linear in the parameters, e.g. log L = logsumexp(a - alpha log N, b - beta log D, e) with
A = e^a, B = e^b, E = e^e, so one optimiser serves every law.

Modules, each importing only those listed after it: published (Gadre et al.'s runs as a benchmark: the
inner cross-validation that chose how to fit them, and the error of every big run), report (the whole
analysis of a run table; the `tenx fit` command in tenx/scaling/cli.py calls it; leave-largest-size-out),
data_law_check (Muennighoff et al.'s runs as a check of the data-constrained fit, and the regimes its law
cannot describe, which `tenx fit` warns of), plots, frontier (compute-optimal frontier, budgets, IsoFLOP minima, leave-largest-out), laws (the laws,
FitConfig, FitResult, the fit functions), repetition (the discount of repeated data and excess
parameters), solver (the optimiser).
"""

from tenx.scaling.fit.data_law_check import regime_warnings
from tenx.scaling.fit.frontier import (
    best_per_budget,
    budget_groups,
    compute_for_loss,
    compute_optimal,
    data_limited_optimal,
    fit_points,
    isoflop_minima,
    leave_largest_out,
)
from tenx.scaling.fit.laws import (
    CHINCHILLA_FORM,
    COMPUTE_FORM,
    DATA_CONSTRAINED_FORM,
    EXCESS_PARAMS_FORM,
    LAWS,
    PARAM_BOUNDS,
    POWER_FORM,
    TIED_FORM,
    FitConfig,
    FitResult,
    fit_chinchilla,
    fit_compute,
    fit_data_constrained,
)
from tenx.scaling.fit.plots import plot_fit
from tenx.scaling.fit.published import inner_cv, published_accuracy
from tenx.scaling.fit.repetition import effective_data, unique_params
from tenx.scaling.fit.report import (
    fit_warnings,
    format_fit,
    leave_largest_size_out,
    parse_target,
    run_fit,
    select_runs,
)
from tenx.scaling.fit.solver import logsumexp

__all__ = [
    "CHINCHILLA_FORM",
    "COMPUTE_FORM",
    "DATA_CONSTRAINED_FORM",
    "EXCESS_PARAMS_FORM",
    "LAWS",
    "PARAM_BOUNDS",
    "POWER_FORM",
    "TIED_FORM",
    "FitConfig",
    "FitResult",
    "best_per_budget",
    "budget_groups",
    "compute_for_loss",
    "compute_optimal",
    "data_limited_optimal",
    "effective_data",
    "fit_chinchilla",
    "fit_compute",
    "fit_data_constrained",
    "fit_points",
    "fit_warnings",
    "format_fit",
    "inner_cv",
    "isoflop_minima",
    "leave_largest_out",
    "leave_largest_size_out",
    "logsumexp",
    "parse_target",
    "plot_fit",
    "published_accuracy",
    "regime_warnings",
    "run_fit",
    "select_runs",
    "unique_params",
]
