"""The replica consistency check as a training callback (the digests and comparisons are in
tenx/parallel/consistency.py)."""

from __future__ import annotations

from typing import Any

import torch

from tenx.errors import TenxError
from tenx.parallel.consistency import (
    AllReduceSum,
    ConsistencyConfig,
    _after_outer_sync,
    dist_allreduce_sum,
    find_divergent,
    gather_digests,
    gradient_digest,
    majority,
    parameter_digest,
)
from tenx.train.hooks import Callback, TrainerView


class ConsistencyCheck(Callback):
    """Every `cfg.every` steps, compare replicas' parameter (and gradient) checksums; name any that diverge.

    Within a DDP job the ranks are compared over the default process group (slot = rank); across torchft
    replica groups over `trainer.replicas.allreduce_sum_` (slot = group id; under FSDP each rank compares
    its shard with the same rank of the other groups). The comparison runs from the
    `pre_optim_step` event of step s (s a multiple of `every`), on every rank at the same steps: the
    parameters as step s found them, and step s's reduced gradients. A cross-replica mismatch is
    recorded once per job (by rank 0); the self-check's by the rank that found itself corrupt. A lone
    process (one rank, no replica groups) has nothing to compare with: the callback does nothing there.
    """

    name = "consistency"

    def __init__(self, cfg: ConsistencyConfig) -> None:
        self.cfg = cfg
        self._active = False
        self._self_check = False
        self._generation = 0
        self._recorded: torch.Tensor | None = None
        self._recorded_generation = 0
        self._suspect_step: int | None = None
        """The step at which this rank's self-check failed (until the state is next loaded)."""
        self._suspect_generation = 0

    # -- hook events -------------------------------------------------------------------------------
    def on_train_start(self, trainer: TrainerView) -> None:
        lone = trainer.world_size == 1 and trainer.replicas is None
        self._active = self.cfg.every > 0 and (not lone or (self.cfg.alone and self.cfg.self_check))
        if not self._active:
            return  # a lone process has no replica to agree with (unless asked to check itself)
        self._self_check = self.cfg.self_check
        if self._self_check:
            self._record(trainer)

    def pre_optim_step(self, trainer: TrainerView) -> None:
        """Gradients are reduced: compare replicas at the due steps, then check this rank's own parameters."""
        if not self._active:
            return
        self._compare_due(trainer)
        if self._self_check:
            self._verify(trainer, trainer.step + 1)

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        if not self._self_check:
            return
        if "skipped" in metrics:  # the guard skipped the update: nothing may have changed the parameters
            self._verify(trainer, trainer.step)
        self._record(trainer)

    def post_state_loaded(self, trainer: TrainerView, source: str) -> None:
        self._generation += 1  # digests recorded before a resume, rollback or heal no longer apply

    def on_train_end(self, trainer: TrainerView) -> None:
        self._self_check = False
        self._active = False

    # -- the self-check ----------------------------------------------------------------------------
    def _record(self, trainer: TrainerView) -> None:
        """Remember the parameters as this step left them (after any outer sync or state load)."""
        self._recorded = parameter_digest(trainer.raw_model)
        self._recorded_generation = self._generation

    def _verify(self, trainer: TrainerView, step: int) -> None:
        """Parameters must be as recorded, unless the trainer loaded state since (resume, rollback, heal)."""
        if self._recorded is None or self._generation != self._recorded_generation:
            return
        now = parameter_digest(trainer.raw_model)
        if torch.equal(now, self._recorded):
            return
        self._suspect_step, self._suspect_generation = step, self._generation
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

    def _suspect(self, trainer: TrainerView) -> bool:
        return self._suspect_step is not None and self._suspect_generation == self._generation

    # -- cross-replica comparison ------------------------------------------------------------------
    def _compare_due(self, trainer: TrainerView) -> None:
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
        trainer: TrainerView,
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

    def _report(
        self, trainer: TrainerView, step: int, *, message: str, emit: bool = True, **fields: Any
    ) -> None:
        """Record and print one mismatch; raise under on_mismatch='stop'."""
        if emit:
            trainer.events.emit("replica-mismatch", step, reporter=trainer.rank, message=message, **fields)
            print(f"tenx: consistency: step {step}: {message}", flush=True)
        if self.cfg.on_mismatch == "stop":
            raise TenxError(
                f"consistency check at step {step}: {message} (parallel.consistency.on_mismatch='stop'); "
                "see events.jsonl"
            )
