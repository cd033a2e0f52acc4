"""Fitting a curve law to one or many loss curves, with a bootstrap over segments of the curves.

Smoothing: the per-step training loss is one batch's loss, noisy by 5-6% on the runs of tests/data/curves,
so each curve's records after warmup are cut into (at most) `windows` windows whose step ranges grow
geometrically, and the fit matches each window's mean loss with the law averaged over up to 5 records
spread over the window. Short windows where the loss falls fast keep that averaging exact to 0.3% of L0
on synthetic curves (equal windows biased L0 by 1%). A window mean of n records has 1/n of one step's
noise variance, so windows are weighted by n, normalised within each curve: a long run does not outweigh
a short one.

Objective: log residuals (relative errors) under scipy's soft-L1 loss (robust to the odd loss spike),
minimised by `least_squares` (trust-region reflective, bounds) from the best `starts` points of a grid over
the nonlinear parameters, at each of which the linear coefficients are solved exactly (non-negative least
squares). The bootstrap resamples contiguous segments of windows within each curve (keeping every curve
and size in every resample) and refits from the optimum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from dataclasses import field as dc_field
from typing import Any

import numpy as np
from scipy.optimize import least_squares, nnls

from tenx.errors import ConfigError
from tenx.scaling.curve.curve_laws import (
    DEFAULT_LAW,
    LAWS,
    SIZE_EXPONENT_BOUNDS,
    SIZE_EXPONENTS,
    SIZE_LAWS,
    Design,
    Law,
    design,
    size_columns,
)
from tenx.scaling.curve.schedule import PARAMS_UNIT, PROGRESS_UNIT, Curve
from tenx.scaling.fit.solver import with_serial_blas
from tenx.utils.text import counted

SAMPLES_PER_WINDOW = 5
MAX_EVALUATIONS = 400
"""least_squares evaluations per start: a fit that has not converged by then sits on a flat ridge (a level
against an exponent), where more iterations move parameters but not the curve."""
MIN_SIZES_FOR_SIZE_LAW = 3


@dataclass
class CurveFit:
    """A fitted curve law: named parameters with bootstrap intervals, the noise, and what it was fitted on.

    `theta` (internal: log of each linear coefficient, then the nonlinear parameters) and `samples` (its
    bootstrap draws) are what predict.py evaluates; everything here is JSON-serialisable.
    """

    law: str
    form: str
    size_law: str
    sizes: list[float]
    """the model sizes N fitted (for `separate`, the size of each level, in order)"""
    names: list[str]
    theta: list[float]
    samples: list[list[float]]
    params: dict[str, float]
    intervals: dict[str, list[float]]
    window_sigma: float
    """RMS log residual of the smoothed points: misfit plus what is left of the noise after smoothing"""
    step_sigma: float
    """scatter (log) of one step's loss about the smooth curve: batch-to-batch noise"""
    points: int
    curves: list[str]
    level: float = 0.95
    fixed: dict[str, float] = dc_field(default_factory=dict)
    prior: dict[str, list[float]] = dc_field(default_factory=dict)

    def to_dict(self, samples: bool = False) -> dict[str, Any]:
        """Plain data; the bootstrap draws only when asked for."""
        out = asdict(self)
        if not samples:
            out.pop("samples")
        return out

    @property
    def law_spec(self) -> Law:
        return LAWS[self.law]


@dataclass
class _Block:
    """One curve as the fit sees it: the law at sample records, averaged into window means."""

    name: str
    design: Design
    average: np.ndarray  # (W, Q)
    y: np.ndarray  # (W,) window mean loss
    weight: np.ndarray  # (W,) square root of each window's weight
    size: int  # index into the fit's sizes

    def take(self, windows: np.ndarray) -> _Block:
        return _Block(
            self.name, self.design, self.average[windows], self.y[windows], self.weight[windows], self.size
        )


def windows_of(curve: Curve, windows: int) -> list[np.ndarray]:
    """The curve's record indices after warmup, cut into at most `windows` runs of at least 2 records
    whose step ranges grow geometrically (short where the loss falls fast, long where it is nearly flat).
    A validation curve's records carry no batch noise to average away: there a window may hold one."""
    least = 2 if curve.quantity == "loss" else 1
    keep = np.flatnonzero(curve.steps >= curve.schedule.first_step)
    if len(keep) < least:
        return []
    steps = curve.steps[keep]
    edges = np.geomspace(steps[0], steps[-1] + 1, windows + 1)
    label = np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, windows - 1)
    parts: list[np.ndarray] = []
    for i in np.unique(label):
        part = keep[label == i]
        if parts and len(parts[-1]) < least:
            parts[-1] = np.concatenate([parts[-1], part])
        else:
            parts.append(part)
    if len(parts) > 1 and len(parts[-1]) < least:
        parts[-2] = np.concatenate([parts[-2], parts.pop()])
    return parts


def _block(curve: Curve, windows: int, size: int) -> _Block:
    parts = windows_of(curve, windows)
    samples = [
        curve.steps[
            w[np.unique(np.linspace(0, len(w) - 1, min(len(w), SAMPLES_PER_WINDOW)).round().astype(int))]
        ]
        for w in parts
    ]
    records = np.concatenate(samples)
    average = np.zeros((len(parts), len(records)))
    start = 0
    for i, s in enumerate(samples):
        average[i, start : start + len(s)] = 1.0 / len(s)
        start += len(s)
    y = np.array([curve.loss[w].mean() for w in parts])
    # a window mean of n records has 1/n of one step's noise variance: weight n, normalised per curve
    counts = np.array([len(w) for w in parts], dtype=float)
    weight = np.sqrt(counts / counts.mean())
    return _Block(curve.name, design(curve.schedule, records, curve.params), average, y, weight, size)


def step_scatter(curves: Sequence[Curve], windows: int) -> float:
    """Pooled scatter of log loss about a straight line within each window (batch noise, not the trend)."""
    total, dof = 0.0, 0
    for c in curves:
        for w in windows_of(c, windows):
            if len(w) < 3:
                continue
            x, y = c.steps[w].astype(float), np.log(c.loss[w])
            coef = np.polyfit(x - x.mean(), y, 1)
            total += float(np.sum((y - np.polyval(coef, x - x.mean())) ** 2))
            dof += len(w) - 2
    return math.sqrt(total / dof) if dof else 0.0


class _Problem:
    """The blocks of a fit and the map from the free parameter vector to log residuals."""

    def __init__(self, law: Law, size_law: str, sizes: list[float], blocks: list[_Block]):
        self.law, self.size_law, self.sizes, self.blocks = law, size_law, sizes, blocks
        self.levels = 2 if size_law == "power" else len(sizes)
        self.n_linear = self.levels + len(law.linear)
        self.names = (
            (["log_E", "log_A_N"] if size_law == "power" else [f"log_L0[{i}]" for i in range(len(sizes))])
            + [f"log_{n}" for n in law.linear]
            + (["a"] if size_law == "power" else [])
            + list(law.nonlinear)
        )
        self.bounds = (
            [(-30.0, 10.0)] * self.n_linear
            + ([SIZE_EXPONENT_BOUNDS] if size_law == "power" else [])
            + list(law.bounds)
        )

    def split(self, theta: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
        """(linear coefficients, size exponent, law's phi) of a full parameter vector."""
        linear = np.exp(theta[: self.n_linear])
        rest = theta[self.n_linear :]
        if self.size_law == "power":
            return linear, float(rest[0]), rest[1:]
        return linear, 0.0, rest

    def columns(self, a: float, block: _Block, law_cols: np.ndarray) -> np.ndarray:
        """(Q, n_linear) signed columns of one block at its sample records."""
        level = size_columns(self.size_law, a, block.design, block.size, len(self.sizes))
        return np.concatenate([level, law_cols], axis=1)

    def evaluate(self, theta: np.ndarray, blocks: list[_Block], grad: bool) -> tuple[np.ndarray, np.ndarray]:
        """Log residuals of the window means and (when `grad`) their Jacobian in theta."""
        linear, a, phi = self.split(theta)
        res, jac = [], []
        for b in blocks:
            law_cols, dlaw = self.law.signed_columns(phi, b.design, grad)
            X = self.columns(a, b, law_cols)
            pred = np.maximum(b.average @ (X @ linear), 1e-9)
            res.append((np.log(pred) - np.log(b.y)) * b.weight)
            if grad:
                assert dlaw is not None
                J = np.empty((X.shape[0], len(theta)))
                J[:, : self.n_linear] = X * linear[None, :]
                col = self.n_linear
                if self.size_law == "power":
                    J[:, col] = -b.design.log_params * X[:, 1] * linear[1]
                    col += 1
                J[:, col:] = np.einsum("qpj,p->qj", dlaw, linear[self.levels :])
                jac.append((b.average @ J) * (b.weight / pred)[:, None])
        return np.concatenate(res), (np.concatenate(jac) if grad else np.empty(0))

    def residuals(self, theta: np.ndarray, blocks: list[_Block]) -> np.ndarray:
        return self.evaluate(theta, blocks, False)[0]


def _starts(problem: _Problem, count: int) -> list[np.ndarray]:
    """The `count` best grid points, each with its exact non-negative linear coefficients."""
    blocks = problem.blocks
    tokens = float(np.median([b.design.tokens.max() for b in blocks]))
    s1 = float(np.median([b.design.s1.max() for b in blocks]))
    scored = []
    exponents = SIZE_EXPONENTS if problem.size_law == "power" else (0.0,)
    y = np.concatenate([b.y for b in blocks])
    w = np.concatenate([b.weight for b in blocks])
    for phi in problem.law.grid(tokens, s1):
        law_cols = [problem.law.signed_columns(phi, b.design)[0] for b in blocks]
        for a in exponents:
            X = np.concatenate([b.average @ problem.columns(a, b, lc) for b, lc in zip(blocks, law_cols)])
            coef, _ = nnls(X * (w / y)[:, None], w)
            pred = X @ coef
            if np.any(pred <= 0):
                continue
            sse = float(np.sum((w * np.log(pred / y)) ** 2))
            theta = np.concatenate(
                [np.log(np.maximum(coef, 1e-12)), [a] if problem.size_law == "power" else [], phi]
            )
            scored.append((sse, theta))
    scored.sort(key=lambda s: s[0])
    return [t for _, t in scored[:count]]


def _clip(theta: np.ndarray, bounds: list[tuple[float, float]]) -> np.ndarray:
    lo = np.array([b[0] for b in bounds]) + 1e-9
    hi = np.array([b[1] for b in bounds]) - 1e-9
    return np.clip(theta, lo, hi)


def _solve(
    problem: _Problem,
    blocks: list[_Block],
    start: np.ndarray,
    free: np.ndarray,
    delta: float,
    prior: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[float, np.ndarray]:
    """One bounded robust least-squares run over the free parameters; (cost, full theta).

    prior: (centre, sd) of every parameter (sd inf: none); a deviation of one sd costs as much as one
    smoothed point off by `delta`."""
    bounds = [problem.bounds[i] for i in np.flatnonzero(free)]
    full = start.copy()
    centre, sd = prior if prior is not None else (full, np.full(len(full), np.inf))
    rows = np.flatnonzero(np.isfinite(sd) & free)
    scale = delta / sd[rows]
    prior_jac = np.zeros((len(rows), len(full)))
    prior_jac[np.arange(len(rows)), rows] = scale

    def residuals(x: np.ndarray) -> np.ndarray:
        full[free] = x
        return np.concatenate([problem.evaluate(full, blocks, False)[0], (full[rows] - centre[rows]) * scale])

    def jacobian(x: np.ndarray) -> np.ndarray:
        full[free] = x
        return np.concatenate([problem.evaluate(full, blocks, True)[1], prior_jac])[:, free]

    x0 = _clip(start[free], bounds)
    res = least_squares(
        residuals,
        x0,
        jac=jacobian,
        bounds=([b[0] for b in bounds], [b[1] for b in bounds]),
        loss="soft_l1",
        f_scale=delta,
        x_scale="jac",
        xtol=1e-9,
        ftol=1e-9,
        max_nfev=MAX_EVALUATIONS,
    )
    theta = start.copy()
    theta[free] = res.x
    return float(res.cost), theta


def _natural(problem: _Problem, theta: np.ndarray) -> dict[str, float]:
    """Named parameters in natural units (coefficients as values, tau in tokens, N-level per size)."""
    out: dict[str, float] = {}
    for name, value in zip(problem.names, theta):
        if name.startswith("log_L0["):
            i = int(name[len("log_L0[") : -1])
            out[f"L0[N={problem.sizes[i]:.6g}]"] = math.exp(value)
        elif name == "log_tau":
            out["tau_tokens"] = math.exp(value) * PROGRESS_UNIT
        elif name.startswith("log_"):
            out[name[4:]] = math.exp(value)
        else:
            out[name] = float(value)
    return out


def _check(curves: Sequence[Curve], law: str, size_law: str, windows: int) -> tuple[Law, str, list[float]]:
    if law not in LAWS:
        raise ConfigError(f"curve law {law!r} is not one of {', '.join(LAWS)}")
    if not curves:
        raise ConfigError("no curves to fit: give at least one run's loss curve")
    if windows < 2:
        raise ConfigError(f"windows: must be at least 2, got {windows}")
    sizes = sorted({float(c.params) for c in curves})
    if size_law == "auto":
        size_law = "power" if len(sizes) >= MIN_SIZES_FOR_SIZE_LAW else "separate"
    if size_law not in SIZE_LAWS:
        raise ConfigError(f"size law {size_law!r} is not one of auto, {', '.join(SIZE_LAWS)}")
    if size_law == "power" and len(sizes) < MIN_SIZES_FOR_SIZE_LAW:
        raise ConfigError(
            f"the size law L0(N) = E + A_N*N^-a needs curves of at least {MIN_SIZES_FOR_SIZE_LAW} model sizes, "
            f"got {len(sizes)} ({', '.join(f'{s:.4g}' for s in sizes)}); add sizes or use size_law='separate'"
        )
    for c in curves:
        after = int(np.sum(c.steps >= c.schedule.first_step))
        least = 4 if c.quantity == "loss" else 2  # a validation record needs no smoothing
        if after < least:
            raise ConfigError(
                f"curve {c.name}: {after} records after warmup (warmup ends at step "
                f"{c.schedule.first_step - 1}); a curve needs at least {least} to give 2 smoothed points"
            )
    return LAWS[law], size_law, sizes


@with_serial_blas
def fit_curves(
    curves: Sequence[Curve],
    law: str = DEFAULT_LAW,
    *,
    size_law: str = "auto",
    windows: int = 48,
    starts: int = 6,
    bootstrap: int = 30,
    segments: int = 6,
    seed: int = 0,
    level: float = 0.95,
    delta: float = 0.02,
    fixed: dict[str, float] | None = None,
    prior: dict[str, tuple[float, float]] | None = None,
) -> CurveFit:
    """Fit `law` to the loss curves jointly: shared shape, a level per size or the size law in N.

    size_law: 'separate' (a level L0 per model size), 'power' (L0(N) = E + A_N N^-a, needs 3 sizes) or
    'auto' (power from 3 sizes on). fixed: internal parameter names (`CurveFit.names`, e.g. 'alpha',
    'log_tau', 'log_C') held at the given values. prior: internal names -> (centre, sd), a soft prior
    (see `_solve`) that the data override where they are informative; fitting starts from its centres.
    bootstrap: resamples of `segments` contiguous segments
    of each curve's windows (0: no intervals). delta: soft-L1 scale of the log residuals.
    """
    spec, size_law, sizes = _check(curves, law, size_law, windows)
    blocks = [_block(c, windows, sizes.index(float(c.params))) for c in curves]
    problem = _Problem(spec, size_law, sizes, blocks)
    fixed, soft = dict(fixed or {}), dict(prior or {})
    for what, given in (("fixed", fixed), ("prior", soft)):
        unknown = sorted(set(given) - set(problem.names))
        if unknown:
            raise ConfigError(
                f"{what}: {', '.join(unknown)} are not parameters of this fit ({', '.join(problem.names)})"
            )
    free = np.array([n not in fixed for n in problem.names])
    unpinned = int(sum(n not in fixed and n not in soft for n in problem.names))
    points = sum(len(b.y) for b in blocks)
    if points < unpinned + 2:
        raise ConfigError(
            f"curve law {law} ({size_law} sizes) has {unpinned} free parameters and needs at least "
            f"{unpinned + 2} smoothed points (windows of 2 or more records after warmup); the "
            f"{counted(len(curves), 'curve')} give {points}: add records or curves, or fix parameters"
        )
    centre = np.array([soft.get(n, (0.0, math.inf))[0] for n in problem.names])
    sd = np.array([soft.get(n, (0.0, math.inf))[1] for n in problem.names], dtype=float)
    penalty = (centre, sd) if soft else None
    candidates = _starts(problem, starts)
    if not candidates:
        raise ConfigError(f"curve law {law}: no starting point gives a positive loss on these curves")
    index = {n: i for i, n in enumerate(problem.names)}
    for theta in candidates:
        for name, value in [*((n, c) for n, (c, _) in soft.items()), *fixed.items()]:
            theta[index[name]] = value
    results = sorted(
        (_solve(problem, blocks, t, free, delta, penalty) for t in candidates), key=lambda r: r[0]
    )
    theta = results[0][1]
    resid = problem.residuals(theta, blocks)
    samples = _bootstrap(problem, theta, free, delta, bootstrap, segments, seed, penalty)
    intervals = {}
    if samples:
        nat = [_natural(problem, s) for s in samples]
        q = (1 - level) / 2
        for name in nat[0]:
            vals = np.array([n[name] for n in nat])
            intervals[name] = [float(np.quantile(vals, q)), float(np.quantile(vals, 1 - q))]
    return CurveFit(
        law=law,
        form=spec.form,
        size_law=size_law,
        sizes=sizes,
        names=problem.names,
        theta=[float(t) for t in theta],
        samples=[[float(v) for v in s] for s in samples],
        params=_natural(problem, theta),
        intervals=intervals,
        window_sigma=float(np.sqrt(np.mean(resid**2))),
        step_sigma=step_scatter(curves, windows),
        points=points,
        curves=[c.name for c in curves],
        level=level,
        fixed=fixed,
        prior={n: list(v) for n, v in soft.items()},
    )


def _bootstrap(
    problem: _Problem,
    theta: np.ndarray,
    free: np.ndarray,
    delta: float,
    count: int,
    segments: int,
    seed: int,
    prior: tuple[np.ndarray, np.ndarray] | None,
) -> list[np.ndarray]:
    """Refits to resampled segments of each curve. With a soft prior each draw also moves the prior's
    centres by a draw of their own spread (randomize-then-optimize), so that what the prior holds (the
    shape of a curve seen only in its first part) carries its uncertainty into the band."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        blocks = []
        for b in problem.blocks:
            parts = np.array_split(np.arange(len(b.y)), min(segments, len(b.y)))
            pick = rng.integers(0, len(parts), len(parts))
            blocks.append(b.take(np.concatenate([parts[i] for i in pick])))
        drawn = prior
        if prior is not None:
            centre, sd = prior
            finite = np.isfinite(sd)
            moved = centre.copy()
            moved[finite] += sd[finite] * rng.standard_normal(int(finite.sum()))
            drawn = (moved, sd)
        out.append(_solve(problem, blocks, theta, free, delta, drawn)[1])
    return out


def log_predict(fit: CurveFit, d: Design, theta: Sequence[float] | None = None) -> np.ndarray:
    """log of the law's loss at the design's records, for `theta` (default: the fit's)."""
    spec = LAWS[fit.law]
    t = np.asarray(fit.theta if theta is None else theta, dtype=float)
    levels = 2 if fit.size_law == "power" else len(fit.sizes)
    n_linear = levels + len(spec.linear)
    linear = np.exp(t[:n_linear])
    rest = t[n_linear:]
    a, phi = (float(rest[0]), rest[1:]) if fit.size_law == "power" else (0.0, rest)
    params = math.exp(d.log_params) * PARAMS_UNIT
    if fit.size_law == "power":
        level = size_columns("power", a, d, 0, 0)
    else:
        match = [i for i, n in enumerate(fit.sizes) if math.isclose(n, params, rel_tol=1e-9)]
        if not match:
            raise ConfigError(
                f"this {fit.law} fit has a level per fitted size ({', '.join(f'{s:.6g}' for s in fit.sizes)}) "
                f"and no law in N, so it cannot predict a model of {params:.6g} parameters; fit curves of at "
                f"least {MIN_SIZES_FOR_SIZE_LAW} sizes (size_law='power')"
            )
        level = size_columns("separate", 0.0, d, match[0], len(fit.sizes))
    pred = np.concatenate([level, spec.signed_columns(phi, d)[0]], axis=1) @ linear
    return np.log(np.maximum(pred, 1e-9))


def fit_from_params(law: str, params: dict[str, float], sizes: Sequence[float] = ()) -> CurveFit:
    """A CurveFit holding given parameters (to draw curves from a law, or to predict with published values).

    `params` are CurveFit.params's names: L0 (one size) or E, A_N and a (the size law, with `sizes` the
    model sizes it spans; any three), then the law's (A, alpha, C, tau_tokens for tissue; A, B, alpha, C,
    beta, gamma for mpl).
    """
    if law not in LAWS:
        raise ConfigError(f"curve law {law!r} is not one of {', '.join(LAWS)}")
    size_law = "power" if "E" in params else "separate"
    sizes = [float(s) for s in sizes] or [PARAMS_UNIT]
    problem = _Problem(LAWS[law], size_law, sizes if size_law == "power" else sizes[:1], [])
    theta = []
    for name in problem.names:
        key = {"log_tau": "tau_tokens"}.get(
            name, "L0" if name.startswith("log_L0[") else name.removeprefix("log_")
        )
        if key not in params:
            raise ConfigError(
                f"curve law {law}: parameter {key} is missing (needs {', '.join(problem.names)})"
            )
        value = params[key] / PROGRESS_UNIT if key == "tau_tokens" else params[key]
        theta.append(math.log(value) if name.startswith("log_") else float(value))
    return CurveFit(
        law=law,
        form=LAWS[law].form,
        size_law=size_law,
        sizes=problem.sizes,
        names=problem.names,
        theta=theta,
        samples=[],
        params=_natural(problem, np.array(theta)),
        intervals={},
        window_sigma=0.0,
        step_sigma=0.0,
        points=0,
        curves=[],
    )
