"""The training loop and the step, plain from top to bottom.

The Trainer receives its built parts (tenx/train/parts.py, by group: data, trained model and optimizer,
checkpointers, services; read under the names of `TrainerParts`) and its callbacks, to which it is a
`TrainerView` (tenx/train/hooks.py). `train_step` reads the step's data and calls the step itself,
tenx/train/step.py (forward, loss, backward, clip, guard, optimizer step; `tenx replay` calls the same),
with the trainer's gradient sync and reductions across ranks and groups as hooks. The cross-group part of
a step (torchft: quorum, gradient average, commit, DiLoCo's outer step) sits behind `self.sync`, which is
a no-op without replica groups.

Side concerns are Callbacks on the named hook events of tenx/train/hooks.py, except those `fit` drives
itself because each must run at one fixed place in the loop or owns the process: the goodput ledger,
the watchdog, the checkpointer's poll, the rollback, the stop signals (and the SIGUSR1 stack dump) and
the replica groups' attach and close; hooks.py says why for each. A wall-clock budget
(tenx/train/callbacks/budget.py) is a callback that plans the run's length; the loop applies its plan
between steps, since callbacks change nothing. Save, load, resume, rollback and healing live in
tenx/train/state.py (TrainerState, inherited).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tenx.data.loader import sequential_windows
from tenx.hardware import host_to_device, peak_flops, resolve_precision
from tenx.monitor.goodput import run_start_time
from tenx.parallel.distributed import DistEnv, all_reduce_mean_, broadcast_int, max_int
from tenx.parallel.replicas import LocalStep
from tenx.rundir import RunDir, step_of
from tenx.train.callbacks.budget import WallBudget
from tenx.train.config import RunConfig
from tenx.train.hooks import Callback
from tenx.train.mfu import MfuMeter
from tenx.train.parts import Parts, build_parts
from tenx.train.rng import seed_everything
from tenx.train.state import TrainerState, git_commit
from tenx.train.step import StepHooks, take_step, token_loss_dtype
from tenx.utils.cpus import choose_threads, env_threads

__all__ = ["Callback", "Trainer", "git_commit", "resolve_precision", "seed_everything"]

_SIGUSR1 = getattr(signal, "SIGUSR1", None)
THREADS_RECHECK_S = 30.0
"""How often a run with auto threads looks again at what other programs keep busy (0.1 s each time)."""


class _StopRequest:
    """SIGTERM/SIGINT during training: remember it, so the loop saves a checkpoint at the step's end.

    Installed only in the main thread. The first signal gives SIGINT back its previous handler, so a second
    Ctrl-C acts at once (stops without waiting for the save); a repeated SIGTERM is the same request again
    and is ignored, since a preemption on Slurm reaches a rank both from the scheduler and through torchrun,
    and acting on the second would lose the checkpoint the first asked for.
    """

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.signum:
            self.signum = signum
        if signal.SIGINT in self._previous:  # a later Ctrl-C acts at once; later SIGTERMs land here again
            signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Trainer(TrainerState):
    """Trains one model on one prepared data directory, with checkpoints and metrics in `run_dir`.

    `parts` are built from `cfg` and `run_dir` when not given (tenx.train.parts.build_parts).
    """

    resume_hint = "--resume auto"
    """How the message of a stop signal says to continue the run; a command that trains runs for the user
    (`tenx ladder`) sets its own (tenx.train.run.train's `resume_hint`)."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path | RunDir,
        callbacks: list[Callback] | None = None,
        *,
        env: DistEnv | None = None,
        parts: Parts | None = None,
    ) -> None:
        self.cfg = cfg
        self.parts = parts if parts is not None else build_parts(cfg, run_dir, env)
        """Everything the run trains with, by group; the names of TrainerParts read them."""
        self.callbacks = list(callbacks or [])
        self.budget = next((cb for cb in self.callbacks if isinstance(cb, WallBudget)), None)
        """The wall-clock budget whose plan the loop follows (tenx.train.callbacks.budget); None: none."""
        self.optim_cfg = cfg.optim
        """The optimizer settings the steps follow: cfg.optim, with the budget's warmup when it re-plans."""
        self.mfu_meter = self._mfu_meter()
        self._auto_threads = self._threads_follow_load()
        self._threads_checked = time.perf_counter()
        self.train_stream.on_bad_shard = self._on_bad_shard
        self.sync: Any = self.replicas if self.replicas is not None else LocalStep()
        """The cross-group part of each step (tenx.parallel.replicas)."""
        self.in_flight: dict[str, Any] = {}
        """The step being taken: its number, loader positions [start, end) and windows (this rank's, and
        every rank's per micro-batch), for the step record and for a crash's incident."""
        self._start_counters()

    def _mfu_meter(self) -> MfuMeter:
        """MFU against every data-parallel worker's peak at the run's precision; its events from rank 0."""
        float8 = self.cfg.train.precision == "fp8"
        return MfuMeter(
            lambda: peak_flops(self.device, self.amp_dtype, float8=float8) * self.data_parallel,
            lambda kind, **fields: self.events.emit(kind, self.step, **fields) if self.rank == 0 else None,
        )

    def _threads_follow_load(self) -> bool:
        """Whether `_follow_load` chooses the thread count again: a lone CPU process with train.follow_load
        and neither train.threads nor OMP_NUM_THREADS."""
        return (
            self.device.type == "cpu"
            and self.cfg.train.follow_load
            and self.cfg.train.threads is None
            and env_threads() is None
            and self.world_size == 1
        )

    def _emit(self, event: str, *args: Any) -> None:
        """Call hook `event` of every callback, in order, with this trainer first."""
        for cb in self.callbacks:
            getattr(cb, event)(self, *args)

    def _on_bad_shard(self, path: str, message: str) -> None:
        """A training shard failed its checksum in data.on_corrupt_shard='skip' mode: record it."""
        self.events.emit("corrupt-shard", self.step + 1, shard=path, message=message, action="skipped")

    # ----- the math -------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed-precision context for forward passes (a no-op in fp32)."""
        if self.amp_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over grad_accum micro-batches (tenx.train.step); returns the step's metrics."""
        t0 = time.perf_counter()
        self.sync.begin_step()  # replica groups, sync mode: the quorum; a group behind its peers heals here
        position = self.loader.position
        windows: list[int] = []
        self.in_flight = {"step": self.step + 1, "position": [position, None], "windows": windows, "all": []}
        batches = []  # the step's data is read first, so a crash record names all of it
        for _ in range(self.grad_accum):
            batches.append(self.loader.next_batch(self.device))
            windows.extend(self.loader.last_windows)
            self.in_flight["all"].append(self.loader.last_global_windows)
        self.in_flight["position"][1] = self.loader.position
        result = take_step(
            self.step + 1,
            [batches],
            self.parts.trained,
            self.parts.shape,
            self.optim_cfg,
            self.device,
            hooks=StepHooks(
                forward_context=self.autocast,
                token_loss_dtype=token_loss_dtype(self.cfg.train.loss_precision),
                gradient_sync=self._gradient_sync,
                reduce=self._reduce,
                commit=self.sync.commit,
            ),
        )
        lr, loss_value, grad_norm, verdict = result.lr, result.loss, result.grad_norm, result.verdict
        if not result.committed:  # a peer group failed during the step: nobody applied it; taken again
            self.events.emit("step-not-committed", self.step + 1, rank=self.rank)
            dt = time.perf_counter() - t0
            return {"step": self.step, "skipped": "not-committed", "loss": loss_value, "step_time_s": dt}
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        # DiLoCo's inner-step count and, every sync_every steps, the outer step (part of this step's time)
        sync_metrics = self.sync.end_step()
        dt = time.perf_counter() - t0
        tokens_per_s = self.tokens_per_step / dt
        achieved = self.flops_per_token * tokens_per_s
        mfu, peak = self.mfu_meter(achieved, self.peak_flops)
        if peak != self.peak_flops:
            self.parts.flops = dataclasses.replace(self.parts.flops, peak=peak)
        metrics: dict[str, Any] = {
            "step": self.step,
            "tokens": self.tokens_seen,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "epoch": self.loader.epochs_seen,
            "step_time_s": dt,
        }
        if result.distill is not None:  # beside the data loss, which stays what every run reports
            metrics["distill_ce"], metrics["distill_kl"] = result.distill
        metrics.update(sync_metrics)
        if verdict is not None:
            metrics["skipped"] = verdict
            self._bad_step(verdict, loss_value, grad_norm, position, windows)
        elif result.applied and (rise := self.guard.rise()) is not None:
            self.events.emit("loss-rise", self.step, **rise, data=self.loader.describe_windows(windows))
        if self.ledger is not None:
            self.ledger.step(self.step, dt, skipped=verdict is not None)
        return metrics

    def _follow_budget(self) -> None:
        """Take the wall-clock budget's latest plan (tenx.train.callbacks.budget): the run's length and the
        warmup that the learning rate follows from the next step on."""
        plan = self.budget.plan if self.budget is not None else None
        if plan is None:
            return
        if plan.total_steps != self.total_steps:
            self.parts.shape = dataclasses.replace(self.parts.shape, total_steps=plan.total_steps)
        if plan.warmup_steps is not None and plan.warmup_steps != self.optim_cfg.warmup_steps:
            self.optim_cfg = dataclasses.replace(self.cfg.optim, warmup_steps=plan.warmup_steps)

    def _follow_load(self) -> None:
        """With train.follow_load and auto threads on a lone CPU process, every THREADS_RECHECK_S: as many torch threads as other
        programs leave CPUs free (tenx.utils.cpus.choose_threads), so a program that starts or stops during
        the run neither halves it nor makes its threads wait on each other. Step records keep the count
        (tenx replay runs each step on it); a change is a `threads-changed` event."""
        if not self._auto_threads or time.perf_counter() - self._threads_checked < THREADS_RECHECK_S:
            return
        threads = choose_threads(quiet=True)
        self._threads_checked = time.perf_counter()
        if threads != torch.get_num_threads():
            self.events.emit("threads-changed", self.step, before=torch.get_num_threads(), threads=threads)
            torch.set_num_threads(threads)

    def _bad_step(
        self, verdict: str, loss: float, grad_norm: float, position: int, windows: list[int]
    ) -> None:
        """Record a skipped update with the data in flight; mark a rollback due after a streak."""
        info = {"step": self.step, "position": [position, self.loader.position]}
        self._rollback_due = self.guard.record_bad(info)
        self.events.emit(
            "skipped-step",
            self.step,
            reason=verdict,
            loss=loss,
            grad_norm=grad_norm,
            threshold=self.guard.threshold(),
            streak=len(self.guard.streak),
            data=self.loader.describe_windows(windows),
            rank=self.rank,
        )

    def _gradient_sync(self, last_micro_batch: bool) -> contextlib.AbstractContextManager[Any]:
        """Reduce gradients across ranks only on the last micro-batch of a step (accumulate locally before)."""
        if self.strategy == "ddp" and not last_micro_batch:
            return self.model.no_sync()  # type: ignore[operator]
        if self.strategy == "fsdp" and self.grad_accum > 1:
            self.model.set_requires_gradient_sync(last_micro_batch)  # type: ignore[operator]
        return contextlib.nullcontext()

    def _reduce(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The step's loss sum and gradients reduced across ranks and replica groups, then pre_optim_step."""
        all_reduce_mean_(loss_sum, self.world_size)  # the job's loss, the same on every rank
        self.sync.reduce(self.raw_model, loss_sum)  # replica groups, sync mode: average across groups
        self._emit("pre_optim_step")
        return loss_sum

    def agree(self, value: int) -> int:
        """Rank 0's `value` on every rank (for decisions every rank must take alike, e.g. when to save)."""
        return broadcast_int(value, self.world_size, self.checkpoint_group)

    @torch.no_grad()
    def validation_loss(self) -> float | None:
        """Mean loss (nats/token) over eval_batches micro-batches spread evenly over the validation split."""
        if self.val_stream is None:
            return None
        self.model.eval()
        ces: list[torch.Tensor] = []  # each batch's loss stays on the device: one wait, at the end
        sizes: list[int] = []
        for inputs, targets in sequential_windows(
            self.val_stream, self.model_cfg.seq_len, self.cfg.train.micro_batch, self.cfg.train.eval_batches
        ):
            with self.autocast():
                _, ce = self.forward(
                    host_to_device(inputs, self.device), host_to_device(targets, self.device)
                )
            ces.append(ce.detach())
            sizes.append(targets.numel())
        total = sum(ce * size for ce, size in zip(torch.stack(ces).tolist(), sizes, strict=True))
        count = sum(sizes)
        if self.strategy == "fsdp":  # a forward without backward leaves the root's parameters gathered
            self.model.reshard()  # type: ignore[operator]
        self.model.train()
        return total / count

    # ----- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train until total_steps; returns the last step's metrics.

        Between the hook events it drives, at fixed places, what is not a callback: replica attach and
        close, ledger, watchdog, the checkpointer's poll, rollback, stop signals (tenx/train/hooks.py)."""
        self.rundir.root.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self.write_provenance()
        stacks = open(self.rundir.stacks(os.getpid()), "w")
        if _SIGUSR1 is not None:  # `kill -USR1 PID` dumps every thread's stack into the run directory
            faulthandler.register(_SIGUSR1, file=stacks, all_threads=True)
        metrics: dict[str, Any] = {}
        stop = _StopRequest()
        try:
            if self.replicas is not None:
                self.replicas.attach(
                    self.raw_model,
                    self.optimizer,
                    self.replica_state_dict,
                    self.load_replica_state_dict,
                    total_steps=self.total_steps,
                )
            self._emit("on_train_start")
            self._follow_budget()
            if self.ledger is not None:
                self.ledger.start(self.step, run_start_time())
            self.watchdog.start(self.step)
            while self.step < self.total_steps:
                self._emit("on_step_start")
                metrics = self.train_step()
                if metrics.get("skipped") == "not-committed":
                    continue
                self._emit("on_step_end", metrics)
                self.checkpointer.poll()
                if self._rollback_due:
                    self.rollback()
                self._follow_budget()
                self._follow_load()
                self.watchdog.beat(self.step)
                signum = self._stop_requested(stop.signum)
                if signum and self.step < self.total_steps:
                    self._save_and_stop(signum)
            self._emit("on_train_end")
            self.checkpointer.wait()
            if self.rank == 0:
                self.clear_memory_tier()
            if self.ledger is not None:
                self.ledger.end(self.step)
        except BaseException as error:
            self._emit("on_error", error)
            raise
        finally:
            stop.restore()
            self.watchdog.stop()
            if self.replicas is not None:
                self.replicas.close()
            if self.ledger is not None:
                self.ledger.close()
            self._emit("close")
            if _SIGUSR1 is not None:
                faulthandler.unregister(_SIGUSR1)
            stacks.close()
            if Path(stacks.name).stat().st_size == 0:
                Path(stacks.name).unlink(missing_ok=True)
        return metrics

    def _stop_requested(self, signum: int) -> int:
        """The signal any rank received (0: none), the same on every rank, so all stop at one step.

        Several ranks: a max-reduce on the training process group, from the loop's own thread (the
        checkpoint group belongs to the background writer)."""
        return max_int(signum, self.world_size, self.device)

    def _save_and_stop(self, signum: int) -> None:
        """A scheduler's SIGTERM (preemption) or Ctrl-C: checkpoint this step, name it, stop (exit 130)."""
        self.checkpointer.wait()
        last = self.checkpointer.last_path
        if last is None or step_of(last) != self.step:
            self.save_checkpoint()
            self.checkpointer.wait()
        path = self.rundir.checkpoint(self.step)
        name = signal.Signals(signum).name
        if self.rank == 0:
            self.events.emit("stopped", self.step, signal=name, checkpoint=str(path))
            print(
                f"tenx: {name} at step {self.step}: saved checkpoint {path}; continue with {self.resume_hint}",
                flush=True,
            )
        raise KeyboardInterrupt
