"""Gadre et al. (2024)'s published runs as a benchmark of `tenx fit`: the 104 open_lm models of
tests/data/gadre2024_open_lm_runs.csv, fitted below 1B parameters and asked for the 1.4B and 6.9B runs.

How a fit of these runs is made is chosen on the small runs alone: `inner_cv` scores each `Variant` by
leave-largest-size-out inside the runs below 1B (fit 10.6M to 154M, predict the 411M runs at 20 or more
tokens per parameter, the regime of the big runs) on each of the three training sets, and the variant with
the lowest mean score is `DEFAULT_VARIANT`. `published_accuracy` then reports how that variant predicts every
run of 1B parameters or more. The measurements behind the default are in docs/scaling.md#gadre-et-als-runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tenx.scaling.fit.frontier import fit_points, prediction_rows
from tenx.scaling.fit.report import leave_largest_size_out, select_runs
from tenx.scaling.fit.solver import with_serial_blas
from tenx.scaling.table import Table, read_table

GADRE_RUNS = Path(__file__).resolve().parents[3] / "tests" / "data" / "gadre2024_open_lm_runs.csv"
"""The run table (see tests/data/README.md)."""
OWN_LOSS = {
    "c4_original": "loss_c4_val",
    "rpj": "loss_paloma_redpajama",
    "rw_original": "loss_paloma_falcon_refinedweb",
}
"""Each training set's loss on a validation split of its own distribution."""
C4_LOSS = dict.fromkeys(OWN_LOSS, "loss_c4_val")
"""Every training set's loss on C4's validation set, the loss Gadre et al. report (174M tokens; the Paloma
splits of OWN_LOSS hold 0.7M and 1M)."""
BIG_RUNS = "params>=1e9"
"""The runs to predict: the 1.4B and 6.9B models."""


@dataclass(frozen=True)
class Variant:
    """One way to fit the runs: the parameter count and the `run_fit` options it fits with."""

    name: str
    params_column: str = "params"
    tie_exponents: bool = False
    huber_delta: float = 1e-3
    max_residual: float = 0.05
    min_tokens_per_param: float = 0.0

    def options(self) -> dict[str, Any]:
        """The keywords of `select_runs` and `fit_points` (no bootstrap)."""
        return {
            "huber_delta": self.huber_delta,
            "tie_exponents": self.tie_exponents,
            "max_residual": self.max_residual,
            "min_tokens_per_param": self.min_tokens_per_param,
            "bootstrap": 0,
        }


TOTAL = Variant("total parameters")
"""Approach 3 with Besiroglu et al.'s corrections and the 5% run rule, on the `params` column."""
TOTAL_TIED = Variant("total parameters, tied exponents", tie_exponents=True)
"""Gadre et al.'s law: E + A/N^a + B/D^a (theirs in C and M, L = E + (a M^η + b M^-η) C^-η, is the same)."""
NON_EMBEDDING = Variant("non-embedding parameters", params_column="params_no_embed")
"""The parameter count without the input embedding (Porian et al. 2024's: the output layer stays in)."""
NON_EMBEDDING_TIED = Variant(
    "non-embedding parameters, tied exponents", params_column="params_no_embed", tie_exponents=True
)
CANDIDATES = (TOTAL, TOTAL_TIED, NON_EMBEDDING, NON_EMBEDDING_TIED)
"""The variants `inner_cv` chooses among."""
DEFAULT_VARIANT = NON_EMBEDDING
"""The lowest mean leave-largest-size-out error of CANDIDATES on the three training sets' own losses."""


def gadre_table(
    dataset: str,
    variant: Variant = DEFAULT_VARIANT,
    loss_columns: Mapping[str, str] = OWN_LOSS,
    path: str | Path = GADRE_RUNS,
) -> Table:
    """One training set's runs, the big ones held out, read with the variant's parameter count."""
    return read_table(
        path,
        filters=[f"dataset={dataset}"],
        loss_column=loss_columns[dataset],
        params_column=variant.params_column,
        holdout=BIG_RUNS,
    )


@with_serial_blas
def inner_cv(
    variants: Sequence[Variant] = CANDIDATES,
    loss_columns: Mapping[str, str] = OWN_LOSS,
    path: str | Path = GADRE_RUNS,
) -> dict[str, Any]:
    """Leave-largest-size-out scores of each variant on each training set's runs below 1B parameters.

    Returns `scores` ({variant: {dataset: RMS relative error}}), `mean` ({variant: mean over datasets}),
    `chosen` (the variant with the lowest mean) and `rows` ({variant: {dataset: each scored run's
    prediction}}). The big runs play no part.
    """
    scores: dict[str, dict[str, float]] = {}
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for variant in variants:
        scores[variant.name], rows[variant.name] = {}, {}
        for dataset in loss_columns:
            cv = leave_largest_size_out(
                gadre_table(dataset, variant, loss_columns, path), **variant.options()
            )
            scores[variant.name][dataset] = cv["rms_rel_error"]
            rows[variant.name][dataset] = cv["rows"]
    mean = {name: float(np.mean(list(s.values()))) for name, s in scores.items()}
    return {"scores": scores, "mean": mean, "chosen": min(mean, key=mean.__getitem__), "rows": rows}


@with_serial_blas
def published_accuracy(
    variant: Variant = DEFAULT_VARIANT,
    loss_columns: Mapping[str, str] = OWN_LOSS,
    path: str | Path = GADRE_RUNS,
) -> dict[str, dict[str, float]]:
    """Relative error (predicted / actual - 1) of every run of 1B parameters or more, predicted from the
    runs below 1B of its training set: {dataset: {run name: error}}."""
    out: dict[str, dict[str, float]] = {}
    for dataset in loss_columns:
        table = gadre_table(dataset, variant, loss_columns, path)
        options = variant.options()
        keep, _ = select_runs(table, "chinchilla", **options)
        for key in ("max_residual", "min_tokens_per_param"):
            options.pop(key)
        fit = fit_points(table.fit.take(keep), "chinchilla", **options)
        predictions = prediction_rows(fit, table.holdout, table.holdout_rows)
        out[dataset] = {p["name"]: p["rel_error"] for p in predictions}
    return out
