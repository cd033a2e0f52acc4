"""One operator against float64: the comparison every numerics check of `tenx triage` makes.

An operator's output as run is compared with the same operator on its inputs raised to float64 (norm-wise
relative error, against its dtype's TOLERANCE); a non-finite value where float64 is finite counts unless
float64 lies beyond the dtype's range. An operator is only judged where its dtype can deliver the result:
when one rounding of its inputs moves the float64 result by more than ILL_CONDITIONED, it is
"ill-conditioned", not faulty. Used by the bisection (tenx/triage/bisect.py) and by the reproductions it
writes (tenx/triage/repro.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_map

from tenx.hardware import float64_device

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""Norm-wise relative error of one operator's output against float64 beyond which it is faulty."""

ILL_CONDITIONED = 0.1
"""Relative change of an operator's float64 result when its inputs move by one rounding of their dtype
beyond which the operator is not judged: its result is not determined by its inputs at their precision
(a healthy step's operators move by ~1e-6; a diverged model's attention by 1e4 and more)."""

GROSS_ERROR = 0.5
"""A norm-wise relative error against float64 this large is judged on bf16/fp16 inputs against one rounding
of float32, the precision their kernels compute in (see `check_op`)."""

SENSITIVITY_SAMPLES = 3
"""Random one-rounding perturbations of the inputs whose largest effect measures an operator's conditioning."""


def op_name(func: Any) -> str:
    return f"aten.{func._schema.name.split('::')[-1]}" + (
        f".{func._overloadname}" if func._overloadname != "default" else ""
    )


def _upcast(x: Any) -> Any:
    """A floating tensor in float64, on a device that has it (an MPS tensor, and its indices, on the CPU)."""
    if not torch.is_tensor(x):
        return x
    if x.is_floating_point():
        return x.detach().to(float64_device(x.device), torch.float64)
    return x.to(float64_device(x.device))


def tensors_of(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def _relative(a64: torch.Tensor, r: torch.Tensor) -> float:
    both = torch.isfinite(r) & torch.isfinite(a64)
    diff = torch.linalg.vector_norm(torch.where(both, a64 - r, 0.0))
    scale = torch.linalg.vector_norm(torch.where(both, r, 0.0))
    return float(diff / scale) if float(scale) > 0 else float(diff)


def compare_with_reference(
    fast: Any, ref: Any, sensitivity: Any = None
) -> tuple[str | None, float | None, float]:
    """(problem or None, norm-wise relative error, tolerance) of an op's outputs against float64.

    The tolerance is the output dtype's (TOLERANCE), widened for an ill-conditioned op: `sensitivity`, the
    float64 outputs for inputs perturbed by one rounding of their dtype, shows how far honest rounding
    can move the result (64 times that is allowed). A non-finite value where float64 is finite counts
    unless float64 itself lies beyond the dtype's range (an overflow the dtype cannot avoid).
    """
    worst, tol = 0.0, 0.0
    perturbed = tensors_of(sensitivity) if sensitivity is not None else []
    for k, (a, r) in enumerate(zip(tensors_of(fast), tensors_of(ref))):
        if not a.is_floating_point() or a.dtype == torch.float64 or a.numel() == 0:
            continue
        limit = TOLERANCE.get(a.dtype, 1e-3)
        if k < len(perturbed):
            limit = max(limit, 64 * _relative(perturbed[k], r))
        tol = max(tol, limit)
        a64 = a.detach().to(r.device, torch.float64)  # where float64 runs: the CPU for an MPS tensor
        finite_r, finite_a = torch.isfinite(r), torch.isfinite(a64)
        representable = r.abs() <= torch.finfo(a.dtype).max
        if bool((finite_r & representable & ~finite_a).any()):
            return "non-finite", None, limit
        err = _relative(a64, r)
        if err > limit:
            return "diverges", err, limit
        worst = max(worst, err)
    return None, worst, tol


def perturb(args: Any, dtypes: Any, seed: int = 0) -> Any:
    """`args` raised to float64 and each floating tensor moved by up to one rounding of its own dtype."""
    gen = torch.Generator().manual_seed(seed)

    def move(x: Any, dtype: Any) -> Any:
        if not (torch.is_tensor(x) and x.is_floating_point()):
            return _upcast(x)
        x64 = x.detach().to(float64_device(x.device), torch.float64)
        noise = torch.rand(x64.shape, generator=gen, dtype=torch.float64).to(x64.device) * 2 - 1
        return x64 * (1 + noise * torch.finfo(dtype).eps)

    return _zip_map(move, args, dtypes)


def _zip_map(fn: Any, values: Any, dtypes: Any) -> Any:
    if isinstance(values, (list, tuple)):
        return type(values)(_zip_map(fn, v, d) for v, d in zip(values, dtypes))
    if isinstance(values, dict):
        return {k: _zip_map(fn, v, dtypes[k]) for k, v in values.items()}
    return fn(values, dtypes)


def _dtypes(values: Any) -> Any:
    return tree_map(lambda x: x.dtype if torch.is_tensor(x) else None, values)


def sensitivity_of(ref: Any, moved: Any) -> float:
    """The largest norm-wise relative change between float64 outputs `ref` and `moved` (non-finite: inf)."""
    worst = 0.0
    for r, m in zip(tensors_of(ref), tensors_of(moved)):
        if not r.is_floating_point() or r.numel() == 0:
            continue
        if not bool(torch.isfinite(m).all()) and bool(torch.isfinite(r).all()):
            return math.inf
        worst = max(worst, _relative(m, r))
    return worst


def check_op(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[str | None, float | None, float]:
    """Compare `out` (the op's output as run) with float64 on the same inputs; see `compare_with_reference`.

    The problem is "ill-conditioned" (not a fault) when one rounding of the inputs moves the float64
    result by more than ILL_CONDITIONED; the error is then that relative change. One exception: a gross
    error (GROSS_ERROR or more: the output no nearer float64 than zeros are) on bf16/fp16 inputs is judged
    against one rounding of float32, the precision their kernels compute in (a bf16 attention backward
    takes the forward's rounded output as an input, and moving it by one bf16 rounding swings the exact
    gradient by several times its size: the kernel, which computes from the output it is given, is not
    that uncertain; measured: 3e-4 from float64 on a healthy llama step, where one bf16 rounding moved the
    result by 1e-2 and, on another call, by 7.8x)."""
    ref = func(*tree_map(_upcast, args), **tree_map(_upcast, kwargs))
    problem, err, tol = compare_with_reference(out, ref)
    if problem is None:
        return problem, err, tol
    dtypes = _dtypes((args, kwargs))
    worst, change = _sensitivity(func, args, kwargs, ref, dtypes)
    if worst is None:
        return problem, err, tol
    if change > ILL_CONDITIONED and (problem == "non-finite" or (err or 0.0) >= GROSS_ERROR):
        computed = tree_map(lambda d: torch.float32 if d in (torch.bfloat16, torch.float16) else d, dtypes)
        if computed != dtypes:
            worst, change = _sensitivity(func, args, kwargs, ref, computed)
            if worst is None:
                return problem, err, tol
    if change > ILL_CONDITIONED:
        return "ill-conditioned", change, ILL_CONDITIONED
    return compare_with_reference(out, ref, worst)


def _sensitivity(func: Any, args: tuple, kwargs: dict, ref: Any, dtypes: Any) -> tuple[Any, float]:
    """The float64 outputs for the inputs moved by one rounding of `dtypes` that differ most from `ref`, and
    that difference (see `sensitivity_of`); (None, inf) when the op fails on moved inputs."""
    sensitivities = []
    for seed in range(SENSITIVITY_SAMPLES):
        moved = perturb((args, kwargs), dtypes, seed)
        try:
            sensitivities.append(func(*moved[0], **moved[1]))
        except Exception:
            return None, math.inf
    worst = max(sensitivities, key=lambda s: sensitivity_of(ref, s))
    return worst, sensitivity_of(ref, worst)


def misbehaves(func: Any, args: tuple, kwargs: dict) -> str | None:
    """How `func` on these inputs differs from float64 (raises, non-finite, diverges), or None."""
    try:
        fast = func(*args, **kwargs)
    except Exception:
        return "raises"
    try:
        problem = check_op(func, args, kwargs, fast)[0]
    except Exception:
        return None  # no float64 kernel: nothing to compare with
    return None if problem == "ill-conditioned" else problem


def in_backward(fn: Any) -> Any:
    """`fn()` called while autograd runs a backward node (as an operator of a backward pass sees it)."""
    result: list[Any] = []

    class _Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            result.append(fn())
            return grad

    _Node.apply(torch.zeros((), requires_grad=True)).backward()
    return result[0]
