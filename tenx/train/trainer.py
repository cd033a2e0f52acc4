"""The training loop, plain from top to bottom.

The math (forward, loss, backward, clip, AdamW step) lives in `train_step`. Side concerns attach through
four hook points on `Callback`: on_train_start, on_step_end, on_train_end, and state_dict/load_state_dict
so their state is checkpointed with everything else. Callbacks never touch gradients or the optimizer.
"""

from __future__ import annotations

import contextlib
import math
import random
import subprocess
import time
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
from tenx import config as cfglib
from tenx.data.loader import TokenLoader, TokenStream, sequential_windows
from tenx.errors import CheckpointError, ConfigError, TenxError
from tenx.model.config import ModelConfig
from tenx.model.flops import count_params, flops_per_token
from tenx.model.transformer import Transformer, lm_loss
from tenx.plan.hardware import (
    cpu_has_fast_bf16,
    hardware_summary,
    peak_flops,
    pick_device,
    tune_cpu_allocator,
)
from tenx.train import checkpoint as ckpt
from tenx.train.config import RunConfig
from tenx.train.optim import build_optimizer, lr_at
from tenx.utils.io import atomic_write_json, atomic_write_text


class Callback:
    """A side concern of training. Override any hook; keep state in state_dict for exact resume."""

    name = "callback"

    def on_train_start(self, trainer: Trainer) -> None:
        """Called once before the first step (after any resume)."""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        """Called after each optimizer step; earlier callbacks may have added to `metrics`."""

    def on_train_end(self, trainer: Trainer) -> None:
        """Called once after the last step."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """The autocast dtype for 'auto' | 'fp32' | 'bf16' on `device`."""
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float32
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


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
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        if world_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise TenxError(
                f"world_size={world_size} needs an initialised process group (launch with torchrun)"
            )
        self.rank, self.world_size = rank, world_size
        self.callbacks = list(callbacks or [])
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.device = pick_device(tc.device)
        if self.device.type == "cpu" and tc.tune_allocator:
            tune_cpu_allocator()
        self.amp_dtype = resolve_precision(tc.precision, self.device)
        seed_everything(tc.seed)

        self.train_stream = TokenStream(
            cfg.data.dir, cfg.data.train_split, cfg.data.verify, cfg.data.max_unique_tokens
        )
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
        self.loader = TokenLoader(
            self.train_stream,
            self.model_cfg.seq_len,
            tc.micro_batch,
            seed=tc.seed,
            rank=rank,
            world_size=world_size,
        )
        self.model = Transformer(self.model_cfg).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.forward = torch.compile(self.model) if tc.compile else self.model

        self.tokens_per_step = tc.micro_batch * tc.grad_accum * world_size * self.model_cfg.seq_len
        self.total_steps = (
            tc.steps if tc.steps is not None else math.ceil((tc.tokens or 0) / self.tokens_per_step)
        )
        self.params = count_params(self.model_cfg)
        self.flops_per_token = flops_per_token(self.model_cfg)
        self.peak_flops = peak_flops(self.device, self.amp_dtype) * world_size
        self.step = 0
        self.tokens_seen = 0
        self.resumed_from: Path | None = None

    # ----- the math -------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed-precision context for forward passes (a no-op in fp32)."""
        if self.amp_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over grad_accum micro-batches; returns the step's metrics."""
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.total_steps, self.cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum = self.cfg.train.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        self.model.train()
        for _ in range(accum):
            inputs, targets = self.loader.next_batch()
            inputs, targets = (
                inputs.to(self.device, non_blocking=True),
                targets.to(self.device, non_blocking=True),
            )
            with self.autocast():
                logits = self.forward(inputs)
            loss, ce = lm_loss(logits, targets, self.model_cfg.z_loss)
            (loss / accum).backward()
            loss_sum += ce.detach()
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_value = (loss_sum / accum).item()
        dt = time.perf_counter() - t0
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        tokens_per_s = self.tokens_per_step / dt
        return {
            "step": self.step,
            "tokens": self.tokens_seen,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / self.peak_flops,
            "epoch": self.loader.epochs_seen,
            "step_time_s": dt,
        }

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
        self.model.train()
        return total / count

    # ----- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train until total_steps; returns the last step's metrics."""
        self.write_provenance()
        for cb in self.callbacks:
            cb.on_train_start(self)
        metrics: dict[str, Any] = {}
        while self.step < self.total_steps:
            metrics = self.train_step()
            for cb in self.callbacks:
                cb.on_step_end(self, metrics)
        for cb in self.callbacks:
            cb.on_train_end(self)
        return metrics

    # ----- state ----------------------------------------------------------------------------------
    def checkpoint_dir(self) -> Path:
        """Where this run's checkpoints live."""
        return self.run_dir / "checkpoints"

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

    def save_checkpoint(self) -> Path:
        """Save everything needed to continue this run bit for bit."""
        tensors, param_groups = self._state_tensors()
        meta = {
            "optim_param_groups": param_groups,
            "data_dir": str(Path(self.cfg.data.dir).resolve()),
            "tokens": self.tokens_seen,
            "loader": self.loader.state_dict(),
            "python_rng": _python_rng_state(),
            "numpy_rng": _numpy_rng_state(),
            "callbacks": {cb.name: cb.state_dict() for cb in self.callbacks},
            "config": cfglib.to_dict(self.cfg),
            "model": cfglib.to_dict(self.model_cfg),
            "data_tokenizer": self.data_manifest["tokenizer"],
            "tenx_version": tenx.__version__,
        }
        path = ckpt.save_checkpoint(self.checkpoint_dir(), self.step, tensors, meta)
        ckpt.prune_checkpoints(self.checkpoint_dir(), self.cfg.checkpoint.keep_last, protect=path)
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore model, optimizer, loader, RNGs, counters and callback state from a checkpoint."""
        saved_model = ckpt.read_checkpoint_meta(path)["model"]
        ours = cfglib.to_dict(self.model_cfg)
        if saved_model != ours:
            diff = ", ".join(
                f"{k}: {saved_model.get(k)!r} in the checkpoint, {ours.get(k)!r} here"
                for k in sorted(set(saved_model) | set(ours))
                if saved_model.get(k) != ours.get(k)
            )
            raise CheckpointError(f"checkpoint {path} holds a different model ({diff})")
        tensors, _ = self._state_tensors()
        meta = ckpt.load_checkpoint(path, tensors)
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
        self.step, self.tokens_seen = int(meta["step"]), int(meta["tokens"])
        for cb in self.callbacks:
            cb.load_state_dict(meta["callbacks"].get(cb.name, {}))
        self.resumed_from = Path(path)

    def resume(self, how: str) -> Path | None:
        """`auto`: the newest checkpoint of this run that verifies (none: start fresh); else a path."""
        if how == "auto":
            path, skipped = ckpt.latest_verified(self.checkpoint_dir())
            for note in skipped:
                print(f"tenx: skipping checkpoint that does not verify: {note}")
            if path is None:
                return None
        else:
            path = Path(how)
        self.load_checkpoint(path)
        return path

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
                "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            },
        )


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
