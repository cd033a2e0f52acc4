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
from typing import TYPE_CHECKING, Any, Literal

import torch

from tenx.config import field
from tenx.errors import ConfigError, TenxError
from tenx.train.hooks import Callback

if TYPE_CHECKING:
    from tenx.train.trainer import Trainer

_MODULUS = 65521
"""Position weights cycle through 1..65521 (the largest prime below 2**16, as in Adler-32)."""
_TENSOR_MIX = 1_000_003
"""Odd multiplier chaining the tensors' weighted sums: the tensors' order matters, and no change is lost."""
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class ConsistencyConfig:
    """Compare data-parallel replicas' parameters (and reduced gradients) to catch silent corruption."""

    every: int = field(100, help="compare replicas every N steps (0: off)")
    gradients: bool = field(True, help="also compare the reduced gradients (where replicas hold full ones)")
    self_check: bool = field(
        True,
        help="each rank checks its parameters did not change between optimizer steps (names the rank "
        "when two replicas disagree and there is no majority); two checksum passes per step",
    )
    on_mismatch: Literal["warn", "stop"] = field(
        "warn",
        help="'warn': record the event and train on (you decide: roll back, replace the host); "
        "'stop': raise an error naming the replica",
    )

    def validate(self) -> None:
        """Check ranges; names the offending field."""
        if self.every < 0:
            raise ConfigError(f"parallel.consistency.every: must be >= 0, got {self.every}")


# ----- the checksum ----------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (FSDP2), else `t`."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


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
        local = _local(tensor).detach()
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


# ----- the callback ----------------------------------------------------------------------------------
class ConsistencyCheck(Callback):
    """Every `cfg.every` steps, compare replicas' parameter (and gradient) checksums; name any that diverge.

    Within a DDP job the ranks are compared over the default process group (slot = rank); across torchft
    replica groups over `trainer.replicas.allreduce_sum_` (slot = group id; under FSDP each rank compares
    its shard with the same rank of the other groups). The comparison runs from the trainer's
    `after_reduce` hook of step s (s a multiple of `every`), on every rank at the same steps: the
    parameters as step s found them, and step s's reduced gradients. A cross-replica mismatch is
    recorded once per job (by rank 0); the self-check's by the rank that found itself corrupt. A lone
    process (one rank, no replica groups) has nothing to compare with: the callback does nothing there.
    """

    name = "consistency"

    def __init__(self, cfg: ConsistencyConfig) -> None:
        self.cfg = cfg
        self._handles: list[Any] = []
        self._self_check = False
        self._recorded: torch.Tensor | None = None
        self._recorded_generation = 0
        self._stepped = False
        self._suspect_step: int | None = None
        """The step at which this rank's self-check failed (until the state is next loaded)."""
        self._suspect_generation = 0

    # -- hook points -------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer) -> None:
        if self.cfg.every <= 0 or (trainer.world_size == 1 and trainer.replicas is None):
            return  # a lone process has no replica to agree with
        trainer.after_reduce.append(self._after_reduce)
        self._self_check = self.cfg.self_check
        if self._self_check:
            self._handles.append(
                trainer.optimizer.register_step_pre_hook(
                    lambda optimizer, args, kwargs: self._before_optimizer_step(trainer)
                )
            )
            self._record(trainer)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if not self._self_check:
            return
        if not self._stepped:  # the guard skipped the update: nothing may have changed the parameters
            self._verify(trainer, trainer.step)
        self._record(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        self._self_check = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._after_reduce in trainer.after_reduce:
            trainer.after_reduce.remove(self._after_reduce)

    # -- the self-check ----------------------------------------------------------------------------
    def _record(self, trainer: Trainer) -> None:
        """Remember the parameters as this step left them (after any outer sync or state load)."""
        self._recorded = parameter_digest(trainer.raw_model)
        self._recorded_generation = _generation(trainer)
        self._stepped = False

    def _before_optimizer_step(self, trainer: Trainer) -> None:
        self._verify(trainer, trainer.step + 1)
        self._stepped = True

    def _verify(self, trainer: Trainer, step: int) -> None:
        """Parameters must be as recorded, unless the trainer loaded state since (resume, rollback, heal)."""
        if self._recorded is None or _generation(trainer) != self._recorded_generation:
            return
        now = parameter_digest(trainer.raw_model)
        if torch.equal(now, self._recorded):
            return
        self._suspect_step, self._suspect_generation = step, _generation(trainer)
        self._report(
            trainer,
            step,
            check="self",
            scope="rank",
            ranks=[trainer.rank],
            digests={trainer.rank: {"recorded": self._recorded.tolist(), "now": now.tolist()}},
            message=f"rank {trainer.rank}'s parameters changed outside an optimizer step: this rank "
            "is corrupt (bad memory or a stray write)",
        )
        self._recorded = now  # report one change once

    def _suspect(self, trainer: Trainer) -> bool:
        return self._suspect_step is not None and self._suspect_generation == _generation(trainer)

    # -- cross-replica comparison ------------------------------------------------------------------
    def _after_reduce(self, trainer: Trainer) -> None:
        """Compare at the steps every rank and group derives alike from `trainer.step` (or the run hangs)."""
        step = trainer.step + 1
        due = step % self.cfg.every == 0
        if due and trainer.strategy == "ddp" and trainer.world_size > 1:
            self._compare(trainer, step, "rank", trainer.rank, trainer.world_size, dist_allreduce_sum())
        replicas = trainer.replicas
        if replicas is None:
            return
        group = (replicas.group_id, replicas.num_groups, replicas.allreduce_sum_)
        if replicas.mode == "sync" and due:
            self._compare(trainer, step, "group", *group)
        elif replicas.mode == "diloco" and _after_outer_sync(step, self.cfg.every, replicas.sync_every):
            self._compare(trainer, step, "group", *group, gradients=False)
        # streaming-diloco syncs fragments at staggered steps: the whole model is never identical across
        # groups, so only the self-check runs.

    def _compare(
        self,
        trainer: Trainer,
        step: int,
        scope: str,
        slot: int,
        slots: int,
        allreduce_sum: AllReduceSum,
        gradients: bool = True,
    ) -> None:
        """One all-reduce of [suspect flag, parameter digest, gradient digest?] from every replica."""
        gradients = gradients and self.cfg.gradients
        device = next(trainer.raw_model.parameters()).device
        parts = [torch.tensor([int(self._suspect(trainer))], dtype=torch.int64, device=device)]
        parts.append(parameter_digest(trainer.raw_model))
        if gradients:
            parts.append(gradient_digest(trainer.raw_model))
        rows = gather_digests(torch.cat([p.to(device) for p in parts]), slot, slots, allreduce_sum)
        checks = ["parameters", "gradients"] if gradients else ["parameters"]
        for i, check in enumerate(checks):
            digests = {s: list(row[1 + 2 * i : 3 + 2 * i]) for s, row in rows.items()}
            divergent = find_divergent(digests)
            if not divergent:
                continue
            agreed = majority(digests)
            witness = None
            if agreed is None:  # no majority: believe the replicas whose self-check failed, if any
                flagged = sorted(s for s, row in rows.items() if row[0])
                if flagged and len(flagged) < len(rows):
                    divergent, witness = flagged, "self-check"
            where = "ranks" if scope == "rank" else "groups"
            named = f"{scope if len(divergent) == 1 else where} {', '.join(map(str, divergent))}"
            if agreed is not None:
                message = f"{check} of {named} differ from the majority of {len(rows)} {where}"
            elif witness:
                message = (
                    f"{check} of {where} disagree with no majority; {named} found its own parameters "
                    "changed outside an optimizer step (self-check): it is the corrupt one"
                )
            else:
                message = (
                    f"{check} of {named} disagree with no majority: cannot tell which is corrupt "
                    "(parallel.consistency.self_check names the rank)"
                )
            self._report(
                trainer,
                step,
                check=check,
                scope=scope,
                emit=trainer.rank == 0,  # every rank sees the same rows: one record per job
                digests=digests,
                majority=list(agreed) if agreed is not None else None,
                undecided=agreed is None and witness is None,
                witness=witness,
                message=message,
                **{where: divergent},
            )

    def _report(self, trainer: Trainer, step: int, *, message: str, emit: bool = True, **fields: Any) -> None:
        """Record and print one mismatch; raise under on_mismatch='stop'."""
        if emit:
            trainer.events.emit("replica-mismatch", step, reporter=trainer.rank, message=message, **fields)
            print(f"tenx: consistency: step {step}: {message}", flush=True)
        if self.cfg.on_mismatch == "stop":
            raise TenxError(
                f"consistency check at step {step}: {message} (parallel.consistency.on_mismatch='stop'); "
                "see events.jsonl"
            )


def _generation(trainer: Trainer) -> int:
    return int(getattr(trainer, "state_generation", 0))


def _after_outer_sync(step: int, every: int, sync_every: int) -> bool:
    """diloco: whether step s starts right after an outer sync, at most one check per `every` steps.

    Groups hold identical parameters only then; the period is `every` rounded up to a multiple of sync_every.
    """
    period = math.ceil(every / sync_every) * sync_every
    return step > 1 and (step - 1) % period == 0
