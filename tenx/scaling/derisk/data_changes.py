"""The kinds of change a data-mode study prices beyond config overrides (tenx.scaling.derisk.change):

- **ensemble** (`ensemble = K`): K members of the change's config, seeds 0..K-1, scored as one model by the
  average of their probabilities (tenx.model.ensemble). At a scale whose runs train S seeds (the smallest:
  `seeds`), max(S, K) members train and S ensembles are scored, ensemble j of members j..j+K-1 (cyclically);
  they share members, so the multiplier's interval counts max(1, members // K) independent ones. The members
  of a change with no overrides are the baseline's own seeds at the compared point (one run, reused).
  Priced at K times the compute.
- **distill** (`distill_from = NAME`): the change's config plus `train.distill_from` = ensemble 0 of the
  ensemble change NAME at the same scale. Its students train after the teachers' members (a second phase).
  Priced at the student's training, the teacher's forward passes over the student's tokens and the
  teacher's own training.
- **sweep** (`sweep`, `baseline_sweep`): every candidate of the change's grid (and of the baseline's) trains
  at the compared point; per scale the candidate with the lowest validation loss (the median of its seeds;
  never the held-out split the multiplier reads) is the change (and the anchor): tuned against tuned.
- **planted** (`planted = f`): the baseline given f times the unique tokens and f times the tokens (the
  same epochs), a win worth exactly f in data by the multiplier's definition: what the instrument must see.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tenx import rundir
from tenx.errors import DataError
from tenx.scaling.derisk.change import ChangeConfig, sweep_candidates
from tenx.scaling.ladder.rungs import LadderConfig, PlannedRun, plan_ladder
from tenx.scaling.ladder.runner import append_result, evaluate_run, load_base
from tenx.utils.io import atomic_write_json, read_json_object

ENSEMBLES = "ensembles"
"""OUT/ensembles/NAME-C<scale>-e<j>/: the ensembles a study assembles out of its member runs."""
SCORES = "scores.json"
"""OUT/ensembles/scores.json: each ensemble's held-out score, keyed by its members (a rerun reuses them)."""


@dataclass
class DataRun:
    """One run of a data-mode study: its config ('baseline', a change, or a part of one: 'NAME/member',
    'NAME/candidate<i>', 'NAME/anchor<i>'), scale (the budget that chose its size), unique-token cap (None:
    fresh data), fraction of the scale's tokens, the planned run, and the phase it trains in (1: after the
    ensembles it learns from are assembled)."""

    stage: str
    scale: float
    unique: int | None
    run: PlannedRun
    fraction: float = 1.0
    phase: int = 0


def tag(stage: str, unique: int | None) -> str:
    """The run-name tag of a stage's runs at unique-token cap `unique` (None: fresh)."""
    return stage.replace("/", "-") + ("-fresh" if unique is None else f"-U{unique:.2e}".replace("+", ""))


def scale_tag(scale: float) -> str:
    return f"C{scale:.2e}".replace("+", "")


def ensemble_dir(out: str | Path, name: str, scale: float, j: int) -> Path:
    """Where ensemble j of change `name` at `scale` is assembled."""
    return Path(out) / ENSEMBLES / f"{name}-{scale_tag(scale)}-e{j}"


def plan_change(
    change: ChangeConfig,
    changes: dict[str, ChangeConfig],
    base: str,
    overrides: list[str],
    one: LadderConfig,
    scale: float,
    seeds: int,
    compare_u: int,
    out: str | Path,
) -> list[DataRun]:
    """The runs of `change` at `scale` (`one`: the ladder settings that fix its depth; `seeds`: the seeds
    a point trains there)."""
    capped = dataclasses.replace(one, unique_tokens=compare_u, seeds=seeds)

    def runs(stage: str, settings: list[str], lc: LadderConfig, unique: int, phase: int = 0) -> list[DataRun]:
        cfg = load_base(base, overrides + settings)
        return [
            DataRun(stage, scale, unique, r, 1.0, phase) for r in plan_ladder(cfg, lc, tag(stage, unique))
        ]

    own = list(change.set)
    if change.planted:
        f = change.planted
        more = dataclasses.replace(capped, budgets=[scale * f], unique_tokens=round(compare_u * f))
        return runs(change.name, own, more, round(compare_u * f))
    if change.ensemble > 1:
        members = dataclasses.replace(capped, seeds=max(seeds, change.ensemble))
        return runs(f"{change.name}/member", own, members, compare_u)
    if change.distill_from:
        teacher = changes.get(change.distill_from)
        if teacher is None or teacher.ensemble < 2:
            raise DataError(
                f"change {change.name!r}: distill_from = {change.distill_from!r} is not an ensemble change of "
                "this study"
            )
        path = ensemble_dir(out, teacher.name, scale, 0).resolve()
        return runs(change.name, [*own, f'train.distill_from="{path}"'], capped, compare_u, phase=1)
    if not change.sweep:
        planned = runs(change.name, own, capped, compare_u)
    else:
        planned = []
        for i, cand in enumerate(sweep_candidates(change.sweep)):
            planned += runs(f"{change.name}/candidate{i}", own + cand, capped, compare_u)
    if change.baseline_sweep:  # the baseline, not the change, over its own grid
        for i, cand in enumerate(sweep_candidates(change.baseline_sweep)):
            planned += runs(f"{change.name}/anchor{i}", cand, capped, compare_u)
    return planned


# ----- after the runs ---------------------------------------------------------------------------------
@dataclass
class ChangeRows:
    """What the analysis reads of one change: its rows per scale (each the point of one seed or ensemble),
    the anchor rows per scale (None: the baseline's own run at the same point), the independent
    repeats per scale (None: its rows' count), its compute as a multiple of the anchor's, and notes."""

    rows: list[list[dict[str, Any]]]
    anchors: list[list[dict[str, Any]]] | None = None
    independent: list[int] | None = None
    compute_multiple: float = 1.0
    notes: list[str] = dataclasses.field(default_factory=list)
    planted: bool = False
    """A planted win: anchored at the baseline's run at the compared U, not at its own (larger) U."""
    single_runs: bool = True
    """Each row is one run (one seed), so repeats of it measure seed noise; an ensemble's are not."""


def stage_rows(
    found: dict[int, dict[str, Any]], planned: list[DataRun], stage: str, scale: float
) -> list[dict[str, Any]]:
    return [found[i] for i, p in enumerate(planned) if p.stage == stage and p.scale == scale and i in found]


def ensembles(
    change: ChangeConfig,
    planned: list[DataRun],
    found: dict[int, dict[str, Any]],
    scale: float,
    count: int,
) -> list[list[dict[str, Any]]]:
    """The member rows of each of `count` ensembles of `change` at `scale`: ensemble j of members j..j+K-1
    of its member runs in seed order, cyclically."""
    members = sorted(stage_rows(found, planned, f"{change.name}/member", scale), key=lambda r: r["seed"])
    return [[members[(j + i) % len(members)] for i in range(change.ensemble)] for j in range(count)]


def assemble_ensembles(
    change: ChangeConfig,
    planned: list[DataRun],
    found: dict[int, dict[str, Any]],
    scales: list[float],
    seeds_at: dict[float, int],
    out: str | Path,
) -> list[list[tuple[Path, list[dict[str, Any]]]]]:
    """Each ensemble of `change` per scale, assembled (OUT/ensembles/NAME-C<scale>-e<j>/ensemble.json, listing
    its members' run directories) unless an earlier call wrote it: [scale][j] -> (its directory, its members'
    rows)."""
    from tenx.checkpoint.models import assemble_ensemble

    made = []
    for scale in scales:
        at = []
        for j, chosen in enumerate(ensembles(change, planned, found, scale, seeds_at[scale])):
            target = ensemble_dir(out, change.name, scale, j)
            if not rundir.RunDir(target).ensemble.exists():
                target.mkdir(parents=True, exist_ok=True)
                assemble_ensemble([Path(r["run_dir"]) for r in chosen], target)
            at.append((target, chosen))
        made.append(at)
    return made


def ensemble_rows(
    change: ChangeConfig,
    made: list[list[tuple[Path, list[dict[str, Any]]]]],
    out: str | Path,
    eval_bytes: int,
) -> ChangeRows:
    """Each ensemble of `change` that assemble_ensembles `made` (per scale), scored on the held-out split
    (cached in OUT/ensembles/scores.json, by its members' keys)."""
    cache_path = Path(out) / ENSEMBLES / SCORES
    cache: dict[str, Any] = read_json_object(cache_path) if cache_path.exists() else {}
    rows, independent = [], []
    for at_scale in made:
        at = []
        for j, (target, chosen) in enumerate(at_scale):
            key = "+".join(r["key"] for r in chosen)
            if key not in cache:
                ev = evaluate_run(target, eval_bytes, ("heldout",))
                cache[key] = ev["heldout"]["loss"]
                atomic_write_json(cache_path, cache)
            at.append({**chosen[0], "heldout_loss": cache[key], "ensemble": j, "members": len(chosen)})
        rows.append(at)
        members = len({r["key"] for _, chosen in at_scale for r in chosen})  # every member serves
        independent.append(max(1, min(len(at), members // change.ensemble)))
    return ChangeRows(
        rows, independent=independent, compute_multiple=float(change.ensemble), single_runs=False
    )


def tuned_rows(
    change: ChangeConfig,
    planned: list[DataRun],
    found: dict[int, dict[str, Any]],
    scales: list[float],
    ladder_dir: str | Path,
    eval_bytes: int,
) -> ChangeRows:
    """Per scale, the sweep candidate (and the baseline candidate) with the lowest median validation loss;
    a row not yet scored on the validation split is scored now and its row updated in results.jsonl."""

    def val(row: dict[str, Any]) -> float:
        if row.get("val_loss") is None:
            ev = evaluate_run(row["run_dir"], eval_bytes, ("val",))
            row["val_loss"], row["val_bpb"] = ev["val"]["loss"], ev["val"]["bits_per_byte"]
            append_result(ladder_dir, {k: v for k, v in row.items() if k not in ("budget", "reused")})
        return float(row["val_loss"])

    def best(prefix: str, grid: list[str], scale: float) -> tuple[int, list[dict[str, Any]]]:
        groups = [
            stage_rows(found, planned, f"{change.name}/{prefix}{i}", scale)
            for i in range(len(sweep_candidates(grid)))
        ]
        medians = [float(np.median([val(r) for r in g])) if g else math.inf for g in groups]
        i = int(np.argmin(medians))
        return i, groups[i]

    rows, anchors, notes = [], [], []
    for scale in scales:
        i, chosen = (
            best("candidate", change.sweep, scale)
            if change.sweep
            else (0, stage_rows(found, planned, change.name, scale))
        )
        rows.append(chosen)
        picked = " ".join(sweep_candidates(change.sweep)[i]) if change.sweep else "(no sweep)"
        if change.baseline_sweep:
            b, anchor = best("anchor", change.baseline_sweep, scale)
            anchors.append(anchor)
            picked += f"; baseline: {' '.join(sweep_candidates(change.baseline_sweep)[b])}"
        notes.append(f"{scale_tag(scale)}: {picked}")
    return ChangeRows(rows, anchors if change.baseline_sweep else None, notes=notes)


def distill_compute_multiple(teacher: ChangeConfig) -> float:
    """The student's price against one baseline run of its size: its own training (1), the teacher's
    forward passes over its tokens (K members, a third of a training step's FLOPs each) and the teacher's
    training (K runs)."""
    k = teacher.ensemble
    return 1.0 + k / 3.0 + k
