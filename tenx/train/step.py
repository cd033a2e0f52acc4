"""One training step, the same code for training and for its replay: `take_step`.

The Trainer (tenx/train/trainer.py) and `tenx replay` (tenx/triage/replay.py) both call `take_step`, so a
replayed step is the trained step by construction, not by two copies edited together. It owns the math:
the learning rate from lr_at, the micro-batch loop (forward with the loss, (loss / accum).backward(), the loss
sum), the gradient clip, the guard's check and whether the update is applied. What differs between the two
callers comes in as `StepHooks`: the trainer's gradient-sync context per micro-batch and its reductions
across ranks and replica groups; replay's reference path (float64 loss, math attention), its op-bug library
and capture contexts, and its "apply as recorded".

Replay runs a data-parallel step in one process: `micro_batches` then holds one list per rank, each rank's
micro-batches run in turn and the gradients are averaged as the all-reduce does (tenx/triage/replay.py
says when that is bit for bit).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tenx.errors import DataError
from tenx.parallel.distributed import full_value
from tenx.train.distill import Teacher
from tenx.train.optim import OptimConfig, lr_at
from tenx.train.parts import ModelParts, RunShape

Context = Callable[[], contextlib.AbstractContextManager[Any]]
Batch = tuple[torch.Tensor, torch.Tensor]


def _no_gradient_sync(last_micro_batch: bool) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def _unreduced(loss_sum: torch.Tensor) -> torch.Tensor:
    return loss_sum


def _committed() -> bool:
    return True


@dataclass
class StepHooks:
    """What the trainer's step and replay's re-execution of it do differently (the defaults: nothing)."""

    forward_context: Context = contextlib.nullcontext
    """Around each forward pass: autocast (replay's reference path: math attention, no autocast)."""
    gradient_sync: Callable[[bool], contextlib.AbstractContextManager[Any]] = _no_gradient_sync
    """Around each micro-batch's forward and backward, told whether it is the step's last: the trainer's
    DDP no_sync / FSDP set_requires_gradient_sync."""
    loop_context: Context = contextlib.nullcontext
    """Around all the micro-batches: replay's op-bug library and bisection's capture."""
    reduce: Callable[[torch.Tensor], torch.Tensor] = _unreduced
    """After the micro-batches, before the clip, given the step's loss sum; returns it reduced: the
    trainer's all-reduce across ranks and groups, then its pre_optim_step event."""
    commit: Callable[[], bool] = _committed
    """After the guard's check: whether the step may be applied (replica groups: every peer finished it)."""
    loss_dtype: torch.dtype = torch.float32
    """The dtype of the loss and the loss sum (float64 on replay's reference path)."""
    token_loss_dtype: torch.dtype | None = None
    """Each token's cross-entropy in this dtype when the logits are in it (`train.loss_precision = "bf16"`;
    tenx.model.transformer.lm_loss), its mean in `loss_dtype`; None: all in `loss_dtype`."""
    catch_errors: bool = False
    """Return an exception a forward, a backward or `reduce` raises as the result (replay compares it with a
    recorded crash) instead of raising it; a DataError (the data, not the step) is raised all the same."""


def token_loss_dtype(loss_precision: str) -> torch.dtype | None:
    """StepHooks.token_loss_dtype for `train.loss_precision`."""
    return torch.bfloat16 if loss_precision == "bf16" else None


@dataclass
class StepResult:
    """What one step produced: its loss, gradient norm and the guard's verdict, or the exception it raised."""

    lr: float
    loss: float = math.nan
    grad_norm: float = math.nan
    verdict: str | None = None
    """The guard's reason to skip the update, None when it let it through."""
    committed: bool = True
    """False: a replica group failed during the step; nobody applied it."""
    applied: bool = False
    error: Exception | None = field(default=None, repr=False)
    distill: list[float] | None = None
    """Distillation (a teacher in the parts): the step's mean H(teacher, student) and KL(teacher || student),
    in nats/token, averaged over the ranks as the loss is; None without a teacher."""


def take_step(
    step: int,
    micro_batches: Sequence[Iterable[Batch]],
    trained: ModelParts,
    shape: RunShape,
    optim: OptimConfig,
    device: torch.device,
    hooks: StepHooks | None = None,
    apply: bool | None = None,
    lr: float | None = None,
) -> StepResult:
    """Take optimizer step `step` (counted from 1) over `micro_batches` (inputs, targets) per rank.

    `trained` is what training builds (tenx.train.parts.build_model_parts): `trained.model` is what
    forward and backward run through (set to training mode), `trained.forward` what the forward calls,
    `trained.raw_model` the transformer whose gradients are clipped; `trained.teacher`, when there is one,
    runs on each micro-batch's inputs inside `forward_context` and the loss mixes in its term
    (tenx.train.distill), whose figures are reduced with the loss sum: `reduce` then gets the vector
    [loss sum, H sum, KL sum] in place of the loss sum. `shape` gives the micro-batches per
    step, the schedule's length and the z-loss. `apply`: None takes the update when the guard and the
    commit allow it; True/False decide it (replay: as the record says). `lr`: the learning rate to take
    (replay: the recorded one, which a wall-clock budget's re-planning may have moved off the config's
    schedule); None: the schedule's, lr_at(step - 1, shape.total_steps, optim).
    """
    hooks = hooks if hooks is not None else StepHooks()
    model, raw_model, forward, teacher = trained.model, trained.raw_model, trained.forward, trained.teacher
    optimizer, guard = trained.optimizer, trained.guard
    accum = shape.grad_accum
    lr = lr_at(step - 1, shape.total_steps, optim) if lr is None else lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.train()
    ranks = len(micro_batches)
    params = list(raw_model.parameters()) if ranks > 1 else []
    losses: list[torch.Tensor] = []
    grads: list[list[torch.Tensor | None]] = []
    try:
        with hooks.loop_context():
            for batches in micro_batches:
                loss_sum = torch.zeros((3,) if teacher else (), device=device, dtype=hooks.loss_dtype)
                for i, (inputs, targets) in enumerate(batches):
                    with hooks.gradient_sync(i == accum - 1):
                        with hooks.forward_context():  # the output layer and the loss, fused, inside
                            loss, ce = _loss(forward, teacher, inputs, targets, hooks)
                        (loss / accum).backward()
                    loss_sum += ce.detach()
                losses.append(loss_sum)
                if ranks > 1:
                    grads.append([p.grad.detach().clone() if p.grad is not None else None for p in params])
                    optimizer.zero_grad(set_to_none=True)
        loss_sum = losses[0] if ranks == 1 else _average_ranks(losses, grads, params)
        loss_sum = hooks.reduce(loss_sum)
    except Exception as error:
        if not hooks.catch_errors or isinstance(error, DataError):
            raise
        optimizer.zero_grad(set_to_none=True)
        return StepResult(lr, error=error)
    clip = optim.grad_clip if optim.grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip)
    # the step's one wait for the device: every figure in one copy (cat promotes to the wider dtype, and
    # MPS has no float64 of its own)
    grad_norm, loss_value, *distill = torch.cat(
        [full_value(norm).reshape(1), (loss_sum / accum).reshape(-1)]
    ).tolist()
    verdict = guard.check(loss_value, grad_norm)
    committed = hooks.commit()
    applied = (verdict is None if apply is None else apply) and committed
    if applied:
        optimizer.step()
        guard.record_good(loss_value, grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(lr, loss_value, grad_norm, verdict, committed, applied, distill=distill or None)


def _loss(
    forward: Any,
    teacher: Teacher | None,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    hooks: StepHooks,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to optimise, the figures to sum): the mean cross-entropy; with a teacher, the vector
    [mean cross-entropy, mean H(teacher, student), mean KL(teacher || student)]."""
    dtypes = {"loss_dtype": hooks.loss_dtype, "token_loss_dtype": hooks.token_loss_dtype}
    if teacher is None:
        return forward(inputs, targets, **dtypes)  # type: ignore[no-any-return]
    soft = teacher.soft_targets(inputs)
    loss, ce, distill = forward(inputs, targets, teacher=soft, **dtypes)
    return loss, torch.cat([ce.reshape(1), distill])


def _average_ranks(
    losses: list[torch.Tensor], grads: list[list[torch.Tensor | None]], params: list[nn.Parameter]
) -> torch.Tensor:
    """Average the ranks' loss sums and gradients (into `params`) as the all-reduce does; the mean loss sum.

    A sum of two floats does not depend on their order and halving is exact, so with 2 ranks this is the
    collective's result bit for bit."""
    ranks = len(losses)
    loss_sum = losses[0]
    for other in losses[1:]:
        loss_sum = loss_sum + other
    loss_sum = loss_sum / ranks
    for i, p in enumerate(params):
        parts = [grad for g in grads if (grad := g[i]) is not None]
        if parts:
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            p.grad = total / ranks
    return loss_sum
