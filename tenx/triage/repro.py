"""The minimal reproduction of a faulty operator that `tenx triage` writes: its inputs, arguments and a script.

The folder holds inputs.safetensors (the operator's tensor inputs, sliced to the smallest part that still
misbehaves), repro.json (the operator's name, its other arguments, the run's op-bug faults and whether it
ran in a backward pass) and repro.py, which runs it as the run did and in float64 and says how they differ.
Nothing in it is unpickled or executed from the data: the operator is looked up by name among aten's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tenx.errors import TenxError
from tenx.rundir import REPRO_INPUTS, REPRO_META, REPRO_SCRIPT
from tenx.triage.opcheck import in_backward, misbehaves, op_name
from tenx.utils.io import atomic_write_bytes, atomic_write_text

REPRO_SOURCE = '''"""Minimal reproduction of a faulty operator found by `tenx triage` (inputs in inputs.safetensors).

Runs the operator on its recorded inputs as the run did (with the library as the run had it) and on the
same inputs in float64, and prints how they differ. Exit status 1: it still misbehaves.
"""

import sys
from pathlib import Path

from tenx.triage.repro import run_repro

sys.exit(run_repro(Path(__file__).parent))
'''


def write_repro(
    out_dir: Path,
    func: Any,
    args: tuple,
    kwargs: dict,
    op_bugs: list[str],
    run_dir: str,
    phase: str = "forward",
) -> Path:
    """Write the operator's tensor inputs (safetensors), its other arguments (JSON) and a script."""
    from safetensors.torch import save

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, spec = {}, []
    for i, a in enumerate(args):
        if torch.is_tensor(a):
            tensors[f"arg{i}"] = a.detach().contiguous().cpu()
            spec.append({"tensor": f"arg{i}"})
        else:
            spec.append({"value": a if isinstance(a, (int, float, bool, str, type(None))) else repr(a)})
    atomic_write_bytes(out_dir / REPRO_INPUTS, save(tensors))
    meta = {
        "op": op_name(func),
        "args": spec,
        "kwargs": {k: v for k, v in kwargs.items() if isinstance(v, (int, float, bool, str, type(None)))},
        "op_bugs": op_bugs,
        "run_dir": run_dir,
        "phase": phase,
    }
    atomic_write_text(out_dir / REPRO_META, json.dumps(meta, indent=1))
    atomic_write_text(out_dir / REPRO_SCRIPT, REPRO_SOURCE)
    return out_dir / REPRO_SCRIPT


def run_repro(folder: Path) -> int:
    """Body of repro.py: 1 when the operator still misbehaves on its inputs, else 0."""
    import contextlib

    from safetensors.torch import load_file

    from tenx.train.callbacks.faults import parse_fault
    from tenx.train.callbacks.opbug import OpBug

    meta = json.loads((folder / REPRO_META).read_text())
    name = str(meta["op"])
    parts = name.split(".")
    if len(parts) not in (2, 3) or parts[0] != "aten" or not all(p.isidentifier() for p in parts):
        raise TenxError(f"{folder / REPRO_META}: op {name!r} is not an aten operator name")
    packet = getattr(torch.ops.aten, parts[1])
    func = getattr(packet, parts[2] if len(parts) == 3 else "default")
    tensors = load_file(str(folder / REPRO_INPUTS))
    args = tuple(tensors[a["tensor"]] if "tensor" in a else a.get("value") for a in meta["args"])
    with contextlib.ExitStack() as stack:
        for text in meta.get("op_bugs", []):
            spec = parse_fault(text)
            stack.enter_context(OpBug(spec.run, spec.op))
        kwargs = dict(meta.get("kwargs", {}))
        if meta.get("phase") == "backward":  # as the run ran it: inside a backward pass
            problem = in_backward(lambda: misbehaves(func, args, kwargs))
        else:
            problem = misbehaves(func, args, kwargs)
    print(f"{name} on {folder / REPRO_INPUTS}: " + (problem or "agrees with float64"))
    return 1 if problem else 0
