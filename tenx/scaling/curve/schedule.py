"""Learning-rate schedules as the curve laws see them, and loss curves read from runs.

A `Schedule` is the learning rate and the tokens of every optimizer update of a whole run, from a tenx
`OptimConfig` (tenx.train.optim.lr_at) or from the `lr` column of a run's metrics. A `Curve` is a run's
observed per-step training loss with its schedule and model size.

Indexing: metrics record `step` s (1-based) logs the loss of the batch that update s-1 (0-based) trains on,
computed before that update, and `lr` = the learning rate of update s-1. So the loss at record s has seen
the n = s - 1 updates 0..s-2; every progress variable of record s sums over those.

Progress variables (the choice that makes runs of different sizes comparable): the ladder scales the peak
learning rate with width (tenx/scaling/ladder/rungs.py) and halves the batch of small runs, so neither the raw
area under the learning rate nor the step count means the same at two sizes. The laws use the learning
rate relative to the run's own peak, r = lr / peak in (0, 1], weighted by each update's tokens:

    S1(n) = sum_{j<n} r_j * tokens_j / PROGRESS_UNIT      "tokens at peak learning rate", in millions

At a constant learning rate S1 is the tokens seen, the D of Chinchilla's L(N, D), so a joint fit across
sizes pairs the curve law with the size law in the same units; two runs of one model that see the same
data at the same relative schedule but different batch sizes get the same S1. The annealing terms use
the drops of r after the peak, d_k = r_{k-1} - r_k (zero during warmup), and the same token weighting.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tenx import rundir
from tenx.errors import ConfigError, DataError, TenxError
from tenx.train.optim import OptimConfig, lr_at

PROGRESS_UNIT = 1e6
"""Tokens per unit of the progress variables (S1 in millions of peak-learning-rate tokens)."""
PARAMS_UNIT = 1e6
"""Parameters per unit of N in the size term L0(N) = E + A_N * (N / PARAMS_UNIT)^-a."""
SCHEDULES = ("cosine", "wsd", "constant")
"""The `optim.schedule` values the laws represent (warmup, then a learning rate that never rises)."""
_RISE_TOLERANCE = 1e-6
QUANTITIES = ("loss", "val_loss")
MAX_STEPS = 2_000_000
"""The longest schedule the laws take from a config: each update's learning rate is held (and computed in
Python), so 1e9 steps would take hours and gigabytes; a run this long is far beyond what a ladder fits."""
"""The metrics columns a curve can follow: each step's training loss, or the periodic validation loss."""


@dataclass
class Schedule:
    """Learning rate and tokens of every optimizer update of one run, and the progress variables."""

    lr: np.ndarray
    """(T,) learning rate of update j (metrics record j + 1)"""
    tokens: np.ndarray
    """(T,) tokens update j trains on"""
    source: str = "metrics"
    """where it came from: an `optim.schedule` name or 'metrics' (for messages)"""

    def __post_init__(self) -> None:
        self.lr = np.asarray(self.lr, dtype=float)
        self.tokens = np.broadcast_to(np.asarray(self.tokens, dtype=float), self.lr.shape).copy()
        _check_schedule(self.lr, self.tokens, self.source)
        self.peak = float(self.lr.max())
        # warmup ends at the first update at the peak: the laws' annealing starts there
        self.warmup = int(np.argmax(self.lr >= self.peak * (1 - _RISE_TOLERANCE)))
        self.ratio = self.lr / self.peak
        self.area = np.concatenate([[0.0], np.cumsum(self.ratio * self.tokens)]) / PROGRESS_UNIT
        self.cum_tokens = np.concatenate([[0.0], np.cumsum(self.tokens)])
        drops = np.zeros_like(self.ratio)
        drops[self.warmup + 1 :] = self.ratio[self.warmup : -1] - self.ratio[self.warmup + 1 :]
        self.drops = np.maximum(drops, 0.0)

    @property
    def steps(self) -> int:
        """Updates in the run (T); records are steps 1..T."""
        return len(self.lr)

    @property
    def first_step(self) -> int:
        """The first record after warmup: the laws describe records first_step..T."""
        return self.warmup + 2

    def to_dict(self) -> dict[str, Any]:
        """Plain data: source, steps, the peak and the step that first uses it, the run's tokens."""
        return {
            "source": self.source,
            "steps": self.steps,
            "peak_lr": self.peak,
            "peak_step": self.warmup + 1,
            "tokens": float(self.cum_tokens[-1]),
        }


def _check_schedule(lr: np.ndarray, tokens: np.ndarray, source: str) -> None:
    """Errors that name the step: a learning rate the laws cannot use, or a rise after the peak."""
    if lr.ndim != 1 or len(lr) < 2:
        raise ConfigError(f"schedule ({source}): needs the learning rate of at least 2 steps, got {lr.size}")
    for what, values in (("learning rate", lr), ("tokens per step", tokens)):
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
        if len(bad):
            raise ConfigError(
                f"schedule ({source}): {what} at step {bad[0] + 1} is {values[bad[0]]}; it must be a "
                "finite number >= 0"
            )
    if not lr.max() > 0 or not tokens.min() > 0:
        raise ConfigError(f"schedule ({source}): every learning rate is 0 or a step has no tokens")
    peak = int(np.argmax(lr >= lr.max() * (1 - _RISE_TOLERANCE)))
    rises = np.flatnonzero(lr[peak + 1 :] > lr[peak:-1] * (1 + _RISE_TOLERANCE))
    if len(rises):
        j = peak + 1 + int(rises[0])
        raise ConfigError(
            f"schedule ({source}): the learning rate rises after its peak at step {peak + 1}, from "
            f"{lr[j - 1]:.4g} to {lr[j]:.4g} at step {j + 1} (a rewarming, cyclic or step-up schedule); the "
            "curve laws represent warmup followed by a learning rate that never rises (cosine, wsd, "
            "constant, linear or step decay)"
        )


def schedule_from_config(optim: OptimConfig, total_steps: int, tokens_per_step: float) -> Schedule:
    """The schedule tenx trains `total_steps` steps of `optim` with (tenx.train.optim.lr_at)."""
    if optim.schedule not in SCHEDULES:
        raise ConfigError(
            f"optim.schedule: {optim.schedule!r} is not a schedule the curve laws represent "
            f"(they know {', '.join(SCHEDULES)})"
        )
    if total_steps <= optim.warmup_steps + 1:
        raise ConfigError(
            f"train.steps: {total_steps} steps leave no step after the {optim.warmup_steps} warmup steps "
            "(optim.warmup_steps); the curve laws describe the loss after warmup"
        )
    if not tokens_per_step > 0:
        raise ConfigError(f"tokens per step: must be positive, got {tokens_per_step}")
    if total_steps > MAX_STEPS:
        raise ConfigError(
            f"train.steps: {total_steps:,} steps are more than the curve laws evaluate ({MAX_STEPS:,}: they "
            "hold each step's learning rate); predict a shorter run"
        )
    lr = np.array([lr_at(step, total_steps, optim) for step in range(total_steps)])
    return Schedule(lr, np.full(total_steps, float(tokens_per_step)), optim.schedule)


def schedule_from_lr(
    lr: Sequence[float], tokens: float | Sequence[float], source: str = "metrics"
) -> Schedule:
    """A schedule from a learning-rate column (one value per step) and tokens per step (one or a column)."""
    return Schedule(np.asarray(lr, dtype=float), np.asarray(tokens, dtype=float), source)


@dataclass
class Curve:
    """One run's observed training loss (records `steps`, 1-based) with its whole schedule and size."""

    name: str
    params: float
    """model parameters N (total, as run.json counts them)"""
    schedule: Schedule
    steps: np.ndarray
    loss: np.ndarray
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """what the run was (optim settings, depth, ...): carried for reports, not used by the fit"""
    quantity: str = "loss"
    """the metrics column: `loss` (each step's training batch) or `val_loss` (the fixed validation batches,
    logged every train.eval_every steps: far less noisy, and what a ladder's held-out figures are)"""
    flops: float | None = None
    """FLOPs of the whole run (run.json's run_flops_per_token, else flops_per_token, x tokens: a distillation
    teacher's forward counted): groups a ladder's budgets"""

    def __post_init__(self) -> None:
        self.steps = np.asarray(self.steps, dtype=int)
        self.loss = np.asarray(self.loss, dtype=float)
        if self.steps.shape != self.loss.shape or self.steps.ndim != 1:
            raise DataError(f"curve {self.name}: steps and loss must be two columns of one length")
        bad = np.flatnonzero(~np.isfinite(self.loss) | (self.loss <= 0))
        if len(bad):
            raise DataError(
                f"curve {self.name}: the loss at step {int(self.steps[bad[0]])} is {self.loss[bad[0]]}; a law "
                "cannot be fitted through a diverged or missing step (cut the curve before it or rerun)"
            )
        if len(self.steps) and (self.steps.min() < 1 or self.steps.max() > self.schedule.steps):
            raise DataError(
                f"curve {self.name}: steps {self.steps.min()}..{self.steps.max()} fall outside the schedule's "
                f"1..{self.schedule.steps}"
            )
        if np.any(np.diff(self.steps) <= 0):
            raise DataError(f"curve {self.name}: steps must increase")
        if not self.params > 0:
            raise DataError(
                f"curve {self.name}: params must be a positive parameter count, got {self.params}"
            )

    def upto(self, step: int) -> Curve:
        """The curve as it was at record `step` (the schedule stays the whole run's)."""
        keep = self.steps <= step
        return dataclasses.replace(self, steps=self.steps[keep], loss=self.loss[keep])

    def after_warmup(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps, loss) of the records the laws describe."""
        keep = self.steps >= self.schedule.first_step
        return self.steps[keep], self.loss[keep]


def curve_from_records(
    records: Iterable[dict[str, Any]],
    name: str,
    params: float,
    schedule: Schedule | None = None,
    config: dict[str, Any] | None = None,
    quantity: str = "loss",
) -> Curve:
    """A curve from metrics records (step, tokens, lr and `quantity`: `loss` or `val_loss`).

    Without `schedule` the schedule is the `lr` column itself (the run so far: fine to fit, not to extend
    past its last step). With one, the `lr` column must agree with it (a resumed run with a changed config
    does not), and the curve may stop early: the rest is what extrapolation predicts. `val_loss` is logged
    only every train.eval_every steps, so its curve needs the schedule. Its record s was measured after
    update s-1, one update later than `loss` at s: the laws ignore that offset (one step in the 20 or more
    between validations).
    """
    if quantity not in QUANTITIES:
        raise ConfigError(f"curve {name}: quantity {quantity!r} is not one of {', '.join(QUANTITIES)}")
    by_step: dict[int, dict[str, Any]] = {}
    for i, rec in enumerate(records):
        if "skipped" in rec:  # a step that did not commit: its update never happened
            continue
        if quantity != "loss" and quantity not in rec:  # validation is logged every eval_every steps
            continue
        missing = [k for k in ("step", "tokens", "lr", quantity) if k not in rec]
        if missing:
            raise DataError(f"curve {name}: metrics record {i + 1} lacks {', '.join(missing)}")
        by_step[int(rec["step"])] = rec  # a step logged twice (rollback and redo): the later one counts
    if not by_step:
        what = "metrics records" if quantity == "loss" else f"records with {quantity} (train.eval_every 0?)"
        raise DataError(f"curve {name}: no {what}")
    if schedule is None and quantity != "loss":
        raise ConfigError(f"curve {name}: a {quantity} curve needs the run's schedule (its config)")
    steps = np.array(sorted(by_step))
    rows = [by_step[s] for s in steps]
    loss = np.array([float(r[quantity]) for r in rows])
    lr = np.array([float(r["lr"]) for r in rows])
    tokens = np.array([float(r["tokens"]) for r in rows])
    if schedule is None:
        if not np.array_equal(steps, np.arange(1, len(steps) + 1)):
            gap = int(np.flatnonzero(steps != np.arange(1, len(steps) + 1))[0]) + 1
            raise DataError(
                f"curve {name}: records start at step 1 and have no gaps to give the schedule; step {gap} "
                "is missing (pass the schedule from the run's config instead)"
            )
        per_step = np.diff(np.concatenate([[0.0], tokens]))
        schedule = Schedule(lr, per_step, "metrics")
    else:
        planned = schedule.lr[steps - 1]
        off = np.flatnonzero(~np.isclose(lr, planned, rtol=1e-4, atol=1e-12))
        if len(off):
            s = int(steps[off[0]])
            raise DataError(
                f"curve {name}: the logged learning rate at step {s} is {lr[off[0]]:.6g} but the schedule "
                f"({schedule.source}) gives {planned[off[0]]:.6g}; was the config changed mid-run?"
            )
    return Curve(name, float(params), schedule, steps, loss, dict(config or {}), quantity)


def curve_from_run(run_dir: str | Path, name: str | None = None, quantity: str = "loss") -> Curve:
    """A run directory's curve of `quantity` (`loss` or `val_loss`): config.toml for the whole schedule,
    metrics.jsonl for the loss, and the parameter count and FLOPs from run.json (or, when absent, the
    parameter count from the config's model with an explicit vocab_size)."""
    from tenx.config import to_dict
    from tenx.model.flops import count_params
    from tenx.monitor.metrics_file import read_metrics
    from tenx.train.config import load_run_config

    rd = rundir.RunDir(run_dir)
    if not rd.config.exists() or not rd.metrics.exists():
        raise DataError(
            f"{run_dir}: not a run directory with a config and metrics (need {rd.config.name} and "
            f"{rd.metrics.name})"
        )
    cfg = load_run_config(rd.config)
    records = read_metrics(rd.metrics)
    prov = json.loads(rd.provenance.read_text()) if rd.provenance.exists() else {}
    params = (prov.get("params") or {}).get("total")
    if params is None:
        if cfg.model.vocab_size is None:
            raise DataError(
                f"{run_dir}: no {rd.provenance.name} and no model.vocab_size: cannot count params"
            )
        params = count_params(cfg.model.resolved(cfg.model.vocab_size)).total
    tokens_per_step = prov.get("tokens_per_step")
    total_steps = prov.get("total_steps") or cfg.train.steps
    if tokens_per_step is None and records:
        tokens_per_step = records[0]["tokens"] / max(1, records[0]["step"])
    if tokens_per_step is None or total_steps is None:
        raise DataError(f"{run_dir}: cannot tell the tokens per step and the steps of the run")
    schedule = schedule_from_config(cfg.optim, int(total_steps), float(tokens_per_step))
    config = {
        "optim": to_dict(cfg.optim),
        "depth": cfg.model.depth,
        "steps": int(total_steps),
        "tokens_per_step": float(tokens_per_step),
        "seed": cfg.train.seed,
    }
    curve = curve_from_records(records, name or Path(run_dir).name, params, schedule, config, quantity)
    per_token = prov.get("run_flops_per_token") or prov.get("flops_per_token")
    if per_token:
        curve.flops = float(per_token) * float(tokens_per_step) * int(total_steps)
    return curve


def read_curves(directory: str | Path, quantity: str = "loss") -> list[Curve]:
    """Every run directory directly under `directory` (sorted by name) as a curve of `quantity`."""
    runs = sorted(p for p in Path(directory).iterdir() if rundir.RunDir(p).config.exists())
    if not runs:
        raise TenxError(f"{directory}: holds no run directories (folders with {rundir.CONFIG})")
    return [curve_from_run(p, quantity=quantity) for p in runs]
