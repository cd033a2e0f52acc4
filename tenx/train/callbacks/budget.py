"""A wall-clock budget: the step count and the schedule's length re-planned from the speed observed.

A step count fixed from a speed measured once is wrong whenever the machine's load changes: measured while
another program was busy, `tenx quickstart` planned 203 steps of a 10-minute budget and finished in 1.7
minutes (alone, the same machine trained 3,246). `WallBudget` plans again at every step's end from the
seconds per step of the recent steps (a whole turn of the loop, validation and checkpoint saves included):
the steps that fit in the time left, after `reserve_steps` steps' worth of it kept for what follows the
loop at the same speed (the quickstart's evaluation). A warmup still under way shortens with a shorter
run (`tenx.train.optim.replanned_warmup`); the decay always ends at the planned last step, since `lr_at`
takes the run's length.

The callback only plans (`plan`); the Trainer applies the plan before its next step
(tenx/train/trainer.py). Every rank takes rank 0's plan. The plan and the budget seconds spent are part of
every checkpoint, so a resumed run continues the same schedule with the time that is left; a rollback
restores the plan of the step it returns to and keeps the clock running.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenx.errors import ConfigError
from tenx.train.hooks import Callback, TrainerView
from tenx.train.optim import replanned_warmup

_MIN_WINDOW = 10  # steps: the fewest the speed is estimated from
_WINDOW_SHARE = 0.25  # the estimate's window: the latest quarter of the steps taken (at least _MIN_WINDOW)


@dataclass(frozen=True)
class StepPlan:
    """What a budgeted run trains: its length and its warmup (None: the config's)."""

    total_steps: int
    warmup_steps: int | None


def planned_steps(meta: dict[str, Any], default: int) -> int:
    """The step count a checkpoint's run was planned to, from its manifest `meta`: the budget's plan when the
    run had one, else `default` (the config's)."""
    state = meta.get("callbacks", {}).get(WallBudget.name, {})
    total = state.get("total_steps") if isinstance(state, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total >= 1 else default


class WallBudget(Callback):
    """Keeps the training loop within `seconds` of wall time, counted from when the budget is made.

    `reserve_steps`: steps' worth of time kept at the end for work after the loop that runs at the
    training's speed. `max_steps` caps the plan (the config's steps). `min_steps` is a floor that only the
    time itself may cut, never the reserve: priced at a speed that is slow for a while (another program
    busy), the reserve alone can seem to leave no time, and a run that ends then cannot grow again when the
    machine is quiet. `warmup_steps`:
    the configured warmup, shortened to a tenth of the planned run while it is under way (None leaves the
    config's warmup alone). `clock`: seconds, monotonic (tests pass a simulated one).
    """

    name = "budget"

    def __init__(
        self,
        seconds: float,
        *,
        reserve_steps: float = 0.0,
        min_steps: int = 1,
        max_steps: int | None = None,
        warmup_steps: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not (math.isfinite(seconds) and seconds > 0):
            raise ConfigError(f"WallBudget: seconds must be a finite number > 0, got {seconds}")
        if not (math.isfinite(reserve_steps) and reserve_steps >= 0):
            raise ConfigError(f"WallBudget: reserve_steps must be a finite number >= 0, got {reserve_steps}")
        if min_steps < 1 or (max_steps is not None and max_steps < min_steps):
            raise ConfigError(
                f"WallBudget: need 1 <= min_steps <= max_steps, got min_steps={min_steps}, max_steps={max_steps}"
            )
        if warmup_steps is not None and warmup_steps < 0:
            raise ConfigError(f"WallBudget: warmup_steps must be >= 0, got {warmup_steps}")
        self.seconds, self.reserve_steps = float(seconds), float(reserve_steps)
        self.min_steps, self.max_steps, self.warmup_steps = min_steps, max_steps, warmup_steps
        self.clock = clock
        self._origin = clock()
        self.plan: StepPlan | None = None
        """The latest plan; None until the run starts."""
        self._marks: deque[tuple[int, float]] = deque()  # (step, clock) at recent step ends
        self._first_step = 0
        self._fresh = True  # the next step is the first since the start or a load: it pays for start-up
        self._loaded_spent = 0.0

    def spent(self) -> float:
        """Budget seconds used so far (those of earlier sessions of a resumed run included)."""
        return self.clock() - self._origin

    def seconds_per_step(self) -> float | None:
        """The recent seconds per step (None before _MIN_WINDOW steps were seen)."""
        if len(self._marks) < 2 or self._marks[-1][0] - self._marks[0][0] < _MIN_WINDOW:
            return None
        (first, t_first), (last, t_last) = self._marks[0], self._marks[-1]
        return (t_last - t_first) / (last - first)

    def _bounded(self, total: int, step: int) -> int:
        total = max(self.min_steps, total)
        if self.max_steps is not None:
            total = min(self.max_steps, total)
        return max(step + 1, total)

    def _set_plan(self, total: int, step: int) -> None:
        warmup = self.plan.warmup_steps if self.plan is not None else None
        warmup = warmup if warmup is not None else self.warmup_steps
        self.plan = StepPlan(total, None if warmup is None else replanned_warmup(step, total, warmup))

    def on_train_start(self, trainer: TrainerView) -> None:
        if self.plan is None:  # a fresh run: the config's length, within the bounds, until a speed is seen
            self._set_plan(self._bounded(trainer.total_steps, trainer.step), trainer.step)
        self._restart_window(trainer.step)

    def _restart_window(self, step: int) -> None:
        self._marks.clear()
        self._first_step = step
        self._marks.append((step, self.clock()))
        self._fresh = True

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        assert self.plan is not None, "on_train_start plans first"
        step, now = trainer.step, self.clock()
        if self._fresh:  # the first step pays for start-up: the window starts after it
            self._restart_window(step)
            self._fresh = False
        else:
            self._marks.append((step, now))
        window = max(_MIN_WINDOW, int(_WINDOW_SHARE * (step - self._first_step)))
        while len(self._marks) > 2 and self._marks[1][0] <= step - window:
            self._marks.popleft()
        per_step = self.seconds_per_step()
        if step < self.plan.total_steps and per_step is not None:  # a plan that has ended stays ended
            per_step = max(per_step, 1e-9)
            time_left = self.seconds - (now - self._origin)
            fit = math.floor(max(0.0, time_left - self.reserve_steps * per_step) / per_step)
            floor = min(self.min_steps, step + math.floor(max(0.0, time_left) / per_step))
            total = max(step + 1, step + fit, floor)
            total = min(total, self.max_steps) if self.max_steps is not None else total
            total = trainer.agree(max(step + 1, total))  # every rank the same: rank 0's clock decides
            if total != self.plan.total_steps:
                self._set_plan(total, step)
        metrics["planned_steps"] = self.plan.total_steps
        metrics["budget_spent_s"] = now - self._origin

    def post_state_loaded(self, trainer: TrainerView, source: str) -> None:
        if source == "resume":  # a new process: the seconds the earlier sessions spent count too
            self._origin -= self._loaded_spent
        self._restart_window(trainer.step)

    def state_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "total_steps": plan.total_steps if plan else None,
            "warmup_steps": plan.warmup_steps if plan else None,
            "spent_s": self.spent(),
            "seconds": self.seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        total, warmup = state.get("total_steps"), state.get("warmup_steps")
        if isinstance(total, int) and total >= 1:
            self.plan = StepPlan(total, warmup if isinstance(warmup, int) else None)
        spent = state.get("spent_s")
        self._loaded_spent = float(spent) if isinstance(spent, (int, float)) and spent >= 0 else 0.0
