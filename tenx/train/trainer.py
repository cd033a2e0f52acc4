"""The training loop and the step, plain from top to bottom.

The Trainer receives its built parts (tenx/train/parts.py: data, model, optimizer, checkpointers, replica
groups, guard, ...) and its callbacks. `train_step` holds the math only: forward, loss, backward, the
reductions, clip, guard, optimizer step. The cross-group part of a step (torchft: quorum, gradient
average, commit, DiLoCo's outer step) sits behind `self.sync`, which is a no-op without replica groups.
Every side concern is a Callback on the named hook events of tenx/train/hooks.py. Save, load, resume,
rollback and healing live in tenx/train/state.py (TrainerState, inherited).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tenx.data.loader import sequential_windows
from tenx.hardware import resolve_precision
from tenx.model.transformer import lm_loss
from tenx.monitor.goodput import process_start_time
from tenx.parallel.distributed import DistEnv, all_reduce_mean_, full_value
from tenx.parallel.replicas import LocalStep
from tenx.rundir import RunDir
from tenx.train.config import RunConfig
from tenx.train.hooks import Callback
from tenx.train.optim import lr_at
from tenx.train.parts import Parts, build_parts
from tenx.train.rng import seed_everything
from tenx.train.state import TrainerState, _step_of, git_commit

__all__ = ["Callback", "Trainer", "git_commit", "resolve_precision", "seed_everything"]

_SIGUSR1 = getattr(signal, "SIGUSR1", None)


class _StopRequest:
    """SIGTERM/SIGINT during training: remember it, so the loop saves a checkpoint at the step's end.

    Installed only in the main thread. The first signal restores the previous handlers, so a second one
    acts at once (Ctrl-C twice stops without waiting for the save).
    """

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self.restore()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Trainer(TrainerState):
    """Trains one model on one prepared data directory, with checkpoints and metrics in `run_dir`.

    `parts` are built from `cfg` and `run_dir` when not given (tenx.train.parts.build_parts).
    """

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path,
        callbacks: list[Callback] | None = None,
        *,
        env: DistEnv | None = None,
        parts: Parts | None = None,
    ) -> None:
        parts = parts if parts is not None else build_parts(cfg, run_dir, env)
        self.cfg = cfg
        self.rundir: RunDir = parts.rundir
        self.run_dir = parts.rundir.root
        self.env = parts.env
        self.rank, self.world_size = parts.env.rank, parts.env.world_size
        self.callbacks = list(callbacks or [])
        self.device, self.amp_dtype = parts.device, parts.amp_dtype
        self.events = parts.events
        self.train_stream, self.val_stream = parts.train_stream, parts.val_stream
        self.train_stream.on_bad_shard = self._on_bad_shard
        self.data_manifest = parts.data_manifest
        self.model_cfg = parts.model_cfg
        self.replicas = parts.replicas
        self.sync: Any = parts.replicas if parts.replicas is not None else LocalStep()
        """The cross-group part of each step (tenx.parallel.replicas)."""
        self.data_parallel, self.grad_accum = parts.data_parallel, parts.grad_accum
        """Data-parallel workers in all (ranks of this job times replica groups); micro-batches per step."""
        self.loader = parts.loader
        self.raw_model = parts.raw_model
        """The transformer itself (under FSDP2 its parameters are DTensor shards)."""
        self.model, self.strategy = parts.model, parts.strategy
        """What forward and backward run through: the DDP wrapper, the FSDP2-sharded model or the model."""
        self.optimizer = parts.optimizer
        self.forward = parts.forward
        self.tokens_per_step, self.total_steps = parts.tokens_per_step, parts.total_steps
        self.params, self.flops_per_token, self.peak_flops = (
            parts.params,
            parts.flops_per_token,
            parts.peak_flops,
        )
        self.step = 0
        self.tokens_seen = 0
        self.in_flight: dict[str, Any] = {}
        """The step being taken: its number, loader positions [start, end) and windows (this rank's, and
        every rank's per micro-batch), for the step record and for a crash's incident."""
        self.resumed_from: Path | None = None
        self.guard = parts.guard
        self.rollbacks = 0
        self._rollback_due = False
        self._data_skips = parts.data_skips
        self.checkpoint_group = parts.checkpoint_group
        self.checkpointer, self.memory_checkpointer = parts.checkpointer, parts.memory_checkpointer
        self.ledger, self.watchdog = parts.ledger, parts.watchdog

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
        """One optimizer step over grad_accum micro-batches; returns the step's metrics."""
        t0 = time.perf_counter()
        self.sync.begin_step()  # replica groups, sync mode: the quorum; a group behind its peers heals here
        lr = lr_at(self.step, self.total_steps, self.cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum = self.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        self.model.train()
        position = self.loader.position
        windows: list[int] = []
        self.in_flight = {"step": self.step + 1, "position": [position, None], "windows": windows, "all": []}
        batches = []  # the step's data is read first, so a crash record names all of it
        for _ in range(accum):
            batches.append(self.loader.next_batch())
            windows.extend(self.loader.last_windows)
            self.in_flight["all"].append(self.loader.last_global_windows)
        self.in_flight["position"][1] = self.loader.position
        for i, (inputs, targets) in enumerate(batches):
            inputs, targets = (
                inputs.to(self.device, non_blocking=True),
                targets.to(self.device, non_blocking=True),
            )
            with self._gradient_sync(i == accum - 1):
                with self.autocast():
                    logits = self.forward(inputs)
                loss, ce = lm_loss(logits, targets, self.model_cfg.z_loss)
                (loss / accum).backward()
            loss_sum += ce.detach()
        all_reduce_mean_(loss_sum, self.world_size)  # the job's loss, the same on every rank
        self.sync.reduce(self.raw_model, loss_sum)  # replica groups, sync mode: average across groups
        self._emit("pre_optim_step")
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), clip)
        grad_norm = full_value(norm).item()
        loss_value = (loss_sum / accum).item()
        verdict = self.guard.check(loss_value, grad_norm)
        commit = self.sync.commit()
        if verdict is None and commit:
            self.optimizer.step()
            self.guard.record_good(loss_value, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        if not commit:  # a peer group failed during the step: nobody applied it; the step is taken again
            self.events.emit("step-not-committed", self.step + 1, rank=self.rank)
            dt = time.perf_counter() - t0
            return {"step": self.step, "skipped": "not-committed", "loss": loss_value, "step_time_s": dt}
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        # DiLoCo's inner-step count and, every sync_every steps, the outer step (part of this step's time)
        sync_metrics = self.sync.end_step()
        dt = time.perf_counter() - t0
        tokens_per_s = self.tokens_per_step / dt
        metrics: dict[str, Any] = {
            "step": self.step,
            "tokens": self.tokens_seen,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / self.peak_flops,
            "epoch": self.loader.epochs_seen,
            "step_time_s": dt,
        }
        metrics.update(sync_metrics)
        if verdict is not None:
            metrics["skipped"] = verdict
            self._bad_step(verdict, loss_value, grad_norm, position, windows)
        if self.ledger is not None:
            self.ledger.step(self.step, dt, skipped=verdict is not None)
        return metrics

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

    def agree(self, value: int) -> int:
        """Rank 0's `value` on every rank (for decisions every rank must take alike, e.g. when to save)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.broadcast(t, src=0, group=self.checkpoint_group)
        return int(t.item())

    @torch.no_grad()
    def validation_loss(self) -> float | None:
        """Mean loss (nats/token) over eval_batches micro-batches spread evenly over the validation split."""
        if self.val_stream is None:
            return None
        self.model.eval()
        total, count = 0.0, 0
        for inputs, targets in sequential_windows(
            self.val_stream, self.model_cfg.seq_len, self.cfg.train.micro_batch, self.cfg.train.eval_batches
        ):
            with self.autocast():
                logits = self.forward(inputs.to(self.device))
            _, ce = lm_loss(logits, targets.to(self.device))
            total += ce.item() * targets.numel()
            count += targets.numel()
        if self.strategy == "fsdp":  # a forward without backward leaves the root's parameters gathered
            self.model.reshard()  # type: ignore[operator]
        self.model.train()
        return total / count

    # ----- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train until total_steps; returns the last step's metrics."""
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
            if self.ledger is not None:
                self.ledger.start(self.step, process_start_time())
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
        if self.world_size == 1:
            return signum
        t = torch.tensor([signum], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def _save_and_stop(self, signum: int) -> None:
        """A scheduler's SIGTERM (preemption) or Ctrl-C: checkpoint this step, name it, stop (exit 130)."""
        self.checkpointer.wait()
        last = self.checkpointer.last_path
        if last is None or _step_of(last) != self.step:
            self.save_checkpoint()
            self.checkpointer.wait()
        path = self.rundir.checkpoint(self.step)
        name = signal.Signals(signum).name
        if self.rank == 0:
            self.events.emit("stopped", self.step, signal=name, checkpoint=str(path))
            print(
                f"tenx: {name} at step {self.step}: saved checkpoint {path}; continue with --resume auto",
                flush=True,
            )
        raise KeyboardInterrupt
