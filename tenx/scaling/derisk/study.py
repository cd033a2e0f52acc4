"""The driver every derisk study shares: train the planned runs, analyse them, write the report.

Runs already in OUT/ladder are reused (a second call only re-analyses). OUT receives derisk_config.json
(the study as given), derisk.json (the figures), report.md and report.png. The compute-multiplier study
(tenx/scaling/derisk/compute_multiplier.py) and the data-multiplier study (tenx/scaling/derisk/data_multiplier.py) differ only
in what they plan, how they analyse the rows and how they draw the report.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tenx.scaling.ladder.rungs import PlannedRun
from tenx.scaling.ladder.runner import run_planned
from tenx.utils.io import atomic_write_json, atomic_write_text


def run_study(
    dc: Any,
    out: str | Path,
    runs: list[PlannedRun],
    *,
    describe: Callable[[dict[str, Any]], str],
    analyse: Callable[[dict[int, dict[str, Any]]], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], Path],
    splits: tuple[str, ...] | None = None,
    phases: list[int] | None = None,
    between: Callable[[dict[int, dict[str, Any]]], None] | None = None,
) -> dict[str, Any]:
    """Train `runs` into OUT/ladder (reusing finished ones), print one line a run (`describe` of its row),
    then `analyse` the rows (run index -> row) and write the study's files; returns the analysis.

    `phases` (one number a run; default all 0): the runs train phase by phase, lowest first, and
    `between(rows so far)` is called after each phase but the last (a data study assembles the ensembles
    its distilled students learn from there)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "derisk_config.json", dataclasses.asdict(dc))
    t0 = time.perf_counter()
    rows: dict[int, dict[str, Any]] = {}
    extra = {} if splits is None else {"splits": splits}
    phase_of = phases or [0] * len(runs)
    order = sorted(set(phase_of))
    for p in order:
        index = [i for i in range(len(runs)) if phase_of[i] == p]
        for j, row in run_planned([runs[i] for i in index], out / "ladder", dc.ladder, **extra):
            i = index[j]
            state = "reused" if row.get("reused") else f"{row['wall_s']:.0f} s"
            print(f"[{i + 1}/{len(runs)}] {runs[i].name}: {describe(row)} ({state})", flush=True)
            rows[i] = row
        if between is not None and p != order[-1]:
            between(rows)
    result = analyse(rows)
    result["wall_s"] = time.perf_counter() - t0
    atomic_write_json(out / "derisk.json", result)
    text = report(result)
    png = plot(result, out / "report.png")
    atomic_write_text(out / "report.md", text + f"\n![multipliers]({png.name})\n")
    print(text)
    print(f"report: {out / 'report.md'}  plot: {png}  numbers: {out / 'derisk.json'}")
    return result
