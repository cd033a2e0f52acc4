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

The other planted ops (`op=NAME` of the fault spec) are backward kernels whose fast path returns the
gradient with its sign flipped, on every call from the fault's step on: the learning signal through that op
points the wrong way, so the run drifts upward and diverges, no spike and no NaN at first, which is the
bug a loss-ratio rule would blame on the learning rate (issue 46):

- `layer_norm_backward`: `aten.native_layer_norm_backward`'s input gradient (gpt2's LayerNorm);
- `sdpa_backward`: the query, key and value gradients of the fused attention's backward (the CPU flash
  kernel, and CUDA's flash, efficient and cuDNN kernels);
- `mm_backward`: every `aten.mm` run by a matmul's backward node (a linear layer's input and weight
  gradients).

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


def _ops(*names: str) -> tuple[Any, ...]:
    """The aten overloads of `names` this build of torch has (CUDA-only kernels may be absent)."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return tuple(found)


PLANTED_OPS: dict[str, tuple[Any, ...]] = {
    "nll_loss": _ops("nll_loss_forward"),
    "layer_norm_backward": _ops("native_layer_norm_backward"),
    "sdpa_backward": _ops(
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
    ),
    "mm_backward": _ops("mm"),
}
"""`op=` of an op-bug fault -> the aten operators it makes wrong."""

_NEGATED_OUTPUTS = {"layer_norm_backward": 1, "sdpa_backward": 3}
"""How many leading outputs (gradients) a planted backward op returns negated; mm: its one output."""


class OpBug(TorchDispatchMode):
    """While entered, the planted op (`op`, a key of PLANTED_OPS) misbehaves as the module doc describes."""

    def __init__(self, run: int = DEFAULT_RUN, op: str = "nll_loss") -> None:
        super().__init__()
        if op not in PLANTED_OPS:
            raise ValueError(f"unknown planted op {op!r}; choose one of {', '.join(PLANTED_OPS)}")
        self.run = run
        self.planted = op
        self.ops = PLANTED_OPS[op]
        self.triggered = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in self.ops or args[0].dtype == torch.float64:
            return out
        if self.planted != "nll_loss":
            return self._negated(out)
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

    def _negated(self, out: Any) -> Any:
        """A backward kernel's gradients with their sign flipped (mm: only when a backward node runs it)."""
        if self.planted == "mm_backward":
            if torch._C._current_autograd_node() is None:
                return out
            self.triggered += 1
            return -out
        self.triggered += 1
        n = _NEGATED_OUTPUTS[self.planted]
        return tuple(-t if i < n and torch.is_tensor(t) else t for i, t in enumerate(out))
