"""The bounds of `tenx plan failures`: values that keep every figure meaningful and the simulation finite.

A duration longer than the simulated span makes every goodput zero, a count beyond 1e12 accelerators makes
a simulated day hold more failures than can be drawn, and the simulation's cost grows with --days x
--replicas x failures per day; tenx/plan/failsim.py refuses what lies outside, naming the flag and its limit.
"""

from __future__ import annotations

import math

from tenx.errors import TenxError
from tenx.plan.failure_rates import DAY_S

MAX_GPUS = 1e12
"""The largest accelerator count `--gpus` takes: 10^5 times the largest machines planned today; beyond it every
figure is zero and a simulated day holds more failures than can be drawn."""
MAX_COUNTS = 1000
"""The most accelerator counts in one `--gpus` list (one table row each)."""
MAX_DAYS = 36500.0
"""The longest simulated span, `--days` (100 years), which also bounds every duration flag: a restart,
detection, save or sync longer than the whole span makes every goodput zero and says nothing."""
MAX_REPLICAS = 1000
"""The most `--replicas` (the 95% interval narrows as 1/sqrt(replicas): 1000 gives 1/11 of 8's)."""
MAX_SIM_EVENTS = 5_000_000
"""The most failures one table may simulate (about a microsecond each: a few seconds)."""
REPLICA_COST_EVENTS = 100
"""What one simulated replica costs besides its events (a generator, a block of draws), in events."""


def check_failure_inputs(
    gpus_list: list[float],
    save_cost_s: float,
    restart_s: float,
    detect_s: float,
    groups: int | None,
    sync_s: float,
    days: float,
    replicas: int,
) -> None:
    """Refuse inputs that make every figure zero or meaningless, or the simulation endless (a TenxError
    naming the flag, its largest value and why); `failure_table` calls it before any work."""
    if not gpus_list or len(gpus_list) > MAX_COUNTS:
        raise TenxError(f"--gpus: give 1 to {MAX_COUNTS} accelerator counts, got {len(gpus_list)}")
    for g in gpus_list:
        if not (math.isfinite(g) and 0 < g <= MAX_GPUS):
            raise TenxError(f"--gpus: each count must be > 0 and at most {MAX_GPUS:.0e}, got {g:g}")
    if not (math.isfinite(days) and 0 < days <= MAX_DAYS):
        raise TenxError(f"--days must be > 0 and at most {MAX_DAYS:g} (100 years), got {days:g}")
    span = days * DAY_S
    for flag, value, low in (
        ("--save-cost-s", save_cost_s, "> 0"),
        ("--restart-s", restart_s, ">= 0"),
        ("--detect-s", detect_s, ">= 0"),
        ("--sync-s", sync_s, "> 0"),
    ):
        positive = value > 0 if low == "> 0" else value >= 0
        if not (math.isfinite(value) and positive and value <= span):
            raise TenxError(
                f"{flag} must be {low} and at most the simulated span, --days {days:g} = {span:g} s "
                f"(longer makes every goodput zero), got {value:g}"
            )
    if groups is not None and not (1 <= groups <= min(gpus_list)):
        raise TenxError(
            f"--groups {groups}: each replica group holds at least one accelerator, and the smallest --gpus "
            f"count is {min(gpus_list):g}: give 1 to {int(min(gpus_list)):,} groups, or auto"
        )
    if not 2 <= replicas <= MAX_REPLICAS:
        raise TenxError(f"--replicas must be 2 to {MAX_REPLICAS}, got {replicas}")
