"""The failure model: how often to checkpoint, and what failures cost a run.

Young (1974) and Daly (2006): with checkpoint cost δ (seconds the run is stalled per save) and mean
time between failures M, the interval that minimises expected lost time is about sqrt(2·δ·M). Each
failure then costs on average half an interval of recomputation plus the restart time.
"""

from __future__ import annotations

import math


def young_daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """The first-order optimal seconds between checkpoints, sqrt(2 * save cost * MTBF)."""
    if save_cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need save cost >= 0 and MTBF > 0, got {save_cost_s} and {mtbf_s}")
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def expected_goodput(interval_s: float, save_cost_s: float, mtbf_s: float, restart_s: float) -> float:
    """First-order expected goodput: time not spent saving, recomputing half an interval, or restarting."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError("interval and MTBF must be > 0")
    lost = save_cost_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s
    return max(0.0, 1.0 - lost)
