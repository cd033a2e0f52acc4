"""The training loop, plain from top to bottom.

The math (forward, loss, backward, clip, guard, AdamW step) lives in `train_step`. Side concerns attach
through the hook points of `Callback` (tenx/train/hooks.py): on_train_start, on_step_start, on_step_end,
on_train_end, and state_dict/load_state_dict so their state is checkpointed with everything else.
Callbacks never touch gradients or the optimizer.

State management lives here too: asynchronous checkpoints, the numerics guard with its rollback, the
hang watchdog, the goodput ledger (RUN_DIR/ledger.jsonl) and the event log (RUN_DIR/events.jsonl).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import math
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import tenx
from tenx import checkpoint as ckpt
from tenx import config as cfglib
from tenx.data.loader import TokenLoader, TokenStream, sequential_windows
from tenx.errors import CheckpointError, ConfigError, DataError, TenxError, UnsafeCheckpointError
from tenx.model.config import ModelConfig
from tenx.model.flops import count_params, flops_per_token
from tenx.model.transformer import Transformer, lm_loss
from tenx.monitor.events import EventLog
from tenx.monitor.goodput import Ledger, process_start_time
from tenx.parallel.distributed import DistEnv, all_reduce_mean_, dist_env, full_value, rank_device, wrap_model
from tenx.plan.hardware import (
    hardware_summary,
    peak_flops,
    pick_device,
    resolve_precision,
    tune_cpu_allocator,
)
from tenx.train.config import RunConfig, accumulation_steps
from tenx.train.guard import StepGuard
from tenx.train.hooks import Callback
from tenx.train.optim import build_optimizer, lr_at
from tenx.train.watchdog import Watchdog
from tenx.utils.io import atomic_write_json, atomic_write_text, bytes_xxhash

__all__ = ["Callback", "Trainer", "resolve_precision", "seed_everything"]

# The manifest fields a resume reads (loader.* are the ones TokenLoader.load_state_dict needs).
_RESUME_FIELDS = (
    "model",
    "tokens",
    "optim_param_groups",
    "python_rng",
    "numpy_rng",
    "callbacks",
    "loader.epoch",
    "loader.cursor",
    "loader.seed",
    "loader.num_windows",
)


def git_commit() -> str | None:
    """The commit of the tenx source tree, when it is a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(tenx.__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class Trainer:
    """Trains one model on one prepared data directory, with checkpoints and metrics in `run_dir`."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path,
        callbacks: list[Callback] | None = None,
        *,
        env: DistEnv | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        env = env if env is not None else dist_env()
        if env.world_size > 1 and not (
            torch.distributed.is_available() and torch.distributed.is_initialized()
        ):
            raise TenxError(
                f"world_size={env.world_size} needs an initialised process group (launch with torchrun)"
            )
        self.env = env
        self.rank, self.world_size = env.rank, env.world_size
        self.callbacks = list(callbacks or [])
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.device = rank_device(pick_device(tc.device), env)
        if self.device.type == "cpu" and tc.tune_allocator:
            tune_cpu_allocator()
        self.amp_dtype = resolve_precision(tc.precision, self.device)
        seed_everything(tc.seed)

        self.events = EventLog(self.run_dir)
        self.train_stream = TokenStream(
            cfg.data.dir,
            cfg.data.train_split,
            cfg.data.verify,
            cfg.data.max_unique_tokens,
            on_corrupt=cfg.data.on_corrupt_shard,
        )
        self.train_stream.on_bad_shard = self._on_bad_shard
        self.data_manifest = self.train_stream.manifest
        vocab = int(self.data_manifest["tokenizer"]["vocab_size"])
        self.model_cfg: ModelConfig = cfg.model.resolved(vocab)
        if self.model_cfg.vocab_size is not None and self.model_cfg.vocab_size < vocab:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's vocabulary {vocab}"
            )
        self.val_stream = (
            TokenStream(cfg.data.dir, cfg.data.val_split, cfg.data.verify)
            if self.data_manifest["splits"].get(cfg.data.val_split, {}).get("tokens", 0)
            > self.model_cfg.seq_len
            else None
        )
        # Replica groups (torchft, across clusters): each group reads its own share of every global batch.
        self.replicas: Any = None
        groups, group_id = 1, 0
        if cfg.parallel.replicas.mode != "off":
            from tenx.parallel.replicas import Replicas

            self.replicas = Replicas(
                cfg.parallel.replicas,
                rank=self.rank,
                world_size=self.world_size,
                device=self.device,
                events=self.events,
            )
            groups, group_id = self.replicas.num_groups, self.replicas.group_id
        self.data_parallel = self.world_size * groups
        """Data-parallel workers in all: ranks of this job times replica groups."""
        self.grad_accum = accumulation_steps(tc, self.data_parallel)
        self.loader = TokenLoader(
            self.train_stream,
            self.model_cfg.seq_len,
            tc.micro_batch,
            seed=tc.seed,
            rank=group_id * self.world_size + self.rank,
            world_size=self.data_parallel,
        )
        self.raw_model = Transformer(self.model_cfg).to(self.device)
        """The transformer itself (under FSDP2 its parameters are DTensor shards)."""
        self.model, self.strategy = wrap_model(self.raw_model, cfg.parallel, self.device, self.world_size)
        """What forward and backward run through: the DDP wrapper, the FSDP2-sharded model or the model."""
        self.optimizer = build_optimizer(self.raw_model, cfg.optim, self.device)
        self.forward = torch.compile(self.model) if tc.compile else self.model
        self.after_reduce: list[Callable[[Trainer], None]] = []
        """Called each step once gradients are reduced across ranks and groups, before clipping."""
        self.state_generation = 0
        """Incremented whenever the training state is loaded (resume, rollback, healing from a peer)."""

        self.tokens_per_step = tc.micro_batch * self.grad_accum * self.data_parallel * self.model_cfg.seq_len
        self.total_steps = (
            tc.steps if tc.steps is not None else math.ceil((tc.tokens or 0) / self.tokens_per_step)
        )
        self.params = count_params(self.model_cfg)
        self.flops_per_token = flops_per_token(self.model_cfg)
        self.peak_flops = peak_flops(self.device, self.amp_dtype) * self.data_parallel
        self.step = 0
        self.tokens_seen = 0
        self.resumed_from: Path | None = None

        self.guard = StepGuard(cfg.guard)
        self.rollbacks = 0
        self._rollback_due = False
        # Data skipped after rollbacks, kept beside the checkpoints so that a resume from a checkpoint
        # older than the rollback skips the same data: the run stays reproducible.
        skips_file = self.run_dir / "data_skips.json"
        self._data_skips: list[list[int]] = (
            json.loads(skips_file.read_text())["skips"] if skips_file.exists() else []
        )
        for start, end in self._data_skips:
            self.loader.add_skip(start, end)
        # Several ranks: checkpoints get a gloo group of their own, so a background save never interleaves
        # its collectives with the training ones (shared/notes: async DCP on the default group hangs).
        self.checkpoint_group: Any = (
            torch.distributed.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s)
            )
            if self.world_size > 1
            else None
        )
        self.checkpointer = ckpt.AsyncCheckpointer(
            self.checkpoint_dir(),
            cfg.checkpoint.keep_last,
            cfg.checkpoint.keep_every,
            cfg.checkpoint.async_save,
            process_group=self.checkpoint_group,
            rank=self.rank,
        )
        memory_tier = bool(cfg.checkpoint.memory_every)
        if memory_tier and not env.single_node:
            memory_tier = False
            if self.rank == 0:
                print("tenx: checkpoint.memory_every needs every rank on one machine; in-memory tier off")
        self.memory_checkpointer = (
            ckpt.AsyncCheckpointer(
                self.memory_checkpoint_dir(),
                keep_last=1,
                async_save=True,
                process_group=self.checkpoint_group,
                rank=self.rank,
            )
            if memory_tier
            else None
        )
        self.before_publish: list[Callable[[Path, int], None]] = []
        """Called with (temporary checkpoint dir, step) before each save is published (fault injection)."""
        self.ledger = Ledger(self.run_dir) if self.rank == 0 else None
        self.watchdog = Watchdog(cfg.watchdog, self.run_dir, self.events)

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
        if self.replicas is not None:
            self.replicas.begin_step()  # sync mode: the quorum; a group behind its peers heals here
        lr = lr_at(self.step, self.total_steps, self.cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum = self.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        self.model.train()
        position = self.loader.position
        windows: list[int] = []
        for i in range(accum):
            inputs, targets = self.loader.next_batch()
            windows.extend(self.loader.last_windows)
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
        if self.replicas is not None:
            self.replicas.reduce_gradients(self.raw_model)  # sync mode: average across groups
            if self.replicas.mode == "sync":  # one loss for every group, so every guard decides alike
                self.replicas.allreduce_mean_(loss_sum)
        for hook in self.after_reduce:
            hook(self)
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), clip)
        grad_norm = full_value(norm).item()
        loss_value = (loss_sum / accum).item()
        verdict = self.guard.check(loss_value, grad_norm)
        commit = self.replicas.should_commit() if self.replicas is not None else True
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
        replica_metrics = self.replicas.end_step() if self.replicas is not None else {}
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
        metrics.update(replica_metrics)
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
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self.write_provenance()
        stacks = open(self.run_dir / f"stacks-pid{os.getpid()}.txt", "w")
        if _SIGUSR1 is not None:  # `kill -USR1 PID` dumps every thread's stack into the run directory
            faulthandler.register(_SIGUSR1, file=stacks, all_threads=True)
        try:
            if self.replicas is not None:
                self.replicas.attach(
                    self.raw_model, self.optimizer, self.replica_state_dict, self.load_replica_state_dict
                )
            for cb in self.callbacks:
                cb.on_train_start(self)
            if self.ledger is not None:
                self.ledger.start(self.step, process_start_time())
            self.watchdog.start(self.step)
            metrics: dict[str, Any] = {}
            while self.step < self.total_steps:
                for cb in self.callbacks:
                    cb.on_step_start(self)
                metrics = self.train_step()
                if metrics.get("skipped") == "not-committed":
                    continue
                for cb in self.callbacks:
                    cb.on_step_end(self, metrics)
                self.checkpointer.poll()
                if self._rollback_due:
                    self.rollback()
                self.watchdog.beat(self.step)
            for cb in self.callbacks:
                cb.on_train_end(self)
            self.checkpointer.wait()
            if self.rank == 0:
                self.clear_memory_tier()
            if self.ledger is not None:
                self.ledger.end(self.step)
        finally:
            self.watchdog.stop()
            if self.replicas is not None:
                self.replicas.close()
            if self.ledger is not None:
                self.ledger.close()
            if _SIGUSR1 is not None:
                faulthandler.unregister(_SIGUSR1)
            stacks.close()
            if Path(stacks.name).stat().st_size == 0:
                Path(stacks.name).unlink(missing_ok=True)
        return metrics

    def rollback(self) -> Path:
        """Reload the newest verified checkpoint before the current streak of bad steps; skip their data."""
        streak = list(self.guard.streak)
        first_bad = streak[0]["step"]
        skip = [streak[0]["position"][0], streak[-1]["position"][1]]
        self._rollback_due = False
        self.rollbacks += 1
        if self.rollbacks > self.cfg.guard.max_rollbacks:
            raise TenxError(
                f"guard: {len(streak)} bad steps in a row from step {first_bad}, and already "
                f"{self.cfg.guard.max_rollbacks} rollbacks (guard.max_rollbacks); the run is unstable: "
                "lower optim.lr, check the data named in events.jsonl, or raise guard.max_rollbacks"
            )
        self.checkpointer.wait()
        target = None
        for step, path in reversed(ckpt.list_checkpoints(self.checkpoint_dir())):
            if step < first_bad:
                try:
                    ckpt.verify_checkpoint(path)
                except UnsafeCheckpointError:
                    raise  # a forged checkpoint stops the run, as in latest_verified
                except CheckpointError as e:
                    print(f"tenx: guard: skipping checkpoint that does not verify: {e}")
                    continue
                target = path
                break
        if target is None:
            raise TenxError(
                f"guard: {len(streak)} bad steps in a row from step {first_bad} and no verified checkpoint "
                "before them to roll back to; save checkpoints more often (checkpoint.every)"
            )
        from_step = self.step
        self._data_skips.append(skip)
        atomic_write_json(self.run_dir / "data_skips.json", {"skips": self._data_skips})
        self.load_checkpoint(target)
        self.events.emit(
            "rollback",
            from_step,
            to_step=self.step,
            checkpoint=str(target),
            bad_steps=[b["step"] for b in streak],
            skipped_positions=skip,
            rollbacks=self.rollbacks,
        )
        if self.ledger is not None:
            self.ledger.rollback(from_step, self.step)
        print(
            f"tenx: guard: {len(streak)} bad steps from step {first_bad}; rolled back to step {self.step} "
            f"and skipped the data they read (loader positions {skip[0]}..{skip[1]})"
        )
        return target

    # ----- state ----------------------------------------------------------------------------------
    def checkpoint_dir(self) -> Path:
        """Where this run's checkpoints live."""
        return self.run_dir / "checkpoints"

    def memory_checkpoint_dir(self) -> Path:
        """The in-memory tier: tmpfs, keyed by the run directory, outliving the process but not the machine."""
        if self.cfg.checkpoint.memory_dir:
            return Path(self.cfg.checkpoint.memory_dir)
        key = bytes_xxhash(str(self.run_dir.resolve()).encode())[:16]
        shm = Path("/dev/shm")
        return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"tenx-{key}"

    def clear_memory_tier(self) -> None:
        """Free the in-memory tier (a fresh start, or training finished)."""
        if self.memory_checkpointer is not None:
            self.memory_checkpointer.wait()
        shutil.rmtree(self.memory_checkpoint_dir(), ignore_errors=True)

    def _state_tensors(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Every tensor of the training state (for DCP), and the optimizer's plain-data param groups (JSON).

        Keeping non-tensor state out of DCP means loading it never needs a pickle.
        """
        optim = get_optimizer_state_dict(self.model, self.optimizer)
        tensors: dict[str, Any] = {
            "model": get_model_state_dict(self.model),
            "optim": {"state": optim["state"]},
            "rng": {"torch": torch.get_rng_state()},
        }
        if self.device.type == "cuda":
            tensors["rng"]["cuda"] = torch.cuda.get_rng_state(self.device)
        return tensors, list(optim["param_groups"])  # type: ignore[arg-type]

    def save_checkpoint(self, tier: str = "disk") -> float:
        """Save everything needed to continue this run bit for bit; returns the seconds the loop was blocked.

        With `checkpoint.async_save` the loop blocks only while the state is copied in memory; the files
        are written, hashed and published in the background (`self.checkpointer`).
        """
        t0 = time.perf_counter()
        tensors, param_groups = self._state_tensors()
        meta_step = self.step
        meta = {
            "optim_param_groups": param_groups,
            "data_dir": str(Path(self.cfg.data.dir).resolve()),
            "tokens": self.tokens_seen,
            "loader": self.loader.state_dict(),
            "python_rng": _python_rng_state(),
            "numpy_rng": _numpy_rng_state(),
            "callbacks": {cb.name: cb.state_dict() for cb in self.callbacks},
            "guard": self.guard.state_dict(),
            "config": cfglib.to_dict(self.cfg),
            "model": cfglib.to_dict(self.model_cfg),
            "data_tokenizer": self.data_manifest["tokenizer"],
            "tenx_version": tenx.__version__,
            "run_id": self.run_id(),
            "world_size": self.world_size,
            "strategy": self.strategy,
            **({"replicas": self.replicas.state_dict()} if self.replicas is not None else {}),
        }
        hooks = list(self.before_publish)
        checkpointer = self.memory_checkpointer if tier == "memory" else self.checkpointer
        assert checkpointer is not None, "checkpoint.memory_every is 0: there is no in-memory tier"
        checkpointer.save(
            self.step,
            tensors,
            meta,
            before_publish=(lambda tmp: _call_all(hooks, tmp, meta_step))
            if hooks and tier == "disk"
            else None,
        )
        blocked = time.perf_counter() - t0  # state dicts and metadata included, not just the snapshot
        if self.ledger is not None:
            self.ledger.checkpoint(self.step, blocked)
        return blocked

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore model, optimizer, loader, RNGs, counters and callback state from a checkpoint.

        The manifest's fields are type-checked when read (checkpoint.validate_manifest); a value that is
        well-typed but still cannot be applied (an RNG state of the wrong length, a param group that does
        not fit this optimizer) is a CheckpointError naming the checkpoint, not a traceback.
        """
        # Rank 0 verifies first, so a forged checkpoint is named as such whatever model it claims to hold.
        read = ckpt.verify_checkpoint if self.rank == 0 else ckpt.read_checkpoint_meta
        saved_model = read(path, require=("model",))["model"]
        ours = cfglib.to_dict(self.model_cfg)
        if saved_model != ours:
            diff = ", ".join(
                f"{k}: {saved_model.get(k)!r} in the checkpoint, {ours.get(k)!r} here"
                for k in sorted(set(saved_model) | set(ours))
                if saved_model.get(k) != ours.get(k)
            )
            raise CheckpointError(f"checkpoint {path} holds a different model ({diff})")
        tensors, _ = self._state_tensors()
        meta = ckpt.load_checkpoint(
            path,
            tensors,
            process_group=self.checkpoint_group,
            verify=False,  # verified above
            require=_RESUME_FIELDS,
        )
        try:
            self._restore_state(tensors, meta)
        except DataError as e:  # the loader's position was saved for other data
            raise CheckpointError(f"checkpoint {path}: {e}") from None
        except (KeyError, IndexError, TypeError, ValueError, OverflowError, RuntimeError) as e:
            raise CheckpointError(
                f"checkpoint {path}: its training state cannot be restored ({type(e).__name__}: {e})"
            ) from None
        self.resumed_from = Path(path)

    def _restore_state(self, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        set_model_state_dict(self.model, tensors["model"])
        set_optimizer_state_dict(
            self.model,
            self.optimizer,
            {"state": tensors["optim"]["state"], "param_groups": meta["optim_param_groups"]},
        )
        torch.set_rng_state(tensors["rng"]["torch"])
        if "cuda" in tensors["rng"]:
            torch.cuda.set_rng_state(tensors["rng"]["cuda"], self.device)
        _set_python_rng_state(meta["python_rng"])
        _set_numpy_rng_state(meta["numpy_rng"])
        self.loader.load_state_dict(meta["loader"])
        for start, end in self._data_skips:  # skips recorded after this checkpoint was saved
            self.loader.add_skip(start, end)
        self.step, self.tokens_seen = int(meta["step"]), int(meta["tokens"])
        self.guard.load_state_dict(meta.get("guard", {}))
        self._rollback_due = False
        for cb in self.callbacks:
            cb.load_state_dict(meta["callbacks"].get(cb.name, {}))
        if self.replicas is not None and "replicas" in meta:
            self.replicas.load_state_dict(meta["replicas"])
        self.state_generation += 1

    # ----- healing from a live peer group (torchft) ----------------------------------------------------
    def replica_state_dict(self) -> dict[str, Any]:
        """Everything a healing replica group needs from a live peer: weights, optimizer, counters, data position."""
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
            "trainer": {
                "step": self.step,
                "tokens": self.tokens_seen,
                "loader": self.loader.state_dict(),
                "guard": self.guard.state_dict(),
            },
        }

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer group's state (see replica_state_dict); the loader position is global, so it is ours too."""
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        trainer_state = state["trainer"]
        self.step, self.tokens_seen = int(trainer_state["step"]), int(trainer_state["tokens"])
        self.loader.load_state_dict(trainer_state["loader"])
        for start, end in self._data_skips:
            self.loader.add_skip(start, end)
        self.guard.load_state_dict(trainer_state.get("guard", {}))
        self.state_generation += 1

    def resume(self, how: str) -> Path | None:
        """`auto`: the newest checkpoint of this run that verifies (none: start fresh); else a path.

        Several ranks: rank 0 chooses (and verifies) and every rank loads its own shards of that one.
        """
        if how == "auto":
            path = self._newest_checkpoint() if self.rank == 0 else None
            if self.world_size > 1:
                box = [str(path) if path else None]
                torch.distributed.broadcast_object_list(box, src=0, group=self.checkpoint_group)
                path = Path(box[0]) if box[0] else None
            if path is None:
                return None
        else:
            path = Path(how)
        self.load_checkpoint(path)
        return path

    def _newest_checkpoint(self) -> Path | None:
        """The newest checkpoint that verifies, of either tier; notes the ones that do not."""
        path, skipped = ckpt.latest_verified(self.checkpoint_dir())
        if self.memory_checkpointer is not None:
            memory, skipped_memory = ckpt.latest_verified(self.memory_checkpoint_dir())
            skipped += skipped_memory
            if memory is not None and ckpt.read_checkpoint_meta(memory).get("run_id") != self.run_id():
                skipped.append(f"checkpoint {memory} belongs to an earlier run in this directory")
                memory = None
            if memory is not None and (path is None or _step_of(memory) > _step_of(path)):
                path = memory
        for note in skipped:
            print(f"tenx: skipping checkpoint that does not verify: {note}")
        return path

    def run_id(self) -> str:
        """This run directory's identity (made on first use), so no other run's in-memory snapshot is loaded."""
        path = self.run_dir / "run_id"
        if not path.exists():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, uuid.uuid4().hex)
        return path.read_text().strip()

    def write_provenance(self) -> None:
        """Record the resolved config, version, commit and hardware in the run directory."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "config.toml", cfglib.dumps_toml(self.cfg))
        atomic_write_json(
            self.run_dir / "run.json",
            {
                "tenx_version": tenx.__version__,
                "git_commit": git_commit(),
                "hardware": hardware_summary(self.device),
                "precision": str(self.amp_dtype).replace("torch.", ""),
                "model": cfglib.to_dict(self.model_cfg),
                "params": {"total": self.params.total, "non_embedding": self.params.non_embedding},
                "flops_per_token": self.flops_per_token,
                "peak_flops": self.peak_flops,
                "tokens_per_step": self.tokens_per_step,
                "total_steps": self.total_steps,
                "data": {
                    "dir": str(Path(self.cfg.data.dir).resolve()),
                    "tokenizer": self.data_manifest["tokenizer"],
                    "train_tokens": len(self.train_stream),
                },
                "world_size": self.world_size,
                "strategy": self.strategy,
                "data_parallel": self.data_parallel,
                "grad_accum": self.grad_accum,
                "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            },
        )


_SIGUSR1 = getattr(signal, "SIGUSR1", None)


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[-1])


def _call_all(hooks: list[Callable[[Path, int], None]], tmp: Path, step: int) -> None:
    for hook in hooks:
        hook(tmp, step)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _python_rng_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _set_python_rng_state(state: list[Any]) -> None:
    random.setstate((state[0], tuple(state[1]), state[2]))


def _numpy_rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return {
        "name": name,
        "keys": np.asarray(keys).tolist(),
        "pos": pos,
        "has_gauss": has_gauss,
        "cached": cached,
    }


def _set_numpy_rng_state(s: dict[str, Any]) -> None:
    np.random.set_state(
        (s["name"], np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["cached"])
    )
