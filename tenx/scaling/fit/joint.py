"""The data-constrained law fitted jointly (FitConfig.joint): E, A, B, alpha, beta and R*_D together on every
run, from the two-stage optimum and the best points of a grid (tenx.scaling.fit.laws.fit_data_constrained)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np

from tenx.scaling.fit.repetition import discount as _discount
from tenx.scaling.fit.solver import best_minimum

# the bounds of the fitted parameters and Hoffmann et al.'s grid of starting points (uncentred: a = log A,
# b = log B, e = log E); tenx.scaling.fit.laws fits every law from them
_LOG_E_BOUNDS = (-10.0, 10.0)
_EXPONENT_BOUNDS = (0.0, 5.0)
_LOG_R_STAR_BOUNDS = (math.log(1e-2), math.log(1e6))
_R_STAR_GRID = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1000.0)
_HOFFMANN_GRID = {
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5),
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
}


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _joint_objective(
    N: np.ndarray, D: np.ndarray, U: np.ndarray, logL: np.ndarray, delta: float
) -> Callable[[np.ndarray], tuple[float, np.ndarray]]:
    """The Huber loss of log L(N, D, U) against logL, and its gradient, in x = (log E, log A, log B, alpha,
    beta, log R*_D)."""
    R_D = np.maximum(D / U - 1.0, 0.0)
    log_n = np.log(N)

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        log_e, log_a, log_b, alpha, beta, log_r = (float(v) for v in x)
        log_d, dlogd_dlogr = _discount(U, R_D, math.exp(log_r))
        n_term, d_term = log_a - alpha * log_n, log_b - beta * log_d
        pred = np.logaddexp(np.logaddexp(n_term, d_term), log_e)
        r = pred - logL
        quadratic = np.abs(r) <= delta
        loss = np.where(quadratic, 0.5 * r * r / delta, np.abs(r) - 0.5 * delta)
        psi = np.where(quadratic, r / delta, np.sign(r))
        w_e, w_n, w_d = np.exp(log_e - pred), np.exp(n_term - pred), np.exp(d_term - pred)
        grad = [psi @ w_e, psi @ w_n, psi @ w_d, -(psi @ (w_n * log_n)), -(psi @ (w_d * log_d))]
        grad.append(psi @ (w_d * -beta * dlogd_dlogr))
        return float(loss.sum()), np.array(grad, dtype=float)

    return objective


_JOINT_BOUNDS = [
    _LOG_E_BOUNDS,
    (None, None),
    (None, None),
    _EXPONENT_BOUNDS,
    _EXPONENT_BOUNDS,
    _LOG_R_STAR_BOUNDS,
]


def _to_joint(values: np.ndarray) -> np.ndarray:
    """Named (E, A, B, alpha, beta, R*_D) -> the joint fit's x (module: _joint_objective)."""
    E, A, B, alpha, beta, r = (float(v) for v in values[:6])
    return np.array([_log(E), _log(A), _log(B), alpha, beta, math.log(r)])


def _joint_starts(
    N: np.ndarray,
    D: np.ndarray,
    U: np.ndarray,
    logL: np.ndarray,
    delta: float,
    two_stage: np.ndarray,
    count: int,
) -> np.ndarray:
    """Where the joint fit starts (in its x): the two-stage optimum, then the `count` points (64 at least) of
    Hoffmann et al.'s grid crossed with the R*_D grid whose loss is lowest (every point is evaluated)."""
    g = _HOFFMANN_GRID
    grid = np.array(
        list(itertools.product(g["e"], g["a"], g["b"], g["alpha"], g["beta"], np.log(_R_STAR_GRID))),
        dtype=float,
    )
    R_D = np.maximum(D / U - 1.0, 0.0)
    log_d = np.stack([_discount(U, R_D, r)[0] for r in _R_STAR_GRID])  # (R*, n)
    which = np.searchsorted(np.log(_R_STAR_GRID), grid[:, 5])  # each grid row's R* index
    n_term = grid[:, 1:2] - grid[:, 3:4] * np.log(N)[None, :]
    d_term = grid[:, 2:3] - grid[:, 4:5] * log_d[which]
    r = np.logaddexp(np.logaddexp(n_term, d_term), grid[:, 0:1]) - logL[None, :]
    losses = np.where(np.abs(r) <= delta, 0.5 * r * r / delta, np.abs(r) - 0.5 * delta).sum(axis=1)
    best = grid[np.argsort(losses, kind="stable")[: max(count, 64)]]
    return np.vstack([_to_joint(two_stage)[None, :], best])


def _fit_joint(
    N: np.ndarray, D: np.ndarray, U: np.ndarray, logL: np.ndarray, delta: float, starts: np.ndarray
) -> np.ndarray:
    """E, A, B, alpha, beta, R*_D minimising the Huber loss of every run together: L-BFGS-B from each row of
    `starts` (the joint x), the best kept, as named values."""
    best_x = best_minimum(_joint_objective(N, D, U, logL, delta), starts, _JOINT_BOUNDS, maxiter=5000)
    log_e, log_a, log_b, alpha, beta, log_r = best_x
    return np.array([math.exp(log_e), math.exp(log_a), math.exp(log_b), alpha, beta, math.exp(log_r)])
