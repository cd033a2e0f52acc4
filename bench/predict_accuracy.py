"""How well tenx predicts losses it has not seen: whole curves across schedules and sizes, a run from its
own start, and the published Gadre et al. runs, each against a named baseline measured in the same process.

With `--ladder LADDER_DIR` (what `tenx ladder --out LADDER_DIR` trained; the acceptance figures), the
curves are the runs' validation losses (`val_loss`, logged ladder.evals_per_run times per run on fixed
held-out batches), compared at every logged step after warmup:
- leave-largest-budget-out: every run of the smaller budgets predicts the top budget's runs;
- cross-schedule: the whole cosine ladder predicts two runs of a held-out size (depth 4) on other schedules,
  warmup-stable-decay (the last 20% decays) and constant-then-linear-decay (the last 50%), which this
  script trains into `--extra DIR` when they are missing (`--no-train`: fail instead);
- self-extrapolation: each ladder run from its first 30%, under a prior fitted to the other ladder runs.
Without it, the curves are the training losses of the 14 runs of tests/data/curves (or `--curves DIR`),
averaged over 25-record windows: leave-largest-size-out, cross-schedule at each size, self-extrapolation.

The default curve law (tissue-rate) is compared with the schedule-blind power law L0 + A*D^-alpha.
Published runs: the 1.4B and 6.9B c4_original runs predicted from those below 1B, with the fit variant
chosen by inner cross-validation (non-embedding parameters) against the previous default (total
parameters).

The last line is JSON with ladder_final_max_err, ladder_curve_max_err, schedule_max_err,
self_extrapolation_err, gadre_c4_max_err, interval_coverage (errors as fractions) and the baselines'.

    python bench/predict_accuracy.py                                     # stored curves, about 30 s
    tenx ladder --out runs/ladder --set train.precision=fp32             # the default ladder
    python bench/predict_accuracy.py --ladder runs/ladder --extra runs/ladder-bench
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from tenx.scaling.curve import DEFAULT_LAW, EXTRAPOLATION_LAW, Curve, curve_from_run, fit_curves, read_curves
from tenx.scaling.curve.backtest import WINDOW, protocol, self_extrapolation_error, split_error
from tenx.scaling.curve.curve_table import read_curve_table
from tenx.scaling.curve.extrapolate import prior_from, shape_prior
from tenx.scaling.fit.published import DEFAULT_VARIANT, TOTAL, published_accuracy

ROOT = Path(__file__).resolve().parents[1]


def curve_figures(curves: list, law: str, extrapolation_law: str, bootstrap: int) -> dict:
    """Leave-largest-out, cross-schedule and self-extrapolation figures of one law."""
    by_name = {c.name: c for c in curves}
    splits = protocol(curves)
    lo = splits["leave_largest_out"]
    largest = split_error(
        law,
        [by_name[n] for n in lo["train"]],
        [by_name[n] for n in lo["test"]],
        WINDOW,
        bootstrap=bootstrap,
        size_law="power",
    )
    cross_rows = []
    for s in splits["cross_schedule"]:
        r = split_error(
            law,
            [by_name[n] for n in s["train"]],
            [by_name[n] for n in s["test"]],
            WINDOW,
            bootstrap=bootstrap,
        )
        cross_rows += r["curves"]
    priors = {
        c.name: fit_curves([o for o in curves if o is not c], extrapolation_law, bootstrap=0) for c in curves
    }
    selfx = self_extrapolation_error(extrapolation_law, curves, 0.3, priors, WINDOW, bootstrap)
    rows = largest["curves"] + cross_rows + selfx["curves"]
    weights = np.array([r["windows"] for r in rows], dtype=float)
    return {
        "ladder_final_max_err": max(abs(r["final"]) for r in largest["curves"]),
        "ladder_curve_max_err": largest["max"],
        "ladder_curve_mean_err": largest["mean"],
        "schedule_max_err": max(r["max"] for r in cross_rows),
        "schedule_mean_err": float(
            np.average([r["mean"] for r in cross_rows], weights=[r["windows"] for r in cross_rows])
        ),
        "self_extrapolation_err": max(abs(r["final"]) for r in selfx["curves"]),
        "self_extrapolation_mean_err": float(np.mean([abs(r["final"]) for r in selfx["curves"]])),
        "interval_coverage": float(np.average([r["coverage"] for r in rows], weights=weights)),
        "skipped": selfx["skipped"],
        "rows": {
            "leave_largest_out": largest["curves"],
            "cross_schedule": cross_rows,
            "self": selfx["curves"],
        },
    }


EXTRA_DEPTH = 4
EXTRA_STEPS = 300
EXTRA_SCHEDULES = {"wsd": 0.2, "lin": 0.5}
"""The benchmark's own runs: depth 4 (2.3x the ladder's largest model) for EXTRA_STEPS steps of the
ladder's batch, warmup-stable-decay with these decay fractions (0.5: constant, then linear decay)."""


def extra_runs(ladder_dir: Path, out: Path, train_missing: bool) -> list[Curve]:
    """The cross-schedule targets, trained into `out` with the ladder's own machinery when missing."""
    import dataclasses

    from tenx.model.flops import flops_per_token
    from tenx.scaling.ladder.rungs import LadderConfig, plan_ladder, shape_for_depth, vocab_size_of
    from tenx.scaling.ladder.runner import read_results, run_one
    from tenx.train.config import load_run_config

    if not train_missing:  # the runs as they are (e.g. tests/data/ladder-val-bench)
        if not (out / "runs").is_dir():
            raise SystemExit(f"{out / 'runs'}: missing; run without --no-train to train the extra runs")
        return read_curves(out / "runs", quantity="val_loss")
    rows = read_results(ladder_dir)
    if not rows:
        raise SystemExit(f"{ladder_dir}: no results.jsonl rows; train the ladder first (tenx ladder --out)")
    top = max(rows, key=lambda r: r["params"])
    base = load_run_config(Path(top["run_dir"]) / "config.toml")
    fpt = flops_per_token(shape_for_depth(base.model, EXTRA_DEPTH, vocab_size_of(base)))
    budget = float(fpt * EXTRA_STEPS * top["global_batch"] * top["seq_len"])
    lc = LadderConfig(budgets=[budget], grid="ratio", min_depth=EXTRA_DEPTH, max_depth=EXTRA_DEPTH)
    curves = []
    for tag, fraction in EXTRA_SCHEDULES.items():
        optim = dataclasses.replace(base.optim, schedule="wsd", decay_fraction=fraction)
        (run,) = plan_ladder(dataclasses.replace(base, optim=optim), lc, tag)
        run_dir = out / "runs" / run.name
        if not (run_dir / "metrics.jsonl").exists() or not any(
            r.get("name") == run.name for r in read_results(out)
        ):
            t0 = time.perf_counter()
            run_one(run, out, lc)
            print(f"trained {run.name} ({run.steps} steps) in {time.perf_counter() - t0:.0f} s", flush=True)
        curves.append(curve_from_run(run_dir, quantity="val_loss"))
    return curves


def _coverage(rows: list[dict]) -> float:
    return float(np.average([r["coverage"] for r in rows], weights=[r["windows"] for r in rows]))


def ladder_figures(
    ladder: list[Curve], extra: list[Curve], law: str, bootstrap: int, published: str | None = None
) -> dict:
    """Leave-largest-budget-out, cross-schedule (extra runs) and self-extrapolation on validation curves.
    With `published` (a curve table), the fits across budgets and schedules take a prior on the law's
    unit-free shape (shape_prior) from a fit to those curves."""
    by_name = {c.name: c for c in ladder}
    shape = {}
    if published is not None:
        table = read_curve_table(published)
        shape = shape_prior(fit_curves([r.curve() for r in table.select()], law, bootstrap=0))
    split = protocol(ladder).get("leave_largest_budget_out")
    if split is None:
        raise SystemExit("the ladder's runs have fewer than two budgets (or no run.json with FLOPs)")
    train = [by_name[n] for n in split["train"]]
    largest = split_error(
        law, train, [by_name[n] for n in split["test"]], 1, bootstrap=bootstrap, size_law="power", prior=shape
    )
    cross = split_error(law, ladder, extra, 1, bootstrap=bootstrap, size_law="power", prior=shape)
    # each run from its first 30%, under the prior of a fit of every other ladder run: its whole curve
    # (the level L0(N) for this run's size included), which the run's own records then correct
    priors = {}
    for c in ladder:
        others = fit_curves([o for o in ladder if o is not c], law, bootstrap=0)
        priors[c.name] = prior_from(others, keep_free=(), params=c.params)
    selfx = self_extrapolation_error(law, ladder, 0.3, priors, 1, bootstrap)
    rows = largest["curves"] + cross["curves"] + selfx["curves"]
    return {
        "ladder_final_max_err": largest["max_final"],
        "ladder_curve_max_err": largest["max"],
        "ladder_curve_mean_err": largest["mean"],
        "schedule_max_err": cross["max"],
        "schedule_mean_err": cross["mean"],
        "self_extrapolation_err": selfx["max_final"],
        "self_extrapolation_mean_err": float(np.mean([abs(r["final"]) for r in selfx["curves"]])),
        "interval_coverage": _coverage(rows),
        "skipped": selfx["skipped"],
        "rows": {
            "leave_largest_budget_out": largest["curves"],
            "cross_schedule": cross["curves"],
            "self": selfx["curves"],
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--curves", default=str(ROOT / "tests" / "data" / "curves"), help="a folder of run directories"
    )
    ap.add_argument("--ladder", help="a trained ladder directory (tenx ladder --out): the acceptance figures")
    ap.add_argument("--extra", help="where the cross-schedule runs live (default: LADDER_DIR-bench)")
    ap.add_argument(
        "--no-train", action="store_true", help="take the extra runs as they are in --extra; train none"
    )
    ap.add_argument("--bootstrap", type=int, default=20, help="bootstrap resamples per fit (bands)")
    ap.add_argument(
        "--published-prior",
        metavar="TABLE",
        help="with --ladder: a curve table of published runs whose fit is a prior on the law's shape "
        "(e.g. tests/data/published-curves/mpl-25m-fit.csv)",
    )
    args = ap.parse_args()

    t0 = time.perf_counter()
    if args.ladder:
        ladder_dir = Path(args.ladder)
        extra = extra_runs(ladder_dir, Path(args.extra or f"{ladder_dir}-bench"), not args.no_train)
        t0 = time.perf_counter()
        curves = read_curves(ladder_dir / "runs", quantity="val_loss")
        print(f"{len(curves)} validation curves from {ladder_dir}, {len(extra)} cross-schedule runs")
        ours = ladder_figures(curves, extra, DEFAULT_LAW, args.bootstrap, args.published_prior)
        base = ladder_figures(curves, extra, "power", args.bootstrap, args.published_prior)
        if args.published_prior:
            print(f"the law's shape carries a prior from a fit to {args.published_prior} (shape_prior)")
        for part, rows in ours["rows"].items():
            print(f"\n{part} ({DEFAULT_LAW}; error of the final point, max and mean over logged steps):")
            for r in rows:
                print(
                    f"  {r['curve']:<24} final {r['final']:>+7.2%}  max {r['max']:>6.2%}  mean {r['mean']:>6.2%}"
                    f"  in band {r['coverage']:>4.0%}"
                )
        for name, why in ours["skipped"].items():
            print(f"  self-extrapolation skips {name}: {why}")
    else:
        curves = read_curves(args.curves)
        print(f"{len(curves)} curves from {args.curves}")
        ours = curve_figures(curves, DEFAULT_LAW, EXTRAPOLATION_LAW, args.bootstrap)
        base = curve_figures(curves, "power", "power", args.bootstrap)
    gadre = published_accuracy(DEFAULT_VARIANT)
    gadre_base = published_accuracy(TOTAL)
    c4, c4_base = gadre["c4_original"], gadre_base["c4_original"]

    held = "leave-largest-budget-out" if args.ladder else "leave-largest-out"
    keys = [
        ("ladder_final_max_err", f"{held}, final loss, max"),
        ("ladder_curve_max_err", f"{held}, whole curve, max"),
        ("ladder_curve_mean_err", f"{held}, whole curve, mean"),
        ("schedule_max_err", "cross-schedule, whole curve, max"),
        ("schedule_mean_err", "cross-schedule, whole curve, mean"),
        ("self_extrapolation_err", "self-extrapolation from 30%, final, max"),
        ("self_extrapolation_mean_err", "self-extrapolation from 30%, final, mean"),
    ]
    print(f"\n{'figure':<44} {DEFAULT_LAW:>12} {'power (base)':>13} {'ratio':>7}")
    for key, label in keys:
        print(f"{label:<44} {ours[key]:>11.2%} {base[key]:>13.2%} {ours[key] / base[key]:>7.2f}")
    print(
        f"{'band coverage (all held-out windows)':<44} {ours['interval_coverage']:>11.0%} {base['interval_coverage']:>13.0%}"
    )
    print(
        f"\nGadre et al. c4_original, >= 1B runs predicted from < 1B ({DEFAULT_VARIANT.name} vs {TOTAL.name}):"
    )
    for name in c4:
        print(f"  {name:<34} {c4[name]:>+8.2%} {c4_base[name]:>+8.2%}")
    for dataset in ("rpj", "rw_original"):
        worst = max(abs(v) for v in gadre[dataset].values())
        print(
            f"  {dataset}: worst {worst:.2%} (before: {max(abs(v) for v in gadre_base[dataset].values()):.2%})"
        )
    gadre_max = max(abs(v) for v in c4.values())
    gadre_base_max = max(abs(v) for v in c4_base.values())
    print(f"\n{time.perf_counter() - t0:.0f} s")
    figures = {key: round(ours[key], 5) for key, _ in keys}
    figures |= {
        "gadre_c4_max_err": round(gadre_max, 5),
        "interval_coverage": round(ours["interval_coverage"], 4),
        "baseline": "power law in tokens (schedule-blind); Gadre: total parameters",
        "baseline_ladder_final_max_err": round(base["ladder_final_max_err"], 5),
        "baseline_ladder_curve_max_err": round(base["ladder_curve_max_err"], 5),
        "baseline_schedule_max_err": round(base["schedule_max_err"], 5),
        "baseline_self_extrapolation_err": round(base["self_extrapolation_err"], 5),
        "baseline_gadre_c4_max_err": round(gadre_base_max, 5),
        "gadre_max_err": {d: round(max(abs(v) for v in r.values()), 5) for d, r in gadre.items()},
        "curves": len(curves),
        "source": str(args.ladder or args.curves),
        "quantity": "val_loss" if args.ladder else "loss",
        "law": DEFAULT_LAW,
        "published_prior": args.published_prior,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
