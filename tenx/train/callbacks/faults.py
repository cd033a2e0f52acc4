"""Fault injection for tests and drills: make a run crash, die, hang, diverge or lose data on purpose.

A fault is `KIND@step=N[,option=value...]` (fires when step N is about to run) or `KIND@p=P[,...]`
(fires at each step with probability P, drawn from `faults.seed` and the step number, so the same
seed gives the same faults). Every fault fires at most once per step over the whole run, restarts
included: before it takes effect it is written (fsynced) to RUN_DIR/events.jsonl, and a restarted
process reads that log and does not fire it again. So a `sigkill@step=30` kills the run once, and the
supervised restart replays step 30 normally.

Kinds:
  crash               raise an exception (the process exits with status 1)
  sigkill             SIGKILL this process; with `phase=save`, during the checkpoint save of step N,
                      after its files are written and before it is published
  hang                stop making progress (sleep forever; the watchdog notices)
  nan                 make the step's loss non-finite (the logits become NaN)
  spike               multiply the step's logits by `factor` (default 100): its loss and gradients spike
  corrupt-checkpoint  damage the newest checkpoint's largest file (of either tier, disk or memory)
  corrupt-shard       damage a training shard's bytes (the data directory is modified: drill on a copy)
                      and make the loader reopen its shards, as a restarted process would
  slow                sleep `seconds` (default 1.0) before the step: a straggler
  bitflip             flip one bit of one parameter on one rank (silent data corruption; the replica
                      consistency checks of tenx/parallel/consistency.py should name the rank)
  op-bug              from step N on, a library op is wrong on a rare data-dependent condition (the
                      cross-entropy's reduction, when the targets hold a run of `run` identical ids,
                      default 12): a spike, a NaN or a crash depending on the data; or, with
                      `op=layer_norm_backward|sdpa_backward|mm_backward`, a backward kernel whose fast
                      path flips its gradients' sign: the run diverges (tenx/train/callbacks/opbug.py)

Options: `count=C` (also fire at the C-1 following steps), `factor=F` (spike), `seconds=S` (slow,
hang), `phase=step|save` (sigkill), `shard=I` (corrupt-shard: index in the split, default the shard
holding the next training window), `rank=R` (only rank R fires; default 0), and for bitflip
`param=NAME` (a name of `model.named_parameters()`), `index=I` (an element of its local shard) and
`bit=B` (default 20: a float32 mantissa bit, so the loss barely moves); the parameter and element
not given are drawn from `faults.seed` and the step.

The injector is a Callback beside the trainer: it acts from `on_step_start` (bitflip included),
through a forward hook on the model for nan/spike, and from `post_checkpoint_saved` for saves. The math is never edited for it.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tenx.config import field
from tenx.errors import ConfigError
from tenx.train.hooks import Callback, TrainerView
from tenx.utils.tensors import local_tensor

if TYPE_CHECKING:
    import torch


KINDS = (
    "crash",
    "sigkill",
    "hang",
    "nan",
    "spike",
    "corrupt-checkpoint",
    "corrupt-shard",
    "slow",
    "bitflip",
    "op-bug",
)
_OPTIONS: dict[str, type] = {
    "count": int,
    "factor": float,
    "seconds": float,
    "phase": str,
    "shard": int,
    "rank": int,
    "param": str,
    "bit": int,
    "index": int,
    "run": int,
    "op": str,
}
_BITFLIP_OPTIONS = ("param", "bit", "index")


class InjectedFault(RuntimeError):
    """The exception a `crash` fault raises."""


@dataclass
class FaultConfig:
    """Faults to inject on purpose (drills and tests); empty in real runs."""

    inject: list[str] = field(
        default_factory=list, help="fault specs KIND@step=N[,opt=v] or KIND@p=P (see docs/fault-tolerance.md)"
    )
    seed: int = field(0, ge=0, help="seed of the random (p=P) faults")

    def validate(self) -> None:
        """Parse every spec; the error names the bad one."""
        for i, text in enumerate(self.inject):
            parse_fault(text, f"faults.inject[{i}]")


@dataclass(frozen=True)
class FaultSpec:
    """One parsed fault: what, when (a step or a probability), and its options."""

    text: str
    kind: str
    step: int | None = None
    p: float | None = None
    count: int = 1
    factor: float = 100.0
    seconds: float = 1.0
    phase: str = "step"
    shard: int | None = None
    rank: int = 0
    param: str | None = None
    bit: int = 20
    index: int | None = None
    run: int = 12
    op: str = "nll_loss"
    """op-bug: which op is planted (tenx.train.callbacks.opbug.PLANTED_OPS)."""

    def fires_at(self, step: int, seed: int, index: int) -> bool:
        """Whether this fault is due when `step` is about to run (or be saved, for phase=save)."""
        if self.step is not None:
            return self.step <= step < self.step + self.count
        assert self.p is not None
        return random.Random(f"tenx-fault:{seed}:{index}:{step}").random() < self.p


def parse_fault(text: str, where: str = "--fault") -> FaultSpec:
    """Parse `KIND@step=N[,opt=v...]` or `KIND@p=P[,...]`; ConfigError names the problem."""
    usage = f"{where}: {text!r} is not a fault spec; expected KIND@step=N[,option=value] or KIND@p=P"
    kind, sep, rest = text.strip().partition("@")
    if not sep or not rest:
        raise ConfigError(usage)
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown fault kind {kind!r}; choose one of {', '.join(KINDS)}")
    values: dict[str, Any] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq:
            raise ConfigError(usage)
        if key in ("step", "p"):
            conv: type = int if key == "step" else float
        elif key in _OPTIONS:
            conv = _OPTIONS[key]
        else:
            raise ConfigError(
                f"{where}: unknown option {key!r} in {text!r}; options: step, p, {', '.join(_OPTIONS)}"
            )
        try:
            values[key] = conv(value.strip())
        except ValueError:
            raise ConfigError(f"{where}: {key}={value!r} in {text!r} is not a {conv.__name__}") from None
    if ("step" in values) == ("p" in values):
        raise ConfigError(f"{where}: {text!r} needs exactly one of step=N and p=P")
    if "step" in values and values["step"] < 1:
        raise ConfigError(f"{where}: step must be >= 1 in {text!r}")
    if "p" in values and not 0.0 <= values["p"] <= 1.0:
        raise ConfigError(f"{where}: p must be within [0, 1] in {text!r}")
    if values.get("count", 1) < 1:
        raise ConfigError(f"{where}: count must be >= 1 in {text!r}")
    if values.get("phase", "step") not in ("step", "save"):
        raise ConfigError(f"{where}: phase must be 'step' or 'save' in {text!r}")
    if values.get("phase") == "save" and kind != "sigkill":
        raise ConfigError(f"{where}: phase=save is only for sigkill, in {text!r}")
    misplaced = [k for k in _BITFLIP_OPTIONS if k in values and kind != "bitflip"]
    if misplaced:
        raise ConfigError(f"{where}: {', '.join(misplaced)} is only for bitflip, in {text!r}")
    if "run" in values and kind != "op-bug":
        raise ConfigError(f"{where}: run is only for op-bug, in {text!r}")
    if "run" in values and values.get("op", "nll_loss") != "nll_loss":
        raise ConfigError(f"{where}: run is only for op-bug's default op (nll_loss), in {text!r}")
    if "op" in values:
        from tenx.train.callbacks.opbug import PLANTED_OPS

        if kind != "op-bug":
            raise ConfigError(f"{where}: op is only for op-bug, in {text!r}")
        if values["op"] not in PLANTED_OPS:
            raise ConfigError(
                f"{where}: op={values['op']!r} in {text!r} is not a planted op; choose one of "
                + ", ".join(PLANTED_OPS)
            )
    if kind == "op-bug" and "step" not in values:
        raise ConfigError(f"{where}: op-bug takes step=N (the step from which the op is wrong), in {text!r}")
    if values.get("run", 2) < 2:
        raise ConfigError(f"{where}: run must be >= 2 in {text!r}")
    if not 0 <= values.get("bit", 0) < 64:
        raise ConfigError(f"{where}: bit must be within [0, 64) in {text!r}")
    if values.get("index", 0) < 0:
        raise ConfigError(f"{where}: index must be >= 0 in {text!r}")
    if kind in ("slow", "hang") and "seconds" not in values:
        values["seconds"] = 1.0 if kind == "slow" else math.inf
    return FaultSpec(text=text, kind=kind, **values)


def damage_file(path: Path, nbytes: int = 64) -> None:
    """Flip `nbytes` bytes in the middle of `path`, in place (keeps its size)."""
    size = path.stat().st_size
    if size == 0:
        path.write_bytes(b"\xff" * nbytes)
        return
    start = max(0, size // 2 - nbytes // 2)
    with open(path, "r+b") as f:
        f.seek(start)
        chunk = f.read(nbytes)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in chunk))
        f.flush()
        os.fsync(f.fileno())


class FaultInjector(Callback):
    """Fires the configured faults at their steps; records each in events.jsonl before it acts."""

    name = "faults"

    def __init__(self, specs: list[FaultSpec], seed: int = 0) -> None:
        self.specs = specs
        self.seed = seed
        self._fired: set[tuple[str, int]] = set()
        self._hooks: list[Any] = []
        self._op_bugs: list[Any] = []
        """OpBug modes entered for the current step (op-bug faults stay armed from their step on)."""

    # -- bookkeeping -------------------------------------------------------------------------------
    def on_train_start(self, trainer: TrainerView) -> None:
        from tenx.monitor.events import read_events

        self._fired = {
            (e["fault"], int(e["step"]))
            for e in read_events(trainer.run_dir)
            if e.get("kind") == "fault" and e.get("step") is not None
        }

    def _due(self, trainer: TrainerView, step: int, phase: str) -> list[FaultSpec]:
        due = []
        for i, spec in enumerate(self.specs):
            if spec.phase != phase or spec.rank != trainer.rank or (spec.text, step) in self._fired:
                continue
            if spec.fires_at(step, self.seed, i):
                due.append(spec)
        return due

    def _record(self, trainer: TrainerView, spec: FaultSpec, step: int, **fields: Any) -> None:
        self._fired.add((spec.text, step))
        trainer.events.emit("fault", step, fault=spec.text, fault_kind=spec.kind, **fields)

    # -- the faults --------------------------------------------------------------------------------
    def on_step_start(self, trainer: TrainerView) -> None:
        step = trainer.step + 1
        for spec in self._due(trainer, step, "step"):
            self._fire(trainer, spec, step)
        self._arm_op_bugs(trainer, step)

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._disarm_op_bugs()

    def on_error(self, trainer: TrainerView, error: BaseException) -> None:
        self._disarm_op_bugs()

    def close(self, trainer: TrainerView) -> None:
        self._disarm_op_bugs()

    def _arm_op_bugs(self, trainer: TrainerView, step: int) -> None:
        """Enter the OpBug mode of every op-bug fault armed by now (recorded once, when first armed)."""
        from tenx.train.callbacks.opbug import OpBug

        if self._op_bugs:
            return  # still entered: the previous step was not committed and is taken again
        for spec in self.specs:
            if spec.kind != "op-bug" or spec.step is None or step < spec.step:
                continue
            if not any(text == spec.text for text, _ in self._fired):
                self._record(trainer, spec, step, run=spec.run, op=spec.op)
            mode = OpBug(spec.run, spec.op)
            mode.__enter__()
            self._op_bugs.append(mode)

    def _disarm_op_bugs(self) -> None:
        while self._op_bugs:
            self._op_bugs.pop().__exit__(None, None, None)

    def _fire(self, trainer: TrainerView, spec: FaultSpec, step: int) -> None:
        kind = spec.kind
        if kind == "op-bug":
            return  # armed in _arm_op_bugs, for every step from spec.step on
        if kind == "crash":
            self._record(trainer, spec, step)
            raise InjectedFault(f"injected crash at step {step} ({spec.text})")
        if kind == "sigkill":
            self._record(trainer, spec, step)
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            self._record(trainer, spec, step, seconds=spec.seconds)
            deadline = time.monotonic() + spec.seconds
            while time.monotonic() < deadline:
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        elif kind == "slow":
            self._record(trainer, spec, step, seconds=spec.seconds)
            time.sleep(spec.seconds)
        elif kind in ("nan", "spike"):
            factor = math.nan if kind == "nan" else spec.factor
            self._record(trainer, spec, step, factor=factor)
            # the last hidden state scaled is the logits scaled (they are its product with the output
            # weight), and the loss the model's forward computes from them sees it
            final_norm = trainer.raw_model.final_norm
            self._hooks.append(final_norm.register_forward_hook(_scale_output(factor)))
        elif kind == "corrupt-checkpoint":
            from tenx.checkpoint import list_checkpoints

            found = []
            for checkpointer in (trainer.checkpointer, trainer.memory_checkpointer):
                if checkpointer is not None:
                    checkpointer.wait()
                    found += list_checkpoints(checkpointer.root)
            if not found:
                self._record(trainer, spec, step, damaged=None, note="no checkpoint yet")
                return
            newest = max(found)[1]  # the newest of both tiers
            target = max((p for p in newest.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
            self._record(trainer, spec, step, damaged=str(target))
            damage_file(target)
        elif kind == "corrupt-shard":
            stream = trainer.train_stream
            shards = stream.manifest["splits"][stream.split]["shards"]
            index = spec.shard
            if index is None:  # the shard the run is reading now
                recent = trainer.loader.last_windows
                file = stream.locate(recent[0] * trainer.model_cfg.seq_len)[0] if recent else None
                index = next((i for i, s in enumerate(shards) if s["file"] == file), 0)
            if not 0 <= index < len(shards):
                raise ConfigError(f"{spec.text}: shard={index}, but the split has {len(shards)} shards")
            target = stream.data_dir / shards[index]["file"]
            self._record(trainer, spec, step, damaged=str(target))
            damage_file(target)
            stream.reopen()
        elif kind == "bitflip":
            self._flip_bit(trainer, spec, step)

    def _flip_bit(self, trainer: TrainerView, spec: FaultSpec, step: int) -> None:
        """Flip bit `spec.bit` of one element of one parameter's local shard, in place."""
        import torch

        params = dict(trainer.raw_model.named_parameters())
        rng = random.Random(f"tenx-bitflip:{self.seed}:{step}")
        if spec.param is None:
            name = rng.choice([n for n, p in params.items() if local_tensor(p).numel() > 0])
        elif spec.param in params:
            name = spec.param
        else:
            some = ", ".join(list(params)[:6])
            raise ConfigError(f"{spec.text}: no parameter {spec.param!r}; parameters include {some}, ...")
        local = local_tensor(params[name]).detach()
        width = 8 * local.element_size()
        if spec.bit >= width:
            raise ConfigError(f"{spec.text}: bit={spec.bit}, but {name} is {local.dtype} ({width} bits)")
        index = spec.index if spec.index is not None else rng.randrange(max(1, local.numel()))
        if not 0 <= index < local.numel():
            raise ConfigError(f"{spec.text}: index={index}, but {name} has {local.numel()} elements here")
        ints = local.view(-1).view(
            {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width // 8]
        )
        mask = 1 << spec.bit if spec.bit < width - 1 else -(1 << spec.bit)  # the sign bit, as a signed int
        before = local.view(-1)[index].item()
        with torch.no_grad():
            flipped = ints[index : index + 1] ^ mask
            after = flipped.view(local.dtype).item()
            self._record(
                trainer,
                spec,
                step,
                param=name,
                index=index,
                bit=spec.bit,
                rank=trainer.rank,
                before=before,
                after=after,
            )
            ints[index : index + 1] = flipped

    def post_checkpoint_saved(self, trainer: TrainerView, tmp_dir: Path, step: int) -> None:
        """A save of `step` is complete but unpublished: a `sigkill@...,phase=save` fault fires here."""
        for spec in self._due(trainer, step, "save"):
            self._record(trainer, spec, step, phase="save", tmp_dir=str(tmp_dir))
            os.kill(os.getpid(), signal.SIGKILL)


def _scale_output(factor: float):
    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output * factor

    return hook


def build_injector(cfg: FaultConfig) -> FaultInjector | None:
    """The injector for `cfg`, or None when no faults are configured."""
    if not cfg.inject:
        return None
    return FaultInjector([parse_fault(t, f"faults.inject[{i}]") for i, t in enumerate(cfg.inject)], cfg.seed)
