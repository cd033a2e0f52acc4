"""What one execution of a training step produced, and how two executions compare (tenx replay)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tenx.train.callbacks.record import step_digest


@dataclass
class StepOutcome:
    """What one execution of a step produced: its loss and gradient norm, or the exception it raised."""

    loss: float | None = None
    grad_norm: float | None = None
    digest: str | None = None
    skipped: str | None = None
    exception: str | None = None
    message: str | None = None
    frames: list[str] = field(default_factory=list)

    @property
    def crashed(self) -> bool:
        return self.exception is not None

    def matches(self, other: StepOutcome, rtol: float = 0.0) -> bool:
        """Bit for bit (rtol 0) or within `rtol`; a crash matches a crash of the same type at the same frame."""
        if self.crashed or other.crashed:
            return (self.exception, self.frames[:1]) == (other.exception, other.frames[:1])
        if rtol == 0.0:
            return self.digest == other.digest
        return _close(self.loss, other.loss, rtol) and _close(self.grad_norm, other.grad_norm, rtol)

    def describe(self) -> str:
        if self.crashed:
            where = f" at {self.frames[0]}" if self.frames else ""
            return f"{self.exception}: {self.message}{where}"
        skipped = f", skipped ({self.skipped})" if self.skipped else ""
        return f"loss {self.loss!r}, grad norm {self.grad_norm!r} (digest {self.digest}){skipped}"


def _close(a: float | None, b: float | None, rtol: float) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def outcome_of_record(record: dict[str, Any]) -> StepOutcome:
    """The outcome a steps.jsonl record describes (its digest recomputed from the exact values)."""
    loss, grad_norm = float(record["loss"]), float(record["grad_norm"])
    return StepOutcome(loss, grad_norm, step_digest(loss, grad_norm), record.get("skipped"))


def outcome_of_crash(event: dict[str, Any]) -> StepOutcome:
    """The outcome a `crash` event describes."""
    return StepOutcome(
        exception=str(event.get("exception")),
        message=str(event.get("message", "")),
        frames=[str(f) for f in event.get("frames") or []],
    )


@dataclass
class ReplayReport:
    """The result of `replay`."""

    run_dir: str
    step: int
    checkpoint: str | None
    """The checkpoint the state was rebuilt from (None: the seeded initialisation)."""
    recorded: StepOutcome | None
    outcomes: list[StepOutcome]
    verdict: str
    bitwise: bool
    notes: list[str] = field(default_factory=list)
    first_divergent: int | None = None
    """The first re-executed step (before N) whose outcome differed from its record."""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        source = self.checkpoint or "the seeded initialisation"
        lines = [f"tenx replay: step {self.step} of {self.run_dir}, rebuilt from {source}"]
        if self.recorded is not None:
            lines.append(f"  recorded : {self.recorded.describe()}")
        for i, outcome in enumerate(self.outcomes):
            lines.append(f"  replay {i + 1} : {outcome.describe()}")
        lines.append(f"  verdict  : {self.verdict}" + ("" if self.bitwise else " (within tolerance)"))
        if self.first_divergent is not None:
            lines.append(f"  step {self.first_divergent} already differed from its record when re-executed")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  {self.seconds:.1f} s")
        return "\n".join(lines)
