"""Data efficiency: which changes make repeated data worth more, by how much, and does the gain persist?

Runs the study of configs/derisk/data_efficiency.toml (`tenx derisk` in data mode: tenx/scaling/
derisk/data_multiplier.py): the baseline at 3 model sizes on fresh data and capped at each unique-token budget U,
each on several fractions of its tokens; Muennighoff et al. (2023)'s data-constrained law fitted to those
runs; each change trained at U = compare_unique_tokens and read off the law, anchored at the baseline's own
run there, as an effective data multiplier per scale, with a 95% interval and a verdict. Runs already in
OUT are reused, so a second call only re-analyses.

The law is then checked on points it was not fitted on, two ways, each against the baseline's own law as
the named baseline of this benchmark:
- leave one out: each repeated-data baseline point (a size, its tokens and unique tokens: the median of its
  seeds, robust to the rare depth-1 run that trains slowly, as the law's Huber fit is) predicted by the law
  fitted to every other baseline run;
- the largest size's repeated points: its repeated-data runs predicted by the law fitted to everything
  else, the largest size's own fresh (single-epoch) runs included: extrapolation in epochs at that size, not
  in model size. Holding out the largest size's fresh points too would leave two sizes, which do not pin
  the law's E, A and alpha (on an exact law its points then come out 6% off): a study of three sizes cannot
  check extrapolation in model size (docs/scaling.md#muennighoff-et-als-runs does, at 8.7B).

Prints the multipliers table and the held-out errors, writes OUT/report.md and OUT/report.png (held-out loss
against epochs per size with the law; multipliers per scale), and ends with one JSON line.

    python bench/data_efficiency.py [--out runs/data-efficiency] [--config configs/derisk/data_efficiency.toml]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from tenx.scaling.derisk.compute_multiplier import load_derisk
from tenx.scaling.derisk.data_multiplier import LAW_FIT, point_medians, run_data_derisk
from tenx.scaling.fit import fit_data_constrained

ROOT = Path(__file__).resolve().parents[1]


def heldout_errors(baseline: list[dict[str, Any]], seed_sigma: float = math.nan) -> dict[str, Any]:
    """Relative errors of the law on baseline points it was not fitted on (see the module docstring). A
    point is a (size, tokens, unique tokens) triple, one row of `point_medians` (the law is fitted to those):
    its seeds are left out together and their median loss is what the law predicts. With `seed_sigma` (a run's held-out loss spread over seeds, nats), each point
    also gets `noise`: that spread relative to the point's loss, over the square root of its seeds (the
    error a law that were exact would still show there, one standard deviation)."""
    rows = point_medians(baseline)  # one row per point, as the study fits the law
    cols = {k: np.array([r[k] for r in rows], dtype=float) for k in ("params", "tokens", "unique_tokens")}
    loss = np.array([r["heldout_loss"] for r in rows], dtype=float)
    triples = [tuple(x) for x in np.column_stack([cols["params"], cols["tokens"], cols["unique_tokens"]])]
    points = sorted(triples)
    index = {p: i for i, p in enumerate(triples)}
    repeated = [p for p in points if p[1] > p[2] * (1 + 1e-9)]

    def predict(train: np.ndarray, test: list[tuple[float, float, float]]) -> np.ndarray:
        fit = fit_data_constrained(
            cols["params"][train],
            cols["tokens"][train],
            cols["unique_tokens"][train],
            loss[train],
            bootstrap=0,
            **LAW_FIT,
        )
        N, D, U = (np.array([t[k] for t in test]) for k in range(3))
        return fit.predict(N=N, D=D, U=U)

    def errors(
        test: list[tuple[float, float, float]], drop_size: float | None = None
    ) -> list[dict[str, float]]:
        """The law fitted without `test` (and without every point of size `drop_size`) predicting it."""
        if not test:
            return []
        left = np.array([index[p] for p in test])
        rest = np.setdiff1d(np.arange(len(rows)), left)
        if drop_size is not None:
            rest = rest[cols["params"][rest] != drop_size]
        if not (cols["tokens"][rest] > cols["unique_tokens"][rest] * (1 + 1e-9)).any():
            return []
        predicted = predict(rest, test)
        return [
            {
                "params": p[0],
                "unique_tokens": p[2],
                "epochs": p[1] / p[2],
                "seeds": rows[index[p]]["seeds"],
                "rel_error": float(q / loss[index[p]] - 1),
                "noise": float(seed_sigma / loss[index[p]] / math.sqrt(rows[index[p]]["seeds"])),
            }
            for p, q in zip(test, predicted)
        ]

    loo = [e for p in repeated for e in errors([p])]
    largest = max((p[0] for p in repeated), default=math.nan)
    # its fresh points stay in the fit: extrapolation in epochs at the largest size, not in model size (the
    # law fitted to two sizes alone does not pin E, A and alpha: an exact law's points come out 6% off)
    top = errors([p for p in repeated if p[0] == largest])
    by_size: dict[str, float] = {}
    for e in loo:  # where the law misses: one size, or all of them
        key = f"{e['params']:.0f}"
        by_size[key] = max(by_size.get(key, 0.0), abs(e["rel_error"]))
    return {
        "leave_one_out": loo,
        "leave_one_out_max_abs": max((abs(e["rel_error"]) for e in loo), default=math.nan),
        "leave_one_out_max_abs_by_size": by_size,
        "largest_size_repeated": top,
        "largest_size_repeated_max_abs": max((abs(e["rel_error"]) for e in top), default=math.nan),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default="runs/data-efficiency", help="study directory (runs there are reused)"
    )
    parser.add_argument("--config", default=str(ROOT / "configs/derisk/data_efficiency.toml"))
    args = parser.parse_args()
    started = time.perf_counter()
    dc = load_derisk(args.config)
    result = run_data_derisk(dc, args.out)
    held = heldout_errors(result["baseline"], result["seed_sigma"])
    print("\nthe law on points it was not fitted on (relative error of the predicted held-out loss):")
    for p in held["leave_one_out"]:
        print(
            f"  leave one out: N {p['params']:9,.0f}, U {p['unique_tokens']:9,.0f}, {p['epochs']:5.2f} epochs: "
            f"{100 * p['rel_error']:+.2f}% (seed noise {100 * p['noise']:.1f}%)"
        )
    for p in held["largest_size_repeated"]:
        print(
            f"  largest size, repeated: N {p['params']:9,.0f}, U {p['unique_tokens']:9,.0f}, "
            f"{p['epochs']:5.2f} epochs: {100 * p['rel_error']:+.2f}% (seed noise {100 * p['noise']:.1f}%)"
        )
    print(
        f"max |error|: leave one out {100 * held['leave_one_out_max_abs']:.2f}%, the largest size's repeated "
        f"points (its fresh ones fitted) {100 * held['largest_size_repeated_max_abs']:.2f}% (on its own fitted "
        f"points: {100 * result['law_max_abs_rel_error']:.2f}%)"
    )
    print(
        "  left one out, by size: "
        + ", ".join(
            f"N {float(n):,.0f}: {100 * e:.2f}%" for n, e in held["leave_one_out_max_abs_by_size"].items()
        )
    )
    changes = {
        c["name"]: {
            "multipliers": c["multipliers"],
            "low": c["low"],
            "high": c["high"],
            "verdict": c["verdict"],
            "slope_per_decade": c["slope_per_decade"],
            "heldout_loss": [x["heldout_loss"] for x in c["scales"]],
            "baseline_heldout_loss": [x["baseline_heldout_loss"] for x in c["scales"]],
            "compute_multiple": c.get("compute_multiple", 1.0),
            **({"notes": c["notes"]} if c.get("notes") else {}),
        }
        for c in result["changes"]
    }
    planted = [(dc_change, c) for dc_change in dc.change if dc_change.planted for c in result["changes"]
               if c["name"] == dc_change.name]  # fmt: skip
    planted_win = None
    if planted:  # the instrument's calibration: a win worth exactly `planted` in data, at the largest size
        spec, c = planted[0]
        planted_win = {
            "planted": spec.planted,
            "multiplier": c["multipliers"][-1],
            "low": c["low"][-1],
            "high": c["high"][-1],
            "by_size": {"multipliers": c["multipliers"], "low": c["low"], "high": c["high"]},
        }
        print(
            f"planted win x{spec.planted:g} (the baseline given {spec.planted:g}x the unique tokens, same epochs) "
            f"measured at the largest size: {c['multipliers'][-1]:.2f} [{c['low'][-1]:.2f}, {c['high'][-1]:.2f}]"
        )
    above = [n for n, c in changes.items() if c["low"][-1] > 1.1]
    print(f"interval above 1.1 at the largest scale: {', '.join(above) if above else 'none'}")
    figures = {
        "scales": [s["params"] for s in result["changes"][0]["scales"]] if result["changes"] else [],
        "epochs_at_compare": [s["epochs"] for s in result["changes"][0]["scales"]]
        if result["changes"]
        else [],
        "changes": changes,
        "planted_win": planted_win,
        "above_1_1_at_largest": above,
        "law": {k: result["law"]["params"][k] for k in result["law"]["params"]},
        "law_fitted_max_abs_rel_error": result["law_max_abs_rel_error"],
        "law_heldout_max_abs_rel_error": held["leave_one_out_max_abs"],
        "law_heldout_max_abs_rel_error_by_size": held["leave_one_out_max_abs_by_size"],
        "law_largest_size_repeated_max_abs_rel_error": held["largest_size_repeated_max_abs"],
        "seed_sigma": result["seed_sigma"],
        "seed_sigma_by_scale": result["seed_sigma_by_scale"],
        "study_wall_s": result["wall_s"],
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
