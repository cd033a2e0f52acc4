"""Effective data multipliers: what a change is worth in unique tokens when the data repeats (`tenx derisk`
with `mode = "data"`).

The baseline is trained at every budget (each budget is one scale: the ladder's `ratio` grid picks its
depth N and it trains D = budget / F tokens), and on each of `token_fractions` of those tokens, on fresh data
and under each unique-token budget U of `unique_tokens` below them, so a run repeats its data D/U times. Its
runs at one scale share the batch size and differ in schedule length only. A capped run reads the U tokens
the run's `data.unique_sample` picks (the shipped study: 'spread', one training sequence from each of many
places of the split); with 'spread', a fresh point reads a spread sample of its own D tokens once, so that
it differs from a capped run in repetition alone. Muennighoff et al. (2023)'s
data-constrained law

    L(N, D, U) = E + A/N^alpha + B/D'^beta,   D' = U + U R* (1 - exp(-R/R*)),  R = D/U - 1

is fitted to all of them (tenx.scaling.fit.fit_data_constrained: Chinchilla on the single-epoch runs, then
the decay R* of repeated tokens on every run). Each change is trained alone on the baseline, at every
scale, at U_c = `compare_unique_tokens` (default: the smallest U). Its **effective data multiplier** at a
scale is

    m = D'_needed(L_change) / D'_needed(L_baseline),   D'_needed(L) = (B / (L - E - A/N^alpha))^(1/beta)

at the baseline's size N, L_baseline being the baseline's own measured loss at the same scale, tokens and
U_c: the factor of unique tokens the baseline would need, repeated as often (D' is proportional to U at a
fixed number of epochs), to reach the change's held-out loss from its own. The law supplies only how loss
falls with effective data there; the measured baseline anchors it, so a law that misses the baseline's
point by a few percent does not turn into a multiplier (were the law exact, D'_needed(L_baseline) would be
D'(D, U_c)). At a fixed compute the baseline could not get there by more unique data alone once it reads
each token once, so the multiplier keeps the epochs, not the compute, fixed. m > 1 is a gain; m is
infinite when the change beats the law's floor for that model size (E + A/N^alpha).

Intervals combine the bootstrap of the law with seed noise. Each scale's noise is its own: the pooled
standard deviation over its runs of several seeds (the baseline's at the smallest scale, an ensemble's members
at the compared point, a change's own `seeds`), drawn from its posterior so that a figure from few repeats
widens the interval as Student's t does; a point that is the median of n seeds carries the median of n
draws, subtracted from the measured loss to give a draw of the true one. The trend across scales and the
verdict (grows / persists / fades / reverses / hurts / unresolved) are tenx.scaling.derisk.compute_multiplier's,
per decade of training compute.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from tenx.errors import ConfigError, DataError
from tenx.scaling.derisk.change import ChangeConfig
from tenx.scaling.derisk.compute_multiplier import DeriskConfig, prepare_stack, verdict
from tenx.scaling.derisk.data_changes import (
    ChangeRows,
    DataRun,
    assemble_ensembles,
    distill_compute_multiple,
    ensemble_rows,
    plan_change,
    stage_rows,
    tag,
    tuned_rows,
)
from tenx.scaling.derisk.data_report import format_data_derisk, plot_data_report
from tenx.scaling.derisk.study import run_study
from tenx.scaling.ladder.rungs import plan_ladder
from tenx.scaling.ladder.runner import config_key, format_dry_run, load_base

MIN_CAPPED_EPOCHS = 1.05
"""A capped run is planned only where it reads its U tokens at least this many times: below, it would be
its fresh twin (both read a spread sample of about their tokens once) trained again, to the same point."""
LAW_PARAMS = ("E", "A", "B", "alpha", "beta", "R_D_star")
"""The data-constrained law's parameters, in FitResult's column order."""


def data_needed(values: np.ndarray, N: Any, loss: Any) -> np.ndarray:
    """D'_needed = (B / (loss - E - A/N^alpha))^(1/beta): the effective data at which the law reaches
    `loss` at size N, for law parameter rows `values` (S, 6) -> (S, M) (N and loss broadcast to M values or
    to (S, M)); inf where the loss lies at or below the law's floor for N."""
    values = np.atleast_2d(np.asarray(values, dtype=float))
    E, A, B, alpha, beta = (values[:, i : i + 1] for i in range(5))
    N, loss = (np.atleast_1d(np.asarray(x, dtype=float)) for x in (N, loss))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        gap = loss - E - A * N**-alpha
        return np.where(gap > 0, (B / np.where(gap > 0, gap, 1.0)) ** (1.0 / beta), np.inf)


def effective_data_multiplier(values: np.ndarray, N: Any, loss: Any, baseline_loss: Any) -> np.ndarray:
    """m = D'_needed(loss) / D'_needed(baseline_loss) at the baseline's size N (module doc) for law
    parameter rows `values` (S, 6) -> (S, M): the factor of effective data, and so of unique tokens at the
    same epochs, between the baseline's measured loss and the change's. inf where the change's loss lies at
    or below the law's floor; nan where the baseline's own does (the law cannot place it)."""
    anchor = data_needed(values, N, baseline_loss)
    with np.errstate(invalid="ignore"):
        return np.where(np.isinf(anchor), np.nan, data_needed(values, N, loss) / anchor)


LAW_FIT = {"joint": True}
"""How the study fits its law (FitConfig): E, A, B, alpha, beta and R*_D together on every baseline point.
Its single-epoch points are fresh runs at two token counts a size, which cannot pin beta alone: fitted
first on them (Muennighoff et al.'s two stages), the law swung between degenerate optima on two passes of
the same study whose losses differed by about 0.01 nats (E at its lower bound on one, beta at its upper
bound of 5 on the other, which read every 8-epoch point 4-7% low and several changes as infinite
multipliers); the repeated points' effective data D' spans the range that pins it (docs/data-efficiency.md)."""


# ----- planning --------------------------------------------------------------------------------------
def per_budget_seeds(dc: DeriskConfig, counts: list[int], scale: float) -> int:
    """The seeds at budget `scale` of per-budget `counts` (smallest budget first: law_seeds, a change's
    `seeds`), else dc.seeds at the smallest budget and 1 at the others."""
    if counts:
        return counts[sorted(dc.budgets).index(scale)]
    return dc.seeds if scale == min(dc.budgets) else 1


def baseline_seeds(dc: DeriskConfig, scale: float) -> int:
    """The seeds of the baseline's runs at budget `scale` (dc.law_seeds, else the default)."""
    return per_budget_seeds(dc, dc.law_seeds, scale)


def change_seeds(dc: DeriskConfig, change: ChangeConfig, scale: float) -> int:
    """The seeds `change` trains at budget `scale` (its own `seeds`, else the default)."""
    return per_budget_seeds(dc, change.seeds, scale)


def plan_data_derisk(dc: DeriskConfig, *, dry_run: bool = False, out: str | Path = ".") -> list[DataRun]:
    """The baseline's runs (on each fraction of each scale's tokens: fresh, and under each U below them)
    and each change's at U_c on the whole of each scale's tokens (tenx.scaling.derisk.data_changes plans
    the kinds beyond overrides; `out`: the study's directory, where a distilled change's teacher is). A run
    planned twice under one stage is planned once; one that two stages share (an ensemble's member and the
    baseline's seed) is listed under each and trained once (run_data_derisk)."""
    if dc.mode != "data":
        raise ConfigError(f"mode: {dc.mode!r}; plan_data_derisk plans mode 'data' studies")
    lc, overrides, depths = prepare_stack(dc, dry_run=dry_run)
    base = load_base(dc.base, overrides)
    planned: list[DataRun] = []
    for scale in sorted(dc.budgets):
        one = dataclasses.replace(lc, budgets=[scale], min_depth=depths[scale], max_depth=depths[scale])
        for fraction in sorted({*dc.token_fractions, 1.0}):
            part = dataclasses.replace(one, budgets=[scale * fraction], seeds=baseline_seeds(dc, scale))
            try:
                fresh = plan_ladder(base, part, tag("baseline", None))
            except ConfigError as e:
                raise ConfigError(
                    f"token_fractions: {fraction:g} of budget {scale:.3g} at depth {depths[scale]} is too "
                    f"short a run ({e}); raise the fraction or lower ladder.min_steps"
                ) from None
            if base.data.unique_sample == "spread":
                # a fresh point reads a spread sample of its own tokens once (one more token: the last
                # window's last target), drawn as a capped run draws its U, so that the two differ in
                # repetition alone; random windows of the whole split are another sample (stratified
                # against not), which the law would read as a cost or a gain of repetition
                once = dataclasses.replace(part, unique_tokens=fresh[0].tokens + 1)
                fresh = plan_ladder(base, once, tag("baseline", None))
            planned += [DataRun("baseline", scale, None, r, fraction) for r in fresh]
            for u in sorted(set(dc.unique_tokens)):
                if fresh[0].tokens < u * MIN_CAPPED_EPOCHS:  # (almost) no token read twice: the fresh run
                    continue
                capped = dataclasses.replace(part, unique_tokens=u)
                planned += [
                    DataRun("baseline", scale, u, r, fraction)
                    for r in plan_ladder(base, capped, tag("baseline", u))
                ]
        by_name = {c.name: c for c in dc.change}
        for change in dc.change:
            seeds = change_seeds(dc, change, scale)
            planned += plan_change(change, by_name, dc.base, overrides, one, scale, seeds, dc.compare_u, out)
    seen: set[tuple[str, str]] = set()
    kept = []
    for p in planned:
        key = (p.stage, config_key(p.run.config))
        if key not in seen:
            seen.add(key)
            kept.append(p)
    return kept


LAW_PARAMETERS = 6
"""E, A, B, alpha, beta and R*_D: fit_warnings asks for 2 points per parameter."""


def law_points(planned: list[DataRun]) -> list[tuple[float, float, float]]:
    """The distinct (params, tokens, unique tokens) points the baseline's planned runs give the law (a run
    without a cap reads each of its tokens once)."""
    runs = [p.run for p in planned if p.stage == "baseline"]
    return sorted({(r.params, r.tokens, min(r.unique_tokens or r.tokens, r.tokens)) for r in runs})


def check_law_fits(planned: list[DataRun]) -> None:
    """ConfigError, before any run trains (and in --dry-run), when the baseline's planned points cannot fit
    L(N, D, U) (tenx.scaling.fit.laws.data_constrained_shortfall), naming the settings that add points."""
    from tenx.scaling.fit.laws import data_constrained_shortfall

    points = np.array(law_points(planned), dtype=float).reshape(-1, 3)
    why = data_constrained_shortfall(points[:, 0], points[:, 1], points[:, 2])
    if why:
        raise ConfigError(
            f"the baseline's planned runs cannot fit the data-constrained law: {why}; add budgets (model "
            "sizes), token_fractions (token counts) or unique_tokens below the runs' tokens (repeated data)"
        )


def plan_warnings(planned: list[DataRun]) -> list[str]:
    """What the dry run can already tell about the fit: fewer than 2 points per parameter of the law."""
    n = len(law_points(planned))
    if n < 2 * LAW_PARAMETERS:
        return [
            f"the baseline plans {n} points for the law's {LAW_PARAMETERS} parameters: too few to determine "
            f"them (aim for {2 * LAW_PARAMETERS} or more: budgets, token_fractions, unique_tokens); `tenx fit` "
            "will flag the fit and the verdicts rest on it"
        ]
    return []


# ----- analysis --------------------------------------------------------------------------------------
def _column(rows: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([float(r[key]) for r in rows])


def point_medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point (params, tokens, unique_tokens), in first-seen order, its held-out loss the median
    of its seeds' and `seeds` their count. The law is fitted to these: each point weighs the same however
    many seeds it has (the smallest scale's three would otherwise outweigh a larger size's one), and a seed
    that trained slowly (depth 1 has such runs, up to 0.1 nats above their siblings) does not move it."""
    groups: dict[tuple[float, float, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["params"], r["tokens"], r["unique_tokens"]), []).append(r)
    return [
        {**g[0], "heldout_loss": float(np.median([r["heldout_loss"] for r in g])), "seeds": len(g)}
        for g in groups.values()
    ]


def analyse_data(
    baseline: list[dict[str, Any]],
    changes: dict[str, list[dict[str, Any]]],
    dc: DeriskConfig,
    kinds: dict[str, ChangeRows] | None = None,
) -> dict[str, Any]:
    """The law fitted on the baseline's rows, and each change's multiplier per scale with its interval,
    trend and verdict. A row: budget (its scale), params, tokens, unique_tokens, heldout_loss. `kinds`: for
    a change beyond overrides (tenx.scaling.derisk.data_changes), its rows per scale, anchors, independent
    repeats, price and notes, in place of `changes`' rows and the baseline's run at the same point; the
    seeds of its rows count in the seed noise unless they are not single runs (an ensemble's)."""
    kinds = kinds or {}
    from tenx.scaling.fit import fit_data_constrained

    points = point_medians(baseline)
    try:
        fit = fit_data_constrained(
            _column(points, "params"),
            _column(points, "tokens"),
            _column(points, "unique_tokens"),
            _column(points, "heldout_loss"),
            bootstrap=dc.bootstrap,
            **LAW_FIT,
        )
    except DataError as e:
        raise DataError(f"{e} (baseline of the data-mode study: add budgets or unique_tokens)") from None
    scales = sorted(dc.budgets)
    repeats: dict[tuple[str, float, float, float], list[float]] = {}
    counted: set[str] = set()  # a run two parts share (a tuned change that picked the baseline) counts once

    def add(part: str, scale: float, r: dict[str, Any]) -> None:
        if r.get("key") is not None:
            if r["key"] in counted:
                return
            counted.add(r["key"])
        repeats.setdefault((part, scale, r["tokens"], r["unique_tokens"]), []).append(r["heldout_loss"])

    for name, rows in {"baseline": baseline, **changes}.items():
        for r in rows:
            add(name, r["budget"], r)
    for name, kind in kinds.items():
        if kind.single_runs:  # an ensemble's rows are neither one run's nor independent
            for part, rows_at in ((name, kind.rows), (f"{name}/anchor", kind.anchors or [])):
                for s, at in zip(scales, rows_at):
                    for r in at:
                        add(part, s, r)
    noise = seed_noise(repeats, scales)
    sigma, dof = noise["pooled"]
    point = np.array([[fit.params[k] for k in LAW_PARAMS]])
    ok = np.all(np.isfinite(fit.samples), axis=1) if len(fit.samples) else np.zeros(0, bool)
    samples = fit.samples[ok] if ok.any() else point
    rng = np.random.default_rng(0)
    target = dc.target or 100 * scales[-1]
    logc = np.log10(np.array(scales))
    q = 100 * (1 - fit.level) / 2
    out_changes = []
    for name in [*changes, *(k for k in kinds if k not in changes)]:
        kind = kinds.get(name)
        at = kind.rows if kind else [[r for r in changes[name] if r["budget"] == s] for s in scales]
        missing = [s for s, a in zip(scales, at) if not a]
        if missing:
            raise DataError(f"change {name!r}: no run at budget {missing[0]:.3g}")
        N, D, U, L = (  # the median of a point's seeds, as the law is fitted to (point_medians)
            np.array([np.median([r[k] for r in a]) for a in at])
            for k in ("params", "tokens", "unique_tokens", "heldout_loss")
        )
        n = np.array(kind.independent if kind and kind.independent else [len(a) for a in at])
        # the baseline's own runs at the same scale, tokens and unique tokens: the anchor of each multiplier
        # (a planted win's: at the compared U, which it was given more of; a tuned change's: the tuned baseline)
        if kind and kind.anchors:
            anchor = kind.anchors
        else:
            u = dc.compare_u if kind and kind.planted else None
            anchor = [
                _same_run(baseline, s, {"unique_tokens": u or a[0]["unique_tokens"]})
                for s, a in zip(scales, at)
            ]
        missing = [s for s, a in zip(scales, anchor) if not a]
        if missing:
            raise DataError(
                f"change {name!r}: the baseline has no run at budget {missing[0]:.3g} with its unique tokens "
                "to compare with"
            )
        N_b, L_b = (
            np.array([np.median([r[k] for r in a]) for a in anchor]) for k in ("params", "heldout_loss")
        )
        n_b = np.array([len(a) for a in anchor])
        m_point = effective_data_multiplier(point, N_b, L, L_b)[0]
        shape = (len(samples), len(L))
        # the true losses: the measured ones less a draw of their seeds' noise (module doc); the change and
        # its anchor share a scale's draw of sigma
        sig = sigma_draws(rng, noise, scales, shape[0])
        m_samples = effective_data_multiplier(
            samples, N_b, L[None, :] - median_noise(rng, sig, n), L_b[None, :] - median_noise(rng, sig, n_b)
        )
        log_m = np.log10(np.clip(np.nan_to_num(m_samples, nan=1.0), 1e-300, 1e300))
        slopes = np.polyfit(logc, log_m.T, 1)[0]
        fin = np.isfinite(m_point) & (m_point > 0)
        slope, intercept = (
            np.polyfit(logc[fin], np.log10(m_point[fin]), 1) if fin.sum() >= 2 else (math.nan, math.nan)
        )
        entry: dict[str, Any] = {
            "name": name,
            "multipliers": [float(x) for x in m_point],
            "low": _bound(log_m, q),
            "high": _bound(log_m, 100 - q),
            "slope_per_decade": float(slope),
            "slope_interval": [float(np.percentile(slopes, q)), float(np.percentile(slopes, 100 - q))],
            "fitted": [float(10 ** (intercept + slope * x)) for x in logc] if fin.sum() >= 2 else None,
            "at_target": float(10 ** (intercept + slope * math.log10(target)))
            if fin.sum() >= 2
            else math.nan,
            "scales": [
                {
                    "budget": s,
                    "params": float(N[j]),
                    "tokens": float(D[j]),
                    "unique_tokens": float(U[j]),
                    "epochs": float(D[j] / U[j]),
                    "heldout_loss": float(L[j]),
                    "baseline_heldout_loss": float(L_b[j]),
                    "seeds": int(n[j]),
                }
                for j, s in enumerate(scales)
            ],
        }
        if kind:
            entry.update(compute_multiple=kind.compute_multiple, notes=kind.notes)
        entry["verdict"] = verdict(entry, dc.tolerance)
        out_changes.append(entry)
    N_b, D_b, U_b, L_b = (_column(baseline, k) for k in ("params", "tokens", "unique_tokens", "heldout_loss"))
    rel = fit.predict(N=N_b, D=D_b, U=U_b) / L_b - 1
    warnings = law_warnings(fit, points, sigma, dof) + noise["warnings"]
    N_p, D_p, U_p, L_p = (_column(points, k) for k in ("params", "tokens", "unique_tokens", "heldout_loss"))
    rel_points = fit.predict(N=N_p, D=D_p, U=U_p) / L_p - 1  # what the law was fitted to
    return {
        "mode": "data",
        "budgets": scales,
        "target": target,
        "compare_unique_tokens": dc.compare_u,
        "seed_sigma": sigma,
        "seed_sigma_by_scale": [
            {"budget": s, "sigma": noise[s][0], "dof": noise[s][1], "own": noise[s][2]} for s in scales
        ],
        "law": fit.to_dict(),
        "law_max_abs_rel_error": float(np.max(np.abs(rel_points))),
        "baseline": [
            {
                **{k: r[k] for k in ("budget", "params", "tokens", "unique_tokens", "heldout_loss")},
                "epochs": r["tokens"] / r["unique_tokens"],
                "predicted": float(r["heldout_loss"] * (1 + e)),
            }
            for r, e in zip(baseline, rel)
        ],
        "changes": out_changes,
        "warnings": warnings,
    }


def seed_noise(repeats: dict[tuple[Any, ...], list[float]], scales: list[float]) -> dict[Any, Any]:
    """Each scale's seed noise from the repeats of one run (key: name, scale, tokens, unique tokens; value:
    its seeds' held-out losses): {scale: (sigma, dof, own)} with the pooled standard deviation over that
    scale's runs of 2 or more seeds and its degrees of freedom; a scale with no repeat borrows the pooled
    figure of every scale (own False, and a warning says so), since the noise differs between sizes (the
    shipped study: 0.05 nats at depth 1, whose rare slow runs widen it, against 0.017 and 0.027 at depths 2
    and 3); 'pooled': (sigma, dof) over all scales; 'warnings'."""
    ss: dict[float, float] = {s: 0.0 for s in scales}
    df: dict[float, int] = {s: 0 for s in scales}
    for (_, scale, *_), losses in repeats.items():
        if len(losses) > 1 and scale in ss:
            x = np.asarray(losses, dtype=float)
            ss[scale] += float(np.sum((x - x.mean()) ** 2))
            df[scale] += len(x) - 1
    total, dof = sum(ss.values()), sum(df.values())
    pooled = (math.sqrt(total / dof) if dof else 0.0, dof)
    out: dict[Any, Any] = {"pooled": pooled, "warnings": []}
    for s in scales:
        if df[s]:
            out[s] = (math.sqrt(ss[s] / df[s]), df[s], True)
        else:
            out[s] = (*pooled, False)
            if dof:
                out["warnings"].append(
                    f"budget {s:.3g}: no run trained more than one seed there; its intervals borrow the seed "
                    f"noise of the other sizes ({pooled[0]:.4f} nats/token), which may not be its own (give a "
                    "change `seeds` there, or law_seeds)"
                )
    return out


def sigma_draws(
    rng: np.random.Generator, noise: dict[Any, Any], scales: list[float], count: int
) -> np.ndarray:
    """(count, scales) draws of each scale's seed noise sigma given its estimate s on dof degrees of freedom:
    s * sqrt(dof / chi2(dof)) (its posterior under a flat prior on log sigma), so that an estimate from few
    repeats widens the intervals as Student's t does instead of being taken as exact; s where dof is 0."""
    columns = []
    for s in scales:
        sigma, dof = noise[s][0], noise[s][1]
        columns.append(sigma * np.sqrt(dof / rng.chisquare(dof, count)) if dof else np.full(count, sigma))
    return np.stack(columns, axis=1)


def median_noise(rng: np.random.Generator, sigma: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """The noise of a point that is the median of seeds[j] runs (point_medians; a point of 2 is their
    mean), each run's held-out loss its true value plus a normal draw of sd sigma[:, j]: the median of that
    many draws, for each of sigma's rows (S, M) -> (S, M)."""
    out = np.empty_like(sigma)
    for j, n in enumerate(np.asarray(seeds, dtype=int)):
        out[:, j] = np.median(rng.normal(0.0, 1.0, (sigma.shape[0], max(int(n), 1))), axis=1) * sigma[:, j]
    return out


def law_warnings(fit: Any, points: list[dict[str, Any]], sigma: float, dof: int) -> list[str]:
    """What `tenx fit` would flag on the law the verdicts rest on (tenx.scaling.fit.report.fit_warnings: a
    parameter at its bound, too few points, intervals of no width; regime_warnings: runs the law does not
    describe), and seed noise measured from no repeat at all."""
    from tenx.scaling.fit.data_law_check import regime_warnings
    from tenx.scaling.fit.report import fit_warnings
    from tenx.scaling.table import Points

    out = fit_warnings({"fit": fit.to_dict(), "n_fit": len(points)})
    N, D, U, L = (_column(points, k) for k in ("params", "tokens", "unique_tokens", "heldout_loss"))
    out += regime_warnings(Points(N, D, L, 6 * N * D, U, _column(points, "budget")))
    if dof == 0:
        out.append(
            f"seed noise {sigma:.4f} nats/token is from one seed per run at the smallest scale (no repeat): "
            "the intervals leave seed noise out (raise seeds or law_seeds)"
        )
    return out


def _same_run(baseline: list[dict[str, Any]], scale: float, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The baseline's rows (its seeds) at `scale` on all of its tokens (the longest runs there) and with
    `row`'s unique tokens: the runs a change's run at that scale is compared with."""
    same = [r for r in baseline if r["budget"] == scale and r["unique_tokens"] == row["unique_tokens"]]
    longest = max((r["tokens"] for r in same), default=None)
    return [r for r in same if r["tokens"] == longest]


def _bound(log_m: np.ndarray, q: float) -> list[float]:
    """The q-th percentile of each column of log10 multipliers (clipped at +-300: inf beyond), as m."""
    values = np.percentile(log_m, q, axis=0)
    return [math.inf if v >= 299 else float(10**v) for v in values]


# ----- the whole study -------------------------------------------------------------------------------
def train_phases(dc: DeriskConfig, planned: list[DataRun], of: list[int], count: int) -> list[int]:
    """The phase each of `count` distinct runs trains in (planned[i] trains as run of[i]): with distilled
    changes, the members of their teachers first (0), then every other run with the students (1), so that
    the students wait only for their teachers and the workers stay busy (the runs of a phase start longest
    first); without, one phase."""
    teachers = {f"{c.distill_from}/member" for c in dc.change if c.distill_from}
    if not teachers:
        return [0] * count
    phases = [1] * count
    for i, p in enumerate(planned):
        if p.stage in teachers:
            phases[of[i]] = 0
    if any(phases[of[i]] < p.phase for i, p in enumerate(planned)):  # a student its own teacher's member
        raise DataError("a distilled change's run is also a member of the ensemble it learns from")
    return phases


def run_data_derisk(dc: DeriskConfig, out: str | Path, *, dry_run: bool = False) -> dict[str, Any]:
    """Train the baseline's and the changes' runs (reusing runs already in OUT), fit, report. A run two
    stages share trains once; the members of the ensembles distilled changes learn from train first, and
    every other run, the students included, after those ensembles are assembled (OUT/ensembles)."""
    out = Path(out)
    planned = plan_data_derisk(dc, dry_run=dry_run, out=out)
    check_law_fits(planned)  # before anything trains, and in the dry run
    unique: list[DataRun] = []
    index: dict[str, int] = {}
    of: list[int] = []  # planned[i] trains as unique[of[i]]
    for p in planned:
        key = config_key(p.run.config)
        if key not in index:
            index[key] = len(unique)
            unique.append(p)
        of.append(index[key])
    if dry_run:
        for name in ["baseline", *(c.name for c in dc.change)]:
            mine = [i for i, p in enumerate(planned) if p.stage.split("/")[0] == name]
            own = [i for i in mine if unique[of[i]] is planned[i]]
            print(f"{name}: {len(mine)} runs" + (f" ({len(own)} its own)" if len(own) != len(mine) else ""))
        print(format_dry_run([p.run for p in unique], dc.ladder))
        for warning in plan_warnings(planned):
            print(f"WARNING: {warning}")
        return {}
    scales = sorted(dc.budgets)
    ensembles = [c for c in dc.change if c.ensemble > 1]

    def counts(c: ChangeConfig) -> dict[float, int]:
        return {s: change_seeds(dc, c, s) for s in scales}

    def found(rows: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        return {i: {**rows[of[i]], "budget": p.scale} for i, p in enumerate(planned) if of[i] in rows}

    def assemble(rows: dict[int, dict[str, Any]]) -> None:  # the teachers, before their students train
        teachers = {c.distill_from for c in dc.change}
        for c in ensembles:
            if c.name in teachers:  # scored with the others after the last phase (the workers wait now)
                assemble_ensembles(c, planned, found(rows), scales, counts(c), out)

    def analysed(rows: dict[int, dict[str, Any]]) -> dict[str, Any]:
        got = found(rows)
        baseline = [got[i] for i, p in enumerate(planned) if p.stage == "baseline" and i in got]
        # an ensemble of the baseline's config trains more of the baseline's seeds at the compared point:
        # every one is a run of the baseline, so its point (the law's, and each change's anchor) is the
        # median of all of them
        keys = {r["key"] for r in baseline}
        for c in ensembles:
            for i, p in enumerate(planned):
                if not c.set and p.stage == f"{c.name}/member" and i in got and got[i]["key"] not in keys:
                    keys.add(got[i]["key"])
                    baseline.append(got[i])
        plain = {
            c.name: [got[i] for i, p in enumerate(planned) if p.stage == c.name and i in got]
            for c in dc.change
            if not c.beyond_overrides
        }
        by_name = {c.name: c for c in dc.change}
        kinds: dict[str, ChangeRows] = {}
        for c in dc.change:
            if c.ensemble > 1:
                made = assemble_ensembles(c, planned, got, scales, counts(c), out)
                kinds[c.name] = ensemble_rows(c, made, out, dc.ladder.eval_bytes)
            elif c.sweep or c.baseline_sweep:
                kinds[c.name] = tuned_rows(c, planned, got, scales, out / "ladder", dc.ladder.eval_bytes)
            elif c.planted or c.distill_from:
                at = [stage_rows(got, planned, c.name, s) for s in scales]
                price = c.planted or distill_compute_multiple(by_name[c.distill_from])
                kinds[c.name] = ChangeRows(at, compute_multiple=price, planted=bool(c.planted))
        return analyse_data(baseline, plain, dc, kinds)

    return run_study(
        dc,
        out,
        [p.run for p in unique],
        describe=lambda row: f"{row['epochs']:.3g} epochs, held-out {row['heldout_loss']:.4f} nats/token",
        analyse=analysed,
        report=format_data_derisk,
        plot=plot_data_report,
        splits=("heldout",),  # what the law reads
        phases=train_phases(dc, planned, of, len(unique)),
        between=assemble,
    )
