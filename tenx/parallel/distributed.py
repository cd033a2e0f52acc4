"""Parallelism inside one cluster: torchrun process groups, DDP and FSDP2, on PyTorch's own engine.

`torchrun --nproc_per_node N -m tenx train ...` sets RANK, WORLD_SIZE, LOCAL_RANK and a rendezvous
store in the environment; `init_distributed` joins that process group (gloo on CPU, NCCL on GPU) and
`wrap_model` applies `parallel.strategy`:

- `ddp`: `torch.nn.parallel.DistributedDataParallel`; every rank holds the whole model and optimizer
  and gradients are averaged by all-reduce (bucketed, overlapped with backward).
- `fsdp`: FSDP2 `fully_shard` on each transformer block, then on the root; parameters, gradients and
  optimizer state are sharded (DTensors) and gathered block by block. Optional mixed precision
  (`parallel.mixed_precision = "bf16"`: bf16 parameters in compute, fp32 gradient reduction and master
  weights) and activation checkpointing (recompute each block's activations in backward).

The loader splits every global batch across ranks (and replica groups), so with a fixed
`train.global_batch` the loss curve does not depend on the number of processes. Replica groups across
clusters (torchft) are in tenx/parallel/replicas.py; replica consistency checks in consistency.py.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from tenx.config import field
from tenx.errors import ConfigError, TenxError
from tenx.parallel.consistency import ConsistencyConfig
from tenx.parallel.replicas import ReplicaConfig

STRATEGIES = ("ddp", "fsdp")


@dataclass
class ParallelConfig:
    """How the work is split across processes (torchrun) and across clusters (torchft replica groups)."""

    strategy: Literal["ddp", "fsdp"] = field(
        "ddp",
        help="with more than one process: 'ddp' (replicated model, all-reduced gradients) or 'fsdp' "
        "(FSDP2 fully_shard: parameters, gradients and optimizer state sharded)",
    )
    backend: Literal["auto", "gloo", "nccl"] = field(
        "auto", help="process-group backend; 'auto': NCCL when training on CUDA, else gloo"
    )
    mixed_precision: Literal["none", "bf16"] = field(
        "none",
        help="fsdp only: 'bf16' computes with bf16 parameters, reduces gradients and keeps master "
        "weights in fp32 (train.precision then only sets autocast)",
    )
    activation_checkpointing: bool = field(
        False, help="recompute each block's activations in backward instead of keeping them (saves memory)"
    )
    timeout_s: float = field(
        600.0,
        gt=0,
        help="collective timeout: a rank waiting this long for its peers fails instead of hanging",
    )
    consistency: ConsistencyConfig = field(
        default_factory=ConsistencyConfig, help="replica consistency checks (silent data corruption)"
    )
    replicas: ReplicaConfig = field(
        default_factory=ReplicaConfig, help="replica groups across clusters (torchft)"
    )


@dataclass(frozen=True)
class DistEnv:
    """This process's place in its torchrun job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def single_node(self) -> bool:
        """Whether every rank of the job runs on this machine."""
        return self.local_world_size == self.world_size


def dist_env() -> DistEnv:
    """Rank and world size from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)."""

    def number(name: str, default: int) -> int:
        value = os.environ.get(name)
        if value is None or value == "":
            return default
        try:
            return int(value)
        except ValueError:
            raise TenxError(f"environment variable {name}={value!r} is not an integer") from None

    world = number("WORLD_SIZE", 1)
    rank = number("RANK", 0)
    local_rank = number("LOCAL_RANK", rank if world > 1 else 0)
    local_world = number("LOCAL_WORLD_SIZE", world)
    if not 0 <= rank < world:
        raise TenxError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return DistEnv(rank, world, local_rank, local_world)


def resolve_backend(backend: str, device: torch.device) -> str:
    """The process-group backend for `parallel.backend` on `device`."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend: 'nccl' needs CUDA devices; use 'gloo' (or 'auto') on CPU")
    return backend


def init_distributed(env: DistEnv, device: torch.device, cfg: ParallelConfig) -> bool:
    """Join the torchrun job's default process group when there is more than one rank.

    Returns whether a process group was initialised here (so the caller knows to tear it down).
    """
    if env.world_size == 1 or dist.is_initialized():
        return False
    if not dist.is_available():
        raise TenxError("this torch build has no torch.distributed; multi-process training is unavailable")
    if "MASTER_ADDR" not in os.environ:
        raise TenxError(
            f"WORLD_SIZE={env.world_size} but no MASTER_ADDR: launch with torchrun "
            "(torchrun --nproc_per_node N -m tenx train ...)"
        )
    backend = resolve_backend(cfg.backend, device)
    kwargs: dict = {"timeout": datetime.timedelta(seconds=cfg.timeout_s)}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, **kwargs)
    return True


_LEFT_GROUP = False  # this process took part in a torch.distributed process group (and has left it)


def shutdown_distributed() -> None:
    """Leave the process group cleanly (a barrier first: FSDP2 otherwise sometimes aborts at exit)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            abandon_distributed()


def abandon_distributed() -> None:
    """Leave the process group without a barrier: a failed rank must not wait for peers that may be gone."""
    global _LEFT_GROUP
    if dist.is_available() and dist.is_initialized():
        _LEFT_GROUP = True
        dist.destroy_process_group()


def end_process(code: int) -> None:
    """End a process that took part in a gloo/NCCL process group with `code`, skipping interpreter teardown.

    `destroy_process_group` unregisters the group, but DDP and FSDP modules still hold it, so its C++ side
    (gloo worker and transport threads) is destroyed in interpreter finalization, in no set order with the
    rest of the interpreter. There, about once in tens of runs under load, a rank aborted with `terminate
    called without an active exception` (SIGABRT) after the run had finished and written everything, and
    torchrun reported the whole job as failed. Everything a run owns is closed and flushed before this is
    called (callbacks, checkpoint writers, metrics); stdio and logging are flushed here. A process that
    never joined a group returns normally."""
    if not _LEFT_GROUP:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say on it
            pass
    logging.shutdown()
    os._exit(code)


@contextmanager
def distributed_group(env: DistEnv, device: torch.device, cfg: ParallelConfig) -> Iterator[None]:
    """The torchrun job's process group for the body (init_distributed): left cleanly when the body ends,
    abandoned without a barrier when it raises (its peers may be gone). A group joined before is left as
    it is."""
    owns = init_distributed(env, device, cfg)
    finished = False
    try:
        yield
        finished = True
    finally:
        if owns:
            if finished:
                shutdown_distributed()
            else:
                abandon_distributed()


def rank_device(device: torch.device, env: DistEnv) -> torch.device:
    """One GPU per local rank: `cuda` becomes `cuda:LOCAL_RANK` in a multi-process job."""
    if device.type == "cuda" and env.world_size > 1 and device.index is None:
        device = torch.device("cuda", env.local_rank % max(1, torch.cuda.device_count()))
    if device.type == "cuda" and device.index is None:  # one process: the current GPU, named by its index
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def wrap_model(
    model: nn.Module, cfg: ParallelConfig, device: torch.device, world_size: int
) -> tuple[nn.Module, str]:
    """Apply the parallel strategy; returns (module to call for forward/backward, strategy used).

    One process: the model as it is ("none"). FSDP2 shards in place, so the returned module is `model`
    itself with DTensor parameters; DDP returns a wrapper whose `.module` is `model`.
    """
    if cfg.activation_checkpointing:
        model.checkpoint_blocks = True  # type: ignore[assignment]
    if world_size == 1:
        if cfg.mixed_precision != "none":
            print("tenx: parallel.mixed_precision applies to fsdp only; one process trains as configured")
        return model, "none"
    if cfg.strategy == "ddp":
        if cfg.mixed_precision != "none":
            raise ConfigError(
                "parallel.mixed_precision: only with parallel.strategy='fsdp' (ddp: use train.precision)"
            )
        ids = [device.index] if device.type == "cuda" else None
        # the model's only buffers are the constant RoPE tables, computed alike on every rank: broadcasting
        # them before each forward would be wasted traffic and a sync point that hides a straggler
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
        return ddp, "ddp"
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    blocks = getattr(model, "blocks", None)
    for block in blocks if blocks is not None else []:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, "fsdp"


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 and single-process models are their own)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def all_reduce_mean_(
    t: torch.Tensor, world_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Average `t` over the ranks, in place (SUM then divide: gloo has no AVG)."""
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t.div_(world_size)
    return t


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective over its mesh), or `t` itself."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def broadcast_int(value: int, world_size: int, group: dist.ProcessGroup | None = None) -> int:
    """Rank 0's `value` on every rank of `group` (a CPU tensor: the group may be gloo's)."""
    if world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=0, group=group)
    return int(t.item())


def max_int(value: int, world_size: int, device: torch.device, group: dist.ProcessGroup | None = None) -> int:
    """The largest `value` of any rank, on every rank (a tensor on `device`, the backend's)."""
    if world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def broadcast_object(obj: Any, world_size: int, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's `obj` (picklable; only rank 0's is read) on every rank of `group`."""
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
