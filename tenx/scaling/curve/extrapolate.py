"""Predicting a whole loss curve with a band, and extrapolating a run from the first part of its own curve.

The band at each step combines the law's parameter uncertainty (the spread of log loss over the fit's
bootstrap draws) with the scatter of the smoothed points about the fit (`CurveFit.window_sigma`: misfit
plus the run-to-run and data-order noise left after smoothing), in quadrature in log space:
log L +- z * sqrt(var_bootstrap + window_sigma^2). It covers the loss averaged over a window like the
fit's; one step's loss scatters about it by a further `step_sigma` (reported, not in the band).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.stats import norm

from tenx.errors import ConfigError
from tenx.scaling.curve.curve_laws import DEFAULT_PRIORS, EXTRAPOLATION_LAW, LAWS, design
from tenx.scaling.curve.fitting import CurveFit, fit_curves, log_predict
from tenx.scaling.curve.schedule import PARAMS_UNIT, Curve, Schedule

MAX_POINTS = 2048
"""A curve longer than this many records is evaluated at this many and interpolated linearly between them
(the laws are smooth in the step; each point costs one pass over the run's learning-rate drops)."""
BAND_POINTS = 256
"""Records at which each bootstrap draw is evaluated for the band's width (interpolated between)."""
_CHUNK = 2_000_000  # design entries (records x decay blocks) evaluated at once


@dataclass
class CurvePrediction:
    """A predicted loss curve: every record from the end of warmup to the last step, with a band."""

    law: str
    params: float
    steps: list[int]
    tokens: list[float]
    lr: list[float]
    loss: list[float]
    lower: list[float]
    upper: list[float]
    level: float
    step_sigma: float
    """scatter (log) of one step's loss about the curve"""
    schedule: dict[str, Any]

    @property
    def final_loss(self) -> float:
        return self.loss[-1]

    def to_dict(self) -> dict[str, Any]:
        """Plain data, with the final loss and its band up front."""
        return {
            "final_loss": self.loss[-1],
            "final_lower": self.lower[-1],
            "final_upper": self.upper[-1],
            **asdict(self),
        }


def _log_curve(
    fit: CurveFit, schedule: Schedule, params: float, records: np.ndarray, theta: Any = None
) -> np.ndarray:
    """log loss at `records`, evaluated in chunks that bound memory."""
    k = max(1, int(np.count_nonzero(schedule.drops)))
    size = max(1, _CHUNK // min(k, 1024))
    out = [
        log_predict(fit, design(schedule, records[i : i + size], params), theta)
        for i in range(0, len(records), size)
    ]
    return np.concatenate(out)


def _spread(first: int, last: int, count: int) -> np.ndarray:
    """At most `count` records from first to last inclusive, evenly spread."""
    if last - first + 1 <= count:
        return np.arange(first, last + 1)
    return np.unique(np.linspace(first, last, count).round().astype(int))


def predict_curve(fit: CurveFit, schedule: Schedule, params: float) -> CurvePrediction:
    """The fitted law's loss at every record after warmup of `schedule` for a model of `params`
    parameters, with the fit's `level` band (see the module docstring)."""
    if fit.law not in LAWS:
        raise ConfigError(f"curve law {fit.law!r} is not one of {', '.join(LAWS)}")
    first, last = schedule.first_step, schedule.steps
    records = np.arange(first, last + 1)
    points = _spread(first, last, MAX_POINTS)
    log_loss = np.interp(records, points, _log_curve(fit, schedule, params, points))
    variance = np.full(len(records), fit.window_sigma**2)
    if fit.samples:
        band_points = _spread(first, last, BAND_POINTS)
        draws = np.array([_log_curve(fit, schedule, params, band_points, s) for s in fit.samples])
        variance += np.interp(records, band_points, draws.var(axis=0))
    half = norm.ppf(0.5 + fit.level / 2) * np.sqrt(variance)
    return CurvePrediction(
        law=fit.law,
        params=float(params),
        steps=[int(s) for s in records],
        tokens=[float(t) for t in schedule.cum_tokens[records]],
        lr=[float(v) for v in schedule.lr[records - 1]],
        loss=[float(v) for v in np.exp(log_loss)],
        lower=[float(v) for v in np.exp(log_loss - half)],
        upper=[float(v) for v in np.exp(log_loss + half)],
        level=fit.level,
        step_sigma=fit.step_sigma,
        schedule=schedule.to_dict(),
    )


LEVEL_SD = 0.03
"""Width (log) of the prior on a run's level from a ladder's size law: about the seed-to-seed spread of the
default ladder's shortest runs (2.9% in held-out loss)."""
PRIOR_SD = {"alpha": 0.05, "p": 0.2, "log_tau": 1.0, "beta": 0.2, "gamma": 0.2}
"""Width of the prior on each law parameter when extrapolating one run; 0.3 (a factor 1.35) for the log of
any coefficient not named here."""


def prior_from(
    fit: CurveFit,
    keep_free: tuple[str, ...] = ("log_A",),
    params: float | None = None,
    level_sd: float = LEVEL_SD,
) -> dict[str, tuple[float, float]]:
    """A soft prior (centre, sd) on the law's shape from a fit of other runs: every parameter of the law
    except the level, the size exponent and `keep_free`.

    With `params` (the run's model size) and a fit with the size law, the level gets a prior too: the
    fit's L0(N) for that size, within `level_sd` (log): the ladder's prediction of the whole curve, which
    the run's own records then correct (pass keep_free=() to hold the amplitude as well)."""
    levels = 2 if fit.size_law == "power" else len(fit.sizes)
    skip = set(fit.names[:levels]) | set(keep_free) | {"a"}
    out = {n: (v, PRIOR_SD.get(n, 0.3)) for n, v in zip(fit.names, fit.theta) if n not in skip}
    if params is not None:
        if fit.size_law != "power":
            raise ConfigError(
                f"prior_from: a level for {params:.4g} parameters needs a fit with the size law "
                f"(3 or more model sizes); this one has {len(fit.sizes)} sizes"
            )
        p = dict(zip(fit.names, fit.theta))
        level = math.exp(p["log_E"]) + math.exp(p["log_A_N"]) * (params / PARAMS_UNIT) ** -p["a"]
        out["log_L0[0]"] = (math.log(level), level_sd)
    return out


SHAPE_PARAMETERS = ("alpha", "p", "beta", "gamma")
"""The law parameters without units: the same whatever the model's size, tokens or loss scale, so a prior
on them can come from runs of another scale (published curves) where coefficients and lags cannot."""


def shape_prior(fit: CurveFit, sd: dict[str, float] | None = None) -> dict[str, tuple[float, float]]:
    """A soft prior (centre, sd) on the unit-free shape parameters (SHAPE_PARAMETERS) of `fit`'s law, from
    a fit to curves of any scale: levels, coefficients and the lag stay free."""
    widths = {**PRIOR_SD, **(sd or {})}
    return {n: (v, widths[n]) for n, v in zip(fit.names, fit.theta) if n in SHAPE_PARAMETERS}


def extrapolate_run(
    curve: Curve,
    law: str = EXTRAPOLATION_LAW,
    *,
    prior: CurveFit | dict[str, tuple[float, float]] | None = None,
    windows: int = 24,
    bootstrap: int = 20,
    seed: int = 0,
) -> tuple[CurvePrediction, CurveFit]:
    """Predict the rest of a run (its final loss and every later step) from the curve it has so far.

    `curve` holds the records so far and the whole run's schedule (curve_from_run, or
    curve_from_records with the config's schedule; `Curve.upto` cuts a finished one). Call it again as
    the run goes on: each call is a small fit of this curve alone.

    Pinning the annealing: early in a cosine run the learning rate has barely dropped, so the curve so far
    cannot tell the annealing coefficient, nor (over a short stretch) the exponent from the level. The
    law's shape (exponent, lag, annealing coefficient) therefore gets a soft prior: from `prior`, a fit
    of the same law to other runs (a ladder: `prior_from`), or a prior given directly; without one,
    `DEFAULT_PRIORS` (the law fitted to the run set in tests/data/curves). Only the level L0 and the
    amplitude A are free of it. The prior weighs as much as a few smoothed points, so as the run goes on
    and its own curve pins the shape, the data take over. `prior={}` fits every parameter freely.
    """
    if isinstance(prior, CurveFit):
        if prior.law != law:
            raise ConfigError(f"prior: a {prior.law} fit cannot pin the parameters of law {law}")
        soft = prior_from(prior)
    elif prior is None:
        soft = {n: (v, PRIOR_SD.get(n, 0.3)) for n, v in DEFAULT_PRIORS.get(law, {}).items()}
    else:
        soft = dict(prior)
    fit = fit_curves(
        [curve], law, size_law="separate", windows=windows, bootstrap=bootstrap, seed=seed, prior=soft
    )
    return predict_curve(fit, curve.schedule, curve.params), fit
