"""How well the curve laws predict published training curves of 25M-2B-parameter models.

    python bench/published_curves.py --data ../shared/data/curves [--laws mpl,tissue,tissue-rate,power]

`--data` is the folder of published curves (its README.md: lr-scheduling/, MultiPowerLaw/,
gemstone-scaling-laws/, datablations/); a user's clone has none, so it is an argument. Tasks, each run for
every law with the same fits (tenx.scaling.curve.fit_curves) and the same error measure:

- mpl_split: the multi-power-law paper's own split at 25M, 100M and 400M: fit its three fitting schedules,
  predict the six others (training losses, already smoothed by the authors);
- schedules: 124M (lr-scheduling, SlimPajama), per peak learning rate: fit a constant run, one cosine and
  one WSD (the 25k-step ones where they exist), predict every other schedule of that peak rate: cooldown
  fractions 0.1-0.994, linear and 1-sqrt cooldowns, cosine to 10% and to 0, other horizons; at peak 1e-3
  also the 100k- and 200k-step extensions of a 50k-step WSD run (horizon_transfer/, another data chunk);
- sizes: Hägele et al.'s scaling runs (cosine and WSD at three lengths per size): fit 33M-124M, predict
  152M, 209M and 360M (2.9x the largest fitted); and Gemstones' constant-rate runs: fit those of 1.05B
  parameters and fewer, predict the three 2B runs;
- self_30: every 124M-360M run of Hägele et al.'s set predicted from its first 30%, given its schedule, under
  a prior from the law fitted to the runs of every smaller size (its level L0(N) and shape: prior_from);
- data_law: the data-constrained law (tenx fit --law data-constrained) on Muennighoff et al.'s final
  losses: the 8.7B runs predicted from the smaller ones, and leave-one-size-out;
- coverage: the share of held-out windows inside the 95% band, every curve task together;
- read_million_rows_seconds: reading a curve table of 1,000,000 rows (written from these curves).

Errors are relative, on the mean of WINDOW consecutive logged points after warmup: `mean` over every
held-out window, `worst_window`, `worst_final` (the last window of each run), `worst_mean` (the worst of
the runs' mean window errors). Fractions: 0.005 is 0.5%. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tenx.scaling.curve import extrapolate_run, fit_curves, predict_curve, prior_from
from tenx.scaling.curve.backtest import curve_error
from tenx.scaling.curve.curve_laws import DEFAULT_LAW
from tenx.scaling.curve.curve_table import (
    CurveTable,
    TableRun,
    read_curve_table,
    table_from_rows,
    write_curve_table,
)
from tenx.scaling.curve.published_curves import MPL_FIT, RunInfo, gemstones, lr_scheduling, multipowerlaw

LAWS = ("mpl", "tissue", "tissue-rate", "tissue-lr", "tissue-area", "power")
WINDOW = 5
"""Logged points per window (1,000 steps of lr-scheduling's validation, 640 of MultiPowerLaw's)."""
GEMSTONES_FILE = "gemstone-scaling-laws/wandb_dfs/wandb_df_for_fitting_hot_100b+_477.jsonl"
SELF_FRACTION = 0.3


def summarise(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The task's figures over the held-out runs' curve_error results."""
    if not errors:
        return {"runs": 0}
    windows = np.array([e["windows"] for e in errors], dtype=float)
    return {
        "runs": len(errors),
        "mean": float(np.average([e["mean"] for e in errors], weights=windows)),
        "worst_window": max(e["max"] for e in errors),
        "worst_final": max(abs(e["final"]) for e in errors),
        "worst_mean": max(e["mean"] for e in errors),
        "coverage": float(np.average([e["coverage"] for e in errors], weights=windows)),
        "worst_run": max(errors, key=lambda e: e["max"])["curve"],
    }


def predict_runs(
    fit_runs: Sequence[TableRun], targets: Sequence[TableRun], law: str, bootstrap: int
) -> list[dict[str, Any]]:
    """Fit `law` to fit_runs' curves and measure its prediction of each target run."""
    fit = fit_curves([r.curve() for r in fit_runs], law, bootstrap=bootstrap)
    out = []
    for r in targets:
        c = r.curve()
        e = curve_error(predict_curve(fit, c.schedule, c.params), c, window=WINDOW)
        out.append({**e, "params": r.params})
    return out


def task_mpl_split(table: CurveTable, law: str, bootstrap: int) -> list[dict[str, Any]]:
    out = []
    for size in sorted({r.params for r in table.runs}):
        runs = [r for r in table.runs if r.params == size]
        fit = [r for r in runs if r.run.split("/")[-1] in MPL_FIT]
        out += predict_runs(fit, [r for r in runs if r not in fit], law, bootstrap)
    return out


def _key(i: RunInfo) -> tuple[Any, ...]:
    return (i.schedule, i.horizon, i.cooldown, i.decay, i.peak_lr, i.dataset)


def schedule_groups(
    table: CurveTable, infos: dict[str, RunInfo]
) -> list[tuple[float, list[TableRun], list[TableRun]]]:
    """(peak lr, fitting runs, held-out runs) of the 124M schedule grid; grad_norm/ reruns of a schedule
    that data/ already holds are left out."""
    val = {r.run: r for r in table.runs if r.split == "val"}
    main = {_key(i) for n, i in infos.items() if "/" not in n}
    chosen = [
        i
        for n, i in infos.items()
        if i.params == 123587328
        and n in val
        and (("/" not in n) or _key(i) not in main)
        and i.dataset.startswith("slimpajama")
    ]
    groups = []
    for lr in sorted({i.peak_lr for i in chosen}):
        at = [i for i in chosen if i.peak_lr == lr and i.dataset == "slimpajama"]
        const = [i for i in at if i.schedule == "constant" and i.horizon == 50000]
        cos = sorted(
            [i for i in at if i.schedule == "cosine"], key=lambda i: abs(i.horizon - 25000)
        ) or sorted([i for i in at if i.schedule == "cosine-zero"], key=lambda i: abs(i.horizon - 25000))
        wsd = sorted(
            [i for i in at if i.schedule == "wsd" and i.cooldown == 0.2 and i.decay == "linear"],
            key=lambda i: abs(i.horizon - 25000),
        )
        if not (const and cos and wsd):
            continue
        fit = [const[0], cos[0], wsd[0]]
        held = [i for i in at if i not in fit]
        if lr == 1e-3:  # the horizon extensions (another chunk of SlimPajama, the same model and peak)
            held += [i for i in chosen if i.peak_lr == lr and i.dataset != "slimpajama"]
        groups.append((lr, [val[i.run] for i in fit], [val[i.run] for i in held]))
    return groups


def task_schedules(
    table: CurveTable, infos: dict[str, RunInfo], law: str, bootstrap: int
) -> list[dict[str, Any]]:
    out = []
    for lr, fit, held in schedule_groups(table, infos):
        for e in predict_runs(fit, held, law, bootstrap):
            out.append({**e, "peak_lr": lr})
    return out


def hagele_runs(table: CurveTable, infos: dict[str, RunInfo]) -> list[TableRun]:
    """Hägele et al.'s scaling runs on SlimPajama (sl*/ann0.2_slimpajama* files): cosine and WSD at three
    lengths per size, 33M-360M."""
    return [
        r
        for r in table.runs
        if r.split == "val"
        and "/" not in r.run
        and (r.run.startswith("sl") or r.run.startswith("ann0.2_slimpajama"))
        and infos[r.run].dataset == "slimpajama"
        and infos[r.run].schedule != "constant"
    ]


SIZES_FIT_MAX = 130e6
"""Hägele et al.'s runs up to 124M are fitted; 152M, 209M and 360M are predicted."""
GEMSTONES_FIT_MAX = 1.1e9


def task_sizes(
    table: CurveTable, infos: dict[str, RunInfo], gems: CurveTable | None, law: str, bootstrap: int
) -> list[dict[str, Any]]:
    runs = hagele_runs(table, infos)
    fit = [r for r in runs if r.params <= SIZES_FIT_MAX]
    out = predict_runs(fit, [r for r in runs if r.params > SIZES_FIT_MAX], law, bootstrap)
    largest = max(r.params for r in fit)
    for e in out:
        e["times_largest_fitted"] = e["params"] / largest
        e["set"] = "lr-scheduling"
    if gems is not None:
        gfit = [r for r in gems.runs if r.params <= GEMSTONES_FIT_MAX]
        gheld = [r for r in gems.runs if r.params > GEMSTONES_FIT_MAX]
        glargest = max(r.params for r in gfit)
        for e in predict_runs(gfit, gheld, law, bootstrap):
            out.append({**e, "times_largest_fitted": e["params"] / glargest, "set": "gemstones"})
    return out


def task_self_30(
    table: CurveTable, infos: dict[str, RunInfo], law: str, bootstrap: int
) -> list[dict[str, Any]]:
    """Each 124M-360M run from its first 30%: the law fitted to the runs of every smaller size (a ladder
    below it) is the prior on the run's level L0(N) and shape (prior_from), which its own records correct."""
    out = []
    runs = hagele_runs(table, infos)
    for size in sorted({r.params for r in runs}):
        if not 120e6 <= size <= 400e6:
            continue
        below = fit_curves([r.curve() for r in runs if r.params < size], law, bootstrap=0)
        prior = prior_from(below, keep_free=(), params=size)
        for r in runs:
            if r.params != size:
                continue
            c = r.curve()
            cut = int(SELF_FRACTION * c.schedule.steps)
            pred, _ = extrapolate_run(c.upto(cut), law, prior=prior, bootstrap=bootstrap)
            e = curve_error(pred, c, window=WINDOW, start=cut + 1)
            out.append({**e, "params": r.params, "from_step": cut})
    return out


def million_rows_seconds(rows: list[dict[str, Any]], directory: Path) -> dict[str, float]:
    """Write a curve table of 1,000,000 rows (these curves, repeated under new run names) and time its read."""
    need, out, copy = 1_000_000, [], 0
    while len(out) < need:
        out += [{**r, "run": f"copy{copy}/{r['run']}"} for r in rows[: need - len(out)]]
        copy += 1
    path = directory / "million.csv"
    start = time.perf_counter()
    write_curve_table(path, out)
    written = time.perf_counter() - start
    start = time.perf_counter()
    table = read_curve_table(path)
    read = time.perf_counter() - start
    assert table.rows == need
    return {"rows": need, "read_seconds": read, "write_and_check_seconds": written}


def data_law_figures(data: Path) -> dict[str, Any]:
    from tenx.scaling.fit.data_law_check import data_law_check

    r = data_law_check(data / "datablations" / "final_val_losses.csv")
    return {
        "worst": r["worst"],
        "worst_all": r["worst_all"],
        "runs": [
            {k: run[k] for k in ("name", "epochs", "tokens", "error", "compute_optimal")} for run in r["runs"]
        ],
        "leave_one_size_out": {f"{n:.4g}": e for n, e in r["leave_one_size_out"].items()},
        "leave_one_size_out_mean": r["leave_one_size_out_mean"],
        "warnings": r["warnings"],
        "options": r["options"],
    }


def run(data: Path, laws: Sequence[str], bootstrap: int, quick: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    mpl_rows, _ = multipowerlaw(data / "MultiPowerLaw")
    mpl = table_from_rows(mpl_rows, "MultiPowerLaw")
    lrs_rows, infos = lr_scheduling(data / "lr-scheduling")
    lrs = table_from_rows(lrs_rows, "lr-scheduling")
    gem_path = data / GEMSTONES_FILE
    gems = table_from_rows(gemstones(gem_path)[0], "gemstones") if gem_path.exists() else None
    tasks: dict[str, dict[str, Any]] = defaultdict(dict)
    details: dict[str, dict[str, Any]] = defaultdict(dict)
    coverage: dict[str, float] = {}
    for law in laws:
        t = time.perf_counter()
        per_task: dict[str, list[dict[str, Any]]] = {
            "mpl_split": task_mpl_split(mpl, law, bootstrap),
            "schedules": task_schedules(lrs, infos, law, bootstrap),
            "sizes": task_sizes(lrs, infos, gems, law, bootstrap),
        }
        per_task["self_30"] = task_self_30(lrs, infos, law, bootstrap)
        for name, errors in per_task.items():
            s = summarise(errors)
            tasks[name][law] = (
                {k: s[k] for k in ("mean", "worst_window", "worst_final", "worst_mean")} if errors else {}
            )
            details[name][law] = {"summary": s, "runs": errors}
        if per_task["sizes"]:
            far = [e for e in per_task["sizes"] if e["times_largest_fitted"] > 2.5]
            tasks["sizes"][law]["beyond_2_5x"] = {
                "worst_final": max(abs(e["final"]) for e in far) if far else None,
                "worst_mean": max(e["mean"] for e in far) if far else None,
                "runs": [e["curve"] for e in far],
            }
        every = [e for errors in per_task.values() for e in errors]
        w = np.array([e["windows"] for e in every], dtype=float)
        coverage[law] = float(np.average([e["coverage"] for e in every], weights=w))
        print(f"{law}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        million = million_rows_seconds(lrs_rows, Path(tmp))
    data_law = data_law_figures(data) if (data / "datablations").is_dir() else {}
    return {
        "default_law": DEFAULT_LAW,
        "tasks": dict(tasks),
        "data_law": data_law,
        "coverage": coverage,
        "read_million_rows_seconds": million["read_seconds"],
        "seconds": time.perf_counter() - t0,
        "details": dict(details),
    }


def print_table(result: dict[str, Any], laws: Sequence[str]) -> None:
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    print(f"{'task':<10} {'law':<12} {'mean':>7} {'worst window':>13} {'worst final':>12} {'worst mean':>11}")
    for task, by_law in result["tasks"].items():
        for law in laws:
            f = by_law.get(law) or {}
            print(
                f"{task:<10} {law:<12} {pct(f.get('mean')):>7} {pct(f.get('worst_window')):>13} "
                f"{pct(f.get('worst_final')):>12} {pct(f.get('worst_mean')):>11}"
            )
    print("coverage of the 95% bands: " + ", ".join(f"{k} {v:.2f}" for k, v in result["coverage"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--data", required=True, type=Path, help="the published curves' folder (../shared/data/curves)"
    )
    ap.add_argument("--laws", default=",".join(LAWS), help="comma-separated curve laws")
    ap.add_argument("--bootstrap", type=int, default=10, help="bootstrap refits per fit (the bands)")
    ap.add_argument("--details", type=Path, help="write every run's errors to this JSON file")
    args = ap.parse_args(argv)
    if not (args.data / "lr-scheduling").is_dir() or not (args.data / "MultiPowerLaw").is_dir():
        ap.error(
            f"--data {args.data}: expected lr-scheduling/ and MultiPowerLaw/ in it (../shared/data/curves)"
        )
    laws = [law for law in args.laws.split(",") if law]
    result = run(args.data, laws, args.bootstrap)
    details = result.pop("details")
    if args.details:
        args.details.write_text(json.dumps(details, indent=1, default=float))
    print_table(result, laws)
    print(json.dumps(result, default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
