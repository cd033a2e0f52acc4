"""Train an ensemble (`model.ensemble = K`): K complete ordinary runs of one config, one after another.

```
RUN/
  config.toml       the ensemble's config (model.ensemble = K)
  members/K/        member K: a run directory of its own, trained with train.seed + K and model.ensemble = 1
  ensemble.json     {"members": ["members/0", ...]}, written once every member has finished
  run.json          member 0's provenance with the parameters and FLOPs per token of all K members
```

Member k is the single run of seed `train.seed + k`, bit for bit (its config.toml is that run's), so anything
that reads a run reads a member, and `tenx ensemble` lists runs trained apart the same way. Under torchrun
each member trains over all the ranks exactly as a single run would (DDP or FSDP as configured); the
process group is joined once, for every member. `--resume auto` skips the members a later one proves
finished (members train in order), resumes the newest from its newest verified checkpoint (or starts it),
and trains the rest fresh, so the result is the uninterrupted ensemble's.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tenx import checkpoint as ckpt
from tenx import config as cfglib
from tenx.errors import TenxError
from tenx.hardware import pick_device
from tenx.parallel.distributed import dist_env, distributed_group, rank_device
from tenx.rundir import RunDir
from tenx.train.config import RunConfig
from tenx.train.hooks import Callback
from tenx.train.trainer import Trainer
from tenx.utils.io import atomic_write_json, atomic_write_text, read_json_object
from tenx.utils.lock import as_run_writer

TrainOne = Callable[..., tuple[Trainer, dict[str, Any]]]
"""tenx.train.run.train: trains one ordinary run (passed in, since that module dispatches here)."""


def member_config(cfg: RunConfig, k: int) -> RunConfig:
    """The config of member `k`: the ensemble's, as one model (model.ensemble = 1) of seed train.seed + k."""
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, ensemble=1),
        train=dataclasses.replace(cfg.train, seed=cfg.train.seed + k),
    )


def _trained_members(run: RunDir) -> list[Path]:
    """Member directories of `run` that hold checkpoints."""
    root = run.member(0).parent
    found = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [p for p in found if ckpt.list_checkpoints(RunDir(p).checkpoints)]


def check_single_run_dir(run_dir: str | Path) -> None:
    """Refuse to train one model (model.ensemble = 1) into a directory that holds an ensemble."""
    run = RunDir(run_dir)
    if run.ensemble.exists() or _trained_members(run):
        raise TenxError(
            f"run directory {run.root} holds an ensemble's members; train it with its model.ensemble, "
            "or choose another --run-dir"
        )


def train_ensemble(
    cfg: RunConfig,
    run_dir: str | Path,
    train_one: TrainOne,
    resume: str | None = None,
    extra_callbacks: list[Callback] | None = None,
    resume_hint: str | None = None,
) -> tuple[Trainer, dict[str, Any]]:
    """Train the `cfg.model.ensemble` members of `cfg` into `run_dir`/members/K with `train_one`, then write
    the ensemble's manifest and provenance (rank 0). Each member gets its own deep copy of
    `extra_callbacks`. Returns the last member's trainer and its metrics, with "members" (each member's last
    metrics; {} for one already finished) and "ensemble" (the manifest's path) added."""
    return as_run_writer(
        run_dir,
        dist_env().rank,
        lambda run: _train_members(cfg, run, train_one, resume, extra_callbacks, resume_hint),
    )


def _train_members(
    cfg: RunConfig,
    run: RunDir,
    train_one: TrainOne,
    resume: str | None,
    extra_callbacks: list[Callback] | None,
    resume_hint: str | None,
) -> tuple[Trainer, dict[str, Any]]:
    count = cfg.model.ensemble
    if resume not in (None, "auto"):
        raise TenxError(
            f"--resume {resume}: an ensemble ({run.root}) resumes with --resume auto, each member from its "
            "newest verified checkpoint"
        )
    if ckpt.list_checkpoints(run.checkpoints):
        raise TenxError(
            f"run directory {run.root} holds a single run's checkpoints; train the ensemble "
            f"(model.ensemble={count}) into another --run-dir"
        )
    if resume is None and (run.ensemble.exists() or _trained_members(run)):
        raise TenxError(
            f"run directory {run.root} already has an ensemble's members; pass --resume auto to continue "
            "it, or choose another --run-dir"
        )
    env = dist_env()
    if env.rank == 0:
        run.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run.config, cfglib.dumps_toml(cfg))
    trainer: Trainer | None = None
    results: list[dict[str, Any]] = []
    device = rank_device(pick_device(cfg.train.device, "train.device"), env)
    with distributed_group(
        env, device, cfg.parallel
    ):  # once for every member: each one's train finds it joined
        for k in range(count):
            if resume is not None and k + 1 < count and run.member(k + 1).exists():
                results.append({})  # a later member has started: this one finished
                continue
            trainer, metrics = train_one(
                member_config(cfg, k),
                run.member(k),
                resume=resume,
                extra_callbacks=copy.deepcopy(extra_callbacks),
                resume_hint=resume_hint,
            )
            results.append(metrics)
    assert trainer is not None  # the last member always trains (or resumes) here
    if env.rank == 0:
        _write_ensemble(cfg, run)
    return trainer, {**results[-1], "members": results, "ensemble": str(run.ensemble)}


def _write_ensemble(cfg: RunConfig, run: RunDir) -> None:
    """RUN/run.json (member 0's provenance, parameters and FLOPs per token times K) and RUN/ensemble.json."""
    count = cfg.model.ensemble
    provenance = read_json_object(RunDir(run.member(0)).provenance)
    params = provenance.get("params") or {}
    flops = provenance.get("flops_per_token")
    provenance.update(
        model={**(provenance.get("model") or {}), "ensemble": count},
        params={key: value * count for key, value in params.items() if isinstance(value, int)},
        ensemble={"members": count, "member_params": params, "member_flops_per_token": flops},
    )
    for key in ("flops_per_token", "run_flops_per_token"):  # the latter counts a distillation teacher too
        if isinstance(provenance.get(key), (int, float)):
            provenance[key] *= count
    atomic_write_json(run.provenance, provenance)
    members = [str(run.member(k).relative_to(run.root)) for k in range(count)]
    atomic_write_json(run.ensemble, {"members": members})
