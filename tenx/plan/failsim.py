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

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import brentq

from tenx.checkpoint.interval import expected_goodput, young_daly_interval_s
from tenx.errors import TenxError
from tenx.plan.failure_limits import (
    MAX_COUNTS,
    MAX_DAYS,
    MAX_GPUS,
    MAX_REPLICAS,
    MAX_SIM_EVENTS,
    REPLICA_COST_EVENTS,
    check_failure_inputs,
)
from tenx.plan.failure_rates import DAY_S, FailureRates
from tenx.utils.cli import above, at_least, subcommand


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


def simulate_sync(
    mtbf_s: float,
    interval_s: float,
    save_cost_s: float,
    restart_s: float,
    detect_s: float = 0.0,
    days: float = 30.0,
    rng: np.random.Generator | None = None,
) -> float:
    """One seeded discrete-event run of a synchronous job: saves every interval, restarts on each failure."""
    rng = rng or np.random.default_rng(0)
    horizon, segment = days * DAY_S, interval_s + save_cost_s
    t = work = 0.0
    for x in _exponentials(rng, mtbf_s):
        if t >= horizon:
            break
        if x >= segment:
            t += segment
            work += interval_s
        else:
            t += x + detect_s + restart_s
    return work / t


def _exponentials(rng: np.random.Generator, mean: float) -> Iterator[float]:
    """Times to the next failure, drawn in blocks: the minimum of the components' independent exponential
    clocks is itself exponential with the summed rate, so one draw at rate 1/M stands for all of them."""
    while True:
        yield from rng.exponential(mean, 4096).tolist()


def simulate_semi_sync(
    groups: int,
    mtbf_s: float,
    sync_s: float,
    restart_s: float,
    detect_s: float = 0.0,
    days: float = 30.0,
    rng: np.random.Generator | None = None,
) -> float:
    """One seeded run of k replica groups: each failure costs its group the work since its last sync + D + R."""
    rng = rng or np.random.default_rng(0)
    horizon = days * DAY_S
    times = np.sort(rng.uniform(0, horizon, rng.poisson(horizon / mtbf_s)))
    owners = rng.integers(0, groups, times.size)
    up_since: dict[
        int, float
    ] = {}  # when a group last came back up (its sync clock restarts there; 0: never down)
    lost = 0.0
    for t, g in zip(times.tolist(), owners.tolist()):
        since = up_since.get(g, 0.0)
        if t < since:
            continue  # the group is already down: the failure is absorbed by its restart
        age = (t - since) % sync_s if sync_s > 0 else 0.0
        back = t + detect_s + restart_s
        lost += age + min(back, horizon) - t
        up_since[g] = back
    return 1.0 - lost / (groups * horizon)


def expected_sim_events(
    mtbf_s: float,
    interval_s: float,
    save_cost_s: float,
    restart_s: float,
    detect_s: float,
    days: float,
    groups: int,
) -> float:
    """The events one replica of `simulate_sync` (and of `simulate_semi_sync` when groups >= 2) draws on
    average: the span over the mean time one loop iteration advances, plus the span's failures."""
    horizon, segment = days * DAY_S, interval_s + save_cost_s
    advance = -math.expm1(-segment / mtbf_s) * (
        mtbf_s + restart_s + detect_s
    )  # E[min(x, seg)] + P(x<seg)(R+D)
    events = horizon / advance if advance > 0 else math.inf
    return events + (horizon / mtbf_s if groups >= 2 else 0.0)


def check_simulation_size(
    gpus_list: list[float],
    failures: FailureRates | None,
    save_cost_s: float,
    restart_s: float,
    detect_s: float,
    groups: int | None,
    min_group_gpus: int,
    days: float,
    replicas: int,
) -> None:
    """Refuse a simulation of more than MAX_SIM_EVENTS expected events, naming the largest --days that fits."""
    events = 0.0
    for g in gpus_list:
        m = job_mtbf_s(g, failures)
        k = groups if groups is not None else choose_groups(g, min_group_gpus)
        tau = exact_interval_s(save_cost_s, m)
        events += replicas * expected_sim_events(m, tau, save_cost_s, restart_s, detect_s, days, k)
    overhead = len(gpus_list) * replicas * REPLICA_COST_EVENTS
    if events + overhead <= MAX_SIM_EVENTS:
        return
    if overhead < MAX_SIM_EVENTS and math.isfinite(events):
        fits = f"at these settings the largest --days is {days * (MAX_SIM_EVENTS - overhead) / events:.3g}"
    else:
        fits = "no --days fits at these settings"
    raise TenxError(
        f"--days {days:g} x --replicas {replicas} at --gpus up to {max(gpus_list):g} would simulate about "
        f"{events + overhead:.3g} failures and saves, more than the {MAX_SIM_EVENTS:,} allowed: {fits}; "
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
        check_simulation_size(
            gpus_list, failures, save_cost_s, restart_s, detect_s, groups, min_group_gpus, days, replicas
        )
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
            row.sim_sync, row.sim_sync_ci = _mean_ci(
                [simulate_sync(m, tau, save_cost_s, restart_s, detect_s, days, r) for r in rngs]
            )
            if k >= 2:
                row.sim_semi_sync, row.sim_semi_sync_ci = _mean_ci(
                    [simulate_semi_sync(k, m, sync_s, restart_s, detect_s, days, r) for r in rngs]
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
            f"{r.gpus:>8.0e} {_dur(r.mtbf_s):>9} {_dur(r.checkpoint_interval_s):>9} "
            f"{r.goodput_sync:>13.3f} {sim:>15} {r.goodput_semi_sync:>17.4f} {semi:>15} "
            f"{r.groups:>7} {r.groups_for_90 if r.groups_for_90 is not None else '-':>6}"
        )
    return "\n".join(lines)


def _dur(s: float) -> str:
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


def register(plan_subparsers: Any) -> None:
    """Register `tenx plan failures` on the `plan` subcommand's subparsers."""
    about = "failures at scale: MTBF, checkpoint interval, goodput"
    subcommand(plan_subparsers, "failures", about, cmd_failures, _failures_arguments)


def _gpu_counts(text: str) -> list[float]:
    """`--gpus`: comma-separated positive, finite accelerator counts."""
    counts = []
    for item in (x.strip() for x in text.split(",")):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0 < value <= MAX_GPUS):
            raise argparse.ArgumentTypeError(
                f"each count must be a number > 0 and at most {MAX_GPUS:.0e}, got {item!r} in {text!r}"
            )
        counts.append(value)
    if len(counts) > MAX_COUNTS:
        raise argparse.ArgumentTypeError(f"at most {MAX_COUNTS} counts, got {len(counts)}")
    return counts


def _groups(text: str) -> int | None:
    """`--groups`: auto (None) or a number of groups >= 1."""
    return None if text == "auto" else at_least(int, 1)(text)


def _failures_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster",
        help="a cluster file or a shipped one whose [failures] rates to use (default: Llama 3's)",
    )
    p.add_argument(
        "--gpus",
        type=_gpu_counts,
        default="1e3,1e4,1e5,1e6,1e7",
        help=f"comma-separated accelerator counts, each at most {MAX_GPUS:.0e}, at most {MAX_COUNTS} of them",
    )
    span = "at most the simulated span, --days x 86400 s: a longer one makes every goodput zero"
    p.add_argument(
        "--save-cost-s",
        type=above(float, 0),
        default=60.0,
        help=f"seconds a checkpoint save stalls the job ({span})",
    )
    p.add_argument(
        "--restart-s",
        type=at_least(float, 0),
        default=600.0,
        help=f"seconds to restart (or heal a group; {span})",
    )
    p.add_argument(
        "--detect-s",
        type=at_least(float, 0),
        default=0.0,
        help=f"seconds from a failure to its detection ({span})",
    )
    p.add_argument(
        "--groups",
        type=_groups,
        default="auto",
        help="semi-synchronous replica groups: auto or N (at most the smallest --gpus count: a group holds one)",
    )
    p.add_argument(
        "--min-group-gpus", type=at_least(int, 1), default=1024, help="auto: accelerators a group must hold"
    )
    p.add_argument(
        "--sync-s",
        type=above(float, 0),
        default=600.0,
        help=f"seconds between semi-synchronous syncs, > 0 (0 would be a sync that never ends; {span})",
    )
    p.add_argument(
        "--days",
        type=above(float, 0, MAX_DAYS),
        default=30.0,
        help=f"simulated days per replica, at most {MAX_DAYS:g} (100 years); a table simulates at most "
        f"{MAX_SIM_EVENTS:,} failures and saves (a few seconds): more is refused naming the largest --days",
    )
    p.add_argument(
        "--replicas",
        type=at_least(int, 2, MAX_REPLICAS),
        default=8,
        help=f"independent simulations (for the 95%% CI), at most {MAX_REPLICAS}",
    )
    p.add_argument("--no-sim", action="store_true", help="closed forms only")
    p.add_argument("--json", help="write one row per accelerator count here (a new file, unless --force)")
    p.add_argument("--force", action="store_true", help="--json: replace an existing file")
    p.add_argument("--seed", type=at_least(int, 0), default=0, help="seed of the simulation")


def cmd_failures(args: argparse.Namespace) -> None:
    """`tenx plan failures`: the table, the 50% crossing, and the groups that keep 90%."""
    from tenx.plan.estimate import cluster_file, load_cluster
    from tenx.utils.io import atomic_write_text, check_output_file

    out = None
    if args.json is not None:
        inputs = (cluster_file(args.cluster),) if args.cluster else ()
        out = check_output_file(args.json, force=args.force, flag="--json", inputs=inputs)
    # argparse runs `type` on a string default too, but not on a value set in Python (tests, callers)
    gpus = _gpu_counts(args.gpus) if isinstance(args.gpus, str) else args.gpus
    groups = _groups(args.groups) if isinstance(args.groups, str) else args.groups
    cluster = load_cluster(args.cluster) if args.cluster else None
    failures = cluster.failures if cluster else FailureRates()
    rows = failure_table(
        gpus,
        args.save_cost_s,
        args.restart_s,
        args.detect_s,
        groups,
        args.min_group_gpus,
        args.sync_s,
        not args.no_sim,
        args.days,
        args.replicas,
        args.seed,
        failures,
    )
    where = f"cluster {cluster.name}" if cluster else "no --cluster: the default"
    print(
        f"rates ({where}): {failures.describe()}, linear in GPUs; δ={args.save_cost_s:g}s "
        f"R={args.restart_s:g}s D={args.detect_s:g}s sync every {args.sync_s:g}s"
    )
    if cluster:
        print(
            f"cluster {cluster.name}: {cluster.accelerators:,} accelerators, one interruption every "
            f"{_dur(job_mtbf_s(cluster.accelerators, failures))} on average"
        )
    print(format_table(rows))
    half = sync_below_half_gpus(args.save_cost_s, args.restart_s, args.detect_s, failures)
    if math.isnan(half):
        print("synchronous goodput does not cross 50% between 1e-9 and 1e18 accelerators at these rates")
    else:
        print(f"synchronous goodput falls below 50% at about {half:,.0f} accelerators")
    for r in rows:
        if r.groups_for_90 is not None:
            print(f"  {r.gpus:.0e} GPUs: >= {r.groups_for_90} groups keep semi-synchronous goodput >= 90%")
    if out is not None:
        keys = ("gpus", "mtbf_s", "checkpoint_interval_s", "goodput_sync", "goodput_semi_sync", "groups")
        rows_out = [
            {**{k: asdict(r)[k] for k in keys}, **{k: v for k, v in asdict(r).items() if k not in keys}}
            for r in rows
        ]
        atomic_write_text(out, json.dumps(rows_out, indent=2) + "\n")
        print(f"wrote {args.json}")
