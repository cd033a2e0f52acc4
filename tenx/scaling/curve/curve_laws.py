"""The loss-curve laws: loss against training progress, aware (or not) of the learning-rate schedule.

Every law predicts the loss after n updates as L0 + sum_i c_i * sign_i * column_i(phi), where the c_i >= 0
enter linearly and phi are a few nonlinear parameters (exponents, time constants). The split lets the fit
solve the linear part exactly on a grid of phi to find starting points (fitting.py). Progress variables
are schedule.py's: S1 in millions of peak-learning-rate tokens, r = lr / peak, d_k = r_{k-1} - r_k.

- `power` (schedule-blind baseline): L0 + A * D^-alpha, D = tokens seen (millions). It sees no schedule,
  so it predicts one curve for every schedule of a run length: the gain of the others is measured against it.
- `tissue` (Tissue et al. 2024, "Scaling Law with Learning Rate Annealing"): L0 + A * S1^-alpha - C * S2,
  S2 the annealing area with momentum: m_i = lambda * m_{i-1} + d_i, S2 = (1 - lambda) * sum_i m_i
  = sum_k d_k (1 - lambda^(n - k)). The (1 - lambda) factor only rescales C, so that C is the loss drop
  of a full anneal once the lag has passed. The paper fixes lambda = 0.999 per step for runs of tens of
  thousands of steps; here the lag is a fitted time constant tau in tokens, lambda_k = exp(-tokens_k / tau),
  so it adapts to run length and batch size.
- `tissue-rate`: tissue with the forward area's learning rate raised to a fitted power p,
  S1p = sum_j r_j^p * tokens_j: p = 1 is Tissue et al.'s area, p = 0 counts tokens whatever the rate.
  On the tiny byte-level runs of tests/data/curves the fitted p is 0 to 0.8 (0 on the long runs of the
  smallest model: a higher learning rate learns no faster per token there, only its annealing shows),
  and this law is the most accurate of them across schedules and sizes.
- `tissue-lr`: tissue-rate with the learning rate itself in the forward area, (lr_j / LR_REFERENCE)^p, not
  relative to the run's peak: a run of a lower peak makes less progress per token. Across published runs
  whose peak rate changes with size (bench/published_curves.py) it halves the size extrapolation's mean error.
- `tissue-area`: tissue-rate with the annealing lag counted in peak-rate tokens since each drop (S1 progress)
  instead of tokens: after a drop to a lower rate the gain shows more slowly, as the multi-power law's
  r^-gamma factor says. On the multi-power-law paper's split it halves the worst window (0.48% vs 0.90%).
- `tissue-paper`: tissue with the paper's lambda = 0.999 per step, to show what fitting the lag buys.
- `mpl` (Luo et al. 2025, "A Multi-Power Law for Loss Curve Prediction Across Learning Rate Schedules"):
  L0 + A * S1^-alpha - B * sum_k d_k * (1 - (C * r_k^-gamma * S_k(n) + 1)^-beta), S_k(n) = S1(n) - S1(k)
  the progress made since the drop at update k (their S_W warmup area is inside S1 here).

Size terms (a joint fit across model sizes): L0 is replaced by `separate` levels, one per model size (no
law in N: only the sizes fitted can be predicted), or by the `power` size law L0(N) = E + A_N * N^-a with
N in millions of parameters: Chinchilla's size term, to which S1 at a constant learning rate adds the D
term, so a constant-rate run of the joint law is L(N, D). Every other parameter is shared across sizes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tenx.scaling.curve.schedule import PARAMS_UNIT, PROGRESS_UNIT, Schedule

MAX_DECAY_BLOCKS = 1024
"""Decay updates beyond this many are merged into this many blocks (the annealing sums are smooth in k):
it bounds the work per predicted point whatever the run length (runs of up to 1024 steps are exact)."""
PAPER_LAMBDA = 0.999
LR_REFERENCE = 1e-3
"""`tissue-lr`'s unit of learning rate (any constant: it only rescales the coefficient A)."""
_TINY = 1e-12


@dataclass
class Design:
    """A schedule's progress variables at query records (1-based steps), ready for any law."""

    records: np.ndarray
    """(Q,) the query records"""
    s1: np.ndarray
    """(Q,) S1: peak-learning-rate tokens seen, millions"""
    tokens: np.ndarray
    """(Q,) tokens seen, millions"""
    log_params: float
    """log(N / PARAMS_UNIT)"""
    drop: np.ndarray
    """(K,) learning-rate drops d_k of the decay updates (or blocks of them)"""
    ratio: np.ndarray
    """(K,) r_k after each drop"""
    since_area: np.ndarray
    """(Q, K) S1 progress since drop k (0 where the drop is not yet in the past)"""
    since_tokens: np.ndarray
    """(Q, K) tokens since drop k, millions (0 likewise)"""
    since_steps: np.ndarray
    """(Q, K) updates since drop k (0 likewise)"""
    updates: np.ndarray
    """(Q,) updates n each record has seen"""
    ratio_run: np.ndarray
    """(n_max,) r_j of the updates any record has seen"""
    tokens_run: np.ndarray
    """(n_max,) tokens of those updates, millions"""
    peak: float = 1.0
    """the schedule's peak learning rate (the laws otherwise see only lr / peak)"""


def _decay_blocks(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k, d_k, r_k) of the updates whose learning rate drops; merged into blocks when there are many."""
    k = np.flatnonzero(schedule.drops > 0)
    if len(k) <= MAX_DECAY_BLOCKS:
        return k, schedule.drops[k], schedule.ratio[k]
    groups = np.array_split(np.arange(len(k)), MAX_DECAY_BLOCKS)
    mid = np.array([k[g[len(g) // 2]] for g in groups])
    drop = np.array([schedule.drops[k[g]].sum() for g in groups])
    return mid, drop, schedule.ratio[mid]


def design(schedule: Schedule, records: np.ndarray, params: float) -> Design:
    """The progress variables of `schedule` at `records` for a model of `params` parameters."""
    records = np.asarray(records, dtype=int)
    n = records - 1  # updates the loss at record s has seen
    k, drop, ratio = _decay_blocks(schedule)
    # the drop at update k counts for a loss that has seen updates 0..n-1 with k <= n-1
    past = k[None, :] < n[:, None]
    area_n, area_k = schedule.area[n], schedule.area[k]
    tok_n, tok_k = schedule.cum_tokens[n], schedule.cum_tokens[k]
    since_area = np.where(past, area_n[:, None] - area_k[None, :], 0.0)
    since_tokens = np.where(past, (tok_n[:, None] - tok_k[None, :]) / PROGRESS_UNIT, 0.0)
    since_steps = np.where(past, (n[:, None] - k[None, :]).astype(float), 0.0)
    return Design(
        records=records,
        s1=area_n,
        tokens=tok_n / PROGRESS_UNIT,
        log_params=math.log(params / PARAMS_UNIT),
        drop=drop,
        ratio=ratio,
        since_area=since_area,
        since_tokens=since_tokens,
        since_steps=since_steps,
        updates=n,
        ratio_run=schedule.ratio[: n.max(initial=0)],
        tokens_run=schedule.tokens[: n.max(initial=0)] / PROGRESS_UNIT,
        peak=schedule.peak,
    )


Columns = tuple[np.ndarray, np.ndarray | None]
"""(Q, P) unsigned columns and, when asked for, (Q, P, len(phi)) their derivatives in phi."""


@dataclass(frozen=True)
class Law:
    """One curve law: its nonlinear parameters and the signed columns its linear coefficients multiply."""

    name: str
    form: str
    nonlinear: tuple[str, ...]
    """names of phi (those starting 'log_' are fitted in log and reported as exp)"""
    linear: tuple[str, ...]
    """names of the coefficients after the level (A, C, ...), all >= 0"""
    signs: tuple[float, ...]
    bounds: tuple[tuple[float, float], ...]
    columns: Callable[[np.ndarray, Design, bool], Columns]
    """(phi, design, derivatives?) -> unsigned columns (and their derivatives in phi)"""
    grid: Callable[[float, float], np.ndarray]
    """(median tokens of a run, median S1 of a run), millions -> (G, len(nonlinear)) starting phi"""

    def signed_columns(self, phi: np.ndarray, d: Design, grad: bool = False) -> Columns:
        sign = np.asarray(self.signs)
        cols, dcols = self.columns(phi, d, grad)
        return cols * sign[None, :], (dcols * sign[None, :, None] if dcols is not None else None)


_ALPHAS = (0.1, 0.25, 0.5, 0.8, 1.2)


def _decline(x: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """x^-alpha and its derivative in alpha."""
    x = np.maximum(x, _TINY)
    value = x**-alpha
    return value, -np.log(x) * value


def _power_columns(phi: np.ndarray, d: Design, grad: bool) -> Columns:
    value, dalpha = _decline(d.tokens, phi[0])
    return value[:, None], (dalpha[:, None, None] if grad else None)


def _lagged(since: np.ndarray, rate: float, drop: np.ndarray, grad: bool) -> tuple[np.ndarray, np.ndarray]:
    """sum_k d_k (1 - exp(-rate * since_k)) and its derivative in log(1 / rate) (0 where since is 0)."""
    decay = np.exp(-rate * since)
    value = (1.0 - decay) @ drop
    return value, (-(rate * since * decay) @ drop if grad else value)


def _tissue_columns(phi: np.ndarray, d: Design, grad: bool) -> Columns:
    s1, ds1 = _decline(d.s1, phi[0])
    lag, dlag = _lagged(d.since_tokens, math.exp(-phi[1]), d.drop, grad)
    if not grad:
        return np.stack([s1, lag], axis=1), None
    dcols = np.zeros((len(s1), 2, 2))
    dcols[:, 0, 0], dcols[:, 1, 1] = ds1, dlag
    return np.stack([s1, lag], axis=1), dcols


def _tissue_rate_columns(
    phi: np.ndarray, d: Design, grad: bool, absolute: bool = False, lag_in_area: bool = False
) -> Columns:
    """tissue-rate's columns; `absolute`: the rate itself (relative to LR_REFERENCE) in the forward area
    (tissue-lr); `lag_in_area`: the annealing lag counted in peak-rate tokens since each drop (tissue-area)."""
    alpha, p = phi[0], phi[2]
    log_r = np.log(np.maximum(d.ratio_run, _TINY))
    if absolute:  # a lower peak makes less progress per token
        log_r = log_r + math.log(d.peak / LR_REFERENCE)
    weighted = np.exp(p * log_r) * d.tokens_run
    area = np.concatenate([[0.0], np.cumsum(weighted)])[d.updates]
    s1, ds1 = _decline(area, alpha)
    lag, dlag = _lagged(d.since_area if lag_in_area else d.since_tokens, math.exp(-phi[1]), d.drop, grad)
    if not grad:
        return np.stack([s1, lag], axis=1), None
    darea = np.concatenate([[0.0], np.cumsum(weighted * log_r)])[d.updates]
    dcols = np.zeros((len(s1), 2, 3))
    dcols[:, 0, 0], dcols[:, 1, 1] = ds1, dlag
    dcols[:, 0, 2] = -alpha * s1 / np.maximum(area, _TINY) * darea
    return np.stack([s1, lag], axis=1), dcols


def _tissue_paper_columns(phi: np.ndarray, d: Design, grad: bool) -> Columns:
    s1, ds1 = _decline(d.s1, phi[0])
    lag, _ = _lagged(d.since_steps, -math.log(PAPER_LAMBDA), d.drop, False)
    if not grad:
        return np.stack([s1, lag], axis=1), None
    dcols = np.zeros((len(s1), 2, 1))
    dcols[:, 0, 0] = ds1
    return np.stack([s1, lag], axis=1), dcols


def _mpl_columns(phi: np.ndarray, d: Design, grad: bool) -> Columns:
    alpha, c, beta, gamma = phi[0], math.exp(phi[1]), phi[2], phi[3]
    s1, ds1 = _decline(d.s1, alpha)
    log_r = np.log(np.maximum(d.ratio, _TINY))
    x = c * np.exp(-gamma * log_r)[None, :] * d.since_area
    log1p = np.log1p(x)
    remain = np.exp(-beta * log1p)  # (1 + x)^-beta
    reduction = (1.0 - remain) @ d.drop  # 0 where x = 0: drops not yet in the past
    cols = np.stack([s1, reduction], axis=1)
    if not grad:
        return cols, None
    dx = beta * remain / (1.0 + x) * x  # d G / d log x
    dcols = np.zeros((len(s1), 2, 4))
    dcols[:, 0, 0] = ds1
    dcols[:, 1, 1] = dx @ d.drop
    dcols[:, 1, 2] = (log1p * remain) @ d.drop
    dcols[:, 1, 3] = -(dx * log_r[None, :]) @ d.drop
    return cols, dcols


def _grid(*axes: tuple[float, ...]) -> np.ndarray:
    return np.array(list(itertools.product(*axes)), dtype=float)


def _rate_law(name: str, form: str, options: dict[str, bool]) -> Law:
    """tissue-rate or one of its variants (_tissue_rate_columns' options)."""
    lag_in_area = options.get("lag_in_area", False)
    return Law(
        name,
        form,
        ("alpha", "log_tau", "p"),
        ("A", "C"),
        (1.0, -1.0),
        ((0.01, 3.0), (math.log(1e-6), math.log(1e6)), (0.0, 2.0)),
        lambda phi, d, grad: _tissue_rate_columns(phi, d, grad, **options),
        lambda tok, s1: _grid(
            _ALPHAS,
            tuple(math.log((s1 if lag_in_area else tok) * f) for f in (0.01, 0.04, 0.15, 0.5)),
            (0.0, 0.5, 1.0),
        ),
    )


LAWS: dict[str, Law] = {
    law.name: law
    for law in (
        Law(
            "power",
            "L0 + A*D^-alpha (D: tokens; schedule-blind)",
            ("alpha",),
            ("A",),
            (1.0,),
            ((0.01, 3.0),),
            _power_columns,
            lambda tok, s1: _grid(_ALPHAS),
        ),
        Law(
            "tissue",
            "L0 + A*S1^-alpha - C*S2, S2 = sum_k d_k (1 - exp(-tokens since k / tau))",
            ("alpha", "log_tau"),
            ("A", "C"),
            (1.0, -1.0),
            ((0.01, 3.0), (math.log(1e-6), math.log(1e6))),
            _tissue_columns,
            lambda tok, s1: _grid(_ALPHAS, tuple(math.log(tok * f) for f in (0.01, 0.04, 0.15, 0.5))),
        ),
        _rate_law("tissue-rate", "L0 + A*S1p^-alpha - C*S2, S1p = sum_j r_j^p tokens_j, S2 as tissue's", {}),
        _rate_law(
            "tissue-lr",
            "L0 + A*S1p^-alpha - C*S2, S1p = sum_j (lr_j / 1e-3)^p tokens_j, S2 as tissue's",
            {"absolute": True},
        ),
        _rate_law(
            "tissue-area",
            "tissue-rate with the lag in peak-rate tokens since each drop (a lower rate anneals slower)",
            {"lag_in_area": True},
        ),
        Law(
            "tissue-paper",
            f"L0 + A*S1^-alpha - C*S2, S2 = sum_k d_k (1 - {PAPER_LAMBDA}^(steps since k))",
            ("alpha",),
            ("A", "C"),
            (1.0, -1.0),
            ((0.01, 3.0),),
            _tissue_paper_columns,
            lambda tok, s1: _grid(_ALPHAS),
        ),
        Law(
            "mpl",
            "L0 + A*S1^-alpha - B*sum_k d_k (1 - (C r_k^-gamma S_k + 1)^-beta)",
            ("alpha", "log_C", "beta", "gamma"),
            ("A", "B"),
            (1.0, -1.0),
            ((0.01, 3.0), (math.log(1e-6), math.log(1e8)), (0.01, 5.0), (0.0, 3.0)),
            _mpl_columns,
            lambda tok, s1: _grid(
                _ALPHAS, tuple(math.log(f / s1) for f in (3.0, 30.0, 300.0)), (0.4, 1.0), (0.0, 0.6)
            ),
        ),
    )
}
DEFAULT_LAW = "tissue-rate"
"""The law the fit functions use unless told otherwise: the most accurate across schedules and sizes on
tests/data/curves (its README has the figures)."""
EXTRAPOLATION_LAW = "power"
"""The law `extrapolate_run` uses unless told otherwise. From the first 30% of each run of
tests/data/curves, with a prior from the other runs, the schedule-blind law was off by 2.5% on average
over the rest of the curve (final loss 4.2% on average, 10.8% at worst) against tissue-rate's 3.7%
(6.5%, 14.4%): with so little of the decay seen, the annealing coefficient comes from the prior, and a
ladder of shorter runs of other sizes gets it wrong for a long run. Pass law= to choose."""
DEFAULT_PRIORS: dict[str, dict[str, float]] = {
    "power": {"alpha": 0.2808},
    "tissue": {"log_C": -1.542, "alpha": 0.193, "log_tau": -3.437},
    "tissue-rate": {"log_C": -1.672, "alpha": 0.2034, "log_tau": -12.41, "p": 0.7876},
    "tissue-paper": {"log_C": -0.8564, "alpha": 0.2634},
    "mpl": {"log_B": -1.55, "alpha": 0.1958, "log_C": 1.706, "beta": 2.992, "gamma": 2.83},
}
"""Each law's shape (internal names: CurveFit.names) fitted to every curve of tests/data/curves
(`prior_from(fit_curves(read_curves("tests/data/curves"), law, bootstrap=0))`): the prior of a
self-extrapolation given no fit of other runs. Byte-level stdlib runs of 0.1M-3.4M parameters: pass a
fit of your own ladder for anything else."""
SIZE_LAWS = ("separate", "power")
SIZE_EXPONENTS = (0.1, 0.3, 0.6, 1.0)
SIZE_EXPONENT_BOUNDS = (0.0, 3.0)


def size_columns(size_law: str, a: float, d: Design, size_index: int, n_sizes: int) -> np.ndarray:
    """(Q, levels) columns of the level: one indicator per size (`separate`), or [1, N^-a] (`power`)."""
    q = len(d.records)
    if size_law == "power":
        return np.stack([np.ones(q), np.full(q, math.exp(-a * d.log_params))], axis=1)
    out = np.zeros((q, n_sizes))
    out[:, size_index] = 1.0
    return out
