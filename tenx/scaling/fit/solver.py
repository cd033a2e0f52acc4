"""The optimiser every law shares: log L = logsumexp_k(T[n, k, :] @ theta), Huber loss on the residuals,
L-BFGS-B from a grid of starts, bootstrap resampling of the runs; and single-threaded BLAS while it runs."""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from scipy.optimize import minimize

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
def serial_blas() -> Iterator[None]:
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


def with_serial_blas(fn: _F) -> _F:
    """`fn` run under `serial_blas` (the public fit functions are all wrapped so)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with serial_blas():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    """log(sum(exp(x))) along `axis`, stable (scipy's generic version costs more than the whole fit)."""
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.squeeze(m, axis=axis) + np.log(np.sum(np.exp(x - m), axis=axis))


@dataclass
class Problem:
    """Data of one fit: term matrix T (n, k, p) and observed log losses y (n,)."""

    T: np.ndarray
    y: np.ndarray
    delta: float
    bounds: list[tuple[float | None, float | None]]

    def take(self, index: np.ndarray) -> Problem:
        return Problem(self.T[index], self.y[index], self.delta, self.bounds)

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


def _lbfgsb(problem: Problem, start: np.ndarray) -> tuple[float, np.ndarray]:
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


def best_starts(problem: Problem, grid: np.ndarray, count: int) -> np.ndarray:
    """The `count` grid points with the lowest objective (every point when count is 0)."""
    if count == 0 or count >= len(grid):
        return grid
    values = np.concatenate(
        [problem.batch_objective(chunk) for chunk in np.array_split(grid, 1 + len(grid) // 512)]
    )
    return grid[np.argsort(values, kind="stable")[:count]]


def optimise(problem: Problem, starts: np.ndarray, keep: int = 0) -> tuple[float, np.ndarray, np.ndarray]:
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


def resample(rng: np.random.Generator, index: np.ndarray, features: np.ndarray, n_params: int) -> np.ndarray:
    """Bootstrap draw of `index`, redrawn while it could not identify the law (too few distinct runs, or a
    single value of some input): such a resample has no optimum, only a ridge."""
    for _ in range(100):
        draw = rng.choice(index, len(index))
        sub = features[draw]
        if len(np.unique(sub, axis=0)) >= n_params and all(len(np.unique(col)) >= 2 for col in sub.T):
            return draw
    return draw


def best_minimum(
    objective: Callable[[np.ndarray], tuple[float, np.ndarray]],
    starts: np.ndarray,
    bounds: list[tuple[float | None, float | None]],
    maxiter: int,
) -> np.ndarray:
    """The lowest of L-BFGS-B's minima of `objective` (its value and gradient) from each row of `starts`."""
    best_value, best_x = float("inf"), starts[0]
    for start in starts:
        res = minimize(
            objective,
            np.array(start, dtype=float),
            jac=True,
            method="L-BFGS-B",
            bounds=bounds,
            options={"ftol": 1e-14, "gtol": 1e-10, "maxiter": maxiter},
        )
        if res.fun < best_value:
            best_value, best_x = float(res.fun), np.asarray(res.x, dtype=float)
    return np.asarray(best_x, dtype=float)
