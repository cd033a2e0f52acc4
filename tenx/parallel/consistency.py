"""Replica consistency checks against silent data corruption (SDC): a flipped bit in one replica's weights.

Data-parallel replicas hold bitwise-identical parameters (DDP ranks after every step; torchft replica
groups after every step in `sync` mode, right after each outer sync in `diloco` mode) and identical
reduced gradients. Every `every` steps each replica computes a checksum of its parameters (and, where
they are identical too, of its reduced gradients) on its own device; the checksums are gathered with a
single all-reduce and a replica that disagrees with the strict majority is named in a
`replica-mismatch` event of RUN_DIR/events.jsonl.

Two replicas that disagree have no majority. The self-check is the witness that breaks the tie: each
rank records its parameter checksum after every step and verifies it just before the next optimizer
step; parameters that changed in between, outside any optimizer step or state load, mean this rank
is the corrupt one. See docs/consistency.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tenx.config import field
from tenx.errors import TenxError
from tenx.utils.tensors import local_tensor

_MODULUS = 65521
"""Position weights cycle through 1..65521 (the largest prime below 2**16, as in Adler-32)."""
_TENSOR_MIX = 1_000_003
"""Odd multiplier chaining the tensors' weighted sums: the tensors' order matters, and no change is lost."""
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class ConsistencyConfig:
    """Compare data-parallel replicas' parameters (and reduced gradients) to catch silent corruption."""

    every: int = field(100, ge=0, help="compare replicas every N steps (0: off)")
    gradients: bool = field(True, help="also compare the reduced gradients (where replicas hold full ones)")
    self_check: bool = field(
        True,
        help="each rank checks its parameters did not change between optimizer steps (names the rank "
        "when two replicas disagree and there is no majority); two checksum passes per step",
    )
    alone: bool = field(
        False,
        help="run the self-check in a lone process too (no replica to compare with): catches parameters "
        "changed outside an optimizer step (bad memory) on one machine",
    )
    on_mismatch: Literal["warn", "stop"] = field(
        "warn",
        help="'warn': record the event and train on (you decide: roll back, replace the host); "
        "'stop': raise an error naming the replica",
    )


# ----- the checksum ----------------------------------------------------------------------------------


_weights_on: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """The position weights 1.._MODULUS on `device` (512 KiB, made once per device)."""
    if device not in _weights_on:
        _weights_on[device] = torch.arange(1, _MODULUS + 1, dtype=torch.int64, device=device)
    return _weights_on[device]


def tensor_digest(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A checksum of the tensors' bits: int64 of shape (2,), computed on their device (no copy to host).

    Each tensor's bytes are read as integers of the same width (float32 as int32, bf16 as int16, ...);
    word 0 is their sum and word 1 a position-weighted sum (weights cycling through 1..65521, tensors
    chained by an odd multiplier), both wrapping modulo 2**64. Any single flipped bit changes word 0 by
    ±2**b, so it is always detected; word 1 also catches swapped values. Identical bits give identical
    digests on every device. A checksum against accidents, not a cryptographic hash.
    """
    total: torch.Tensor | None = None
    weighted: torch.Tensor | None = None
    for tensor in tensors:
        local = local_tensor(tensor).detach()
        n = local.numel()
        if n == 0:
            continue
        if local.element_size() not in _INT_OF_WIDTH:
            raise TypeError(f"tensor_digest: no integer view for dtype {local.dtype}")
        ints = local.reshape(-1).view(_INT_OF_WIDTH[local.element_size()])
        weights = _weights(ints.device)
        full = n - n % _MODULUS
        tail = ints[full:].to(torch.int64)
        part_sum = tail.sum()
        part_weighted = (tail * weights[: n - full]).sum()
        if full:  # column sums of the (rows, 65521) view: the weights apply per column
            columns = ints[:full].view(-1, _MODULUS).sum(0, dtype=torch.int64)
            part_sum = part_sum + columns.sum()
            part_weighted = part_weighted + (columns * weights).sum()
        if total is None or weighted is None:
            total, weighted = part_sum, part_weighted
        else:
            total = total + part_sum.to(total.device)
            weighted = weighted * _TENSOR_MIX + part_weighted.to(weighted.device)
    if total is None or weighted is None:
        return torch.zeros(2, dtype=torch.int64)
    return torch.stack([total, weighted])


def parameter_digest(model: torch.nn.Module) -> torch.Tensor:
    """`tensor_digest` of this rank's parameters (its local shards under FSDP2), in module order."""
    return tensor_digest(p for p in model.parameters())


def gradient_digest(model: torch.nn.Module) -> torch.Tensor:
    """`tensor_digest` of this rank's gradients (parameters without one are left out, alike on every rank)."""
    return tensor_digest(p.grad for p in model.parameters() if p.grad is not None)


# ----- gathering and blame ---------------------------------------------------------------------------
AllReduceSum = Callable[[torch.Tensor], None]
"""Sums an int64 tensor in place across the replicas (a process group, or torchft's manager)."""


def dist_allreduce_sum(group: Any = None) -> AllReduceSum:
    """An AllReduceSum over a torch.distributed process group (None: the default group)."""

    def allreduce(t: torch.Tensor) -> None:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)

    return allreduce


def gather_digests(
    local: torch.Tensor, slot: int, slots: int, allreduce_sum: AllReduceSum
) -> dict[int, tuple[int, ...]]:
    """Every replica's `local` vector (int64, shape (k,)), keyed by slot, with only an all-reduce.

    Each replica writes its vector into row `slot` of a zero (slots, 1 + k) tensor, column 0 a presence
    count, and the rows are summed: a replica that did not take part (torchft zeroes a healing group's
    contribution) leaves its row at zero and is absent from the result. Two replicas claiming one slot
    is an error.
    """
    if not 0 <= slot < slots:
        raise ValueError(f"slot {slot} is outside [0, {slots})")
    rows = torch.zeros(slots, 1 + local.numel(), dtype=torch.int64, device=local.device)
    rows[slot, 0] = 1
    rows[slot, 1:] = local.to(torch.int64)
    allreduce_sum(rows)
    table = rows.cpu().tolist()
    doubled = [i for i, row in enumerate(table) if row[0] > 1]
    if doubled:
        raise TenxError(f"consistency check: slots {doubled} were claimed by more than one replica")
    return {i: tuple(row[1:]) for i, row in enumerate(table) if row[0] == 1}


def majority(rows: Mapping[int, Sequence[int]]) -> tuple[int, ...] | None:
    """The value held by a strict majority of the rows, or None (a tie, or no rows)."""
    counts: dict[tuple[int, ...], int] = {}
    for value in rows.values():
        counts[tuple(value)] = counts.get(tuple(value), 0) + 1
    for value, count in counts.items():
        if 2 * count > len(rows):
            return value
    return None


def find_divergent(rows: Mapping[int, Sequence[int]]) -> list[int]:
    """The slots whose value differs from the strict majority; with disagreement and no majority, all slots."""
    if len({tuple(v) for v in rows.values()}) <= 1:
        return []
    agreed = majority(rows)
    return sorted(slot for slot, value in rows.items() if agreed is None or tuple(value) != agreed)


def _after_outer_sync(step: int, every: int, sync_every: int) -> bool:
    """diloco: whether step s starts right after an outer sync, at most one check per `every` steps.

    Groups hold identical parameters only then; the period is `every` rounded up to a multiple of sync_every.
    """
    period = math.ceil(every / sync_every) * sync_every
    return step > 1 and (step - 1) % period == 0
