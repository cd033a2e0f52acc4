"""Counterfactual replay: would the run have diverged without its fast path?

A step taken on weights that have already diverged says little about who diverged them: every kernel
disagrees with float64 on a blown-up model's activations, and exact arithmetic shows a huge loss too. So
when an incident's state has diverged (its float64 loss is non-finite or DIVERGED_RATIO times the run's
first loss or more), triage goes back to before the trouble and asks the question directly:

- the *trouble* starts at the first step on the incident's timeline whose recorded loss is non-finite or
  DIVERGED_RATIO times the first loss or more (the incident's own step when none is);
- the state is rebuilt from the newest verified checkpoint before that step (or the seeded
  initialisation), and the steps up to the incident are re-executed on the *reference path* (float64
  parameters and optimizer state, math attention: no fast kernel runs), on the same data, with the
  learning rate and the guard's decisions the run recorded;
- the *fast path* is the run itself: its recorded losses (triage has already replayed the incident's step
  bit for bit, so the records are what the fast path computes).

If the reference path diverges too (its loss reaches DIVERGED_RATIO times the first, or is not finite),
the divergence is in the math (`ml`). If only the fast path diverges, a kernel did it: the first step where
the two paths part (their losses differ by more than PART_RATIO, or only the fast path's is not finite)
is bisected operator by operator against float64, on a state the reference path shows to be healthy, and
the operator found there is named (`library-op`). A rule that excuses a verdict has to be tested on the
case it could wrongly excuse: tests/test_triage_counterfactual.py plants backward faults that drive the
run to diverge, and runs learning rates 100-1000x too high with no fault.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenx.errors import DataError, TenxError
from tenx.rundir import RunDir
from tenx.train.callbacks.record import read_steps
from tenx.triage.outcome import StepOutcome
from tenx.triage.replay import Replayer, recorded_lr

DIVERGED_RATIO = 1.5
"""A loss this many times the run's first recorded loss (or a non-finite one) marks a diverged state: a
model's loss starts near ln(vocabulary) and healthy training only lowers it."""

PART_RATIO = 0.05
"""Relative difference between the fast path's and the reference path's losses at which the two part (a
bf16 step differs from float64 by ~1%, an fp32 one by ~1e-6)."""


def first_loss(run_dir: str | Path) -> float | None:
    """The loss of the run's first recorded step (its initial state: the healthiest it has been)."""
    for record in read_steps(RunDir(run_dir).steps):
        loss = record.get("loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            return float(loss)
    return None


def ran_away(loss: float | None, start: float) -> bool:
    """Whether `loss` is not finite, or DIVERGED_RATIO times `start` or more."""
    return loss is None or not math.isfinite(loss) or loss >= DIVERGED_RATIO * start


def diverged_state(run_dir: str | Path, reference: StepOutcome) -> str | None:
    """Why the step's state is one a healthy run does not produce (None when it may be): its float64 loss
    is not finite, or is DIVERGED_RATIO times the run's first recorded loss or more."""
    if reference.crashed or reference.loss is None:
        return None
    if not math.isfinite(reference.loss):
        return f"the float64 path's loss is {reference.loss} as well"
    start = first_loss(run_dir)
    if start is None or start <= 0 or reference.loss < DIVERGED_RATIO * start:
        return None
    return (
        f"the float64 path's loss is {reference.loss:.4g}, {reference.loss / start:.3g}x the run's first "
        f"recorded loss ({start:.4g}): the weights diverged before this step"
    )


@dataclass
class Counterfactual:
    """Both paths from before the trouble up to the incident's step (see the module doc)."""

    run_dir: str
    step: int
    """The incident's step: the window's last."""
    trouble: int
    """The first step whose recorded loss ran away (the incident's step when none did)."""
    start: int
    """The state both paths start from: a checkpoint's step, 0 for the seeded initialisation."""
    checkpoint: str | None
    first: float
    """The run's first recorded loss."""
    fast: dict[int, float] = field(default_factory=dict)
    """Step -> loss as the run recorded it (inf: non-finite or crashed)."""
    reference: dict[int, float] = field(default_factory=dict)
    """Step -> loss on the reference path (stops at the step it runs away)."""
    times: dict[int, float] = field(default_factory=dict)
    """Step -> the time its record was written (the execution on the incident's timeline)."""
    reference_diverged: int | None = None
    """The first step at which the reference path's loss ran away too (None: it never did)."""
    parted: int | None = None
    """The first step where the two paths part (only when the reference path did not run away)."""
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The figures kept as an incident's evidence (and compared by later incidents of the run)."""
        peak = max(self.reference.items(), key=lambda kv: kv[1]) if self.reference else None
        return {
            "trouble": self.trouble,
            "start": self.start,
            "checkpoint": self.checkpoint,
            "end": self.step,
            "first_loss": self.first,
            "reference_diverged": self.reference_diverged,
            "reference_peak": list(peak) if peak else None,
            "fast_peak": list(max(self.fast.items(), key=lambda kv: kv[1])) if self.fast else None,
            "parted": self.parted,
            "seconds": round(self.seconds, 2),
        }

    def text(self) -> str:
        where = f"checkpoint {self.checkpoint}" if self.checkpoint else "the seeded initialisation"
        lines = [
            f"counterfactual: steps {self.start + 1}..{self.step} replayed from {where} on the reference "
            f"path (float64, math kernels); the run's first loss {self.first:.4g}, trouble from step "
            f"{self.trouble}"
        ]
        for s in sorted(self.reference):
            ref, fast = self.reference[s], self.fast.get(s, math.nan)
            mark = " <- parted" if s == self.parted else ""
            mark += " <- reference ran away" if s == self.reference_diverged else ""
            lines.append(f"  step {s:>6}  fast {fast:>10.4g}  reference {ref:>10.4g}{mark}")
        lines.append(f"  {self.seconds:.1f} s")
        return "\n".join(lines)


def trouble_step(chain: dict[int, dict[str, Any]], step: int, first: float) -> int:
    """The first step of the timeline whose recorded loss ran away (see `ran_away`), else `step`."""
    for s in sorted(chain):
        loss = chain[s].get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and ran_away(float(loss), first):
            return s
    return step


def episode(run_dir: str | Path, step: int, at_time: float | None) -> tuple[int, float]:
    """(trouble step, first loss) of the incident at `step`: incidents of one run with the same trouble
    step share one counterfactual."""
    first = first_loss(run_dir)
    if first is None or first <= 0:
        raise TenxError(f"{run_dir}: no finite first loss recorded: nothing to tell divergence from")
    replayer = Replayer(run_dir)
    _, chain, _ = replayer.plan(step, at_time, None)
    return trouble_step(chain, step, first), first


def counterfactual(
    run_dir: str | Path, step: int, *, at_time: float | None = None, recorded: StepOutcome | None = None
) -> Counterfactual:
    """Replay the reference path from before the trouble up to `step` (the module doc); TenxError when the
    steps before the trouble can be neither loaded from a checkpoint nor re-executed from the start."""
    t0 = time.perf_counter()
    first = first_loss(run_dir)
    if first is None or first <= 0:
        raise TenxError(f"{run_dir}: no finite first loss recorded: nothing to tell divergence from")
    replayer = Replayer(run_dir)
    recorded, chain, windows = replayer.plan(step, at_time, recorded)
    trouble = trouble_step(chain, step, first)
    source = replayer.load_before(trouble, chain)
    start = replayer.step
    cf = Counterfactual(str(run_dir), step, trouble, start, str(source) if source else None, first)
    cf.times = {s: float(r["time"]) for s, r in chain.items() if isinstance(r.get("time"), (int, float))}
    for s in range(start + 1, step + 1):
        if s < step:
            loss = float(chain[s]["loss"])
        else:
            loss = recorded.loss if recorded is not None and recorded.loss is not None else math.inf
        cf.fast[s] = loss if math.isfinite(loss) else math.inf
    replayer.to_reference()
    try:
        for s in range(start + 1, step + 1):
            record = chain.get(s)
            if s < step and (record is None or not record.get("windows")):
                raise TenxError(
                    f"{replayer.rundir.steps}: no windows recorded for step {s}: cannot re-execute it"
                )
            outcome = replayer.run_step(
                s,
                record["windows"] if s < step and record else windows,
                apply=(record.get("skipped") is None) if s < step and record else False,
                lr=recorded_lr(record) if s < step and record else None,
            )
            loss = outcome.loss if outcome.loss is not None and not outcome.crashed else math.inf
            cf.reference[s] = loss if math.isfinite(loss) else math.inf
            if ran_away(loss, first):
                cf.reference_diverged = s
                break
    except DataError as e:
        raise TenxError(
            f"cannot replay steps {start + 1}..{step} of {run_dir}: the data changed: {e}"
        ) from None
    if cf.reference_diverged is None:
        cf.parted = next((s for s in sorted(cf.reference) if _parted(cf.fast[s], cf.reference[s])), step)
    cf.seconds = time.perf_counter() - t0
    return cf


def _parted(fast: float, reference: float) -> bool:
    if not math.isfinite(fast):
        return math.isfinite(reference)
    return abs(fast - reference) > PART_RATIO * abs(reference)
