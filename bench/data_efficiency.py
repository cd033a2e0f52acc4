"""Data efficiency: which changes make repeated data worth more, by how much, and does the gain persist?

Runs the study of configs/derisk/data_efficiency.toml (`tenx derisk` in data mode: tenx/scaling/
data_multiplier.py): the baseline at 3 model sizes on fresh data, capped at each unique-token budget U and on
U tokens read once; Muennighoff et al. (2023)'s data-constrained law fitted to those runs; each change
trained at U = compare_unique_tokens and read off the law as an effective data multiplier per scale, with a
95% interval and a verdict. Runs already in OUT are reused, so a second call only re-analyses.

The law is then checked on points it was not fitted on, two ways, each against the baseline's own law as
the named baseline of this benchmark:
- leave one out: each repeated-data baseline run (a size and a number of epochs) predicted by the law fitted
  to every other baseline run;
- the largest size: its repeated-data runs predicted by the law fitted to everything else (extrapolation in
  model size, the harder case).

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

from tenx.scaling.data_multiplier import run_data_derisk
from tenx.scaling.derisk import load_derisk
from tenx.scaling.fit import fit_data_constrained

ROOT = Path(__file__).resolve().parents[1]


def heldout_errors(baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """Relative errors of the law on baseline runs it was not fitted on (see the module docstring)."""
    cols = {k: np.array([r[k] for r in baseline], dtype=float) for k in ("params", "tokens", "unique_tokens")}
    loss = np.array([r["heldout_loss"] for r in baseline], dtype=float)
    repeated = np.flatnonzero(cols["tokens"] > cols["unique_tokens"] * (1 + 1e-9))

    def predict(train: np.ndarray, test: np.ndarray) -> np.ndarray:
        fit = fit_data_constrained(
            cols["params"][train],
            cols["tokens"][train],
            cols["unique_tokens"][train],
            loss[train],
            bootstrap=0,
        )
        return fit.predict(N=cols["params"][test], D=cols["tokens"][test], U=cols["unique_tokens"][test])

    everything = np.arange(len(baseline))
    loo = []
    for i in repeated:
        rest = everything[everything != i]
        if (cols["tokens"][rest] > cols["unique_tokens"][rest] * (1 + 1e-9)).any():
            loo.append(float(predict(rest, np.array([i]))[0] / loss[i] - 1))
    largest = cols["params"].max()
    top = repeated[cols["params"][repeated] == largest]
    rest = everything[~np.isin(everything, top)]
    extrapolated = [float(x) for x in predict(rest, top) / loss[top] - 1] if len(top) else []
    points = [
        {"params": cols["params"][i], "epochs": cols["tokens"][i] / cols["unique_tokens"][i], "rel_error": e}
        for i, e in zip(repeated, loo)
    ]
    return {
        "leave_one_out": points,
        "leave_one_out_max_abs": max((abs(e) for e in loo), default=math.nan),
        "largest_size": [
            {
                "params": cols["params"][i],
                "epochs": cols["tokens"][i] / cols["unique_tokens"][i],
                "rel_error": e,
            }
            for i, e in zip(top, extrapolated)
        ],
        "largest_size_max_abs": max((abs(e) for e in extrapolated), default=math.nan),
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
    held = heldout_errors(result["baseline"])
    print("\nthe law on points it was not fitted on (relative error of the predicted held-out loss):")
    for p in held["leave_one_out"]:
        print(
            f"  leave one out: N {p['params']:9,.0f}, {p['epochs']:5.2f} epochs: {100 * p['rel_error']:+.2f}%"
        )
    for p in held["largest_size"]:
        print(
            f"  largest size:  N {p['params']:9,.0f}, {p['epochs']:5.2f} epochs: {100 * p['rel_error']:+.2f}%"
        )
    print(
        f"max |error|: leave one out {100 * held['leave_one_out_max_abs']:.2f}%, largest size from the "
        f"smaller ones {100 * held['largest_size_max_abs']:.2f}% (on its own fitted points: "
        f"{100 * result['law_max_abs_rel_error']:.2f}%)"
    )
    changes = {
        c["name"]: {
            "multipliers": c["multipliers"],
            "low": c["low"],
            "high": c["high"],
            "verdict": c["verdict"],
            "slope_per_decade": c["slope_per_decade"],
        }
        for c in result["changes"]
    }
    above = [n for n, c in changes.items() if c["low"][-1] > 1.1]
    print(f"interval above 1.1 at the largest scale: {', '.join(above) if above else 'none'}")
    figures = {
        "scales": [s["params"] for s in result["changes"][0]["scales"]] if result["changes"] else [],
        "epochs_at_compare": [s["epochs"] for s in result["changes"][0]["scales"]]
        if result["changes"]
        else [],
        "changes": changes,
        "above_1_1_at_largest": above,
        "law": {k: result["law"]["params"][k] for k in result["law"]["params"]},
        "law_fitted_max_abs_rel_error": result["law_max_abs_rel_error"],
        "law_heldout_max_abs_rel_error": held["leave_one_out_max_abs"],
        "law_largest_size_max_abs_rel_error": held["largest_size_max_abs"],
        "seed_sigma": result["seed_sigma"],
        "study_wall_s": result["wall_s"],
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
