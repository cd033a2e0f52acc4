"""The laws: Chinchilla L(N, D), compute L(C), data-constrained L(N, D, U); their fit functions and results.

Each law builds a `Problem` (solver.py) from data and maps centred internal parameters to named ones.
Every fit function takes the same keyword options: the fields of `FitConfig` (`tie_exponents` is
fit_chinchilla's alone, `excess_params` fit_data_constrained's), documented there once.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, ClassVar

import numpy as np

from tenx.config import check_bounds, field
from tenx.errors import ConfigError, DataError, TenxError
from tenx.scaling.fit.joint import (  # the grids and bounds are the joint fit's too
    _EXPONENT_BOUNDS,
    _HOFFMANN_GRID,
    _LOG_E_BOUNDS,
    _LOG_R_STAR_BOUNDS,
    _R_STAR_GRID,
    _fit_joint,
    _joint_starts,
    _to_joint,
)
from tenx.scaling.fit.repetition import discount as _discount
from tenx.scaling.fit.repetition import effective_data, unique_params
from tenx.scaling.fit.solver import (
    Problem,
    best_minimum,
    best_starts,
    logsumexp,
    optimise,
    resample,
    with_serial_blas,
)

LAWS = ("chinchilla", "compute", "data-constrained")
CHINCHILLA_FORM = "E + A/N^alpha + B/D^beta"
TIED_FORM = "E + A/N^alpha + B/D^alpha"
COMPUTE_FORM = "E + A*C^-alpha"
POWER_FORM = "power"
DATA_CONSTRAINED_FORM = "E + A/N^alpha + B/D'^beta, D' = U + U*R_D_star*(1 - exp(-R_D/R_D_star))"
EXCESS_PARAMS_FORM = (
    "E + A/N'^alpha + B/D'^beta, D' = U + U*R_D_star*(1 - exp(-R_D/R_D_star)), "
    "N' = U_N + U_N*R_N_star*(1 - exp(-R_N/R_N_star)), U_N = min(N, N_opt(U))"
)

# L(C) has one reducible term; its grid is written directly in centred coordinates: a_c is the log of the
# reducible loss at the data's geometric-mean compute, so the same grid suits any range of C.
_COMPUTE_GRID = {
    "a_c": (-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5),
    "alpha": (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0),
}
PARAM_BOUNDS: dict[str, tuple[float, float]] = {
    "E": (math.exp(_LOG_E_BOUNDS[0]), math.exp(_LOG_E_BOUNDS[1])),
    "alpha": _EXPONENT_BOUNDS,
    "beta": _EXPONENT_BOUNDS,
    "R_D_star": (math.exp(_LOG_R_STAR_BOUNDS[0]), math.exp(_LOG_R_STAR_BOUNDS[1])),
    "R_N_star": (math.exp(_LOG_R_STAR_BOUNDS[0]), math.exp(_LOG_R_STAR_BOUNDS[1])),
}
"""The range the optimiser allows each bounded parameter (A and B are free): a fitted value or an interval
at one of these ends means the runs did not determine it (tenx.scaling.fit.report.fit_warnings)."""
_MIN_COMPUTE_POINTS = 4  # below this L(C) = E + A C^-alpha is under-determined; fall back to A C^-alpha


@dataclass
class FitConfig:
    """How a law is fitted: every fit function takes these fields as keywords, its one list of options
    (`tenx fit` sets huber_delta, bootstrap, seed and tie_exponents)."""

    SECTION: ClassVar[str] = "fit"
    """Where its fields sit in the config tree (errors name `fit.FIELD`)."""

    huber_delta: float = field(
        1e-3,
        help="Huber loss threshold on log-loss residuals (Hoffmann et al. use 1e-3: nearly an L1 fit, robust "
        "to the odd bad run)",
    )
    bootstrap: int = field(
        200,
        ge=0,
        le=100_000,
        help="bootstrap resamples of the runs for the confidence intervals (0: no intervals)",
    )
    seed: int = field(0, ge=0, help="seed of the bootstrap resampling (same seed, same intervals)")
    level: float = field(0.95, gt=0, lt=1, help="confidence level of the percentile intervals")
    starts: int = field(
        64,
        ge=0,
        help="L-BFGS-B runs from this many of the grid's starting points, those with the lowest loss "
        "(0: every point of the grid); on the Gadre et al. runs 64 find the optimum of the full grid",
    )
    bootstrap_starts: int = field(
        2,
        ge=0,
        help="each bootstrap refit starts from the full-data optimum and up to this many of the other "
        "distinct optima the full-data fit reached from the grid",
    )
    tie_exponents: bool = field(
        False, help="chinchilla: one exponent for N and D (Gadre et al. 2024's form E + A/N^a + B/D^a)"
    )
    joint: bool = field(
        False,
        help="data-constrained: fit E, A, B, alpha, beta and R*_D together on every run, single-epoch and "
        "repeated, instead of Muennighoff et al.'s two stages (Chinchilla on the single-epoch runs, then R*_D "
        "on all): for runs whose single-epoch ones cover too few token counts to pin beta on their own (two, "
        "in the data-efficiency study), where the repeated runs' effective data D' does; not with "
        "excess_params",
    )
    excess_params: bool = field(
        False,
        help="data-constrained: parameters beyond what the unique tokens can use count for less, as "
        "repeated tokens do (Muennighoff et al.'s R*_N term: N' = U_N + U_N R*_N (1 - exp(-R_N/R*_N)), "
        "U_N = min(N, the compute-optimal size for U tokens), R_N = N/U_N - 1)",
    )

    def validate(self) -> None:
        """Check bounds and that huber_delta is a finite positive number; names the offending field."""
        check_bounds(self)
        if not (self.huber_delta > 0 and math.isfinite(self.huber_delta)):
            raise ConfigError(f"fit.huber_delta: must be a positive number, got {self.huber_delta}")


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
        logN = np.log(Na)[None, :]
        if self.law == "data-constrained":
            Ua = Da if U is None else np.broadcast_to(np.atleast_1d(np.asarray(U, dtype=float)), Da.shape)
            logD = np.log(effective_data(Da[None, :], Ua[None, :], cols["R_D_star"]))
            if "R_N_star" in cols:
                chinchilla = [cols[k] for k in ("A", "B", "alpha", "beta")]
                with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                    usable = unique_params(np.minimum(Ua, Da)[None, :], *chinchilla)
                    logN = np.log(effective_data(Na[None, :], usable, cols["R_N_star"]))
        terms = np.stack(
            np.broadcast_arrays(
                np.log(cols["A"]) - cols["alpha"] * logN,
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
        q = 100 * (1 - level) / 2
        with np.errstate(over="ignore", invalid="ignore"):  # a wild refit's prediction may overflow: inf
            preds = np.exp(self._log_predict(self.samples[ok], N, D, C, U))
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
    problem = Problem(law.build(features), logL, cfg.huber_delta, law.bounds)
    extra = law.extra_starts if law.extra_starts is not None else np.empty((0, law.grid.shape[1]))
    grid = best_starts(problem, law.grid, cfg.starts)
    value, theta, optima = optimise(problem, np.vstack([extra, grid]), keep=cfg.bootstrap_starts)
    rng = np.random.default_rng(cfg.seed)
    n = len(logL)
    samples = np.empty((cfg.bootstrap, len(law.names)))
    for i in range(cfg.bootstrap):
        sub = problem.take(resample(rng, np.arange(n), features, grid.shape[1]))
        samples[i] = law.natural(optimise(sub, optima)[1])
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


_OPTIONS = frozenset(f.name for f in dataclasses.fields(FitConfig))


_LAW_OPTIONS = {
    "tie_exponents": "fit_chinchilla",
    "excess_params": "fit_data_constrained",
    "joint": "fit_data_constrained",
}
"""The options of one fit function alone."""


def _config(what: str, options: dict[str, Any]) -> FitConfig:
    """The validated FitConfig of a fit function's keyword options (a law's own options to that law only)."""
    for name in options:
        if name not in _OPTIONS or _LAW_OPTIONS.get(name, what) != what:
            raise TypeError(f"{what}() got an unexpected keyword argument {name!r}")
    cfg = FitConfig(**options)
    cfg.validate()
    return cfg


@with_serial_blas
def fit_chinchilla(
    N: Any,
    D: Any,
    L: Any,
    **options: Any,
) -> FitResult:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta (Hoffmann et al. approach 3, Besiroglu et al. corrections).

    `options`: FitConfig's fields (bootstrap, seed, huber_delta, level, starts, bootstrap_starts,
    tie_exponents) as keywords.
    """
    cfg = _config("fit_chinchilla", options)
    a = _check_arrays("fit_chinchilla", N=N, D=D, L=L)
    n_params = 4 if cfg.tie_exponents else 5
    if len(a["L"]) < n_params or len(np.unique(a["N"])) < 2 or len(np.unique(a["D"])) < 2:
        raise DataError(
            f"fit_chinchilla: {len(a['L'])} runs with {len(np.unique(a['N']))} model sizes and "
            f"{len(np.unique(a['D']))} token counts; need at least {n_params} runs over 2 or more of each"
        )
    logN, logD = np.log(a["N"]), np.log(a["D"])
    law = _chinchilla_law(logN, logD, cfg.tie_exponents)
    return _fit_law(law, np.column_stack([logN, logD]), np.log(a["L"]), cfg)


@with_serial_blas
def fit_compute(
    C: Any,
    L: Any,
    **options: Any,
) -> FitResult:
    """Fit L(C) = E + A*C^-alpha; with fewer than 4 points the pure power law A*C^-alpha (form "power").

    `options`: FitConfig's fields but tie_exponents, as keywords.
    """
    cfg = _config("fit_compute", options)
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


def _log(x: float) -> float:
    """log x, and -inf for a coefficient a bootstrap fit drove to 0 (exp underflowed): its term vanishes."""
    return math.log(x) if x > 0 else -math.inf


def _fit_decays(
    base: np.ndarray,
    N: np.ndarray,
    D: np.ndarray,
    U: np.ndarray,
    logL: np.ndarray,
    delta: float,
    starts: np.ndarray,
) -> np.ndarray:
    """With E, A, B, alpha, beta fixed, the log R*_D (and log R*_N, where `starts` has two columns) minimising
    the Huber loss: L-BFGS-B from each row of `starts` (log values), the best kept."""
    E, A, B, alpha, beta = base
    excess = starts.shape[1] == 2
    R_D = np.maximum(D / U - 1.0, 0.0)
    log_n = np.log(N)
    if excess:
        usable = unique_params(U, A, B, alpha, beta)
        U_N = np.where(np.isfinite(usable), np.minimum(N, usable), N)
        R_N = N / U_N - 1.0
    n_term = _log(A) - alpha * log_n

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        log_d, dlogd_dlogr = _discount(U, R_D, math.exp(float(x[0])))
        d_term = _log(B) - beta * log_d
        terms = [n_term]
        if excess:
            log_n_eff, dlogn_dlogr = _discount(U_N, R_N, math.exp(float(x[1])))
            terms = [_log(A) - alpha * log_n_eff]
        pred = np.logaddexp(np.logaddexp(terms[0], d_term), _log(E))
        r = pred - logL
        quadratic = np.abs(r) <= delta
        loss = np.where(quadratic, 0.5 * r * r / delta, np.abs(r) - 0.5 * delta)
        psi = np.where(quadratic, r / delta, np.sign(r))
        grad = [float(psi @ (np.exp(d_term - pred) * -beta * dlogd_dlogr))]
        if excess:
            grad.append(float(psi @ (np.exp(terms[0] - pred) * -alpha * dlogn_dlogr)))
        return float(loss.sum()), np.array(grad)

    return best_minimum(objective, starts, [_LOG_R_STAR_BOUNDS] * starts.shape[1], maxiter=2000)


@with_serial_blas
def data_constrained_shortfall(N: Any, D: Any, U: Any) -> str | None:
    """Why L(N, D, U) cannot be fitted to runs of N parameters, D tokens and U unique tokens (arrays), or
    None: stage one needs 5 single-epoch runs over 2 or more sizes and token counts, stage two a run that
    repeats its data. The one check, for fit_data_constrained and for a derisk plan before it trains."""
    N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
    U = np.minimum(np.asarray(U, dtype=float), D)
    single = D <= U * (1 + 1e-9)
    if single.sum() < 5 or len(np.unique(N[single])) < 2 or len(np.unique(D[single])) < 2:
        return (
            f"{int(single.sum())} single-epoch runs (tokens <= unique tokens) over "
            f"{len(np.unique(N[single]))} model sizes and {len(np.unique(D[single]))} token counts; need at "
            "least 5 over 2 or more model sizes and token counts to fit E, A, B, alpha, beta first"
        )
    if single.all():
        return "no run repeats its data (tokens > unique tokens); R*_D is undefined"
    return None


def fit_data_constrained(
    N: Any,
    D: Any,
    U: Any,
    L: Any,
    **options: Any,
) -> FitResult:
    """Fit Muennighoff et al.'s L(N, D, U): Chinchilla on single-epoch runs, then R*_D on all runs.

    Repeated tokens count as effective data D' (see `effective_data`). Parameters are not discounted
    (N' = N) unless `excess_params`: then R*_N is fitted with R*_D, and the parameters beyond the
    compute-optimal size for the unique tokens (`unique_params`) count as the paper's N'; it matters for
    models far larger than their unique data supports.
    `options`: FitConfig's fields but tie_exponents, as keywords.
    """
    cfg = _config("fit_data_constrained", options)
    if cfg.joint and cfg.excess_params:
        raise ConfigError("fit.joint: the joint fit has no R*_N term; leave out excess_params or joint")
    a = _check_arrays("fit_data_constrained", N=N, D=D, U=U, L=L)
    a["U"] = np.minimum(a["U"], a["D"])  # unique tokens read: a single-epoch run reads D of them
    single = a["D"] <= a["U"] * (1 + 1e-9)
    why = data_constrained_shortfall(a["N"], a["D"], a["U"])
    if why:
        raise DataError(f"fit_data_constrained: {why}")
    logL = np.log(a["L"])
    logN, logD = np.log(a["N"]), np.log(a["D"])
    law = _chinchilla_law(logN[single], logD[single], tie=False)
    features = np.column_stack([logN, logD])

    def fit_once(index: np.ndarray, starts: np.ndarray, r_starts: np.ndarray) -> np.ndarray:
        """E, A, B, alpha, beta on the single-epoch runs of `index`, then R*_D (and R*_N) on all of them,
        from the rows of `r_starts` (R*_D, or R*_D and R*_N)."""
        sub_single = index[single[index]]
        problem = Problem(law.build(features[sub_single]), logL[sub_single], cfg.huber_delta, law.bounds)
        theta = optimise(problem, starts)[1]
        base = law.natural(theta)
        runs = (base, a["N"][index], a["D"][index], a["U"][index], logL[index], cfg.huber_delta)
        log_starts = np.array([[math.log(r) for r in row] for row in r_starts])
        return np.append(base, [math.exp(x) for x in _fit_decays(*runs, log_starts)])

    everything = np.arange(len(logL))
    single_idx, repeated_idx = everything[single], everything[~single]
    full = Problem(law.build(features[single]), logL[single], cfg.huber_delta, law.bounds)
    optima = optimise(full, best_starts(full, law.grid, cfg.starts), keep=cfg.bootstrap_starts)[2]
    r_grid = np.array(list(itertools.product(_R_STAR_GRID, repeat=2 if cfg.excess_params else 1)))
    values = fit_once(everything, optima[:1], r_grid)
    names = ("E", "A", "B", "alpha", "beta", "R_D_star") + (("R_N_star",) if cfg.excess_params else ())
    if cfg.joint:
        runs = (a["N"], a["D"], a["U"], logL, cfg.huber_delta)
        joint_starts = _joint_starts(*runs, values, cfg.starts)
        values = _fit_joint(*runs, joint_starts)
        # each resample's refit starts from the full data's optimum, then the two-stage one and the best grid
        # point (bootstrap_starts of joint_starts' rows)
        refit_starts = np.vstack([_to_joint(values)[None, :], joint_starts[: cfg.bootstrap_starts]])
    rng = np.random.default_rng(cfg.seed)
    samples = np.empty((cfg.bootstrap, len(names)))
    for i in range(cfg.bootstrap):
        # Stratified: each resample keeps as many single-epoch runs as the data, so stage 1 always has them.
        index = np.concatenate(
            [resample(rng, single_idx, features, 5), rng.choice(repeated_idx, len(repeated_idx))]
        )
        if cfg.joint:
            samples[i] = _fit_joint(
                a["N"][index], a["D"][index], a["U"][index], logL[index], cfg.huber_delta, refit_starts
            )
        else:
            samples[i] = fit_once(index, optima, values[None, 5:])
    result = FitResult(
        law="data-constrained",
        form=EXCESS_PARAMS_FORM if cfg.excess_params else DATA_CONSTRAINED_FORM,
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
            "joint": cfg.joint,
        },
    )
    resid = np.log(result.predict(N=a["N"], D=a["D"], U=a["U"])) - logL
    result.residual_rms = float(np.sqrt(np.mean(resid**2)))
    return result
