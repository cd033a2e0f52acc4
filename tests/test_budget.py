"""The wall-clock budget (tenx.train.callbacks.budget) and MFU against a peak measured too low.

Time is simulated: a clock the test advances by a step time of its choosing (a machine that is busy for a
while, then quiet), never the real one, so nothing here depends on how fast this machine is.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from tenx.errors import ConfigError
from tenx.monitor.events import read_events
from tenx.rundir import RunDir, step_of
from tenx.train.callbacks.budget import StepPlan, WallBudget, planned_steps
from tenx.train.hooks import Callback
from tenx.train.optim import OptimConfig, lr_at, replanned_warmup
from tenx.train.run import train


class Clock:
    """Simulated seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Machine(Callback):
    """Each step takes `step_s(clock)` simulated seconds (placed before the budget among the callbacks)."""

    name = "machine"

    def __init__(self, clock: Clock, step_s) -> None:
        self.clock, self.step_s = clock, step_s

    def on_step_start(self, trainer) -> None:
        self.clock.now += self.step_s(self.clock.now)


def busy_then_quiet(busy_s: float, slow: float, fast: float):
    """Step seconds on a machine another program keeps busy for its first `busy_s` seconds."""
    return lambda now: slow if now < busy_s else fast


class View:
    """What the budget reads of a trainer (tenx.train.hooks.TrainerView), for a loop without a model."""

    def __init__(self, total_steps: int) -> None:
        self.step, self.total_steps = 0, total_steps

    def agree(self, value: int) -> int:
        return value


def run_loop(budget: WallBudget, clock: Clock, total_steps: int, step_s, optim: OptimConfig):
    """The trainer's loop around the budget: (learning rates taken, steps planned after each step)."""
    view = View(total_steps)
    budget.on_train_start(view)
    view.total_steps = budget.plan.total_steps
    lrs, plans = [], []
    while view.step < view.total_steps:
        warmup = budget.plan.warmup_steps if budget.plan.warmup_steps is not None else optim.warmup_steps
        lrs.append(lr_at(view.step, view.total_steps, dataclasses.replace(optim, warmup_steps=warmup)))
        clock.now += step_s(clock.now)
        view.step += 1
        budget.on_step_end(view, {})
        view.total_steps = budget.plan.total_steps
        plans.append(view.total_steps)
    return lrs, plans


def test_a_plan_from_a_probe_five_times_too_slow_still_ends_at_the_budget():
    """The probe ran while another program was busy: it planned 200 steps where the budget holds about
    a thousand. Re-planned from the steps observed, the loop ends within 5% of its budget (less the
    reserve kept for what follows at the same speed), and the decay ends at the new last step."""
    clock = Clock()
    optim = OptimConfig(lr=1e-3, warmup_steps=50, min_lr_ratio=0.1)
    budget = WallBudget(600.0, reserve_steps=100, min_steps=100, max_steps=5000, warmup_steps=50, clock=clock)
    step_s = busy_then_quiet(60.0, slow=2.5, fast=0.5)
    lrs, plans = run_loop(budget, clock, 200, step_s, optim)

    loop_end = 600.0 - 100 * 0.5  # the reserve at the speed of the last steps
    assert abs(clock.now - loop_end) <= 0.05 * loop_end, (clock.now, len(lrs))
    assert len(lrs) > 4 * 200 and plans[-1] == len(lrs)
    assert lrs[-1] == pytest.approx(optim.lr * optim.min_lr_ratio, rel=1e-3)  # the decay ended at the end
    warmup = budget.plan.warmup_steps
    assert warmup <= 20  # at most a tenth of the first plan (shorter runs planned on the way shorten it)
    assert all(a < b for a, b in zip(lrs[: warmup - 1], lrs[1:warmup], strict=True))  # rising all along
    assert lrs[warmup - 1] == optim.lr


def test_a_plan_too_long_for_a_machine_that_became_busy_is_shortened():
    """The other way round: planned on a quiet machine, trained beside a busy program."""
    clock = Clock()
    budget = WallBudget(300.0, min_steps=10, clock=clock)
    lrs, _ = run_loop(budget, clock, 3000, lambda now: 0.1 if now < 20 else 0.5, OptimConfig())
    assert abs(clock.now - 300.0) <= 0.05 * 300.0 and len(lrs) < 1000


def test_the_budget_is_bounded_by_the_configs_steps_and_the_floor():
    clock = Clock()
    capped = WallBudget(1000.0, max_steps=150, clock=clock)
    lrs, _ = run_loop(capped, clock, 100, lambda now: 0.1, OptimConfig())
    assert len(lrs) == 150  # fast enough for far more: the cap
    # the reserve, priced at a slow speed, leaves no time at all: the floor holds against it
    clock = Clock()
    floored = WallBudget(100.0, reserve_steps=200, min_steps=40, clock=clock)
    lrs, _ = run_loop(floored, clock, 100, lambda now: 1.0, OptimConfig())
    assert len(lrs) == 40
    # but not against the time itself: 10 seconds end the run after about 10 steps
    clock = Clock()
    out_of_time = WallBudget(10.0, min_steps=40, clock=clock)
    lrs, _ = run_loop(out_of_time, clock, 100, lambda now: 1.0, OptimConfig())
    assert len(lrs) == 12  # the first estimate comes after 11 steps (start-up step and a window of 10)


def test_replanned_warmup_only_shortens_one_under_way():
    assert replanned_warmup(0, 200, 50) == 20  # a short run: a tenth of it
    assert replanned_warmup(0, 5000, 50) == 50
    assert replanned_warmup(30, 100, 50) == 30  # never ends before the step already taken
    assert replanned_warmup(10, 5000, 20) == 20  # not lengthened: the learning rate would fall
    assert replanned_warmup(60, 100, 50) == 50  # over: stays
    assert replanned_warmup(5, 100, 0) == 0


def test_the_budget_refuses_senseless_settings():
    with pytest.raises(ConfigError, match="seconds must be a finite number > 0"):
        WallBudget(math.nan)
    with pytest.raises(ConfigError, match="min_steps <= max_steps"):
        WallBudget(10.0, min_steps=100, max_steps=50)
    with pytest.raises(ConfigError, match="reserve_steps"):
        WallBudget(10.0, reserve_steps=-1)


def test_planned_steps_reads_a_checkpoints_budget_or_falls_back():
    assert planned_steps({"callbacks": {"budget": {"total_steps": 321}}}, 100) == 321
    assert planned_steps({"callbacks": {}}, 100) == 100
    assert planned_steps({"callbacks": {"budget": {"total_steps": "x"}}}, 100) == 100


def test_the_trainer_follows_the_budget_and_a_resumed_run_continues_its_schedule(
    tiny_config, tiny_data, tmp_path
):
    """A real run: the trainer takes the budget's plan (length and warmup) for its learning rates; the plan
    and the seconds spent are in every checkpoint, so the run resumed from one takes the next step with
    the same learning rate as the uninterrupted run did."""
    overrides = ("train.steps=40", "optim.warmup_steps=30", "checkpoint.every=10", "train.eval_every=0")
    cfg = tiny_config(tiny_data, *overrides, "log.tensorboard=false", "checkpoint.async_save=false")
    run_dir = tmp_path / "run"

    class StopAt(Callback):
        name = "stop"

        def on_step_end(self, trainer, metrics) -> None:
            if trainer.step == 63:
                raise KeyboardInterrupt

    clock = Clock()
    budget = WallBudget(100.0, min_steps=10, warmup_steps=30, clock=clock)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, run_dir, extra_callbacks=[Machine(clock, lambda now: 1.0), budget, StopAt()])
    first = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    assert len(first) == 62 and first[-1]["planned_steps"] == 100  # 40 configured, 100 fit in the budget
    assert budget.plan == StepPlan(100, 4)  # warmup: a tenth of the run planned at the start, 40 steps
    # every step's learning rate is that of the plan in force when it began
    in_force = [40] + [r["planned_steps"] for r in first[:-1]]
    schedule = dataclasses.replace(cfg.optim, warmup_steps=4)
    assert [r["lr"] for r in first] == pytest.approx(
        [lr_at(r["step"] - 1, total, schedule) for r, total in zip(first, in_force, strict=True)]
    )

    clock2 = Clock()
    clock2.now = 1000.0  # another process: its clock starts elsewhere
    resumed = WallBudget(100.0, min_steps=10, warmup_steps=30, clock=clock2)
    trainer, _ = train(
        cfg, run_dir, resume="auto", extra_callbacks=[Machine(clock2, lambda now: 1.0), resumed]
    )
    assert step_of(trainer.resumed_from) == 60 and trainer.step == trainer.total_steps == 100
    second = {r["step"]: r for r in map(json.loads, RunDir(run_dir).metrics.read_text().splitlines())}
    assert [second[s]["lr"] for s in (61, 62)] == [r["lr"] for r in first[60:62]]
    assert second[100]["lr"] == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio, rel=5e-3)
    assert second[100]["budget_spent_s"] == pytest.approx(100.0)  # 60 s before the interruption, 40 after
    # replay takes each step's recorded learning rate, not the config's 40-step schedule: bit for bit
    from tenx.triage.replay import replay

    for step in (45, 95):
        assert replay(run_dir, step, repeat=1).verdict == "reproduces"


def test_a_step_above_a_peak_measured_again_too_low_reads_mfu_unknown_never_100_percent(
    tiny_config, tiny_data, tmp_path, monkeypatch, capsys
):
    """The peak is far too low (a wrong FLOP count or peak looks the same): the trainer measures it again
    with a matmul benchmark, still finds the step faster, and reports MFU as unknown, once as an event and
    on the progress line; no figure is clamped to 100%."""
    import tenx.train.parts as parts_module
    import tenx.train.trainer as trainer_module

    monkeypatch.setattr(parts_module, "peak_flops", lambda device, dtype, float8=False: 1.0)  # FLOP/s
    measured = []
    monkeypatch.setattr(
        trainer_module, "peak_flops", lambda device, dtype, float8=False: measured.append(float8) or 2.0
    )
    cfg = tiny_config(tiny_data, "train.steps=3", "log.tensorboard=false", "log.print_every=1")
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in RunDir(tmp_path / "run").metrics.read_text().splitlines()]
    assert measured == [False]  # measured once (at most once a minute), in the run's own dtype
    assert [r["mfu"] for r in records] == [None, None, None]
    events = read_events(tmp_path / "run")
    unknown = [e for e in events if e["kind"] == "mfu-unknown"]
    assert len(unknown) == 1 and unknown[0]["step"] == 1 and unknown[0]["peak"] == 2.0
    assert "FLOP count or the peak is wrong" in unknown[0]["message"]
    assert [e["before"] for e in events if e["kind"] == "peak-flops-raised"] == [1.0]
    from tenx.train.callbacks.metrics import Progress

    progress, view = Progress(print_every=1), type("View", (), {"step": 3, "total_steps": 3})()
    progress.on_train_start(view)
    progress.on_step_end(view, {**records[-1], "loss": 5.0})
    assert "mfu unknown (a step above the peak: FLOPs or peak wrong)" in capsys.readouterr().err


def test_a_peak_measured_again_higher_gives_an_honest_mfu_below_one(
    tiny_config, tiny_data, tmp_path, monkeypatch
):
    """A peak first measured while other work shared the cores: the re-measured one is adopted."""
    import tenx.train.parts as parts_module
    import tenx.train.trainer as trainer_module

    monkeypatch.setattr(parts_module, "peak_flops", lambda device, dtype, float8=False: 1.0)
    monkeypatch.setattr(trainer_module, "peak_flops", lambda device, dtype, float8=False: 1e15)
    train(tiny_config(tiny_data, "train.steps=3", "log.tensorboard=false"), tmp_path / "run")
    records = [json.loads(line) for line in RunDir(tmp_path / "run").metrics.read_text().splitlines()]
    assert all(0 < r["mfu"] < 1e-3 for r in records)
    raised = [e for e in read_events(tmp_path / "run") if e["kind"] == "peak-flops-raised"]
    assert len(raised) == 1 and raised[0]["peak"] == 1e15 and raised[0]["achieved"] < 1e12
    assert not [e for e in read_events(tmp_path / "run") if e["kind"] == "mfu-unknown"]
