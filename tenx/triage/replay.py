"""Exact replay of one training step: `tenx replay RUN_DIR --step N [--repeat K]`.

The state before step N is rebuilt from the newest verified checkpoint before it that lies on the same
timeline (its loader position matches the step record of its step; before the first checkpoint: the
seeded initialisation, built by the trainer's own builder), then steps are re-executed deterministically
on the data positions recorded in RUN_DIR/steps.jsonl, with the guard's recorded decisions (a step the run
skipped is skipped again). A step is executed by the trainer's own step function (tenx/train/step.py), so
the two cannot drift apart. Step N is then run `repeat` times from that same state and each outcome (loss and gradient norm bits, digest,
or the exception and its innermost frame) is compared with the record:

- `reproduces`: every repeat equals the record bit for bit (deterministic: an ML or data cause, or a
  deterministic library bug);
- `does-not-reproduce`: the repeats agree with each other but not with the record (transient: hardware
  or environment); the first re-executed step that already differed from its record is named;
- `differs-between-repeats`: non-determinism, a race.

Data-parallel runs are replayed in one process: each rank's micro-batches are run in turn and their
gradients averaged as the all-reduce does. With 2 ranks this is bitwise (a sum of two floats does not
depend on order, and halving is exact); with more ranks the reduction order of the collective is not
known, and FSDP's sharded reduce-scatter is not reproduced bit for bit either: the report says so, and
outcomes are then compared within the precision's tolerance. Replica groups (torchft) are not replayed.

The op-bug fault is part of "the library the run used" and is installed again; every other fault is a
one-shot event (what replay exists to tell apart) and is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tenx import checkpoint as ckpt
from tenx import config as cfglib
from tenx import rundir as rd
from tenx.data.loader import TokenLoader, train_stream
from tenx.errors import CheckpointError, DataError, TenxError
from tenx.hardware import float64_device, pick_device
from tenx.model.transformer import Transformer
from tenx.train.callbacks.faults import parse_fault
from tenx.train.callbacks.opbug import OpBug
from tenx.train.callbacks.record import error_frames, read_steps, step_digest
from tenx.train.callbacks.stats import ModelProbe
from tenx.train.config import RunConfig, load_run_config
from tenx.train.distill import replay_teacher
from tenx.train.float8 import restore_plain_linears
from tenx.train.guard import StepGuard
from tenx.train.parts import build_model_parts, run_shape, validation_stream
from tenx.train.step import StepHooks, take_step, token_loss_dtype
from tenx.triage.outcome import ReplayReport, StepOutcome, outcome_of_record
from tenx.utils.io import read_json_object

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-9}
"""Relative tolerance for comparing a loss or gradient norm when a replay cannot be bitwise."""


class Replayer:
    """Rebuilds a run's training state in this process and re-executes its steps (see the module doc).

    `reference=True` builds the reference path instead: float64 parameters, no autocast, no compile,
    math attention; the op-bug, when the run had one, stays installed (the reference path is correct
    because it never takes the fast path). `capture`, when given, is a context manager factory wrapped
    around each step's forward and backward passes (tenx.triage.bisect uses it).
    """

    def __init__(self, run_dir: str | Path, *, reference: bool = False) -> None:
        self.rundir = rd.RunDir(run_dir)
        if not self.rundir.config.is_file():
            raise TenxError(f"{self.rundir.root}: no {rd.CONFIG}: not a tenx run directory")
        self.cfg: RunConfig = load_run_config(self.rundir.config)
        self.reference = reference
        self.notes: list[str] = []
        self.target_step: int | None = None
        """The step `prepare` rebuilt the state for; `step_lr` is its recorded learning rate."""
        self.step_lr: float | None = None
        self.step_threads: dict[int, int] = {}  # torch's CPU threads each step ran on, as recorded
        prov = read_json_object(self.rundir.provenance)
        tc = self.cfg.train
        threads = tc.threads or int(prov.get("hardware", {}).get("torch_threads") or 0)
        if threads:
            torch.set_num_threads(threads)  # a matmul's blocking, so its bits, may depend on it
        self.device = pick_device(tc.device, "train.device")
        precision = str(prov.get("precision", "float32"))
        self.amp_dtype = torch.float64 if reference else _DTYPES.get(precision, torch.float32)
        self.world_size = int(prov.get("world_size", 1))
        self.strategy = str(prov.get("strategy", "none"))
        if self.cfg.parallel.replicas.mode != "off":
            raise TenxError(
                f"{self.rundir.root}: the run used replica groups (parallel.replicas.mode="
                f"{self.cfg.parallel.replicas.mode!r}); replay covers single-process, DDP and FSDP runs"
            )
        self.stream = train_stream(self.cfg.data, self.cfg.model.seq_len, verify=True, on_corrupt="skip")
        self.shape = shape = run_shape(
            self.cfg, int(self.stream.manifest["tokenizer"]["vocab_size"]), self.world_size
        )
        self.model_cfg = shape.model_cfg
        self.seq_len, self.micro_batch = self.model_cfg.seq_len, tc.micro_batch
        self._check_unchanged(prov)
        tokenizer = self.stream.manifest["tokenizer"]  # a distilled run: its teacher, as run.json recorded it
        self.teacher = replay_teacher(self.cfg, prov, self.model_cfg, tokenizer, self.device)
        self.bitwise = not reference and (
            self.data_parallel <= 2 and self.strategy in ("none", "ddp", "single")
        )
        if self.data_parallel > 2:
            self.notes.append(
                f"{self.data_parallel} data-parallel ranks replayed in one process: the all-reduce's "
                "summation order is not reproduced, so outcomes are compared within tolerance"
            )
        if tc.compile:
            self.notes.append("the run used torch.compile; replayed eagerly, so compared within tolerance")
            self.bitwise = False
        if self.strategy == "fsdp":
            self.notes.append("FSDP's reduce-scatter is not reproduced bit for bit in one process")
            self.bitwise = False
        if self.device.type != str(prov.get("hardware", {}).get("device", self.device.type)).split(":")[0]:
            self.notes.append("replayed on a different device type than the run: not bitwise")
            self.bitwise = False
        self.op_bugs = [parse_fault(t) for t in self.cfg.faults.inject if t.strip().startswith("op-bug@")]
        self.records = [self._checked(i, r) for i, r in enumerate(read_steps(self.rundir.steps))]
        self.model: Transformer | None = None
        self.probe: ModelProbe | None = None  # the statistics' probe batch, built when a step needs it
        self.guard = StepGuard(self.cfg.guard)

    def _check_unchanged(self, prov: dict[str, Any]) -> None:
        """Refuse a run whose model config or data changed since it ran (run.json): replaying another model
        or other data would call a healthy step `does-not-reproduce`, a transient hardware fault's verdict."""
        ran, now = prov.get("model") or {}, cfglib.to_dict(self.model_cfg)
        for k in [k for k in sorted(set(ran) | set(now)) if ran and ran.get(k) != now.get(k)][:1]:
            raise TenxError(
                f"cannot replay {self.rundir.root}: model.{k} is {now.get(k)!r} in {rd.CONFIG} but the run "
                f"trained with {ran.get(k)!r} ({rd.PROVENANCE}): restore the config it trained with"
            )
        data = prov.get("data") or {}
        was = ((data.get("tokenizer") or {}).get("xxhash"), data.get("train_tokens", len(self.stream)))
        if data and was != (self.stream.manifest["tokenizer"].get("xxhash"), len(self.stream)):
            raise TenxError(
                f"cannot replay {self.rundir.root}: the data in {self.cfg.data.dir} changed since the run "
                f"trained on it (tokenizer, training tokens: {was}, now {len(self.stream)}): prepare it again "
                "as it was, or point data.dir at the data it trained on"
            )

    def _checked(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        """A step record whose fields have the types and ranges replay relies on; else TenxError naming it."""
        num_windows = (len(self.stream) - 1) // self.seq_len

        def bad(field: str) -> TenxError:
            return TenxError(
                f"{self.rundir.steps}: record {index + 1} (step {record.get('step')!r}) has a malformed "
                f"{field!r}; the file is damaged or was not written by tenx: replay needs its records"
            )

        for name in ("loss", "grad_norm"):
            value = record.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise bad(name)
            try:
                float(value)
            except ValueError:
                raise bad(name) from None
        windows = record.get("windows")
        if windows is not None and not (
            isinstance(windows, list)
            and all(
                isinstance(ids, list)
                and all(type(w) is int and 0 <= w < num_windows for w in ids)
                and len(ids) == self.micro_batch * self.data_parallel
                for ids in windows
            )
        ):
            raise bad("windows")
        position = record.get("position")
        if position is not None and not (
            isinstance(position, list)
            and len(position) == 2
            and all(type(x) is int and x >= 0 for x in position)
        ):
            raise bad("position")
        if type(record.get("skips", 0)) is not int or not isinstance(record.get("time", 0.0), (int, float)):
            raise bad("skips/time")
        return record

    @property
    def data_parallel(self) -> int:
        return self.shape.data_parallel

    @property
    def grad_accum(self) -> int:
        return self.shape.grad_accum

    @property
    def total_steps(self) -> int:
        return self.shape.total_steps

    # ----- state ------------------------------------------------------------------------------------
    def _fresh(self) -> None:
        """The run's initial state: seeded initialisation, built as build_parts builds it."""
        built = build_model_parts(self.cfg, self.model_cfg, self.device, teacher=self.teacher)
        self.trained = built  # what take_step runs on; the names below are the same objects
        self.model, self.optimizer, self.guard = built.raw_model, built.optimizer, built.guard
        self.step = 0

    def _load(self, path: Path) -> None:
        self._fresh()
        assert self.model is not None
        tensors: dict[str, Any] = {
            "model": get_model_state_dict(self.model),
            "optim": {"state": get_optimizer_state_dict(self.model, self.optimizer)["state"]},
            "rng": {"torch": torch.get_rng_state()},
        }
        meta = ckpt.load_checkpoint(path, tensors, verify=True, require=("model", "optim_param_groups"))
        set_model_state_dict(self.model, tensors["model"])
        set_optimizer_state_dict(
            self.model,
            self.optimizer,
            {"state": tensors["optim"]["state"], "param_groups": meta["optim_param_groups"]},
        )
        torch.set_rng_state(tensors["rng"]["torch"])
        self.guard.load_state_dict(meta.get("guard", {}))
        self.step = int(meta["step"])

    def timeline(self, step: int, before: float | None = None) -> dict[int, dict[str, Any]]:
        """Step -> record, for the steps before `step` on the timeline that led to it (see module doc)."""
        chain: dict[int, dict[str, Any]] = {}
        for record in self.records:
            if before is not None and float(record.get("time", 0.0)) >= before:
                break
            if record["step"] < step:
                chain[record["step"]] = record
                for later in [s for s in chain if s > record["step"]]:
                    del chain[later]  # a rollback or a restart: later steps are taken again
        return chain

    def record_of(self, step: int, after: float | None = None) -> dict[str, Any] | None:
        """The record of `step`: the first written at or after `after`, else the last one."""
        found = [r for r in self.records if r["step"] == step]
        if after is not None:
            later = [r for r in found if float(r.get("time", 0.0)) >= after - 1e-3]
            return later[0] if later else None
        return found[-1] if found else None

    def rebuild(self, step: int, chain: dict[int, dict[str, Any]]) -> tuple[Path | None, int | None]:
        """Load the state before `step`; returns (checkpoint or None, first re-executed step that differed)."""
        source = self.load_before(step, chain)
        first_divergent = None
        for s in range(self.step + 1, step):
            record = chain[s]
            outcome = self.run_step(
                s, record["windows"], apply=record.get("skipped") is None, lr=recorded_lr(record)
            )
            if first_divergent is None and not outcome.matches(outcome_of_record(record), self.rtol):
                first_divergent = s
        return source, first_divergent

    def load_before(self, step: int, chain: dict[int, dict[str, Any]]) -> Path | None:
        """Load the newest verified checkpoint before `step` on its timeline (None: the seeded initialisation,
        when every step before `step` is recorded); `self.step` is then the state's step."""
        source: Path | None = None
        for c, path in reversed(ckpt.list_checkpoints(self.rundir.checkpoints)):
            if c >= step or (c > 0 and c not in chain):
                continue
            try:
                meta = ckpt.read_checkpoint_meta(path, require=("loader.epoch", "loader.cursor"))
            except CheckpointError:
                continue
            loader = meta["loader"]
            position = int(loader["epoch"]) * int(loader["num_windows"]) + int(loader["cursor"])
            if chain[c].get("position") and position != chain[c]["position"][1]:
                continue  # a checkpoint of another timeline (saved before a rollback's data skip)
            try:
                self._load(path)
            except CheckpointError as e:
                self.notes.append(f"skipped {path}: {e}")
                continue
            source = path
            break
        if source is None:
            if any(s not in chain for s in range(1, step)):
                missing = min(s for s in range(1, step) if s not in chain)
                raise TenxError(
                    f"{self.rundir.root}: no verified checkpoint before step {step} on its timeline, and "
                    f"no record of step {missing} in {rd.STEPS} to re-execute from the start"
                )
            self._fresh()
        return source

    def prepare(
        self, step: int, at_time: float | None, recorded: StepOutcome | None
    ) -> tuple[StepOutcome | None, list[list[int]], Path | None, int | None]:
        """Rebuild the state before the execution of `step` an incident at `at_time` saw (None: its last).

        Returns the outcome to compare with (`recorded`, else the step's record), the step's windows, the
        checkpoint rebuilt from and the first re-executed step that differed from its record."""
        recorded, chain, windows = self.plan(step, at_time, recorded)
        source, first_divergent = self.rebuild(step, chain)
        return recorded, windows, source, first_divergent

    def plan(
        self, step: int, at_time: float | None, recorded: StepOutcome | None
    ) -> tuple[StepOutcome | None, dict[int, dict[str, Any]], list[list[int]]]:
        """What `prepare` needs before it loads a state: the outcome to compare with, the timeline of the
        steps before `step` (step -> record) and the step's windows; sets the step's lr and thread counts."""
        record = self.record_of(step, after=at_time) if recorded is None else None
        if recorded is None and record is not None:
            recorded = outcome_of_record(record)
        before = at_time if at_time is not None else (float(record["time"]) if record else None)
        chain = self.timeline(step, before)
        self.target_step = step
        self.step_lr = recorded_lr(record) if record is not None else None
        self.step_threads = {s: r["threads"] for s, r in chain.items() if isinstance(r.get("threads"), int)}
        if record is not None and isinstance(record.get("threads"), int):
            self.step_threads[step] = record["threads"]
        if self.step_lr is None and chain:  # a step that crashed: the schedule as last recorded
            total = chain[max(chain)].get("total_steps")
            if isinstance(total, int) and total > 0:
                self.shape = dataclasses.replace(self.shape, total_steps=total)
        return recorded, chain, step_windows(self, step, record, chain)

    @property
    def rtol(self) -> float:
        return 0.0 if self.bitwise else TOLERANCE.get(self.amp_dtype, 1e-5)

    def snapshot(self) -> dict[str, Any]:
        """The model, optimizer and guard state (copies), to run a step several times from one state."""
        assert self.model is not None
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optim": _clone(self.optimizer.state_dict()),
            "guard": self.guard.state_dict(),
            "step": self.step,
        }

    def restore(self, snap: dict[str, Any]) -> None:
        assert self.model is not None
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(_clone(snap["optim"]))
        self.guard.load_state_dict(snap["guard"])
        self.step = snap["step"]

    # ----- data ---------------------------------------------------------------------------------------
    def windows_at(self, position: int, skips: list[list[int]]) -> list[list[int]]:
        """The global window ids per micro-batch of a step that starts at loader `position`."""
        loader = TokenLoader(
            self.stream,
            self.seq_len,
            self.micro_batch,
            seed=self.cfg.train.seed,
            world_size=self.data_parallel,
        )
        for start, end in skips:
            loader.add_skip(int(start), int(end))
        loader._seek(position)
        return [loader._take_windows(self.micro_batch * self.data_parallel) for _ in range(self.grad_accum)]

    def batch(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of windows `ids`; a window whose shard no longer verifies is a DataError."""
        rows = []
        for w in ids:
            if not self.stream.window_ok(w * self.seq_len, self.seq_len + 1):
                bad = "; ".join(self.stream.bad_shards.values())
                raise DataError(f"window {w} lies in a shard that fails its checksum now ({bad})")
            rows.append(torch.from_numpy(self.stream.read(w * self.seq_len, self.seq_len + 1)))
        tokens = torch.stack(rows)
        return tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)

    # ----- the step -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def library(self) -> Iterator[None]:
        """The library as the run had it: its op-bug faults installed."""
        with contextlib.ExitStack() as stack:
            for spec in self.op_bugs:
                stack.enter_context(OpBug(spec.run, spec.op))
            yield

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp_dtype in (torch.float32, torch.float64):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def run_step(
        self,
        step: int,
        windows: list[list[int]],
        *,
        apply: bool | None = None,
        capture: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        lr: float | None = None,
    ) -> StepOutcome:
        """Execute step `step` on `windows` (global ids per micro-batch) from the current state.

        The step is the trainer's own (tenx.train.step.take_step) with replay's hooks: every rank's
        micro-batches in this process, the op-bug library and `capture` around them, the reference path's
        float64 loss and math attention. `apply`: whether to take the optimizer step (None: as the guard
        decides now; True/False: as the record says). `lr`: the learning rate to take (default: step
        `step`'s as recorded by `prepare`, else the schedule's). Exceptions from the forward or backward are
        returned as the outcome.
        """
        assert self.model is not None
        threads = self.step_threads.get(step)
        if threads is not None and self.device.type == "cpu" and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        result = take_step(
            step,
            [self._micro_batches(windows, rank) for rank in range(self.data_parallel)],
            self.trained,
            self.shape,
            self.cfg.optim,
            self.device,
            hooks=StepHooks(
                forward_context=self._forward_context,
                loop_context=lambda: self._executing(capture),
                loss_dtype=self._loss_dtype,
                token_loss_dtype=None if self.reference else token_loss_dtype(self.cfg.train.loss_precision),
                reduce=lambda loss_sum: self._pre_optim_step(step, loss_sum, capture),
                catch_errors=True,
            ),
            apply=apply,
            lr=lr if lr is not None else (self.step_lr if step == self.target_step else None),
        )
        if result.error is not None:  # the step's own failure is the outcome to compare
            error = result.error
            return StepOutcome(
                exception=type(error).__name__, message=str(error)[:2000], frames=error_frames(error)
            )
        self.step = step
        return StepOutcome(
            result.loss, result.grad_norm, step_digest(result.loss, result.grad_norm), result.verdict
        )

    def _micro_batches(
        self, windows: list[list[int]], rank: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Rank `rank`'s inputs and targets of each micro-batch, read as the step reaches them."""
        for ids in windows:
            yield self.batch(ids[rank * self.micro_batch : (rank + 1) * self.micro_batch])

    @contextlib.contextmanager
    def _executing(
        self, capture: Callable[[], contextlib.AbstractContextManager[Any]] | None
    ) -> Iterator[None]:
        """Around a step's micro-batches: the run's library, and `capture` when given."""
        with self.library(), capture() if capture else contextlib.nullcontext():
            yield

    def _pre_optim_step(
        self,
        step: int,
        loss_sum: torch.Tensor,
        capture: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    ) -> torch.Tensor:
        """Where the trainer's statistics ran their probe forward (every `monitor.stats_every`-th step), run
        it too, under the run's library and `capture`: an operator may fail there, not in the step's loss."""
        every = self.cfg.monitor.stats_every
        if every > 0 and step % every == 0:
            assert self.model is not None
            if self.probe is None:
                val = validation_stream(self.cfg, self.stream.manifest, self.seq_len)
                self.probe = ModelProbe(self.stream, val, self.seq_len, self.micro_batch, self.device)
            with self._executing(capture):
                self.probe.figures(self.model, self._forward_context)
        return loss_sum

    @contextlib.contextmanager
    def _forward_context(self) -> Iterator[None]:
        """Around each forward pass: autocast as the run had it; math attention on the reference path."""
        with self.autocast(), _attention(self.reference):
            yield

    @property
    def _loss_dtype(self) -> torch.dtype:
        return torch.float64 if self.reference else torch.float32

    def to_reference(self) -> None:
        """Switch the rebuilt state to the reference path: float64 parameters and optimizer state (moved to
        the CPU from MPS, which has no float64)."""
        assert self.model is not None
        self.reference, self.amp_dtype, self.bitwise = True, torch.float64, False
        self.probe = None  # rebuilt on the reference path's device
        trained_on, device = self.device, float64_device(self.device)
        if device != trained_on:
            self.notes.append(f"{trained_on.type} has no float64: the reference path ran on the CPU")
            self.device = device
        if restore_plain_linears(self.model):  # an fp8 run: its matmuls in float64 too
            self.notes.append("the reference path ran the fp8 run's linears as plain float64 ones")
        self.model.to(device, torch.float64)
        if self.teacher is not None:  # on the student's device, in its own dtype (its products are cast)
            self.teacher.model.to(device)
        for state in self.optimizer.state.values():
            for k, v in list(state.items()):
                if torch.is_tensor(v):
                    where = device if v.device.type == trained_on.type else v.device  # a CPU step count stays
                    state[k] = v.to(
                        where, torch.float64 if v.is_floating_point() and k != "step" else v.dtype
                    )


def _attention(reference: bool) -> contextlib.AbstractContextManager[Any]:
    if not reference:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _clone(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def step_windows(replayer: Replayer, step: int, record: dict[str, Any] | None, chain: dict[int, Any]) -> list:
    """The data of `step`: its record's windows, else those after the previous step's end position."""
    if record is not None and record.get("windows"):
        return record["windows"]
    previous = chain.get(step - 1)
    skips_file = read_json_object(replayer.rundir.data_skips).get("skips", [])
    if previous is None:
        if step != 1:
            raise TenxError(
                f"no record of step {step - 1} in {replayer.rundir.steps}: cannot tell step {step}'s data"
            )
        return replayer.windows_at(0, [])
    skips = skips_file[: int(previous.get("skips", 0))]
    return replayer.windows_at(int(previous["position"][1]), skips)


def replay(
    run_dir: str | Path,
    step: int,
    *,
    repeat: int = 2,
    at_time: float | None = None,
    recorded: StepOutcome | None = None,
) -> ReplayReport:
    """Rebuild the state before `step` and run it `repeat` times; compare with the record (module doc).

    `at_time` picks the execution of `step` an incident saw (the records written before it form its
    timeline); `recorded` overrides the outcome to compare with (a crash event's exception).
    """
    t0 = time.perf_counter()
    if repeat < 1:
        raise TenxError(f"--repeat must be >= 1, got {repeat}")
    if step < 1:
        raise TenxError(f"--step must be >= 1 (steps are counted from 1), got {step}")
    replayer = Replayer(run_dir)
    try:
        recorded, windows, source, first_divergent = replayer.prepare(step, at_time, recorded)
        snap = replayer.snapshot()
        outcomes = []
        for i in range(repeat):
            if i:
                replayer.restore(snap)
            outcomes.append(replayer.run_step(step, windows, apply=False))
    except DataError as e:
        raise TenxError(
            f"cannot replay step {step} of {run_dir}: the data changed since it ran: {e}"
        ) from None
    rtol = replayer.rtol
    if any(not o.matches(outcomes[0], rtol) for o in outcomes[1:]):
        verdict = "differs-between-repeats"
    elif recorded is None:
        verdict = "no-record"
    elif outcomes[0].matches(recorded, rtol):
        verdict = "reproduces"
    else:
        verdict = "does-not-reproduce"
    return ReplayReport(
        run_dir=str(run_dir),
        step=step,
        checkpoint=str(source) if source else None,
        recorded=recorded,
        outcomes=outcomes,
        verdict=verdict,
        bitwise=replayer.bitwise,
        notes=replayer.notes,
        first_divergent=first_divergent,
        seconds=time.perf_counter() - t0,
    )


def recorded_lr(record: dict[str, Any]) -> float | None:
    """The learning rate a step record says the step took (None in records older than the field)."""
    lr = record.get("lr")
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None
