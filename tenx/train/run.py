"""Python API for a training run: config + run directory in, trained checkpoints and metrics out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tenx import checkpoint as ckpt
from tenx import config as cfglib
from tenx.checkpoint.writer import kept_checkpoints
from tenx.errors import TenxError
from tenx.hardware import pick_device
from tenx.parallel.distributed import DistEnv, dist_env, distributed_group, rank_device
from tenx.rundir import RunDir
from tenx.train.callbacks import Checkpointing, Validation
from tenx.train.callbacks.consistency import ConsistencyCheck
from tenx.train.callbacks.faults import build_injector
from tenx.train.callbacks.metrics import MetricsLogger, Progress
from tenx.train.callbacks.prequential import Prequential
from tenx.train.callbacks.record import StepRecord
from tenx.train.callbacks.stats import ModelStats
from tenx.train.callbacks.wandb_sink import WandbSink
from tenx.train.callbacks.watch import Watch
from tenx.train.config import RunConfig
from tenx.train.members import check_single_run_dir, train_ensemble
from tenx.train.trainer import Callback, Trainer
from tenx.utils.lock import as_run_writer
from tenx.utils.storage import describe_storage_problem


def default_callbacks(cfg: RunConfig, extra: list[Callback] | None = None, rank: int = 0) -> list[Callback]:
    """The fault injector (when faults are configured), the replica consistency check (when
    parallel.consistency.every > 0), validation, `extra` callbacks, the step record, the prequential code
    length (rank 0), the statistics inside the model (when
    monitor.stats_every > 0), the watch (prediction and trends, on rank 0), metrics, the W&B sink (when
    log.wandb), checkpointing.

    Anything a callback adds to the step's metrics is logged, and a checkpoint holds every callback's state
    after its hook for that step has run. Metrics and progress are written by rank 0 only; every rank
    validates and checkpoints (both are collective under FSDP).
    """
    injector = build_injector(cfg.faults)
    consistency = cfg.parallel.consistency
    callbacks: list[Callback] = [
        *([injector] if injector else []),
        *([ConsistencyCheck(consistency)] if consistency.every > 0 else []),
        Validation(cfg.train.eval_every),
        *(extra or []),
        StepRecord(),  # steps.jsonl (rank 0) and crash records (every rank): what tenx replay starts from
    ]
    if rank == 0:  # the training stream's prequential code length (its figures join the step's metrics)
        callbacks.append(Prequential(cfg.log.prequential_xz_mb))
    if cfg.monitor.stats_every:  # on every rank: its statistics gather figures from all of them
        callbacks.append(ModelStats(cfg.monitor.stats_every))
    if rank == 0 and (cfg.monitor.prediction or cfg.monitor.trends):
        callbacks.append(Watch(cfg.monitor))  # after every callback that adds figures, before they are logged
    if rank == 0:
        callbacks.append(MetricsLogger(cfg.log.tensorboard))
    if rank == 0 and cfg.log.wandb:  # after metrics.jsonl is written: W&B mirrors it
        callbacks.append(build_wandb_sink(cfg))
    if cfg.log.progress and rank == 0:
        callbacks.append(Progress(cfg.log.print_every))
    c = cfg.checkpoint
    callbacks.append(Checkpointing(c.every, c.at_end, c.mtbf_s, c.auto_first_step, c.memory_every))
    return callbacks


def build_wandb_sink(cfg: RunConfig) -> WandbSink:
    """The W&B sink of `cfg.log` (imports wandb: a ConfigError that says `pip install wandb` without it)."""
    log = cfg.log
    return WandbSink(
        project=log.wandb_project,
        entity=log.wandb_entity,
        name=log.wandb_name,
        mode=log.wandb_mode,
        directory=log.wandb_dir,
        prediction=cfg.monitor.prediction,
        config=cfglib.to_dict(cfg),
    )


def train(
    cfg: RunConfig,
    run_dir: str | Path,
    resume: str | None = None,
    extra_callbacks: list[Callback] | None = None,
    resume_hint: str | None = None,
) -> tuple[Trainer, dict[str, Any]]:
    """Train `cfg` into `run_dir`. `resume`: None (fresh; refuses a run dir with checkpoints), 'auto', or a path.
    `resume_hint`: what a stop signal's message says continues the run (default `--resume auto`).
    The run directory is made a RunDir here, once: the trainer, its parts and its callbacks
    (`trainer.rundir`) take their paths from it. With model.ensemble = K > 1 it trains K members into
    RUN/members/K, one after another (tenx/train/members.py)."""
    if cfg.model.ensemble > 1:
        return train_ensemble(cfg, run_dir, train, resume, extra_callbacks, resume_hint)
    check_single_run_dir(run_dir)
    env = dist_env()  # rank 0 holds the run's lock (one writer per run directory) for the job
    return as_run_writer(
        run_dir, env.rank, lambda run: _train(cfg, run, env, resume, extra_callbacks, resume_hint)
    )


def _train(
    cfg: RunConfig,
    run: RunDir,
    env: DistEnv,
    resume: str | None,
    extra_callbacks: list[Callback] | None,
    resume_hint: str | None,
) -> tuple[Trainer, dict[str, Any]]:
    run_dir, checkpoints = run.root, run.checkpoints
    if resume is None and ckpt.list_checkpoints(checkpoints):
        raise TenxError(
            f"run directory {run_dir} already has checkpoints; pass --resume auto to continue it, "
            "or choose another --run-dir"
        )
    device = rank_device(pick_device(cfg.train.device, "train.device"), env)
    with distributed_group(env, device, cfg.parallel):
        trainer = Trainer(cfg, run, default_callbacks(cfg, extra_callbacks, env.rank), env=env)
        if resume_hint is not None:
            trainer.resume_hint = resume_hint
        if resume is None and env.rank == 0:
            trainer.clear_memory_tier()  # snapshots of an earlier run that used this directory
        if resume is not None:
            path = trainer.resume(resume)
            if env.rank == 0:
                print(
                    f"tenx: resumed from {path} at step {trainer.step}"
                    if path
                    else "tenx: no checkpoint yet; starting fresh"
                )
        try:
            metrics = trainer.fit()
        except OSError as e:
            problem = describe_storage_problem(e, run_dir)
            if problem is None:
                raise
            raise TenxError(
                f"training {run_dir} stopped at step {trainer.step}: {problem}; "
                f"{kept_checkpoints(checkpoints)}. Free space, then continue with "
                "--resume auto"
            ) from e
    return trainer, metrics
