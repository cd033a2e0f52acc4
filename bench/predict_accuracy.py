"""How well tenx predicts losses it has not seen: whole curves across schedules and sizes, a run from its
own start, and the published Gadre et al. runs, each against a named baseline measured in the same process.

Curves (default: the 14 real runs of tests/data/curves, or --curves DIR of run directories such as a
ladder's runs/ folder): the default curve law (tissue-rate) against the schedule-blind power law
L0 + A*D^-alpha, on
- leave-largest-out: every run of the smaller sizes predicts the largest size's runs, whole curves;
- cross-schedule: cosine runs of a size predict its WSD and constant-then-linear-decay runs;
- self-extrapolation: each run from its first 30% (law shape under a prior fitted to the other runs).
Errors are absolute relative errors of the loss averaged over 25-record windows after warmup.

Published runs: the 1.4B and 6.9B c4_original runs predicted from those below 1B, with the fit variant
chosen by inner cross-validation (non-embedding parameters) against the previous default (total
parameters).

The last line is JSON with ladder_final_max_err, ladder_curve_max_err, schedule_max_err,
self_extrapolation_err, gadre_c4_max_err, interval_coverage (errors as fractions) and the baselines'.

    python bench/predict_accuracy.py              # about 30 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from tenx.scaling.curve import DEFAULT_LAW, EXTRAPOLATION_LAW, fit_curves, read_curves
from tenx.scaling.curve.evaluate import WINDOW, protocol, self_extrapolation_error, split_error
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
        "rows": {
            "leave_largest_out": largest["curves"],
            "cross_schedule": cross_rows,
            "self": selfx["curves"],
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--curves", default=str(ROOT / "tests" / "data" / "curves"), help="a folder of run directories"
    )
    ap.add_argument("--bootstrap", type=int, default=20, help="bootstrap resamples per fit (bands)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    curves = read_curves(args.curves)
    print(f"{len(curves)} curves from {args.curves}")
    ours = curve_figures(curves, DEFAULT_LAW, EXTRAPOLATION_LAW, args.bootstrap)
    base = curve_figures(curves, "power", "power", args.bootstrap)
    gadre = published_accuracy(DEFAULT_VARIANT)
    gadre_base = published_accuracy(TOTAL)
    c4, c4_base = gadre["c4_original"], gadre_base["c4_original"]

    keys = [
        ("ladder_final_max_err", "leave-largest-out, final loss, max"),
        ("ladder_curve_max_err", "leave-largest-out, whole curve, max"),
        ("ladder_curve_mean_err", "leave-largest-out, whole curve, mean"),
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
        "law": DEFAULT_LAW,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
