"""Muennighoff et al.'s (2023) repetition discount: effective tokens D' of repeated data and effective
parameters N' of a model larger than its unique tokens warrant (the data-constrained law, laws.py)."""

from __future__ import annotations

from typing import Any

import numpy as np


def effective_data(D: Any, U: Any, R_star: Any) -> np.ndarray:
    """Muennighoff et al.'s effective tokens D' = U + U*R*(1 - exp(-R/R*)), with R = D/U - 1 repetitions.

    U counts the unique tokens a run reads, at most D (a run of D tokens over more unique ones reads D once).
    The same discount serves their excess parameters: N' = effective_data(N, U_N, R*_N) (`unique_params`).
    """
    D, U = np.asarray(D, dtype=float), np.asarray(U, dtype=float)
    U = np.minimum(U, D)
    R = np.maximum(D / U - 1.0, 0.0)
    return U + U * R_star * -np.expm1(-R / R_star)


def unique_params(U: Any, A: Any, B: Any, alpha: Any, beta: Any) -> np.ndarray:
    """Muennighoff et al.'s U_N before its cap at N: the compute-optimal model size for U training tokens
    under E + A/N^alpha + B/D^beta: N_opt = G (G U)^(beta/alpha), G = (alpha A / (beta B))^(1/(alpha+beta)).

    Parameters beyond it are excess for U unique tokens; infinite (none are) where alpha is 0.
    """
    U, A, B, alpha, beta = (np.asarray(x, dtype=float) for x in (U, A, B, alpha, beta))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_g = (np.log(alpha * A) - np.log(beta * B)) / (alpha + beta)
        return np.where(alpha > 0, np.exp(log_g + beta / alpha * (log_g + np.log(U))), np.inf)


def discount(base: np.ndarray, R: np.ndarray, r_star: float) -> tuple[np.ndarray, np.ndarray]:
    """log of base + base*r*(1 - exp(-R/r)) (`effective_data`) and its derivative in log r."""
    decay = np.exp(-R / r_star)
    eff = base + base * r_star * (1 - decay)
    return np.log(eff), r_star * base * ((1 - decay) - (R / r_star) * decay) / eff
