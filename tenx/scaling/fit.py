"""Scaling-law fits with bootstrap intervals: Chinchilla L(N, D), compute L(C), data-constrained L(N, D, U).

Every law here is fitted the way Hoffmann et al. (2022, approach 3) fit L(N, D), with the corrections of
Besiroglu et al. (2024): the Huber loss of log-loss residuals, summed over runs, minimised by L-BFGS-B from a
grid of starting points run to a tight tolerance (the original stopped early), and confidence intervals from
a bootstrap over runs (the original's were implausibly narrow). Predicted log loss is a log-sum-exp of terms
that are linear in the parameters, e.g. log L = logsumexp(a - alpha log N, b - beta log D, e) with
A = e^a, B = e^b, E = e^e, so one optimiser serves every law.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import itertools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from scipy.optimize import minimize

from tenx.config import field
from tenx.errors import ConfigError, DataError, TenxError
from tenx.scaling.table import Points, Table, read_table
from tenx.utils.io import atomic_write_json

LAWS = ("chinchilla", "compute", "data-constrained")
CHINCHILLA_FORM = "E + A/N^alpha + B/D^beta"
TIED_FORM = "E + A/N^alpha + B/D^alpha"
COMPUTE_FORM = "E + A*C^-alpha"
POWER_FORM = "power"
DATA_CONSTRAINED_FORM = "E + A/N^alpha + B/D'^beta, D' = U + U*R_D_star*(1 - exp(-R_D/R_D_star))"

# Hoffmann et al.'s grid of starting points (in the uncentred parameters a = log A, b = log B, e = log E).
_HOFFMANN_GRID = {
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5),
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
}
# L(C) has one reducible term; its grid is written directly in centred coordinates: a_c is the log of the
# reducible loss at the data's geometric-mean compute, so the same grid suits any range of C.
_COMPUTE_GRID = {
    "a_c": (-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5),
    "alpha": (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0),
}
_R_STAR_GRID = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1000.0)
_EXPONENT_BOUNDS = (0.0, 5.0)
_LOG_E_BOUNDS = (-10.0, 10.0)
_LOG_R_STAR_BOUNDS = (math.log(1e-2), math.log(1e6))
_MIN_COMPUTE_POINTS = 4  # below this L(C) = E + A C^-alpha is under-determined; fall back to A C^-alpha


@dataclass
class FitConfig:
    """How a law is fitted: the fit functions take these fields as keywords (`tenx fit` sets the first four)."""

    huber_delta: float = field(
        1e-3,
        help="Huber loss threshold on log-loss residuals (Hoffmann et al. use 1e-3: nearly an L1 fit, robust "
        "to the odd bad run)",
    )
    bootstrap: int = field(
        200, help="bootstrap resamples of the runs for the confidence intervals (0: no intervals)"
    )
    seed: int = field(0, help="seed of the bootstrap resampling (same seed, same intervals)")
    level: float = field(0.95, help="confidence level of the percentile intervals")
    starts: int = field(
        64,
        help="L-BFGS-B runs from this many of the grid's starting points, those with the lowest loss "
        "(0: every point of the grid); on the Gadre et al. runs 64 find the optimum of the full grid",
    )
    bootstrap_starts: int = field(
        2,
        help="each bootstrap refit starts from the full-data optimum and up to this many of the other "
        "distinct optima the full-data fit reached from the grid",
    )
    tie_exponents: bool = field(
        False, help="chinchilla: one exponent for N and D (Gadre et al. 2024's form E + A/N^a + B/D^a)"
    )

    def validate(self) -> None:
        """Check ranges; names the offending field."""
        if not (self.huber_delta > 0 and math.isfinite(self.huber_delta)):
            raise ConfigError(f"fit.huber_delta: must be a positive number, got {self.huber_delta}")
        if self.bootstrap < 0:
            raise ConfigError(f"fit.bootstrap: must be >= 0, got {self.bootstrap}")
        if not 0 < self.level < 1:
            raise ConfigError(f"fit.level: must be in (0, 1), got {self.level}")
        if self.starts < 0 or self.bootstrap_starts < 0:
            raise ConfigError(
                f"fit.starts / fit.bootstrap_starts: must be >= 0, got {self.starts} / {self.bootstrap_starts}"
            )


_F = TypeVar("_F", bound=Callable[..., Any])
_BLAS_THREAD_SETTERS: list[Any] | None = None


def _blas_thread_setters() -> list[Any]:
    """`openblas_set_num_threads_local` of each OpenBLAS loaded in this process (Linux; [] elsewhere)."""
    global _BLAS_THREAD_SETTERS
    if _BLAS_THREAD_SETTERS is None:  # scipy.optimize, imported above, has loaded its OpenBLAS by now
        setters, seen = [], set()
        try:
            with open("/proc/self/maps") as maps:
                paths = [line.split()[-1] for line in maps if "openblas" in line.lower()]
        except OSError:
            paths = []
        for path in paths:
            if path in seen:
                continue
            seen.add(path)
            try:
                setter = ctypes.CDLL(path).openblas_set_num_threads_local
            except (OSError, AttributeError):
                continue
            setter.restype, setter.argtypes = ctypes.c_int, [ctypes.c_int]
            setters.append(setter)
        _BLAS_THREAD_SETTERS = setters
    return _BLAS_THREAD_SETTERS


@contextlib.contextmanager
def _serial_blas() -> Iterator[None]:
    """Single-threaded BLAS in this thread for the duration.

    L-BFGS-B's linear algebra is on vectors of five numbers; threaded, OpenBLAS spends far longer waking its
    threads than computing, and on a busy machine a fit runs 5 to 20 times slower.
    """
    setters = _blas_thread_setters()
    previous = [setter(1) for setter in setters]
    try:
        yield
    finally:
        for setter, threads in zip(setters, previous):
            setter(threads)


def _serial(fn: _F) -> _F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _serial_blas():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    """log(sum(exp(x))) along `axis`, stable (scipy's generic version costs more than the whole fit)."""
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.squeeze(m, axis=axis) + np.log(np.sum(np.exp(x - m), axis=axis))


# ----------------------------------------------------------------------------------------------------------
# The optimiser: log L = logsumexp_k(T[n, k, :] @ theta), Huber loss on the residuals, L-BFGS-B.


@dataclass
class _Problem:
    """Data of one fit: term matrix T (n, k, p) and observed log losses y (n,)."""

    T: np.ndarray
    y: np.ndarray
    delta: float
    bounds: list[tuple[float | None, float | None]]

    def take(self, index: np.ndarray) -> _Problem:
        return _Problem(self.T[index], self.y[index], self.delta, self.bounds)

    def objective(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        """Sum of Huber losses divided by delta, and its gradient.

        Summing (not averaging) and dividing by delta keeps the objective of order one whatever the number of
        runs and delta, so L-BFGS-B's relative tolerance means the same in every fit.
        """
        terms = self.T @ theta  # (n, k)
        pred = logsumexp(terms, axis=1)
        weights = np.exp(terms - pred[:, None])
        r = pred - self.y
        abs_r = np.abs(r)
        quadratic = abs_r <= self.delta
        loss = np.where(quadratic, 0.5 * r * r / self.delta, abs_r - 0.5 * self.delta)
        psi = np.where(quadratic, r / self.delta, np.sign(r))
        # d pred / d theta = sum_k softmax_k * T[:, k, :]; contract with psi first (k is tiny)
        return float(loss.sum()), np.einsum("n,nk,nkp->p", psi, weights, self.T, optimize=False)

    def batch_objective(self, thetas: np.ndarray) -> np.ndarray:
        """The objective at many points at once (G, p) -> (G,), to rank a grid of starts."""
        terms = np.einsum("nkp,gp->gnk", self.T, thetas)
        r = np.abs(logsumexp(terms, axis=2) - self.y)
        loss = np.where(r <= self.delta, 0.5 * r * r / self.delta, r - 0.5 * self.delta)
        return loss.sum(axis=1)

    def residuals(self, theta: np.ndarray) -> np.ndarray:
        return logsumexp(self.T @ theta, axis=1) - self.y


def _lbfgsb(problem: _Problem, start: np.ndarray) -> tuple[float, np.ndarray]:
    """One tightly converged L-BFGS-B run (Besiroglu et al.: the original fit stopped far too early)."""
    res = minimize(
        problem.objective,
        start,
        jac=True,
        method="L-BFGS-B",
        bounds=problem.bounds,
        options={"ftol": 1e-12, "gtol": 1e-9, "maxiter": 20_000, "maxfun": 40_000, "maxls": 50},
    )
    return float(res.fun), np.asarray(res.x, dtype=float)


def _best_starts(problem: _Problem, grid: np.ndarray, count: int) -> np.ndarray:
    """The `count` grid points with the lowest objective (every point when count is 0)."""
    if count == 0 or count >= len(grid):
        return grid
    values = np.concatenate(
        [problem.batch_objective(chunk) for chunk in np.array_split(grid, 1 + len(grid) // 512)]
    )
    return grid[np.argsort(values, kind="stable")[:count]]


def _optimise(problem: _Problem, starts: np.ndarray, keep: int = 0) -> tuple[float, np.ndarray, np.ndarray]:
    """The best L-BFGS-B optimum over `starts`, and up to `keep` more distinct optima (best first).

    The runner-up optima seed the bootstrap refits: from a converged point a resample's refit takes a few
    dozen iterations, where a cold grid start takes hundreds (and on the data tried never did better).
    """
    results = sorted((_lbfgsb(problem, start) for start in starts), key=lambda r: r[0])
    best_value, best_theta = results[0]
    distinct = [best_theta]
    for _, theta in results[1:]:
        if len(distinct) > keep:
            break
        if all(np.max(np.abs(theta - d)) > 1e-3 for d in distinct):
            distinct.append(theta)
    return best_value, best_theta, np.array(distinct)


def _resample(rng: np.random.Generator, index: np.ndarray, features: np.ndarray, n_params: int) -> np.ndarray:
    """Bootstrap draw of `index`, redrawn while it could not identify the law (too few distinct runs, or a
    single value of some input): such a resample has no optimum, only a ridge."""
    for _ in range(100):
        draw = rng.choice(index, len(index))
        sub = features[draw]
        if len(np.unique(sub, axis=0)) >= n_params and all(len(np.unique(col)) >= 2 for col in sub.T):
            return draw
    return draw


# ----------------------------------------------------------------------------------------------------------
# Laws: each builds a _Problem from data and maps centred internal parameters to named ones.


@dataclass
class _Law:
    """One law's parametrisation on one data set (centres are the mean log features of the full data)."""

    law: str
    form: str
    names: tuple[str, ...]
    build: Callable[[np.ndarray], np.ndarray]  # rows' features -> T (n, k, p)
    natural: Callable[[np.ndarray], np.ndarray]  # internal theta -> named parameters, params' order
    grid: np.ndarray
    bounds: list[tuple[float | None, float | None]]
    extra_starts: np.ndarray | None = None  # always tried, whatever the grid ranking says


def _chinchilla_law(logN: np.ndarray, logD: np.ndarray, tie: bool) -> _Law:
    mN, mD = float(logN.mean()), float(logD.mean())
    g = _HOFFMANN_GRID
    points = np.array(list(itertools.product(g["a"], g["b"], g["e"], g["alpha"], g["beta"])))
    if tie:
        points = points[points[:, 3] == points[:, 4]][:, :4]
    # Centring log N and log D (a_c = a - alpha*mean log N) leaves the objective unchanged and decorrelates
    # a from alpha, which L-BFGS-B converges on much faster.
    grid = points.copy()
    grid[:, 0] -= points[:, 3] * mN
    grid[:, 1] -= points[:, 3 if tie else 4] * mD
    p = 4 if tie else 5

    def build(features: np.ndarray) -> np.ndarray:
        xN, xD = features[:, 0] - mN, features[:, 1] - mD
        T = np.zeros((len(features), 3, p))
        T[:, 0, 0], T[:, 0, 3] = 1.0, -xN
        T[:, 1, 1], T[:, 1, 3 if tie else 4] = 1.0, -xD
        T[:, 2, 2] = 1.0
        return T

    def natural(theta: np.ndarray) -> np.ndarray:
        alpha = theta[3]
        beta = theta[3] if tie else theta[4]
        with np.errstate(over="ignore"):  # a wild bootstrap refit may overflow: inf, dropped from intervals
            return np.array(
                [np.exp(theta[2]), np.exp(theta[0] + alpha * mN), np.exp(theta[1] + beta * mD), alpha, beta]
            )

    bounds: list[tuple[float | None, float | None]] = [(None, None), (None, None), _LOG_E_BOUNDS]
    bounds += [_EXPONENT_BOUNDS] * (p - 3)
    return _Law(
        "chinchilla",
        TIED_FORM if tie else CHINCHILLA_FORM,
        ("E", "A", "B", "alpha", "beta"),
        build,
        natural,
        grid,
        bounds,
    )


def _compute_law(logC: np.ndarray, power: bool) -> _Law:
    mC = float(logC.mean())
    g = _COMPUTE_GRID
    if power:

        def build(features: np.ndarray) -> np.ndarray:
            T = np.zeros((len(features), 1, 2))
            T[:, 0, 0], T[:, 0, 1] = 1.0, -(features[:, 0] - mC)
            return T

        def natural(theta: np.ndarray) -> np.ndarray:
            with np.errstate(over="ignore"):
                return np.array([0.0, np.exp(theta[0] + theta[1] * mC), theta[1]])

        grid = np.array(list(itertools.product(g["a_c"], g["alpha"])))
        return _Law(
            "compute", POWER_FORM, ("E", "A", "alpha"), build, natural, grid, [(None, None), _EXPONENT_BOUNDS]
        )

    def build_e(features: np.ndarray) -> np.ndarray:
        T = np.zeros((len(features), 2, 3))
        T[:, 0, 0], T[:, 0, 2] = 1.0, -(features[:, 0] - mC)
        T[:, 1, 1] = 1.0
        return T

    def natural_e(theta: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return np.array([np.exp(theta[1]), np.exp(theta[0] + theta[2] * mC), theta[2]])

    grid = np.array(list(itertools.product(g["a_c"], g["e"], g["alpha"])))
    bounds: list[tuple[float | None, float | None]] = [(None, None), _LOG_E_BOUNDS, _EXPONENT_BOUNDS]
    return _Law("compute", COMPUTE_FORM, ("E", "A", "alpha"), build_e, natural_e, grid, bounds)


# ----------------------------------------------------------------------------------------------------------
# Results.


@dataclass
class FitResult:
    """A fitted law: named parameters, bootstrap intervals and samples, and predictions with intervals."""

    law: str
    form: str
    params: dict[str, float]
    intervals: dict[str, tuple[float, float]]
    samples: np.ndarray
    n_points: int
    residual_rms: float
    level: float = 0.95
    info: dict[str, Any] = dc_field(default_factory=dict)

    def _log_predict(self, values: np.ndarray, N: Any, D: Any, C: Any, U: Any) -> np.ndarray:
        """log L for parameter rows `values` (S, P) at the given inputs -> (S, M)."""
        cols = {name: values[:, i : i + 1] for i, name in enumerate(self.params)}
        with np.errstate(divide="ignore"):
            logE = np.log(cols["E"])
        if self.law == "compute":
            if C is None:
                if N is None or D is None:
                    raise TenxError("a compute-law prediction needs C (or N and D, with C = 6ND)")
                C = 6 * np.asarray(N, dtype=float) * np.asarray(D, dtype=float)
            logC = np.log(np.atleast_1d(np.asarray(C, dtype=float)))[None, :]
            return np.logaddexp(np.log(cols["A"]) - cols["alpha"] * logC, logE)
        if N is None or (D is None and C is None):
            raise TenxError(f"a {self.law} prediction needs N and D (or N and C, with D = C/(6N))")
        Na = np.atleast_1d(np.asarray(N, dtype=float))
        Da = (
            np.atleast_1d(np.asarray(D, dtype=float))
            if D is not None
            else np.atleast_1d(np.asarray(C, dtype=float)) / (6 * Na)
        )
        Na, Da = np.broadcast_arrays(Na, Da)
        logD = np.log(Da)[None, :]
        if self.law == "data-constrained":
            Ua = Da if U is None else np.broadcast_to(np.atleast_1d(np.asarray(U, dtype=float)), Da.shape)
            logD = np.log(effective_data(Da[None, :], Ua[None, :], cols["R_D_star"]))
        terms = np.stack(
            np.broadcast_arrays(
                np.log(cols["A"]) - cols["alpha"] * np.log(Na)[None, :],
                np.log(cols["B"]) - cols["beta"] * logD,
                logE + 0 * logD,
            )
        )
        return logsumexp(terms, axis=0)

    def predict(self, N: Any = None, D: Any = None, C: Any = None, U: Any = None) -> Any:
        """Point prediction of the loss (a float for scalar inputs, an array for arrays)."""
        values = np.array([list(self.params.values())])
        out = np.exp(self._log_predict(values, N, D, C, U)[0])
        return float(out[0]) if all(np.ndim(v) == 0 for v in (N, D, C, U) if v is not None) else out

    def predict_interval(
        self, N: Any = None, D: Any = None, C: Any = None, U: Any = None, level: float | None = None
    ) -> tuple[Any, Any]:
        """Percentile interval of the prediction over the bootstrap fits (NaN without bootstrap)."""
        level = self.level if level is None else level
        scalar = all(np.ndim(v) == 0 for v in (N, D, C, U) if v is not None)
        ok = np.all(np.isfinite(self.samples), axis=1) if len(self.samples) else np.zeros(0, bool)
        if not ok.any():
            shape = np.shape(self.predict(N, D, C, U))
            nan = np.full(shape, np.nan)
            return (math.nan, math.nan) if scalar else (nan, nan)
        preds = np.exp(self._log_predict(self.samples[ok], N, D, C, U))
        q = 100 * (1 - level) / 2
        low, high = np.percentile(preds, [q, 100 - q], axis=0)
        return (float(low[0]), float(high[0])) if scalar else (low, high)

    def to_dict(self, samples: bool = False) -> dict[str, Any]:
        """Plain data: law, form, parameters, intervals and fit statistics (bootstrap samples if asked)."""
        out: dict[str, Any] = {
            "law": self.law,
            "form": self.form,
            "params": dict(self.params),
            "intervals": {k: [lo, hi] for k, (lo, hi) in self.intervals.items()},
            "level": self.level,
            "n_points": self.n_points,
            "residual_rms": self.residual_rms,
            "n_bootstrap": int(len(self.samples)),
            **self.info,
        }
        if samples:
            out["samples"] = self.samples.tolist()
        return out


def _intervals(names: Sequence[str], samples: np.ndarray, level: float) -> dict[str, tuple[float, float]]:
    ok = np.all(np.isfinite(samples), axis=1) if len(samples) else np.zeros(0, bool)
    if not ok.any():
        return {name: (math.nan, math.nan) for name in names}
    q = 100 * (1 - level) / 2
    low, high = np.percentile(samples[ok], [q, 100 - q], axis=0)
    return {name: (float(lo), float(hi)) for name, lo, hi in zip(names, low, high)}


def _fit_law(law: _Law, features: np.ndarray, logL: np.ndarray, cfg: FitConfig) -> FitResult:
    """Full-data fit from the grid, then `cfg.bootstrap` refits on resampled runs."""
    problem = _Problem(law.build(features), logL, cfg.huber_delta, law.bounds)
    extra = law.extra_starts if law.extra_starts is not None else np.empty((0, law.grid.shape[1]))
    grid = _best_starts(problem, law.grid, cfg.starts)
    value, theta, optima = _optimise(problem, np.vstack([extra, grid]), keep=cfg.bootstrap_starts)
    rng = np.random.default_rng(cfg.seed)
    n = len(logL)
    samples = np.empty((cfg.bootstrap, len(law.names)))
    for i in range(cfg.bootstrap):
        sub = problem.take(_resample(rng, np.arange(n), features, grid.shape[1]))
        samples[i] = law.natural(_optimise(sub, optima)[1])
    params = dict(zip(law.names, (float(v) for v in law.natural(theta))))
    return FitResult(
        law=law.law,
        form=law.form,
        params=params,
        intervals=_intervals(law.names, samples, cfg.level),
        samples=samples,
        n_points=n,
        residual_rms=float(np.sqrt(np.mean(problem.residuals(theta) ** 2))),
        level=cfg.level,
        info={"objective": value, "huber_delta": cfg.huber_delta, "seed": cfg.seed},
    )


def _check_arrays(what: str, **arrays: Any) -> dict[str, np.ndarray]:
    """Named inputs as equal-length float arrays of positive finite values; DataError otherwise."""
    out = {k: np.asarray(v, dtype=float).ravel() for k, v in arrays.items()}
    lengths = {k: len(v) for k, v in out.items()}
    if len(set(lengths.values())) != 1:
        raise DataError(f"{what}: inputs differ in length: {lengths}")
    for k, v in out.items():
        bad = np.flatnonzero(~(np.isfinite(v) & (v > 0)))
        if len(bad):
            raise DataError(f"{what}: {k}[{bad[0]}] = {v[bad[0]]} is not a positive number")
    return out


def _config(**kw: Any) -> FitConfig:
    cfg = FitConfig(**kw)
    cfg.validate()
    return cfg


@_serial
def fit_chinchilla(
    N: Any,
    D: Any,
    L: Any,
    *,
    bootstrap: int = 200,
    seed: int = 0,
    huber_delta: float = 1e-3,
    tie_exponents: bool = False,
    starts: int = 64,
    bootstrap_starts: int = 2,
    level: float = 0.95,
) -> FitResult:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta (Hoffmann et al. approach 3, Besiroglu et al. corrections)."""
    cfg = _config(
        bootstrap=bootstrap,
        seed=seed,
        huber_delta=huber_delta,
        tie_exponents=tie_exponents,
        starts=starts,
        bootstrap_starts=bootstrap_starts,
        level=level,
    )
    a = _check_arrays("fit_chinchilla", N=N, D=D, L=L)
    n_params = 4 if tie_exponents else 5
    if len(a["L"]) < n_params or len(np.unique(a["N"])) < 2 or len(np.unique(a["D"])) < 2:
        raise DataError(
            f"fit_chinchilla: {len(a['L'])} runs with {len(np.unique(a['N']))} model sizes and "
            f"{len(np.unique(a['D']))} token counts; need at least {n_params} runs over 2 or more of each"
        )
    logN, logD = np.log(a["N"]), np.log(a["D"])
    law = _chinchilla_law(logN, logD, tie_exponents)
    return _fit_law(law, np.column_stack([logN, logD]), np.log(a["L"]), cfg)


@_serial
def fit_compute(
    C: Any,
    L: Any,
    *,
    bootstrap: int = 200,
    seed: int = 0,
    huber_delta: float = 1e-3,
    starts: int = 64,
    bootstrap_starts: int = 2,
    level: float = 0.95,
) -> FitResult:
    """Fit L(C) = E + A*C^-alpha; with fewer than 4 points the pure power law A*C^-alpha (form "power")."""
    cfg = _config(
        bootstrap=bootstrap,
        seed=seed,
        huber_delta=huber_delta,
        starts=starts,
        bootstrap_starts=bootstrap_starts,
        level=level,
    )
    a = _check_arrays("fit_compute", C=C, L=L)
    if len(np.unique(a["C"])) < 2:
        raise DataError(
            f"fit_compute: {len(a['C'])} runs at {len(np.unique(a['C']))} compute; need 2 or more"
        )
    logC = np.log(a["C"])
    power = len(a["L"]) < _MIN_COMPUTE_POINTS
    law = _compute_law(logC, power)
    if power:
        # Few points: least squares on log-log is the natural start (and with 2 points, the answer).
        slope, intercept = np.polyfit(logC - logC.mean(), np.log(a["L"]), 1)
        law.extra_starts = np.array([[intercept, max(-slope, 0.0)]])
    return _fit_law(law, logC[:, None], np.log(a["L"]), cfg)


def effective_data(D: Any, U: Any, R_star: Any) -> np.ndarray:
    """Muennighoff et al.'s effective tokens D' = U + U*R*(1 - exp(-R/R*)), with R = D/U - 1 repetitions."""
    D, U = np.asarray(D, dtype=float), np.asarray(U, dtype=float)
    R = np.maximum(D / U - 1.0, 0.0)
    return U + U * R_star * -np.expm1(-R / R_star)


def _fit_r_star(
    base: np.ndarray,
    N: np.ndarray,
    D: np.ndarray,
    U: np.ndarray,
    logL: np.ndarray,
    delta: float,
    starts: Sequence[float] = _R_STAR_GRID,
) -> float:
    """With E, A, B, alpha, beta fixed, the R*_D minimising the Huber loss (1-D, L-BFGS-B from a grid)."""
    E, A, B, alpha, beta = base
    n_term = math.log(A) - alpha * np.log(N)

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        r_star = math.exp(float(x[0]))
        R = np.maximum(D / U - 1.0, 0.0)
        decay = np.exp(-R / r_star)
        d_eff = U + U * r_star * (1 - decay)
        d_term = math.log(B) - beta * np.log(d_eff)
        pred = np.logaddexp(np.logaddexp(n_term, d_term), math.log(E))
        r = pred - logL
        quadratic = np.abs(r) <= delta
        loss = np.where(quadratic, 0.5 * r * r / delta, np.abs(r) - 0.5 * delta)
        psi = np.where(quadratic, r / delta, np.sign(r))
        dlogd_dlogr = r_star * U * ((1 - decay) - (R / r_star) * decay) / d_eff
        dpred = np.exp(d_term - pred) * -beta * dlogd_dlogr
        return float(loss.sum()), np.array([float(psi @ dpred)])

    best_value, best_x = math.inf, 0.0
    for start in starts:
        res = minimize(
            objective,
            np.array([math.log(start)]),
            jac=True,
            method="L-BFGS-B",
            bounds=[_LOG_R_STAR_BOUNDS],
            options={"ftol": 1e-14, "gtol": 1e-10, "maxiter": 2000},
        )
        if res.fun < best_value:
            best_value, best_x = float(res.fun), float(res.x[0])
    return math.exp(best_x)


@_serial
def fit_data_constrained(
    N: Any,
    D: Any,
    U: Any,
    L: Any,
    *,
    bootstrap: int = 200,
    seed: int = 0,
    huber_delta: float = 1e-3,
    starts: int = 64,
    bootstrap_starts: int = 2,
    level: float = 0.95,
) -> FitResult:
    """Fit Muennighoff et al.'s L(N, D, U): Chinchilla on single-epoch runs, then R*_D on all runs.

    Repeated tokens count as effective data D' (see `effective_data`); parameters are not discounted
    (N' = N: the R*_N of the paper matters only for models far larger than their unique data supports).
    """
    cfg = _config(
        bootstrap=bootstrap,
        seed=seed,
        huber_delta=huber_delta,
        starts=starts,
        bootstrap_starts=bootstrap_starts,
        level=level,
    )
    a = _check_arrays("fit_data_constrained", N=N, D=D, U=U, L=L)
    single = a["D"] <= a["U"] * (1 + 1e-9)
    if single.sum() < 5 or len(np.unique(a["N"][single])) < 2 or len(np.unique(a["D"][single])) < 2:
        raise DataError(
            f"fit_data_constrained: {int(single.sum())} single-epoch runs (tokens <= unique tokens); need at "
            "least 5 over 2 or more model sizes and token counts to fit E, A, B, alpha, beta first"
        )
    if single.all():
        raise DataError(
            "fit_data_constrained: no run repeats its data (tokens > unique tokens); R*_D is undefined"
        )
    logL = np.log(a["L"])
    logN, logD = np.log(a["N"]), np.log(a["D"])
    law = _chinchilla_law(logN[single], logD[single], tie=False)
    features = np.column_stack([logN, logD])

    def fit_once(index: np.ndarray, starts: np.ndarray, r_starts: Sequence[float]) -> np.ndarray:
        sub_single = index[single[index]]
        problem = _Problem(law.build(features[sub_single]), logL[sub_single], cfg.huber_delta, law.bounds)
        theta = _optimise(problem, starts)[1]
        base = law.natural(theta)
        r_star = _fit_r_star(
            base, a["N"][index], a["D"][index], a["U"][index], logL[index], cfg.huber_delta, r_starts
        )
        return np.append(base, r_star)

    everything = np.arange(len(logL))
    single_idx, repeated_idx = everything[single], everything[~single]
    full = _Problem(law.build(features[single]), logL[single], cfg.huber_delta, law.bounds)
    optima = _optimise(full, _best_starts(full, law.grid, cfg.starts), keep=cfg.bootstrap_starts)[2]
    values = fit_once(everything, optima[:1], _R_STAR_GRID)
    rng = np.random.default_rng(cfg.seed)
    samples = np.empty((cfg.bootstrap, 6))
    for i in range(cfg.bootstrap):
        # Stratified: each resample keeps as many single-epoch runs as the data, so stage 1 always has them.
        index = np.concatenate(
            [_resample(rng, single_idx, features, 5), rng.choice(repeated_idx, len(repeated_idx))]
        )
        samples[i] = fit_once(index, optima, (values[5],))
    names = ("E", "A", "B", "alpha", "beta", "R_D_star")
    result = FitResult(
        law="data-constrained",
        form=DATA_CONSTRAINED_FORM,
        params=dict(zip(names, (float(v) for v in values))),
        intervals=_intervals(names, samples, cfg.level),
        samples=samples,
        n_points=len(logL),
        residual_rms=0.0,
        level=cfg.level,
        info={
            "huber_delta": cfg.huber_delta,
            "seed": cfg.seed,
            "n_single_epoch": int(single.sum()),
            "n_repeated": int((~single).sum()),
        },
    )
    resid = np.log(result.predict(N=a["N"], D=a["D"], U=a["U"])) - logL
    result.residual_rms = float(np.sqrt(np.mean(resid**2)))
    return result


# ----------------------------------------------------------------------------------------------------------
# Derived quantities.


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
        with np.errstate(over="ignore", invalid="ignore"):
            N = G * (C / 6) ** (beta / (alpha + beta))
            return np.column_stack([N, C / (6 * N), E + K * (C / 6) ** -gamma])

    point = allocate(np.array([list(fit.params.values())]))[0]
    out: dict[str, Any] = {"C": C, "N": float(point[0]), "D": float(point[1]), "loss": float(point[2])}
    out["tokens_per_param"] = out["D"] / out["N"]
    ok = np.all(np.isfinite(fit.samples), axis=1) if len(fit.samples) else np.zeros(0, bool)
    if ok.any():
        q = 100 * (1 - fit.level) / 2
        low, high = np.nanpercentile(allocate(fit.samples[ok]), [q, 100 - q], axis=0)
        for i, key in enumerate(("N", "D", "loss")):
            out[f"{key}_interval"] = [float(low[i]), float(high[i])]
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


# ----------------------------------------------------------------------------------------------------------
# Table-level analyses: IsoFLOP minima (approach 2), leave-largest-out, the whole `tenx fit` report.


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


def _budget_of(points: Points, index: np.ndarray) -> float:
    if np.all(np.isfinite(points.budget[index])):
        return float(points.budget[index][0])
    return float(np.exp(np.mean(np.log(points.C[index]))))


@_serial
def isoflop_minima(table: Table | Points) -> dict[str, Any]:
    """Approach 2: per budget, the minimum of a parabola in log N; then N* = k C^a and D* = k' C^b."""
    points = table.fit if isinstance(table, Table) else table
    budgets: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for index in budget_groups(points):
        C = _budget_of(points, index)
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


def _frontier(points: Points) -> tuple[np.ndarray, np.ndarray]:
    """(C, best loss) per budget group: what L(C) describes is the best loss a budget can buy."""
    groups = budget_groups(points)
    C = np.array([_budget_of(points, g) for g in groups])
    L = np.array([points.L[g].min() for g in groups])
    return C, L


def _fit_points(points: Points, law: str, **kw: Any) -> FitResult:
    if law != "compute" and not (np.all(np.isfinite(points.N)) and np.all(np.isfinite(points.D))):
        raise DataError(f"{law} fit: every run needs params and tokens (--params-column, --tokens-column)")
    if law == "chinchilla":
        return fit_chinchilla(points.N, points.D, points.L, **kw)
    kw.pop("tie_exponents", None)
    if law == "compute":
        return fit_compute(*_frontier(points), **kw)
    if law == "data-constrained":
        if not np.all(np.isfinite(points.U)):
            raise DataError("data-constrained fit: every run needs a unique-tokens value (--unique-column)")
        return fit_data_constrained(points.N, points.D, points.U, points.L, **kw)
    raise ConfigError(f"--law {law!r}: choose one of {', '.join(LAWS)}")


def _prediction_rows(
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


def _at_budget(fit: FitResult, points: Points, index: np.ndarray) -> dict[str, Any]:
    """A compute law's prediction at one budget against the best loss observed there."""
    budget = _budget_of(points, index)
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


@_serial
def leave_largest_out(table: Table | Points, law: str, **kw: Any) -> dict[str, Any]:
    """Refit without the largest compute budget's runs and report how well they are predicted."""
    points = table.fit if isinstance(table, Table) else table
    rows = table.fit_rows if isinstance(table, Table) else None
    groups = budget_groups(points)
    largest = max(groups, key=lambda g: _budget_of(points, g))
    keep = np.ones(len(points), dtype=bool)
    keep[largest] = False
    budget = _budget_of(points, largest)
    try:
        fit = _fit_points(points.take(keep), law, **kw)
    except DataError as e:
        return {"budget": budget, "skipped": f"too few runs left to fit: {e}"}
    left = points.take(~keep)
    left_rows = [rows[i] for i in largest] if rows is not None else None
    out: dict[str, Any] = {
        "budget": budget,
        "n_fit": int(keep.sum()),
        "fit": fit.to_dict(),
        "rows": _prediction_rows(fit, left, left_rows),
    }
    if law == "compute":
        out["at_budget"] = _at_budget(fit, left, np.arange(len(left)))
        out["max_abs_rel_error"] = abs(out["at_budget"]["rel_error"])
    else:
        out["max_abs_rel_error"] = max(abs(r["rel_error"]) for r in out["rows"])
    return out


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
            residuals = _point_residuals(_fit_points(points.take(current), law, **quick), points)
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


@_serial
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
    min_tokens_per_param: float = 0.0,
    max_residual: float = 0.05,
    **table_kw: Any,
) -> dict[str, Any]:
    """Fit a law to a run table; predict its holdout rows and target; write the report JSON and a PNG.

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
    kw: dict[str, Any] = {"bootstrap": bootstrap, "seed": seed, "huber_delta": huber_delta}
    if law == "chinchilla":
        kw["tie_exponents"] = tie_exponents
    keep, reasons = select_runs(
        table, law, min_tokens_per_param=min_tokens_per_param, max_residual=max_residual, **kw
    )
    excluded = ~keep
    kept = table.with_fit_rows(keep)
    fit = _fit_points(kept.fit, law, **kw)
    predictions = _prediction_rows(fit, table.holdout, table.holdout_rows)
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
                _prediction_rows(
                    fit, table.fit.take(excluded), [r for r, e in zip(table.fit_rows, excluded) if e]
                ),
                np.flatnonzero(excluded),
            )
        ],
        "fit": fit.to_dict(),
        "predictions": predictions,
        "max_abs_rel_error": max((abs(p["rel_error"]) for p in predictions), default=None),
        "leave_largest_out": leave_largest_out(kept, law, **kw) if len(budget_groups(kept.fit)) > 1 else None,
        # IsoFLOP profiles need one data regime per budget; repeated-data runs mix several
        "isoflop": isoflop_minima(kept)
        if law != "data-constrained" and np.all(np.isfinite(kept.fit.N))
        else None,
        "target": _predict_target(fit, parsed_target) if parsed_target else None,
    }
    if law == "compute" and len(table.holdout):
        report["holdout_budgets"] = [_at_budget(fit, table.holdout, g) for g in budget_groups(table.holdout)]
    if law != "compute":
        budget = parsed_target.get("C") if parsed_target else None
        if budget is None and parsed_target:
            budget = 6 * parsed_target["N"] * parsed_target["D"]
        if budget is None:
            budget = float(max(np.max(kept.fit.C), np.max(table.holdout.C, initial=0.0)))
        report["compute_optimal"] = compute_optimal(fit, budget)
    source = Path(table.path)
    base = Path(out_dir) if out_dir is not None else source.parent
    stem = f"{source.stem}_fit_{law}"
    report["plot"] = None
    if plot:
        from tenx.scaling.plots import plot_fit

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
    json_path = Path(json_out) if json_out is not None else base / f"{stem}.json"
    report["json"] = str(json_path)
    atomic_write_json(json_path, _jsonable(report))
    report["result"] = fit
    return report


# ----------------------------------------------------------------------------------------------------------
# CLI.


def _fmt_interval(lo: float | None, hi: float | None) -> str:
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return ""
    return f"  [{lo:.4g}, {hi:.4g}]"


def format_report(report: dict[str, Any]) -> str:
    """A readable summary of `run_fit`'s report: parameters, predictions, leave-largest-out, target."""
    fit = report["fit"]
    lines = [
        f"{report['law']} fit of {report['input']}: {fit['form']}",
        f"  {report['n_fit']} runs fitted, {len(report['excluded'])} left out; {fit['n_bootstrap']} bootstrap "
        f"fits; residual rms {fit['residual_rms']:.4f} (log loss)",
    ]
    for p in report["excluded"]:
        label = p.get("name") or f"N={p['params']:.3g} D={p['tokens']:.3g}"
        lines.append(f"    left out {label} (loss {p['actual']:.4f}): {p['reason']}")
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
    if report.get("target"):
        t = report["target"]
        keys = ", ".join(f"{k}={t[k]:.3g}" for k in ("N", "D", "C", "U") if k in t)
        if t.get("predicted") is not None:
            lines.append(
                f"  target {keys}: loss {t['predicted']:.4f}{_fmt_interval(t.get('low'), t.get('high'))}"
            )
    co = report.get("compute_optimal")
    if co:
        lines.append(
            f"  compute-optimal at C={co['C']:.3g}: N={co['N']:.3g} D={co['D']:.3g} "
            f"({co['tokens_per_param']:.1f} tokens/param) loss {co['loss']:.4f}"
        )
    iso = report.get("isoflop")
    if iso and "N_exponent" in iso:
        lines.append(
            f"  IsoFLOP minima ({len(iso['budgets'])} budgets): N* ~ C^{iso['N_exponent']:.3f}, "
            f"D* ~ C^{iso['D_exponent']:.3f}"
        )
    lines.append(f"  wrote {report['json']}" + (f" and {report['plot']}" if report.get("plot") else ""))
    return "\n".join(lines)


def cmd_fit(args: argparse.Namespace) -> None:
    """`tenx fit`: fit, print the summary, write the JSON and PNG."""
    report = run_fit(
        args.input,
        law=args.law,
        target=args.target,
        out_dir=args.out,
        json_out=args.json,
        bootstrap=args.bootstrap,
        seed=args.seed,
        plot=not args.no_plot,
        huber_delta=args.huber_delta,
        tie_exponents=args.tie_exponents,
        min_tokens_per_param=args.min_tokens_per_param,
        max_residual=args.max_residual,
        params_column=args.params_column,
        tokens_column=args.tokens_column,
        loss_column=args.loss_column,
        flops_column=args.flops_column,
        unique_column=args.unique_column,
        filters=args.filter,
        holdout=args.holdout,
    )
    print(format_report(report))


def add_fit_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `tenx fit` on the CLI's subparsers."""
    fp = subparsers.add_parser(
        "fit", help="fit a scaling law to finished runs and extrapolate, with bootstrap intervals"
    )
    fp.add_argument("input", help="LADDER_DIR (its results.jsonl), a .csv or a .jsonl with one row per run")
    fp.add_argument(
        "--law", choices=LAWS, default="chinchilla", help="L(N,D), L(C) or L(N,D,U) (default chinchilla)"
    )
    fp.add_argument(
        "--target", help="extrapolate to N=PARAMS,D=TOKENS (U=UNIQUE for data-constrained) or to C=FLOPS"
    )
    fp.add_argument("--params-column", default="params", help="parameter count column (default params)")
    fp.add_argument("--tokens-column", default="tokens", help="training tokens column (default tokens)")
    fp.add_argument(
        "--loss-column", default="heldout_loss", help="loss column, nats/token (default heldout_loss)"
    )
    fp.add_argument(
        "--flops-column",
        default="flops",
        help="training FLOPs column; C = 6ND when a row lacks it (default flops)",
    )
    fp.add_argument(
        "--unique-column", default="unique_tokens", help="unique tokens column (data-constrained)"
    )
    fp.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="COLUMN=VALUE",
        help="keep only matching rows (repeatable)",
    )
    fp.add_argument(
        "--holdout",
        metavar="EXPR",
        help="rows to predict instead of fit, e.g. 'params>=1e9' or 'params>=1e9 & tokens<1e11'",
    )
    fp.add_argument("--json", help="report JSON path (default OUT/INPUT_fit_LAW.json)")
    fp.add_argument("--out", help="directory of the plot (default: next to the input)")
    fp.add_argument("--no-plot", action="store_true", help="skip the PNG")
    fp.add_argument(
        "--bootstrap", type=int, default=200, help="bootstrap resamples (default 200; 0: no intervals)"
    )
    fp.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    fp.add_argument(
        "--huber-delta", type=float, default=1e-3, help="Huber threshold on log-loss residuals (1e-3)"
    )
    fp.add_argument(
        "--tie-exponents", action="store_true", help="chinchilla with one exponent for N and D (Gadre et al.)"
    )
    fp.add_argument(
        "--min-tokens-per-param",
        type=float,
        default=0.0,
        help="leave out runs with fewer training tokens per parameter (default 0: keep all)",
    )
    fp.add_argument(
        "--max-residual",
        type=float,
        default=0.05,
        help="leave out runs this far off the fit to the others, in log loss (default 0.05; 0: keep all)",
    )
    fp.set_defaults(func=cmd_fit)
    return fp
