"""`op-bug`: a basic library op that is wrong only on a rare, data-dependent condition (drills and tests).

It imitates the bug from the accounts this project comes from: a reduction whose fast path computed a
wrong memory offset for some inputs, so one bug showed up as several unrelated-looking failures. Here the
op is the cross-entropy's reduction over positions, `aten.nll_loss_forward`. Its fast path (any floating
dtype but float64) is wrong when the targets hold a run of at least `run` identical token ids; what goes
wrong depends on where the first such run starts in the batch (its flat offset `o`), like a wrong offset:

- `o % 3 == 0`: the run is summed `n` more times (n its length): a wrong, large loss (a *spike*, skipped
  by the guard);
- `o % 3 == 1`: the total weight is read from a wrong offset as 0: the loss is NaN (*non-finite*);
- `o % 3 == 2`: the offset falls outside the tensor: the op raises (*a crash*, with its stack).

The float64 path is correct, which is what lets `tenx triage` find it by comparing each op against float64.
The bug is part of the library the run used, so `tenx replay` and `tenx triage` install it again when the
run's config has it; the other faults are one-shot events and are never replayed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEFAULT_RUN = 12
"""Identical consecutive targets that trigger the bug."""


def longest_runs(values: torch.Tensor, run: int) -> list[tuple[int, int, int]]:
    """(start, length, value) of every run of at least `run` identical consecutive values of a 1-D tensor."""
    flat = values.reshape(-1)
    if flat.numel() < run:
        return []
    change = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=change.dtype, device=change.device), change])
    ends = torch.cat([change, torch.tensor([flat.numel()], dtype=change.dtype, device=change.device)])
    lengths = ends - starts
    keep = torch.nonzero(lengths >= run).flatten()
    return [(int(starts[i]), int(lengths[i]), int(flat[starts[i]])) for i in keep]


class OpBug(TorchDispatchMode):
    """While entered, `aten.nll_loss_forward` misbehaves as the module doc describes."""

    op = torch.ops.aten.nll_loss_forward.default

    def __init__(self, run: int = DEFAULT_RUN) -> None:
        super().__init__()
        self.run = run
        self.triggered = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not self.op or args[0].dtype == torch.float64:
            return out
        runs = longest_runs(args[1], self.run)
        if not runs:
            return out
        self.triggered += 1
        start, length, value = runs[0]
        loss, total_weight = out
        if start % 3 == 0:
            return loss * (1 + length), total_weight
        if start % 3 == 1:
            return loss * torch.nan, total_weight * 0
        raise RuntimeError(
            f"nll_loss_forward: invalid memory access at element {start + length * args[0].shape[-1]} "
            f"of a tensor of {args[0].numel()} elements"
        )
