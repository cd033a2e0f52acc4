"""The run's config tree: model, data, optimizer, training loop, checkpoints and logging."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch

from tenx import config as cfglib
from tenx.config import field
from tenx.data.loader import DataConfig
from tenx.errors import ConfigError, TenxError
from tenx.model.config import ModelConfig
from tenx.monitor.config import MonitorConfig
from tenx.parallel.distributed import ParallelConfig
from tenx.train.callbacks.faults import FaultConfig
from tenx.train.guard import GuardConfig
from tenx.train.optim import OptimConfig
from tenx.train.watchdog import WatchdogConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
"""The torch device types `train.device` may name (whether this machine has one is checked when a run starts)."""


def resolve_config_path(name: str) -> Path:
    """A config path as given, or the name of a shipped config (`quickstart` -> configs/quickstart.toml)."""
    path = Path(name)
    try:
        if path.is_file() or path.suffix == ".toml":
            return path
    except (OSError, ValueError) as e:  # a name too long for the file system, an embedded NUL byte
        why = getattr(e, "strerror", None) or e  # a ValueError has no strerror
        raise TenxError(f"config {name!r}: cannot be used as a path ({why})") from None  # the whole path
    shipped = CONFIG_DIR / f"{name}.toml"
    if shipped.exists():
        return shipped
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.toml")) if CONFIG_DIR.is_dir() else []
    raise TenxError(
        f"config {name!r} not found; give a .toml path or one of: {', '.join(names) or '(none shipped)'}"
    )


@dataclass
class TrainConfig:
    """The training loop: budget, batch, device, precision."""

    ALTERNATIVES: ClassVar[tuple[tuple[str, ...], ...]] = (("steps", "tokens"),)
    """Either budget; `--set` of one replaces the other's value from the config file."""

    steps: int | None = field(None, ge=1, help="optimizer steps to train (or give `tokens`)")
    tokens: int | None = field(None, ge=1, help="token budget; steps = ceil(tokens / tokens per step)")
    micro_batch: int = field(8, ge=1, help="sequences per forward/backward on each rank")
    grad_accum: int = field(
        1,
        ge=1,
        help="micro-batches accumulated per optimizer step (derived from global_batch when that is set)",
    )
    global_batch: int | None = field(
        None,
        ge=1,
        help="sequences per optimizer step over all ranks and replica groups; grad_accum becomes "
        "global_batch / (micro_batch * ranks * groups), so the loss curve does not depend on the process count",
    )
    seed: int = field(0, help="seed for initialisation and data order")
    device: str = field("auto", help="'auto' (CUDA if available, else CPU), 'cpu', 'cuda', 'cuda:1', ...")
    precision: Literal["auto", "fp32", "bf16", "fp8"] = field(
        "auto",
        help="'auto': bf16 autocast on GPUs and on CPUs with native bf16 matmuls, else fp32; 'fp8': bf16 "
        "autocast plus fp8 matmuls in the block linears (torchao; GPUs of compute capability 8.9+)",
    )
    loss_precision: Literal["fp32", "bf16"] = field(
        "fp32",
        help="'bf16': under bf16 autocast, each token's cross-entropy from the bf16 logits, only its mean in "
        "fp32 (a third faster a step on one CPU thread for a narrow model with a 4096 vocabulary, whose "
        "log-softmax is a quarter of the step; the loss within 3e-5 of fp32's, relative); in fp32 it is fp32",
    )
    compile: bool = field(False, help="torch.compile the model")
    threads: int | None = field(
        None,
        ge=1,
        help="CPU threads for torch (default: auto, tenx.utils.cpus.choose_threads: OMP_NUM_THREADS, else the "
        "usable CPUs less those other programs keep busy, shared among this machine's ranks)",
    )
    follow_load: bool = field(
        False,
        help="with auto threads on a lone CPU process: choose the thread count again every 30 s from other "
        "programs' load (faster on a busy machine, but a count is part of a run's numerics: a run that "
        "follows the load, or resumes, is no longer bit for bit the uninterrupted run)",
    )
    tune_allocator: bool = field(
        True, help="CPU on Linux/glibc: keep freed buffers in the heap (avoids a page fault storm every step)"
    )
    eval_every: int = field(100, ge=0, help="validation loss every N steps (0: only at the end)")
    eval_batches: int = field(16, ge=1, help="micro-batches of the validation split per evaluation")
    distill_from: str = field(
        "",
        help="distil from a teacher: a run directory, a checkpoint or an ensemble directory (ensemble.json), "
        "trained on this data's tokenizer; the loss becomes (1 - distill_weight) * CE(data) + distill_weight "
        "* H(teacher, student) (docs/training.md#distillation); empty: off",
    )
    distill_weight: float = field(
        0.5,
        ge=0,
        le=1,
        help="train.distill_from: the weight of the teacher's term (0: the data loss alone; the teacher still "
        "runs and is logged)",
    )

    def validate(self) -> None:
        """Check that exactly one budget is set, the seed and the device; names the offending field."""
        if self.steps is None and self.tokens is None:
            raise ConfigError("train.steps: set train.steps or train.tokens")
        if self.steps is not None and self.tokens is not None:
            raise ConfigError("train.steps: set only one of train.steps and train.tokens")
        if self.seed < 0:  # numpy's generators take non-negative seeds only
            raise ConfigError(f"train.seed: must be >= 0, got {self.seed}")
        if self.device != "auto":
            try:
                kind = torch.device(self.device).type
            except (RuntimeError, ValueError) as e:
                raise ConfigError(
                    f"train.device: {self.device[:80]!r} is not a device ({str(e).splitlines()[0][:100]}); "
                    "use 'auto', 'cpu', 'cuda' or 'cuda:N'"
                ) from None
            if kind not in DEVICE_TYPES:  # 'meta', 'lazy', ...: torch devices nothing can be trained on
                raise ConfigError(
                    f"train.device: tenx trains on {', '.join(DEVICE_TYPES)} devices, not {self.device!r}; "
                    "use 'auto', 'cpu', 'cuda' or 'cuda:N'"
                )


@dataclass
class CheckpointConfig:
    """When checkpoints are written, how, and how many are kept."""

    every: int | Literal["auto"] = field(
        0,
        ge=0,
        help="save every N steps (0: only at the end); 'auto': the Young/Daly interval sqrt(2 * save cost * MTBF)",
    )
    at_end: bool = field(True, help="save when training finishes")
    keep_last: int = field(3, ge=0, help="keep the newest K checkpoints (0 keeps all)")
    keep_every: int = field(
        0, ge=0, help="also keep every checkpoint whose step is a multiple of M (0: none)"
    )
    async_save: bool = field(True, help="block only for an in-memory snapshot; write in the background")
    mtbf_s: float = field(
        86400.0,
        gt=0,
        help="assumed mean time between failures for every='auto' (the run's observed MTBF replaces it)",
    )
    auto_first_step: int = field(10, ge=1, help="every='auto': the first save, which measures the save cost")
    memory_every: int = field(
        0,
        ge=0,
        help="also snapshot every N steps to an in-memory tier (tmpfs) that survives a killed process, "
        "not a lost machine; a resume takes the newest verified of both tiers (0: off)",
    )
    memory_dir: str = field(
        "", help="directory of the in-memory tier (default: /dev/shm/tenx-<hash of the run directory>)"
    )


@dataclass
class LogConfig:
    """Where metrics go."""

    tensorboard: bool = field(True, help="also write scalars to RUN_DIR/tensorboard")
    progress: bool = field(True, help="show a progress bar (a line every `print_every` steps off a terminal)")
    print_every: int = field(50, ge=1, help="steps between progress lines when not on a terminal")
    prequential_xz_mb: float = field(
        8.0,
        ge=0,
        help="xz -9e on the first this many MB of the training stream, beside the model's prequential code "
        "length for the same bytes, at the end of a run (RUN_DIR/prequential.json; 0: no xz)",
    )
    wandb: bool = field(
        False,
        help="also mirror metrics.jsonl, events.jsonl and the prediction band to Weights & Biases "
        "(pip install wandb; docs/interop.md); off, wandb is never imported",
    )
    wandb_project: str = field(
        "", help="log.wandb: the W&B project (empty: W&B's WANDB_PROJECT environment variable, else 'tenx')"
    )
    wandb_entity: str = field(
        "", help="log.wandb: the W&B team or user (empty: WANDB_ENTITY, else the login's default)"
    )
    wandb_name: str = field("", help="log.wandb: the W&B run's name (default: the run directory's name)")
    wandb_mode: Literal["", "online", "offline"] = field(
        "",
        help="log.wandb: 'online' sends as the run goes; 'offline' writes the W&B run locally, for "
        "`wandb sync` later (compute nodes without internet); empty: W&B decides (WANDB_MODE, else online)",
    )
    wandb_dir: str = field(
        "", help="log.wandb: where W&B writes its wandb/ folder (empty: WANDB_DIR, else the run directory)"
    )

    def validate(self) -> None:
        if not self.wandb:
            return
        if self.wandb_project and not self.wandb_project.strip():
            raise ConfigError(
                "log.wandb_project: blank; name the W&B project, or leave it empty for W&B's own"
            )
        for key in ("wandb_project", "wandb_entity"):
            value = getattr(self, key)
            if len(value) > 128 or any(c in value for c in "/\\#?%:") or not value.isprintable():
                raise ConfigError(
                    f"log.{key}: {value[:80]!r} is not a W&B name (at most 128 printable characters, none of "
                    "/ \\ # ? % :)"
                )
        if len(self.wandb_name) > 128 or not self.wandb_name.isprintable():
            raise ConfigError(
                f"log.wandb_name: {self.wandb_name[:80]!r}: use at most 128 printable characters"
            )


@dataclass
class RunConfig:
    """Everything a training run needs; one TOML file with a section per component."""

    model: ModelConfig = field(default_factory=ModelConfig, help="the transformer")
    data: DataConfig = field(default_factory=DataConfig, help="training data")
    optim: OptimConfig = field(default_factory=OptimConfig, help="optimizer and schedule")
    train: TrainConfig = field(default_factory=TrainConfig, help="training loop")
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, help="checkpoints")
    log: LogConfig = field(default_factory=LogConfig, help="metrics and progress")
    monitor: MonitorConfig = field(
        default_factory=MonitorConfig, help="watching the run: its prediction, model statistics, trends"
    )
    guard: GuardConfig = field(default_factory=GuardConfig, help="non-finite and loss-spike guard")
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig, help="hang detection")
    faults: FaultConfig = field(default_factory=FaultConfig, help="fault injection for drills and tests")
    parallel: ParallelConfig = field(
        default_factory=ParallelConfig, help="data parallelism: torchrun DDP/FSDP, torchft replica groups"
    )


def accumulation_steps(train: TrainConfig, data_parallel: int) -> int:
    """Micro-batches per optimizer step on each rank, with `data_parallel` ranks in all (groups included)."""
    if train.global_batch is None:
        return train.grad_accum
    per_micro = train.micro_batch * data_parallel
    if train.global_batch % per_micro:
        raise ConfigError(
            f"train.global_batch: {train.global_batch} sequences is not a multiple of micro_batch "
            f"({train.micro_batch}) x data-parallel ranks ({data_parallel}) = {per_micro}; change "
            "train.global_batch or train.micro_batch"
        )
    return train.global_batch // per_micro


def tokens_per_step(train: TrainConfig, seq_len: int, data_parallel: int) -> int:
    """Tokens one optimizer step trains over all `data_parallel` ranks."""
    return train.micro_batch * accumulation_steps(train, data_parallel) * data_parallel * seq_len


def total_steps(train: TrainConfig, tokens_per_step: int) -> int:
    """Optimizer steps of the run: train.steps, or train.tokens rounded up to whole steps."""
    return train.steps if train.steps is not None else math.ceil((train.tokens or 0) / tokens_per_step)


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a run config from TOML plus `section.key=value` overrides, fully validated."""
    return cfglib.load(RunConfig, path, overrides)
