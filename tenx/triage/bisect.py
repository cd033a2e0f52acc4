"""Numerics bisection: run a step on the path it was trained on, check every operator against float64.

Each operator the step's forward and backward dispatch (seen through a `TorchDispatchMode`) is run as
trained, then run again on the same inputs raised to float64 (the reference path: no fast path, no reduced
precision). An operator is *faulty* when it raises, when it returns non-finite values where float64 is
finite, or when its output differs from float64 by more than its dtype's tolerance (norm-wise relative
error). Comparing each operator on its own inputs, rather than two whole runs, keeps rounding from
accumulating: the first faulty operator is the culprit, not the last one a divergence reached.

An operator is only judged on inputs whose result its dtype can deliver: when moving its inputs by one
rounding of their dtype moves the float64 result by more than `ILL_CONDITIONED` (relative), no kernel in
that dtype can be held to float64 there (attention on a diverged model's huge activations: a saturated
softmax, an intermediate that overflows), so the operator is noted as ill-conditioned, not faulty, and the
check goes on. Whether the step's inputs are ones a healthy run produces is the verdict's question
(tenx.triage.classify compares the reference path's loss with the run's first steps).

For the culprit the report gives its module path (or the innermost source frame outside the model), its
inputs' shapes, dtypes and strides, and a property of the data that triggers it: the operator is re-run on
ever smaller slices of its inputs along their shared leading dimension until the smallest slice that still
misbehaves is found, and that slice is described (a run of identical ids, non-finite values, ...). Its
inputs and a short script are written as a minimal reproduction. The whole step is also run on the
reference path (float64 model, math attention), whose loss and gradient norm say whether the anomaly
exists in exact arithmetic too (an ML or data cause) or only on the fast path (a library op).
"""

from __future__ import annotations

import math
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from tenx.train.callbacks.record import frame_name
from tenx.triage.opcheck import check_op, in_backward, misbehaves, op_name, tensors_of
from tenx.triage.outcome import StepOutcome
from tenx.triage.replay import Replayer
from tenx.triage.repro import write_repro

_SKIP = {
    "aten._to_copy",
    "aten.clone",
    "aten.copy_",
    "aten.detach",
    "aten.lift_fresh",
    "aten.empty_like",
    "aten.empty_strided",
    "aten.new_empty",
    "aten.new_empty_strided",
    "aten.zeros_like",
    "aten.ones_like",
    "aten.fill_",
    "aten.zero_",
}


@dataclass
class OpFinding:
    """The first faulty operator of a step."""

    index: int
    """Its position among the step's dispatched operators."""
    op: str
    phase: str
    """forward or backward"""
    module: str
    """The model module it ran in (forward), the autograd node (backward), or the innermost source frame."""
    location: str
    problem: str
    """raises, non-finite or diverges"""
    error: float | None
    tolerance: float
    message: str
    inputs: list[dict[str, Any]]
    """shape, dtype and strides of each tensor argument"""
    property: dict[str, Any] | None = None
    """The data that triggers it (see `data_property`)."""


@dataclass
class BisectReport:
    """The result of `bisect_step`."""

    run_dir: str
    step: int
    ops_checked: int
    first: OpFinding | None
    trained: StepOutcome
    reference: StepOutcome
    recorded: StepOutcome | None
    repro: str | None
    seconds: float
    notes: list[str] = field(default_factory=list)
    ill_conditioned: dict[str, int] = field(default_factory=dict)
    """Operators not judged (op -> calls): one rounding of their inputs moves their exact result by more
    than ILL_CONDITIONED."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        lines = [f"tenx triage: step {self.step} of {self.run_dir}: {self.ops_checked} operators checked"]
        lines.append(f"  trained path   : {self.trained.describe()}")
        lines.append(f"  reference path : {self.reference.describe()} (float64)")
        f = self.first
        if f is None:
            lines.append("  no operator differs from float64 beyond its tolerance")
        else:
            err = f" (error {f.error:.3g}, tolerance {f.tolerance:g})" if f.error is not None else ""
            lines.append(f"  first faulty operator: {f.op} [{f.phase}] in {f.module}: {f.problem}{err}")
            lines.append(f"    at {f.location}")
            for i, t in enumerate(f.inputs):
                lines.append(f"    input {i}: {t['dtype']} {t['shape']} strides {t['strides']}")
            if f.property:
                lines.append(f"    triggered by: {f.property['text']}")
        if self.ill_conditioned:
            ops = ", ".join(f"{op} x{n}" for op, n in sorted(self.ill_conditioned.items()))
            lines.append(
                f"  not judged (inputs leave the exact result undetermined at their precision): {ops}"
            )
        if self.repro:
            lines.append(f"  minimal reproduction: {self.repro}")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  {self.seconds:.1f} s")
        return "\n".join(lines)


class OpChecker(TorchDispatchMode):
    """Checks every dispatched operator against float64 until the first faulty one (see module doc)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.count = 0
        self.first: OpFinding | None = None
        self.first_call: tuple[Any, tuple, dict] | None = None
        self.ill_conditioned: Counter[str] = Counter()
        """Operators passed over because their inputs leave their result undetermined (ILL_CONDITIONED)."""
        self.worst_conditioning = 0.0
        self._modules: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> OpChecker:
        for name, module in self.model.named_modules():
            label = name or "model"
            self._handles.append(
                module.register_forward_pre_hook(lambda m, a, n=label: self._modules.append(n))
            )
            self._handles.append(module.register_forward_hook(lambda m, a, o: self._pop()))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    def _pop(self) -> None:
        if self._modules:
            self._modules.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = op_name(func)
        check = self.first is None and name not in _SKIP and not func.is_view and not func._schema.is_mutable
        saved = (
            tree_map(lambda x: x.detach().clone() if torch.is_tensor(x) else x, (args, kwargs))
            if check
            else None
        )
        self.count += 1
        try:
            out = func(*args, **kwargs)
        except Exception as error:
            if check and saved is not None:
                self._found(func, name, saved, "raises", None, 0.0, f"{type(error).__name__}: {error}")
            raise
        if not check or saved is None or not any(t.is_floating_point() for t in tensors_of(out)):
            return out
        try:
            problem, err, tol = check_op(func, saved[0], saved[1], out)
        except Exception:
            return out  # this operator has no float64 kernel: unchecked
        if problem == "ill-conditioned":
            self.ill_conditioned[name] += 1
            self.worst_conditioning = max(self.worst_conditioning, err or 0.0)
        elif problem:
            self._found(func, name, saved, problem, err, tol, f"{problem} against float64")
        return out

    def _found(
        self, func: Any, name: str, saved: Any, problem: str, err: float | None, tol: float, message: str
    ) -> None:
        node = torch._C._current_autograd_node()
        phase = "backward" if node is not None else "forward"
        location = _source_location()
        if node is not None:
            module = node.name()
        elif self._modules and self._modules[-1] != "model":
            module = self._modules[-1]
        else:
            module = location
        args, kwargs = saved
        self.first = OpFinding(
            index=self.count,
            op=name,
            phase=phase,
            module=module,
            location=location,
            problem=problem,
            error=err,
            tolerance=tol,
            message=message,
            inputs=[
                {
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).replace("torch.", ""),
                    "strides": list(t.stride()),
                }
                for t in tensors_of(list(args))
            ],
        )
        self.first_call = (func, args, kwargs)


def _source_location() -> str:
    """The innermost frame of tenx's model or loss code (else of any tenx code) on the current stack."""
    frames = [f for f in traceback.extract_stack() if "/tenx/" in f.filename and "/triage/" not in f.filename]
    model = [f for f in frames if "/tenx/model/" in f.filename]
    pick = (model or frames or traceback.extract_stack())[-1]
    return frame_name(pick.filename, pick.lineno, pick.name)


def _arg_name(func: Any, i: int) -> str:
    """The schema name of argument `i` of an operator (e.g. `target`), else `input i`."""
    arguments = getattr(getattr(func, "_schema", None), "arguments", [])
    return str(arguments[i].name) if i < len(arguments) else f"input {i}"


def slice_inputs(args: tuple, lo: int, hi: int) -> tuple:
    """`args` with rows lo..hi of every tensor that shares the first tensor's leading dimension."""
    tensors = [a for a in args if torch.is_tensor(a) and a.dim() >= 1]
    if not tensors:
        return args
    n = tensors[0].shape[0]
    return tuple(a[lo:hi] if torch.is_tensor(a) and a.dim() >= 1 and a.shape[0] == n else a for a in args)


def data_property(func: Any, args: tuple, kwargs: dict, seq_len: int | None = None) -> dict[str, Any] | None:
    """The smallest slice of the inputs (along their shared leading dimension) on which `func` still
    misbehaves, and what distinguishes it; None when the whole input is needed."""
    tensors = [a for a in args if torch.is_tensor(a) and a.dim() >= 1]
    if not tensors:
        return None
    n = tensors[0].shape[0]
    sliced = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.dim() >= 1 and a.shape[0] == n]

    def bad(lo: int, hi: int) -> bool:
        return misbehaves(func, slice_inputs(args, lo, hi), kwargs) is not None

    if n < 2 or not bad(0, n):
        return None
    lo, hi = 0, n
    a, b = 1, n  # smallest hi with bad(0, hi)
    while a < b:
        mid = (a + b) // 2
        if bad(0, mid):
            b = mid
        else:
            a = mid + 1
    hi = a
    a, b = 0, hi - 1  # largest lo with bad(lo, hi)
    while a < b:
        mid = (a + b + 1) // 2
        if bad(mid, hi):
            a = mid
        else:
            b = mid - 1
    lo = a
    prop: dict[str, Any] = {"start": lo, "end": hi, "length": hi - lo, "argument": None}
    for i in sliced:
        part = args[i][lo:hi]
        if hi - lo < 2:
            continue
        if not part.is_floating_point() and bool((part == part.reshape(-1)[0]).all()):
            value = int(part.reshape(-1)[0])
            prop.update(kind="identical-run", argument=i, name=_arg_name(func, i), value=value)
            prop["text"] = (
                f"a run of {hi - lo} identical values ({value}) in `{prop['name']}` of {op_name(func)}; a "
                "shorter run does not trigger it"
            )
            break
        if part.is_floating_point() and not bool(torch.isfinite(part).all()):
            prop.update(kind="non-finite-input", argument=i, text=f"non-finite values in input {i}")
            break
        if part.is_floating_point() and part.dim() >= 2 and bool((part == part[:1]).all()):
            prop.update(kind="identical-rows", argument=i, text=f"{hi - lo} identical rows in input {i}")
            break
    else:
        prop.update(kind="slice", text=f"rows {lo}..{hi} of the inputs (no simpler property found)")
    if seq_len:
        prop["positions"] = [divmod(lo, seq_len), divmod(hi - 1, seq_len)]
    return prop


def bisect_step(
    run_dir: str | Path,
    step: int,
    *,
    at_time: float | None = None,
    recorded: StepOutcome | None = None,
    repro_dir: Path | None = None,
) -> BisectReport:
    """Replay `step` on the trained path with every operator checked, then on the reference path."""
    t0 = time.perf_counter()
    replayer = Replayer(run_dir)
    recorded, windows, _, _ = replayer.prepare(step, at_time, recorded)
    snap = replayer.snapshot()
    assert replayer.model is not None
    checker = OpChecker(replayer.model)
    trained = replayer.run_step(step, windows, apply=False, capture=lambda: checker)
    replayer.restore(snap)
    replayer.to_reference()
    reference = replayer.run_step(step, windows, apply=False)
    notes = list(replayer.notes)
    if replayer.cfg.train.compile:
        notes.append("the run used torch.compile; operators were checked in eager mode on its precision")
    repro = None
    if checker.first is not None and checker.first_call is not None:
        func, args, kwargs = checker.first_call
        with replayer.library():
            find = lambda: data_property(func, args, kwargs, replayer.seq_len)  # noqa: E731
            checker.first.property = in_backward(find) if checker.first.phase == "backward" else find()
        prop = checker.first.property
        if prop is not None:  # the smallest slice that still misbehaves is the reproduction (kilobytes)
            args = slice_inputs(args, int(prop["start"]), int(prop["end"]))
        if repro_dir is not None:
            specs = [t for t in replayer.cfg.faults.inject if t.strip().startswith("op-bug@")]
            repro = str(write_repro(repro_dir, func, args, kwargs, specs, str(run_dir), checker.first.phase))
    if not math.isfinite(trained.loss or 0.0) and trained.loss is not None:
        notes.append("the trained path's loss is not finite")
    return BisectReport(
        run_dir=str(run_dir),
        step=step,
        ops_checked=checker.count,
        first=checker.first,
        trained=trained,
        reference=reference,
        recorded=recorded,
        repro=repro,
        seconds=time.perf_counter() - t0,
        notes=notes,
        ill_conditioned=dict(checker.ill_conditioned),
    )
