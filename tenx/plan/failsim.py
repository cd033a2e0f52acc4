"""Failures at scale: what component failures cost a synchronous run, and a semi-synchronous one, as the
accelerator count grows from 1e3 to 1e7 (`tenx plan failures`).

Rates are the cluster file's (`--cluster`, its `[failures]` table: tenx/plan/failure_rates.py), by default
Llama 3's: 419 unexpected interruptions by component over 16,384 H100 GPUs × 54 days. Each rate scales
linearly with the GPU count: per-GPU rate = count / gpu_days.

Synchronous (one job: any failure stops everyone, who restart from the last checkpoint). With job MTBF M,
checkpoint cost δ (the loop is stalled), interval τ (work between saves), restart R and detection latency D
(a failure is noticed D after it happens; that time is lost too), exponential failures give the exact
expected wall time of one segment of work τ (failures during detection/restart are absorbed by it):

    E[T] = (M + R + D) · (exp((τ + δ)/M) - 1)        goodput = τ / E[T]

(the renewal argument of Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 2006, with failures not counted during downtime). Its optimum solves τ = M·(1 - exp(-(τ+δ)/M))
and does not depend on R or D: detection latency lowers goodput but leaves the best interval where it was.
Young (1974) sqrt(2δM) and Daly's higher-order variant are its approximations; first order,
goodput ≈ 1 - δ/τ - (τ/2 + R + D)/M.

Semi-synchronous (DiLoCo-style): G GPUs in k replica groups that synchronise every `sync_s` seconds. A failed
group heals from a live peer while the others go on (the global batch shrinks meanwhile); it loses its work
since the last sync plus D + R. Group MTBF is k·M; with syncs every H from each up period's start the exact
renewal goodput is (kM - E[U mod H]) / (kM + R + D), E[U mod H] = kM - H/(exp(H/kM) - 1). Rule for k: groups
must hold at least `min_group_gpus` accelerators (a model replica with its tensor/pipeline parallelism);
goodput grows with k, so `auto` takes the most groups that rule allows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import brentq

from tenx.checkpoint.interval import expected_goodput, young_daly_interval_s
from tenx.errors import TenxError
from tenx.plan.failure_limits import (
    MAX_SIM_EVENTS,
    REPLICA_COST_EVENTS,
    check_failure_inputs,
)
from tenx.plan.failure_rates import DAY_S, FailureRates


def component_rates_per_gpu_s(failures: FailureRates | None = None) -> dict[str, float]:
    """Failures per GPU-second of each component: its count over the exposure (Llama 3's by default)."""
    return (failures or FailureRates()).per_gpu_s()


def job_mtbf_s(gpus: float, failures: FailureRates | None = None) -> float:
    """Mean seconds between failures of a job spanning `gpus` accelerators (rates add linearly)."""
    if not gpus > 0:
        raise TenxError(f"--gpus: need a positive accelerator count, got {gpus}")
    return 1.0 / (gpus * sum(component_rates_per_gpu_s(failures).values()))


def daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order estimate of the optimum interval (work between saves)."""
    if save_cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_cost_s / (2 * mtbf_s)
    return math.sqrt(2 * save_cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_cost_s


def exact_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """The interval maximising the exact exponential goodput: τ = M(1 - exp(-(τ+δ)/M)); R and D drop out."""
    if save_cost_s <= 0:
        return 0.0

    def f(tau: float) -> float:
        return tau - mtbf_s * (1 - math.exp(-(tau + save_cost_s) / mtbf_s))

    return float(brentq(f, 1e-12 * mtbf_s, mtbf_s))


def sync_goodput_exact(
    interval_s: float, save_cost_s: float, mtbf_s: float, restart_s: float, detect_s: float = 0.0
) -> float:
    """Exact goodput of a synchronous job under Poisson failures: τ / ((M + R + D)(e^{(τ+δ)/M} - 1))."""
    if interval_s <= 0:
        return 0.0
    exponent = (interval_s + save_cost_s) / mtbf_s
    if exponent > 700:  # e^700 is near float's limit: a segment of work practically never completes
        return 0.0
    return interval_s / ((mtbf_s + restart_s + detect_s) * math.expm1(exponent))


def semi_sync_goodput(
    groups: int, mtbf_s: float, sync_s: float, restart_s: float, detect_s: float = 0.0
) -> float:
    """Exact renewal goodput of one of `groups` replica groups (each fails at 1/groups the job's rate)."""
    m = groups * mtbf_s
    ratio = sync_s / m
    # syncs so rare that a group practically never reaches one: all its up time is lost (e^700 overflows)
    lost_in_up = m if ratio > 700 else m - sync_s / math.expm1(ratio) if sync_s > 0 else 0.0
    return (m - lost_in_up) / (m + restart_s + detect_s)


@dataclass
class Row:
    """One accelerator count's failure budget, closed form and simulated."""

    gpus: float
    mtbf_s: float
    checkpoint_interval_s: float
    young_interval_s: float
    daly_interval_s: float
    goodput_sync: float
    goodput_sync_first_order: float
    goodput_semi_sync: float
    groups: int
    groups_for_90: int | None
    sim_sync: float | None = None
    sim_sync_ci: float | None = None
    sim_semi_sync: float | None = None
    sim_semi_sync_ci: float | None = None


def choose_groups(gpus: float, min_group_gpus: int) -> int:
    """The most groups that each still hold `min_group_gpus` accelerators (1 if two do not fit)."""
    return max(1, int(gpus // min_group_gpus))


def groups_for_goodput(
    target: float,
    gpus: float,
    mtbf_s: float,
    sync_s: float,
    restart_s: float,
    detect_s: float,
    min_group_gpus: int,
) -> int | None:
    """The fewest groups (>= 2) whose semi-synchronous goodput reaches `target`; None if none allowed does."""
    k_max = choose_groups(gpus, min_group_gpus)
    if k_max < 2 or semi_sync_goodput(k_max, mtbf_s, sync_s, restart_s, detect_s) < target:
        return None
    lo, hi = 2, k_max
    while lo < hi:
        mid = (lo + hi) // 2
        if semi_sync_goodput(mid, mtbf_s, sync_s, restart_s, detect_s) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def simulate_groups(
    groups: int,
    mtbf_s: float,
    segment_s: float,
    work_s: float,
    restart_s: float,
    detect_s: float = 0.0,
    days: float = 30.0,
    rng: np.random.Generator | None = None,
) -> float:
    """One seeded discrete-event run of `groups` groups, the job's failures (mean `mtbf_s` apart; the minimum
    of the components' exponential clocks is exponential with the summed rate) each striking one group. A
    group works in segments of `segment_s` seconds, `work_s` of them progress (the rest a checkpoint save);
    a failure costs it the segment so far, then D + R (a failure while it is down is absorbed by its
    restart). Returns the progress over groups x the span."""
    rng = rng or np.random.default_rng(0)
    horizon = days * DAY_S
    times = np.sort(rng.uniform(0, horizon, rng.poisson(horizon / mtbf_s)))
    owners = rng.integers(0, groups, times.size)
    up_since: dict[int, float] = {}  # when a group last came back up (its segment clock restarts there)
    lost = 0.0
    for t, g in zip(times.tolist(), owners.tolist()):
        since = up_since.get(g, 0.0)
        if t < since:
            continue  # the group is already down: the failure is absorbed by its restart
        age = (t - since) % segment_s if segment_s > 0 else 0.0
        back = t + detect_s + restart_s
        lost += age + min(back, horizon) - t
        up_since[g] = back
    progress = work_s / segment_s if segment_s > 0 else 1.0
    return (1.0 - lost / (groups * horizon)) * progress


def expected_sim_events(mtbf_s: float, days: float, groups: int) -> float:
    """The failures one replica of the synchronous `simulate_groups` (and of the semi-synchronous one when
    groups >= 2) draws on average."""
    return days * DAY_S / mtbf_s * (2 if groups >= 2 else 1)


def check_simulation_size(
    gpus_list: list[float],
    failures: FailureRates | None,
    groups: int | None,
    min_group_gpus: int,
    days: float,
    replicas: int,
) -> None:
    """Refuse a simulation of more than MAX_SIM_EVENTS expected events, naming the largest --days that fits."""
    events = 0.0
    for g in gpus_list:
        k = groups if groups is not None else choose_groups(g, min_group_gpus)
        events += replicas * expected_sim_events(job_mtbf_s(g, failures), days, k)
    overhead = len(gpus_list) * replicas * REPLICA_COST_EVENTS
    if events + overhead <= MAX_SIM_EVENTS:
        return
    if overhead < MAX_SIM_EVENTS and math.isfinite(events):
        fits = f"at these settings the largest --days is {days * (MAX_SIM_EVENTS - overhead) / events:.3g}"
    else:
        fits = "no --days fits at these settings"
    raise TenxError(
        f"--days {days:g} x --replicas {replicas} at --gpus up to {max(gpus_list):g} would simulate about "
        f"{events + overhead:.3g} failures, more than the {MAX_SIM_EVENTS:,} allowed: {fits}; "
        "or lower --replicas or --gpus, or pass --no-sim for the closed forms only"
    )


def _mean_ci(samples: list[float]) -> tuple[float, float]:
    a = np.asarray(samples)
    half = 1.96 * a.std(ddof=1) / math.sqrt(a.size) if a.size > 1 else float("nan")
    return float(a.mean()), float(half)


def failure_table(
    gpus_list: list[float],
    save_cost_s: float = 60.0,
    restart_s: float = 600.0,
    detect_s: float = 0.0,
    groups: int | None = None,
    min_group_gpus: int = 1024,
    sync_s: float = 600.0,
    simulate: bool = True,
    days: float = 30.0,
    replicas: int = 8,
    seed: int = 0,
    failures: FailureRates | None = None,
) -> list[Row]:
    """The failure budget at each accelerator count under `failures` (Llama 3's rates by default);
    `groups=None` picks k by the group-size rule. Inputs that make the figures meaningless or the simulation
    endless are refused first (`check_failure_inputs`, `check_simulation_size`)."""
    check_failure_inputs(gpus_list, save_cost_s, restart_s, detect_s, groups, sync_s, days, replicas)
    if simulate:
        check_simulation_size(gpus_list, failures, groups, min_group_gpus, days, replicas)
    rows = []
    for i, g in enumerate(gpus_list):
        m = job_mtbf_s(g, failures)
        tau = exact_interval_s(save_cost_s, m)
        k = groups if groups is not None else choose_groups(g, min_group_gpus)
        sync = sync_goodput_exact(tau, save_cost_s, m, restart_s, detect_s)
        semi = semi_sync_goodput(k, m, sync_s, restart_s, detect_s) if k >= 2 else sync
        young = young_daly_interval_s(save_cost_s, m)
        row = Row(
            gpus=g,
            mtbf_s=m,
            checkpoint_interval_s=tau,
            young_interval_s=young,
            daly_interval_s=daly_interval_s(save_cost_s, m),
            goodput_sync=sync,
            goodput_sync_first_order=expected_goodput(young, save_cost_s, m, restart_s + detect_s),
            goodput_semi_sync=semi,
            groups=k,
            groups_for_90=groups_for_goodput(0.9, g, m, sync_s, restart_s, detect_s, min_group_gpus),
        )
        if simulate:
            rngs = [np.random.default_rng([seed, i, r]) for r in range(replicas)]
            # synchronous: one group, whose segment is an interval of work and its save
            row.sim_sync, row.sim_sync_ci = _mean_ci(
                [simulate_groups(1, m, tau + save_cost_s, tau, restart_s, detect_s, days, r) for r in rngs]
            )
            if k >= 2:  # semi-synchronous: a failure costs its group the work since its last sync
                row.sim_semi_sync, row.sim_semi_sync_ci = _mean_ci(
                    [simulate_groups(k, m, sync_s, sync_s, restart_s, detect_s, days, r) for r in rngs]
                )
            else:
                row.sim_semi_sync, row.sim_semi_sync_ci = row.sim_sync, row.sim_sync_ci
        rows.append(row)
    return rows


def simulate_ledger_case(
    step_s: float,
    p_kill_per_step: float,
    save_every_steps: int,
    save_cost_s: float,
    restart_s: float,
    steps: int,
    *,
    startup_s: float = 0.0,
    other_s_per_step: float = 0.0,
    trials: int = 2000,
    seed: int = 0,
) -> dict[str, float]:
    """Predict the chaos drill's ledger goodput: `sigkill@p=P` fires once per step index, at the step's start.

    A kill at step s (each step independently, with probability p, whatever the attempt) loses the steps
    since the last save, (s-1) mod every, and costs a restart; the replayed steps do not fire again.
    Goodput is the ledger's: steps·step_s over startup + steps·(step_s + other) + saves + recompute + restarts.
    Returns the simulated mean and its 95% half-width, and the ratio of expectations.
    """
    if not 0 <= p_kill_per_step < 1 or save_every_steps < 1 or steps < 1:
        raise TenxError("need 0 <= p < 1, save_every_steps >= 1 and steps >= 1")
    rng = np.random.default_rng(seed)
    since_save = (np.arange(1, steps + 1) - 1) % save_every_steps  # steps lost by a kill at step s
    base = startup_s + steps * (step_s + other_s_per_step) + (steps // save_every_steps) * save_cost_s
    kills = rng.random((trials, steps)) < p_kill_per_step
    lost = kills @ (since_save * step_s + restart_s)
    goodput = steps * step_s / (base + lost)
    expected_lost = p_kill_per_step * float(np.sum(since_save * step_s + restart_s))
    mean, half = _mean_ci(goodput.tolist())
    return {
        "goodput": mean,
        "ci95": half,
        "goodput_expected": steps * step_s / (base + expected_lost),
        "kills_expected": p_kill_per_step * steps,
    }


def ledger_case_from_drill(drill_json: str | Path) -> dict[str, float]:
    """Predict a chaos drill's goodput from its drill.json: per-step costs from its ledger, kills from p."""
    summary = json.loads(Path(drill_json).read_text())
    led = summary["ledger"]
    steps = int(summary["steps"])
    every = int(summary["memory_every"] or summary["every"])  # the newest tier a restart resumes from
    restarts = max(1, int(led["restarts"]))
    pred = simulate_ledger_case(
        step_s=led["productive_s"] / steps,
        p_kill_per_step=float(summary["p"]),
        save_every_steps=every,
        save_cost_s=led["checkpoint_s"] / (steps // every),
        restart_s=led["restart_s"] / restarts,
        steps=steps,
        startup_s=led["startup_s"],
        other_s_per_step=led["other_s"] / steps,
    )
    return {**pred, "measured": float(led["goodput"])}


def format_table(rows: list[Row]) -> str:
    """The failure table, one line per accelerator count."""
    head = (
        f"{'gpus':>8} {'mtbf':>9} {'interval':>9} {'goodput_sync':>13} {'sim_sync':>15} "
        f"{'goodput_semi_sync':>17} {'sim_semi':>15} {'groups':>7} {'k@90%':>6}"
    )
    lines = [head]
    for r in rows:
        sim = f"{r.sim_sync:.3f}±{r.sim_sync_ci:.3f}" if r.sim_sync is not None else "-"
        semi = f"{r.sim_semi_sync:.4f}±{r.sim_semi_sync_ci:.4f}" if r.sim_semi_sync is not None else "-"
        lines.append(
            f"{r.gpus:>8.0e} {short_duration(r.mtbf_s):>9} {short_duration(r.checkpoint_interval_s):>9} "
            f"{r.goodput_sync:>13.3f} {sim:>15} {r.goodput_semi_sync:>17.4f} {semi:>15} "
            f"{r.groups:>7} {r.groups_for_90 if r.groups_for_90 is not None else '-':>6}"
        )
    return "\n".join(lines)


def short_duration(s: float) -> str:
    """Seconds as the failure table prints them: `2.50h`, `12.0m` or `42.0s`."""
    return f"{s / 3600:.2f}h" if s >= 3600 else f"{s / 60:.1f}m" if s >= 60 else f"{s:.1f}s"


def sync_below_half_gpus(
    save_cost_s: float, restart_s: float, detect_s: float, failures: FailureRates | None = None
) -> float:
    """The accelerator count at which synchronous goodput (optimal interval) falls to 50%."""

    def f(log_g: float) -> float:
        m = job_mtbf_s(10**log_g, failures)
        return sync_goodput_exact(exact_interval_s(save_cost_s, m), save_cost_s, m, restart_s, detect_s) - 0.5

    low, high = -9.0, 18.0
    if f(low) * f(high) > 0:  # rates so extreme that goodput never crosses 50% in that range
        return math.nan
    return float(10 ** brentq(f, low, high))
