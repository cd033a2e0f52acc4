"""Every part of a training run, built once from its config and run directory (the Trainer receives them).

`build_parts` is the only place that constructs the data streams and loader, the model and its parallel
wrapper, the optimizer, the checkpointers of both tiers, the replica groups, the guard, the watchdog, the
event log and the goodput ledger. The Trainer then only runs the loop over them. The run's step counts
(`run_shape`) and its initial model, optimizer and guard (`build_model_parts`) come from two functions
that `tenx replay` calls too, so a replay rebuilds the state the run started from, not a re-derivation.
"""

from __future__ import annotations

import datetime
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

import torch

from tenx import checkpoint as ckpt
from tenx.data.loader import TokenLoader, TokenStream
from tenx.data.loader import train_stream as data_train_stream
from tenx.errors import ConfigError, TenxError
from tenx.hardware import (
    check_compile_backend,
    peak_flops,
    pick_device,
    resolve_precision,
    tune_cpu_allocator,
)
from tenx.model.config import ModelConfig
from tenx.model.flops import ParamCount, count_params, flops_per_token
from tenx.model.transformer import Transformer
from tenx.monitor.events import EventLog
from tenx.monitor.goodput import Ledger
from tenx.parallel.distributed import DistEnv, dist_env, rank_device, wrap_model
from tenx.rundir import RunDir
from tenx.train.config import RunConfig, accumulation_steps
from tenx.train.config import tokens_per_step as run_tokens_per_step
from tenx.train.config import total_steps as run_total_steps
from tenx.train.distill import Teacher, load_teacher
from tenx.train.float8 import check_float8_support, convert_linears_to_float8
from tenx.train.guard import StepGuard
from tenx.train.optim import build_optimizer
from tenx.train.rng import seed_everything
from tenx.train.watchdog import Watchdog
from tenx.utils.cpus import set_torch_threads
from tenx.utils.io import bytes_xxhash


def memory_tier_dir(cfg: RunConfig, rundir: RunDir) -> Path:
    """The in-memory tier: tmpfs, keyed by the run directory, outliving the process but not the machine."""
    if cfg.checkpoint.memory_dir:
        return Path(cfg.checkpoint.memory_dir)
    key = bytes_xxhash(str(rundir.root.resolve()).encode())[:16]
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"tenx-{key}"


@dataclass(frozen=True)
class RunShape:
    """What a run's steps follow, from its config, the data's vocabulary and the data-parallel width."""

    model_cfg: ModelConfig
    data_parallel: int
    """Data-parallel workers in all (ranks of the job times replica groups)."""
    grad_accum: int
    """Micro-batches per step on each worker."""
    tokens_per_step: int
    total_steps: int


def run_shape(cfg: RunConfig, vocab: int, data_parallel: int) -> RunShape:
    """The model's config and the step counts of a run of `cfg` on `data_parallel` workers."""
    model_cfg: ModelConfig = cfg.model.resolved(vocab)
    if model_cfg.vocab_size is not None and model_cfg.vocab_size < vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's vocabulary {vocab}"
        )
    tokens_per_step = run_tokens_per_step(cfg.train, model_cfg.seq_len, data_parallel)
    return RunShape(
        model_cfg=model_cfg,
        data_parallel=data_parallel,
        grad_accum=accumulation_steps(cfg.train, data_parallel),
        tokens_per_step=tokens_per_step,
        total_steps=run_total_steps(cfg.train, tokens_per_step),
    )


def validation_stream(cfg: RunConfig, manifest: dict[str, Any], seq_len: int) -> TokenStream | None:
    """The run's validation split (`data.val_split`), None when it holds no more than one window's tokens."""
    val_tokens = manifest["splits"].get(cfg.data.val_split, {}).get("tokens", 0)
    return TokenStream(cfg.data.dir, cfg.data.val_split, cfg.data.verify) if val_tokens > seq_len else None


@dataclass
class ModelParts:
    """A run's trained state as it starts: the model, its parallel form, the optimizer and the guard."""

    raw_model: Transformer
    model: torch.nn.Module
    """What forward and backward run through: the DDP wrapper, the FSDP2-sharded model or the model."""
    strategy: str
    optimizer: torch.optim.Optimizer
    guard: StepGuard
    forward: Any
    """What the training forward calls: `model`, or `torch.compile(model)` with train.compile."""
    teacher: Teacher | None = None
    """The frozen teacher of train.distill_from (tenx.train.distill), None without distillation."""


def build_model_parts(
    cfg: RunConfig,
    model_cfg: ModelConfig,
    device: torch.device,
    wrap: Callable[[Transformer], tuple[torch.nn.Module, str]] | None = None,
    compile: bool = False,
    teacher: Teacher | None = None,
) -> ModelParts:
    """The run's initial model (seeded from train.seed), optimizer and guard, as training and replay start.

    `wrap` applies the parallel strategy (tenx.parallel.distributed.wrap_model) before the optimizer is
    built, since FSDP2 replaces the parameters; replay runs the model as it is, uncompiled. `teacher`, loaded
    once by the caller (tenx.train.distill), joins the parts as it is."""
    if compile:
        check_compile_backend(device)
    seed_everything(cfg.train.seed)
    raw_model = Transformer(model_cfg).to(device)
    if cfg.train.precision == "fp8":  # before the wrapper and torch.compile, as torchao requires
        convert_linears_to_float8(raw_model, device)
    model, strategy = wrap(raw_model) if wrap is not None else (raw_model, "none")
    optimizer = build_optimizer(raw_model, cfg.optim, device)
    if compile:
        # A process that trains one run after another (a ladder's worker) keeps dynamo's compiled code, and
        # past torch._dynamo.config.recompile_limit (8) graphs of one function dynamo runs the rest eagerly
        # without an error: the data-efficiency study's twelfth model shape trained eagerly, so a run's numbers
        # depended on what its worker had trained before. Each run starts from none (inductor's disk cache
        # keeps the recompiles to a few seconds)
        torch._dynamo.reset()
    forward = torch.compile(model) if compile else model
    return ModelParts(raw_model, model, strategy, optimizer, StepGuard(cfg.guard), forward, teacher)


@dataclass
class DataParts:
    """The training data: both splits' streams, the loader over the training one, the skipped ranges."""

    train_stream: TokenStream
    val_stream: TokenStream | None
    """None when the validation split is shorter than one window."""
    manifest: dict[str, Any]
    """The data directory's manifest.json."""
    loader: TokenLoader
    skips: list[list[int]]
    """Loader position ranges [start, end) skipped after rollbacks (RUN_DIR/data_skips.json), already
    added to the loader; a rollback appends to this list."""


@dataclass
class CheckpointParts:
    """The checkpointers of both tiers and the process group their collectives use."""

    disk: ckpt.AsyncCheckpointer
    memory: ckpt.AsyncCheckpointer | None
    """The in-memory tier (checkpoint.memory_every); None without it."""
    group: Any
    """A gloo group of their own with several ranks (None with one), so a background save never
    interleaves its collectives with the training ones."""


@dataclass
class ServiceParts:
    """What records, watches and connects the run beside the step."""

    events: EventLog
    ledger: Ledger | None
    """The goodput ledger, on rank 0 only."""
    watchdog: Watchdog
    replicas: Any
    """tenx.parallel.replicas.Replicas, or None without replica groups."""


@dataclass(frozen=True)
class Flops:
    """What MFU and run.json are computed from: the model's size and cost, and the job's peak."""

    params: ParamCount
    per_token: int
    """Training FLOPs per token (tenx.model.flops)."""
    peak: float
    """Peak FLOP/s of every data-parallel worker together, at the run's precision."""


@dataclass
class Parts:
    """What a Trainer trains with, by group (see build_parts)."""

    rundir: RunDir
    env: DistEnv
    device: torch.device
    amp_dtype: torch.dtype
    shape: RunShape
    data: DataParts
    trained: ModelParts
    flops: Flops
    checkpoints: CheckpointParts
    services: ServiceParts


T = TypeVar("T")


class Part(Generic[T]):
    """A Trainer attribute that is a field of its parts: `loader = Part[TokenLoader]("data.loader")` reads
    and writes `trainer.parts.data.loader`, so the trainer and its parts never disagree."""

    def __init__(self, path: str) -> None:
        *self.groups, self.field = path.split(".")

    def _holder(self, trainer: Any) -> Any:
        holder = trainer.parts
        for group in self.groups:
            holder = getattr(holder, group)
        return holder

    @overload
    def __get__(self, trainer: None, owner: type) -> Part[T]: ...
    @overload
    def __get__(self, trainer: object, owner: type) -> T: ...
    def __get__(self, trainer: object | None, owner: type) -> Part[T] | T:
        if trainer is None:
            return self
        return getattr(self._holder(trainer), self.field)

    def __set__(self, trainer: object, value: T) -> None:
        setattr(self._holder(trainer), self.field, value)


class TrainerParts:
    """The Trainer's parts under the names its loop, its state methods and its callbacks read."""

    parts: Parts
    rundir = Part[RunDir]("rundir")
    run_dir = Part[Path]("rundir.root")
    env = Part[DistEnv]("env")
    rank = Part[int]("env.rank")
    world_size = Part[int]("env.world_size")
    device = Part[torch.device]("device")
    amp_dtype = Part[torch.dtype]("amp_dtype")
    model_cfg = Part[ModelConfig]("shape.model_cfg")
    data_parallel = Part[int]("shape.data_parallel")
    grad_accum = Part[int]("shape.grad_accum")
    tokens_per_step = Part[int]("shape.tokens_per_step")
    total_steps = Part[int]("shape.total_steps")
    train_stream = Part[TokenStream]("data.train_stream")
    val_stream = Part[TokenStream | None]("data.val_stream")
    data_manifest = Part[dict[str, Any]]("data.manifest")
    loader = Part[TokenLoader]("data.loader")
    data_skips = Part[list[list[int]]]("data.skips")
    raw_model = Part[Transformer]("trained.raw_model")
    model = Part[torch.nn.Module]("trained.model")
    strategy = Part[str]("trained.strategy")
    optimizer = Part[torch.optim.Optimizer]("trained.optimizer")
    guard = Part[StepGuard]("trained.guard")
    forward = Part[Any]("trained.forward")
    teacher = Part[Teacher | None]("trained.teacher")
    params = Part[ParamCount]("flops.params")
    flops_per_token = Part[int]("flops.per_token")
    peak_flops = Part[float]("flops.peak")
    checkpointer = Part[ckpt.AsyncCheckpointer]("checkpoints.disk")
    memory_checkpointer = Part[ckpt.AsyncCheckpointer | None]("checkpoints.memory")
    checkpoint_group = Part[Any]("checkpoints.group")
    events = Part[EventLog]("services.events")
    ledger = Part[Ledger | None]("services.ledger")
    watchdog = Part[Watchdog]("services.watchdog")
    replicas = Part[Any]("services.replicas")


def build_parts(cfg: RunConfig, run_dir: str | Path | RunDir, env: DistEnv | None = None) -> Parts:
    """Build every part of a run of `cfg` in `run_dir`, in the order their dependencies need."""
    rundir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    env = env if env is not None else dist_env()
    if env.world_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise TenxError(
            f"world_size={env.world_size} needs an initialised process group (launch with torchrun)"
        )
    tc = cfg.train
    set_torch_threads(tc.threads, "--set train.threads=N", share=env.local_world_size)
    device = rank_device(pick_device(tc.device, "train.device"), env)
    if device.type == "cpu" and tc.tune_allocator:
        tune_cpu_allocator()
    amp_dtype = resolve_precision(tc.precision, device)
    if tc.precision == "fp8":  # refused before any data is opened when the device cannot
        check_float8_support(device)

    events = EventLog(rundir.root)
    train_stream = data_train_stream(cfg.data, cfg.model.seq_len)
    manifest = train_stream.manifest
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
    shape = run_shape(cfg, int(manifest["tokenizer"]["vocab_size"]), data_parallel)
    model_cfg = shape.model_cfg
    val_stream = validation_stream(cfg, manifest, model_cfg.seq_len)
    loader = TokenLoader(
        train_stream,
        model_cfg.seq_len,
        tc.micro_batch,
        seed=tc.seed,
        rank=group_id * env.world_size + env.rank,
        world_size=data_parallel,
    )
    # loaded before build_model_parts seeds the student: the numbers building the teacher draws change nothing
    teacher = load_teacher(cfg, model_cfg, manifest["tokenizer"], device)
    built = build_model_parts(
        cfg,
        model_cfg,
        device,
        wrap=lambda m: wrap_model(m, cfg.parallel, device, env.world_size),
        compile=tc.compile,
        teacher=teacher,
    )

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
        rundir=rundir,
        env=env,
        device=device,
        amp_dtype=amp_dtype,
        shape=shape,
        data=DataParts(train_stream, val_stream, manifest, loader, data_skips),
        trained=built,
        flops=Flops(
            count_params(model_cfg),
            flops_per_token(model_cfg),
            peak_flops(device, amp_dtype, float8=cfg.train.precision == "fp8") * data_parallel,
        ),
        checkpoints=CheckpointParts(checkpointer, memory_checkpointer, checkpoint_group),
        services=ServiceParts(
            events=events,
            ledger=Ledger(rundir.root) if env.rank == 0 else None,
            watchdog=Watchdog(cfg.watchdog, rundir, events),
            replicas=replicas,
        ),
    )
