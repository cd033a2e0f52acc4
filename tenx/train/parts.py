"""Every part of a training run, built once from its config and run directory (the Trainer receives them).

`build_parts` is the only place that constructs the data streams and loader, the model and its parallel
wrapper, the optimizer, the checkpointers of both tiers, the replica groups, the guard, the watchdog, the
event log and the goodput ledger. The Trainer then only runs the loop over them.
"""

from __future__ import annotations

import datetime
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tenx import checkpoint as ckpt
from tenx.data.loader import TokenLoader, TokenStream
from tenx.errors import ConfigError, TenxError
from tenx.hardware import peak_flops, pick_device, resolve_precision, tune_cpu_allocator
from tenx.model.config import ModelConfig
from tenx.model.flops import count_params, flops_per_token
from tenx.model.transformer import Transformer
from tenx.monitor.events import EventLog
from tenx.monitor.goodput import Ledger
from tenx.parallel.distributed import DistEnv, dist_env, rank_device, wrap_model
from tenx.rundir import RunDir
from tenx.train.config import RunConfig, accumulation_steps
from tenx.train.config import tokens_per_step as run_tokens_per_step
from tenx.train.config import total_steps as run_total_steps
from tenx.train.guard import StepGuard
from tenx.train.optim import build_optimizer
from tenx.train.rng import seed_everything
from tenx.train.watchdog import Watchdog
from tenx.utils.io import bytes_xxhash


@dataclass
class Parts:
    """What a Trainer trains with (see build_parts)."""

    cfg: RunConfig
    rundir: RunDir
    env: DistEnv
    device: torch.device
    amp_dtype: torch.dtype
    events: EventLog
    train_stream: TokenStream
    val_stream: TokenStream | None
    data_manifest: dict[str, Any]
    model_cfg: ModelConfig
    replicas: Any
    """tenx.parallel.replicas.Replicas, or None without replica groups."""
    data_parallel: int
    grad_accum: int
    loader: TokenLoader
    raw_model: Transformer
    model: torch.nn.Module
    strategy: str
    optimizer: torch.optim.Optimizer
    forward: Any
    tokens_per_step: int
    total_steps: int
    params: Any
    flops_per_token: float
    peak_flops: float
    guard: StepGuard
    data_skips: list[list[int]]
    checkpoint_group: Any
    checkpointer: ckpt.AsyncCheckpointer
    memory_checkpointer: ckpt.AsyncCheckpointer | None
    ledger: Ledger | None
    watchdog: Watchdog


def memory_tier_dir(cfg: RunConfig, rundir: RunDir) -> Path:
    """The in-memory tier: tmpfs, keyed by the run directory, outliving the process but not the machine."""
    if cfg.checkpoint.memory_dir:
        return Path(cfg.checkpoint.memory_dir)
    key = bytes_xxhash(str(rundir.root.resolve()).encode())[:16]
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"tenx-{key}"


def build_parts(cfg: RunConfig, run_dir: str | Path | RunDir, env: DistEnv | None = None) -> Parts:
    """Build every part of a run of `cfg` in `run_dir`, in the order their dependencies need."""
    rundir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    env = env if env is not None else dist_env()
    if env.world_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise TenxError(
            f"world_size={env.world_size} needs an initialised process group (launch with torchrun)"
        )
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    device = rank_device(pick_device(tc.device, "train.device"), env)
    if device.type == "cpu" and tc.tune_allocator:
        tune_cpu_allocator()
    amp_dtype = resolve_precision(tc.precision, device)
    seed_everything(tc.seed)

    events = EventLog(rundir.root)
    train_stream = TokenStream(
        cfg.data.dir,
        cfg.data.train_split,
        cfg.data.verify,
        cfg.data.max_unique_tokens,
        on_corrupt=cfg.data.on_corrupt_shard,
    )
    manifest = train_stream.manifest
    vocab = int(manifest["tokenizer"]["vocab_size"])
    model_cfg: ModelConfig = cfg.model.resolved(vocab)
    if model_cfg.vocab_size is not None and model_cfg.vocab_size < vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's vocabulary {vocab}"
        )
    val_tokens = manifest["splits"].get(cfg.data.val_split, {}).get("tokens", 0)
    val_stream = (
        TokenStream(cfg.data.dir, cfg.data.val_split, cfg.data.verify)
        if val_tokens > model_cfg.seq_len
        else None
    )
    # Replica groups (torchft, across clusters): each group reads its own share of every global batch.
    replicas: Any = None
    groups, group_id = 1, 0
    if cfg.parallel.replicas.mode != "off":
        from tenx.parallel.replicas import Replicas

        replicas = Replicas(
            cfg.parallel.replicas, rank=env.rank, world_size=env.world_size, device=device, events=events
        )
        groups, group_id = replicas.num_groups, replicas.group_id
    data_parallel = env.world_size * groups
    grad_accum = accumulation_steps(tc, data_parallel)
    loader = TokenLoader(
        train_stream,
        model_cfg.seq_len,
        tc.micro_batch,
        seed=tc.seed,
        rank=group_id * env.world_size + env.rank,
        world_size=data_parallel,
    )
    raw_model = Transformer(model_cfg).to(device)
    model, strategy = wrap_model(raw_model, cfg.parallel, device, env.world_size)
    optimizer = build_optimizer(raw_model, cfg.optim, device)
    tokens_per_step = run_tokens_per_step(tc, model_cfg.seq_len, data_parallel)
    total_steps = run_total_steps(tc, tokens_per_step)

    # Data skipped after rollbacks, kept beside the checkpoints so that a resume from a checkpoint older
    # than the rollback skips the same data: the run stays reproducible.
    data_skips = json.loads(rundir.data_skips.read_text())["skips"] if rundir.data_skips.exists() else []
    for start, end in data_skips:
        loader.add_skip(start, end)
    # Several ranks: checkpoints get a gloo group of their own, so a background save never interleaves its
    # collectives with the training ones (shared/notes: async DCP on the default group hangs).
    checkpoint_group: Any = (
        torch.distributed.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s)
        )
        if env.world_size > 1
        else None
    )
    c = cfg.checkpoint
    checkpointer = ckpt.AsyncCheckpointer(
        rundir.checkpoints,
        c.keep_last,
        c.keep_every,
        c.async_save,
        process_group=checkpoint_group,
        rank=env.rank,
    )
    memory_tier = bool(c.memory_every)
    if memory_tier and not env.single_node:
        memory_tier = False
        if env.rank == 0:
            print("tenx: checkpoint.memory_every needs every rank on one machine; in-memory tier off")
    memory_checkpointer = (
        ckpt.AsyncCheckpointer(
            memory_tier_dir(cfg, rundir),
            keep_last=1,
            async_save=True,
            process_group=checkpoint_group,
            rank=env.rank,
        )
        if memory_tier
        else None
    )
    return Parts(
        cfg=cfg,
        rundir=rundir,
        env=env,
        device=device,
        amp_dtype=amp_dtype,
        events=events,
        train_stream=train_stream,
        val_stream=val_stream,
        data_manifest=manifest,
        model_cfg=model_cfg,
        replicas=replicas,
        data_parallel=data_parallel,
        grad_accum=grad_accum,
        loader=loader,
        raw_model=raw_model,
        model=model,
        strategy=strategy,
        optimizer=optimizer,
        forward=torch.compile(model) if tc.compile else model,
        tokens_per_step=tokens_per_step,
        total_steps=total_steps,
        params=count_params(model_cfg),
        flops_per_token=flops_per_token(model_cfg),
        peak_flops=peak_flops(device, amp_dtype) * data_parallel,
        guard=StepGuard(cfg.guard),
        data_skips=data_skips,
        checkpoint_group=checkpoint_group,
        checkpointer=checkpointer,
        memory_checkpointer=memory_checkpointer,
        ledger=Ledger(rundir.root) if env.rank == 0 else None,
        watchdog=Watchdog(cfg.watchdog, rundir.root, events),
    )
