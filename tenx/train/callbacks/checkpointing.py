"""Checkpointing: a save every N steps, or at the Young/Daly interval, and at the end."""

from __future__ import annotations

import time
from typing import Any

from tenx.checkpoint.interval import young_daly_interval_s
from tenx.train.hooks import Callback, TrainerView


class Checkpointing(Callback):
    """Saves a checkpoint every `every` steps (or at the Young/Daly interval for 'auto') and at the end.

    'auto' saves first at `auto_first_step` to measure the save cost δ (the seconds the loop is blocked),
    then every sqrt(2·δ·MTBF) seconds, converted to steps with the measured time per step. MTBF is the
    run's observed one (wall time / failures so far, from its ledger) once it has failed, else `mtbf_s`.
    The interval never drops below the background write time, so saves do not queue behind each other.
    """

    name = "checkpointing"

    def __init__(
        self,
        every: int | str,
        at_end: bool = True,
        mtbf_s: float = 86400.0,
        auto_first_step: int = 10,
        memory_every: int = 0,
    ) -> None:
        self.every, self.at_end, self.memory_every = every, at_end, memory_every
        self.mtbf_s, self.auto_first_step = mtbf_s, auto_first_step
        self.last_saved = -1
        self.next_auto = 0
        self.interval_steps: int | None = None
        self._save_cost: float | None = None
        self._step_s: float | None = None
        self._last_time = 0.0
        self._observed_mtbf: float | None = None

    def on_train_start(self, trainer: TrainerView) -> None:
        self.next_auto = trainer.step + self.auto_first_step
        self._last_time = time.perf_counter()
        if self.every == "auto":
            from tenx.monitor.goodput import compute_goodput

            report = compute_goodput(trainer.run_dir)
            failures = report.get("restarts", 0) + report.get("rollbacks", 0)
            if failures and report.get("wall_s", 0) > 0:
                self._observed_mtbf = report["wall_s"] / failures

    def _due(self, trainer: TrainerView) -> bool:
        if self.every == "auto":
            return trainer.step >= self.next_auto
        return bool(self.every) and trainer.step % int(self.every) == 0

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        now = time.perf_counter()
        dt, self._last_time = now - self._last_time, now
        self._step_s = dt if self._step_s is None else 0.9 * self._step_s + 0.1 * dt
        if self._due(trainer):
            blocked = trainer.save_checkpoint()
            self.last_saved = trainer.step
            if self.every == "auto":
                self._plan_next(trainer, blocked)
            self._last_time = time.perf_counter()  # the save's blocking is not step time
        elif (
            self.memory_every and trainer.step % self.memory_every == 0 and trainer.step < trainer.total_steps
        ):
            trainer.save_checkpoint(tier="memory")
            self._last_time = time.perf_counter()

    def _plan_next(self, trainer: TrainerView, blocked: float) -> None:
        self._save_cost = blocked if self._save_cost is None else 0.7 * self._save_cost + 0.3 * blocked
        mtbf = self._observed_mtbf or self.mtbf_s
        interval_s = max(
            young_daly_interval_s(self._save_cost, mtbf), trainer.checkpointer.last_write_s or 0.0
        )
        # Every rank must save at the same steps (saves are collective): rank 0's measurement decides.
        steps = trainer.agree(max(1, round(interval_s / max(self._step_s or 1e-9, 1e-9))))
        if trainer.rank == 0 and (
            self.interval_steps is None or abs(steps - self.interval_steps) > 0.2 * self.interval_steps
        ):
            trainer.events.emit(
                "checkpoint-interval",
                trainer.step,
                save_cost_s=round(self._save_cost, 6),
                mtbf_s=round(mtbf, 1),
                mtbf_source="observed" if self._observed_mtbf else "assumed",
                interval_s=round(interval_s, 3),
                interval_steps=steps,
            )
        self.interval_steps = steps
        self.next_auto = trainer.step + steps

    def on_train_end(self, trainer: TrainerView) -> None:
        if self.at_end and self.last_saved != trainer.step:
            trainer.save_checkpoint()
            self.last_saved = trainer.step
