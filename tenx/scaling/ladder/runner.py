"""Scaling ladders: plan runs from FLOP budgets, train them idempotently, record one results table.

A ladder turns a base config and a list of compute budgets C (training FLOPs) into runs: the planning rules
(grids, shapes, hyperparameters by size) are tenx/scaling/ladder/rungs.py's, the cluster launch scripts
tenx/scaling/ladder/emit.py's, the dry run's time estimate tenx/scaling/ladder/cost.py's. Runs are
idempotent: a run whose row (keyed by a hash of its resolved config) is in results.jsonl is skipped; a run
with checkpoints resumes from the newest verified one; a finished run is only evaluated. Several runs may
train at once (`ladder.workers`: run_planned).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Literal

from tenx import config as cfglib
from tenx import rundir
from tenx.errors import ConfigError, TenxError
from tenx.scaling.ladder.cost import (
    contention_note,
    estimate_seconds,
    measure_tokens_per_s,
    run_seconds,
    start_order,
    steady_step_seconds,
    workers_seconds,
)
from tenx.scaling.ladder.emit import launch_files, write_launch_files
from tenx.scaling.ladder.rungs import (
    DEFAULT_BUDGETS,
    BudgetCheck,
    LadderConfig,
    PlannedRun,
    format_checks,
    format_ladder_plan,
    format_seconds,
    minimum_checks,
    parse_budgets,
    plan_checks,
    plan_ladder,
    shape_for_depth,
)
from tenx.train.config import RunConfig, load_run_config
from tenx.train.hooks import Callback, TrainerView
from tenx.utils.io import atomic_write_json, atomic_write_text, bytes_xxhash, cache_dir, read_jsonl
from tenx.utils.lock import exclusive_writer

__all__ = [
    "DEFAULT_BUDGETS",
    "BudgetCheck",
    "LadderConfig",
    "LadderProgress",
    "PlannedRun",
    "append_result",
    "config_key",
    "ensure_data",
    "estimate_seconds",
    "evaluate_run",
    "format_checks",
    "format_dry_run",
    "format_ladder_plan",
    "load_base",
    "measure_tokens_per_s",
    "minimum_checks",
    "parse_budgets",
    "plan_checks",
    "plan_ladder",
    "read_results",
    "resume_hint",
    "run_seconds",
    "run_ladder",
    "run_one",
    "run_planned",
    "shape_for_depth",
    "slot_config",
    "steady_step_seconds",
]


# ----- data ------------------------------------------------------------------------------------------
def ensure_data(base: RunConfig, lc: LadderConfig, *, dry_run: bool = False) -> RunConfig:
    """`base` with a prepared data.dir: its own when that holds prepared data, else `ladder.prepare_source`
    prepared once into the cache directory (tenx.utils.io.cache_dir) and reused by later ladders.

    A dry run prepares nothing: it says what it would prepare and where, and plans with the vocabulary
    that tokenizer will have.
    """
    from tenx.data.prepare.pipeline import PrepareConfig, format_prepare_summary, is_prepared, prepare
    from tenx.data.tokenizer import ByteTokenizer

    if (Path(base.data.dir) / "manifest.json").exists():
        return base
    if lc.prepare_source is None:
        raise TenxError(
            f"data.dir {base.data.dir} is not prepared; run `tenx data prepare --source ... --out "
            f"{base.data.dir}` first (or set ladder.prepare_source)"
        )
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", lc.prepare_source).strip("_") or "source"
    target = cache_dir() / "data" / f"{slug}-{lc.prepare_tokenizer}"
    prep = PrepareConfig(source=lc.prepare_source, out=str(target), tokenizer=lc.prepare_tokenizer)
    data = dataclasses.replace(base.data, dir=str(target))
    if is_prepared(prep):
        print(
            f"tenx: data.dir {base.data.dir} is not prepared; using {lc.prepare_source} prepared in {target}"
        )
        return dataclasses.replace(base, data=data)
    if dry_run:
        print(
            f"tenx: data.dir {base.data.dir} is not prepared: a real run would prepare {lc.prepare_source} "
            f"({lc.prepare_tokenizer} tokenizer) into {target} (the cache directory: $TENX_CACHE_DIR); "
            "this dry run prepared nothing"
        )
        vocab = ByteTokenizer.vocab_size if lc.prepare_tokenizer == "bytes" else prep.vocab_size
        model = dataclasses.replace(base.model, vocab_size=base.model.vocab_size or vocab)
        return dataclasses.replace(base, data=data, model=model)
    print(f"tenx: preparing {lc.prepare_source} into {target} ({lc.prepare_tokenizer} tokenizer)")
    print(format_prepare_summary(prepare(prep, progress=False), target))
    return dataclasses.replace(base, data=data)


# ----- results table ---------------------------------------------------------------------------------
def config_key(cfg: RunConfig) -> str:
    """Identity of a run: a hash of everything that changes its numbers (model, data, optim, train).

    Only the fields that differ from their defaults are hashed, so a field added to tenx later, whose
    default keeps the old behaviour, leaves every earlier run's identity (and a ladder's reuse of it) as
    it was."""
    tree, default = cfglib.to_dict(cfg), cfglib.to_dict(RunConfig())
    core = {
        k: {f: v for f, v in tree[k].items() if v != default[k].get(f, _ABSENT)}
        for k in ("model", "data", "optim", "train")
        if k in tree
    }
    for how in ("micro_batch", "grad_accum", "device", "threads", "compile", "tune_allocator"):
        core["train"].pop(how, None)  # how the batch is computed, not what is computed
    return bytes_xxhash(json.dumps(core, sort_keys=True).encode())


_ABSENT = object()


def read_results(ladder_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of LADDER_DIR/results.jsonl (empty when there is none); a bad line is a clear error."""
    return read_jsonl(Path(ladder_dir) / "results.jsonl", missing_ok=True)


def append_result(ladder_dir: str | Path, row: dict[str, Any]) -> None:
    """Add (or replace, by key) one row of results.jsonl, written atomically."""
    rows = [r for r in read_results(ladder_dir) if r.get("key") != row["key"]] + [row]
    atomic_write_text(Path(ladder_dir) / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


# ----- evaluation ------------------------------------------------------------------------------------
def _spread_documents(texts: list[str], max_bytes: int) -> list[str]:
    """Whole documents spread evenly over the split, adding up to at least `max_bytes` (0: all)."""
    total = sum(len(t.encode("utf-8")) for t in texts)
    if max_bytes <= 0 or total <= max_bytes:
        return texts
    picked, size = [], 0
    # a golden-ratio stride order samples the whole split, not its first files (which share a package)
    for i in sorted(range(len(texts)), key=lambda i: (i * 0.6180339887) % 1.0):
        picked.append(i)
        size += len(texts[i].encode("utf-8"))
        if size >= max_bytes:
            break
    return [texts[i] for i in sorted(picked)]


EVAL_SPLITS = ("val", "heldout")
"""The splits a ladder run is scored on, by default."""


def evaluate_run(
    run_dir: str | Path, eval_bytes: int, splits: tuple[str, ...] = EVAL_SPLITS
) -> dict[str, dict[str, Any]]:
    """Loss and bits per byte of a finished run's final checkpoint on each of `splits` (val, heldout)."""
    from tenx.checkpoint.models import load_model
    from tenx.data.manifest import read_manifest, split_documents_text
    from tenx.data.tokenizer import load_tokenizer
    from tenx.eval.bpb import eval_texts
    from tenx.hardware import resolve_precision

    loaded = load_model(run_dir, "auto")
    data_dir = loaded.data_dir
    manifest = read_manifest(data_dir)
    tok = load_tokenizer(data_dir, manifest["tokenizer"])
    device = next(loaded.model.parameters()).device
    amp = resolve_precision("auto", device)
    out = {}
    for split in splits:
        texts = _spread_documents(list(split_documents_text(data_dir, manifest, split, tok)), eval_bytes)
        out[split] = eval_texts(loaded.model, texts, tok, batch_size=16, amp_dtype=amp)
    return out


# ----- running ---------------------------------------------------------------------------------------
PROGRESS_EVERY_S = 30.0
"""Seconds between the progress lines of a ladder run while it trains."""


class LadderProgress(Callback):
    """While a ladder run trains, a line every `every_s` seconds (and at its first step): the run, its step,
    loss, time so far and the time its remaining steps will take at the pace so far. `clock` is the time
    source (tests drive it)."""

    name = "ladder-progress"

    def __init__(
        self, label: str, every_s: float = PROGRESS_EVERY_S, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.label, self.every_s, self.clock = label, every_s, clock
        self._t0 = self._last = 0.0
        self._start_step = 0
        self._printed = False

    def on_train_start(self, trainer: TrainerView) -> None:
        self._t0 = self._last = self.clock()
        self._start_step = trainer.step
        self._printed = False

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        now = self.clock()
        if self._printed and now - self._last < self.every_s:
            return
        self._last, self._printed = now, True
        done, left = trainer.step - self._start_step, trainer.total_steps - trainer.step
        elapsed = now - self._t0
        eta = f"{format_seconds(elapsed / done * left)} left" if done else "time left unknown"
        print(
            f"  {self.label}: step {trainer.step}/{trainer.total_steps} | loss {metrics['loss']:.4f} | "
            f"{format_seconds(elapsed)} so far, {eta}",
            flush=True,
        )


def resume_hint(command: str = "") -> str:
    """What continues a stopped ladder run: the same `tenx ladder` command (finished runs are skipped, the
    stopped one resumes from its checkpoint); `command`: that command, when known."""
    if command:
        return f"the same command (it skips finished runs and resumes this one): {command}"
    return "the same `tenx ladder` (or `tenx derisk`) command: it skips finished runs and resumes this one"


def _clear_unfinished(run_dir: Path) -> None:
    """Delete what a ladder run that stopped before its first checkpoint wrote into `run_dir`, so it starts
    over cleanly; a TenxError, deleting nothing, when the directory holds anything tenx does not write."""
    foreign = sorted(p.name for p in run_dir.iterdir() if not rundir.written_by_tenx(p.name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise TenxError(
            f"{run_dir} holds files tenx did not write ({shown}); the ladder starts this run over there and "
            "never deletes what it did not write: move them elsewhere, or use another ladder directory"
        )
    for entry in run_dir.iterdir():
        if entry.name == rundir.WRITER_LOCK:
            continue  # held now
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def run_one(
    run: PlannedRun,
    ladder_dir: str | Path,
    lc: LadderConfig,
    *,
    label: str = "",
    command: str = "",
    progress_every_s: float | None = PROGRESS_EVERY_S,
    callbacks: list[Callback] | None = None,
    splits: tuple[str, ...] = EVAL_SPLITS,
    record: bool = True,
) -> dict[str, Any]:
    """Train (or resume, or reuse) one planned run, evaluate it on `splits` and record its row in
    results.jsonl (a split not scored has None for its loss and bits per byte; a reused row keeps what it
    was scored on). `record=False` leaves the recording to the caller (run_planned).

    While it trains a line every `progress_every_s` seconds says how far it is (None: no lines), headed by
    `label` (default: the run's name). `command` is the ladder's own command, which a stop signal's message
    names as what continues the ladder. `callbacks`: more training callbacks (tests)."""
    from tenx import checkpoint as ckpt
    from tenx.monitor.goodput import mark_run_start
    from tenx.monitor.loss_plot import plot_loss_curve
    from tenx.train.run import train

    ladder_dir = Path(ladder_dir)
    key = config_key(run.config)
    for row in read_results(ladder_dir):
        if row.get("key") == key:
            return {**row, "reused": True}
    run_dir = ladder_dir / "runs" / run.name
    rd = rundir.RunDir(run_dir)
    text = cfglib.dumps_toml(run.config)
    config_path = rd.config
    if config_path.exists() and config_path.read_text() != text:
        if config_key(load_run_config(config_path)) != key:
            raise TenxError(
                f"{run_dir} holds a run of a different config (the base config or the ladder settings "
                "changed); delete that directory or use another ladder directory"
            )
    t0 = time.perf_counter()
    latest, _ = ckpt.latest_verified(rd.checkpoints)
    trained = latest is not None and ckpt.read_checkpoint_meta(latest)["step"] >= run.steps
    if not trained:
        run_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_writer(rd.writer_lock, "ladder run directory"):
            resume = "auto" if ckpt.list_checkpoints(rd.checkpoints) else None
            if resume is None:
                _clear_unfinished(run_dir)  # a run that crashed before its first checkpoint starts over
            atomic_write_text(config_path, text)
            extra = list(callbacks or [])
            if progress_every_s is not None:
                extra.append(LadderProgress(label or run.name, progress_every_s))
            mark_run_start()  # this run's start-up in its ledger begins here, not when the process began
            train(run.config, run_dir, resume=resume, extra_callbacks=extra, resume_hint=resume_hint(command))
    train_s = time.perf_counter() - t0
    metrics = read_jsonl(rd.metrics)
    plot_loss_curve(rd.metrics, rd.loss_curve, run.name)
    t1 = time.perf_counter()
    ev = evaluate_run(run_dir, lc.eval_bytes, splits)
    eval_s = time.perf_counter() - t1
    train_tokens = _train_tokens(run.config)
    unique = min(run.unique_tokens or train_tokens, train_tokens)
    row = {
        "name": run.name,
        "key": key,
        **{k: v for k, v in run.record().items() if k != "name"},
        "unique_tokens": unique,
        "epochs": run.tokens / unique,
        "family": run.config.model.family,
        "train_loss": metrics[-1]["loss"],
        **{f"{split}_loss": ev[split]["loss"] if split in ev else None for split in EVAL_SPLITS},
        **{f"{split}_bpb": ev[split]["bits_per_byte"] if split in ev else None for split in EVAL_SPLITS},
        "eval_bytes": {k: v["bytes"] for k, v in ev.items()},
        "step_time_s": sum(m.get("step_time_s", 0.0) for m in metrics),
        "wall_s": time.perf_counter() - t0,
        "train_s": train_s,
        "eval_s": eval_s,
        "resumed_or_reused_training": trained,
        "run_dir": str(run_dir),
        "config": cfglib.to_dict(run.config),
        "time": time.time(),
    }
    if record:
        append_result(ladder_dir, row)
    return row


def _train_tokens(cfg: RunConfig) -> int:
    from tenx.data.manifest import read_manifest

    return int(read_manifest(cfg.data.dir)["splits"][cfg.data.train_split]["tokens"])


# ----- several runs at once ------------------------------------------------------------------------
# `ladder.workers` runs at a time on one machine. Small runs leave a machine idle: on 2 CPU cores a depth-1
# step is 27 ms on one thread and 24 ms on two, so two such runs side by side, one thread each, take about
# as long as one. Each worker is a process of its own (spawned, so nothing of this process's torch state
# is shared) with a *slot*: on a CPU its share of the threads (train.threads / workers, or this machine's
# usable CPUs / workers when train.threads is 0), on CUDA its own GPU (slot i trains on cuda:i). Neither
# is part of a run's identity (config_key leaves out how a batch is computed), but a run's numbers do
# depend on its thread count: a study that compares runs trains them all with the same workers. Runs
# start costliest first (training FLOPs), so that the short ones fill the gaps at the end rather than a
# long one running alone. Workers train and score; this process alone writes results.jsonl (each row as
# its run finishes, atomically), so two runs never race on it.
def slot_config(run: PlannedRun, slot: int, workers: int) -> PlannedRun:
    """`run` as worker slot `slot` of `workers` trains it: its share of the CPU threads, or its own GPU."""
    if workers == 1:
        return run
    import torch

    from tenx.hardware import pick_device

    train = run.config.train
    if pick_device(train.device, "train.device").type == "cuda":  # 'auto' on a GPU machine too
        count = torch.cuda.device_count()
        if count < workers:
            raise ConfigError(
                f"ladder.workers={workers} trains one run per GPU, but this machine has {count}; "
                f"give ladder.workers={max(count, 1)} or fewer"
            )
        train = dataclasses.replace(train, device=f"cuda:{slot}")
    else:
        from tenx.utils.cpus import usable_cpu_count

        total = train.threads or usable_cpu_count()
        train = dataclasses.replace(train, threads=max(1, total // workers))
    return dataclasses.replace(run, config=dataclasses.replace(run.config, train=train))


def run_planned(
    runs: list[PlannedRun],
    ladder_dir: str | Path,
    lc: LadderConfig,
    *,
    labels: list[str] | None = None,
    command: str = "",
    splits: tuple[str, ...] = EVAL_SPLITS,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Train (or resume, or reuse), score and record each of `runs` as tenx.scaling.ladder.runner.run_one does,
    `lc.workers` at a time, costliest first; yields (index in `runs`, its row) as each finishes (in plan
    order with one worker).
    `labels` head each run's progress lines (default: the runs' names)."""
    labels = labels or [r.name for r in runs]
    if lc.workers == 1:
        for i, run in enumerate(runs):
            yield i, run_one(run, ladder_dir, lc, label=labels[i], command=command, splits=splits)
        return
    queue = [(i, runs[i]) for i in start_order(runs)]
    free = list(range(lc.workers))
    running: dict[Future[dict[str, Any]], tuple[int, int]] = {}
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(lc.workers, mp_context=spawn, initializer=_idle_worker_signals) as pool:
        previous = _forward_sigterm(pool)
        try:
            while queue or running:
                while queue and free:
                    (i, run), slot = queue.pop(0), free.pop(0)
                    future = pool.submit(
                        run_one,
                        slot_config(run, slot, lc.workers),
                        ladder_dir,
                        lc,
                        label=labels[i],
                        command=command,
                        splits=splits,
                        record=False,
                    )
                    running[future] = (i, slot)
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: running[f][0]):
                    i, slot = running.pop(future)
                    free.append(slot)
                    row = future.result()
                    if not row.get("reused"):
                        append_result(ladder_dir, row)
                    yield i, row
        except BaseException:
            for future in running:
                future.cancel()
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _idle_worker_signals() -> None:
    """A worker between runs ignores stop signals (a run installs the trainer's own handlers while it
    trains, which save and stop): one dying idle would break the pool and kill its busy sibling."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _forward_sigterm(pool: ProcessPoolExecutor) -> Any:
    """Pass a SIGTERM sent to this process alone (a scheduler's, a `kill`) on to the workers, whose runs
    then save a checkpoint and stop as a lone run does; their stop ends the ladder. The previous handler
    (None off the main thread, where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def forward(signum: int, frame: Any) -> None:
        for process in list(getattr(pool, "_processes", {}).values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)

    return signal.signal(signal.SIGTERM, forward)


def _say(line: str) -> None:
    print(line, flush=True)


# ----- the whole ladder ------------------------------------------------------------------------------
def load_base(config: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """The base run config of a ladder (a path or a shipped config name) with overrides."""
    from tenx.train.config import resolve_config_path

    return load_run_config(resolve_config_path(str(config)), overrides)


def format_dry_run(
    plan: list[PlannedRun], lc: LadderConfig, footer: str | None = None, *, estimate: bool = True
) -> str:
    """What a dry run prints (`tenx ladder` and `tenx derisk`, both modes): the plan's table with, when
    `estimate`, each run's time on this machine (each shape's steps timed on its worker's share of the
    threads, as it will train) and the plan's wall time as run_planned schedules it on lc.workers."""
    if not estimate:
        return format_ladder_plan(plan, footer=footer)
    shapes = len({(r.depth, r.config.train.micro_batch) for r in plan})
    _say(f"timing the training steps of each of the plan's {shapes} model shapes on this machine")
    seconds = estimate_seconds([slot_config(r, 0, lc.workers) for r in plan], lc, progress=_say)
    wall = (lc.workers, workers_seconds(plan, seconds, lc.workers))
    return format_ladder_plan(plan, seconds, footer, wall) + contention_note()


def run_ladder(
    base: RunConfig,
    lc: LadderConfig,
    out: str | Path,
    *,
    tag: str = "base",
    dry_run: bool = False,
    emit: Literal["torchrun", "slurm"] | None = None,
    nproc: int = 8,
    nodes: int = 1,
    collect: str = "",
    estimate: bool = True,
) -> list[dict[str, Any]]:
    """Plan the ladder into `out` and run it (or print it, or write cluster launch scripts).

    `collect` is this ladder's own command without --emit (`tenx ladder ...`): the emitted scripts end with
    it, and a stop signal's message names it as what continues the ladder. Returns the results rows of the
    plan's runs (empty for a dry run or when emitting).
    """
    lc.validate()
    base = ensure_data(base, lc, dry_run=dry_run)
    plan = plan_ladder(base, lc, tag)
    checks = plan_checks(plan, lc)
    footer = format_checks(checks, lc) if lc.grid == "isoflop" else None
    out = Path(out)
    if dry_run:
        print(format_dry_run(plan, lc, footer, estimate=estimate))
        return []
    # everything --emit writes is built and checked first: a refusal leaves `out` as it was
    launch = (
        None if emit is None else launch_files(plan, out, emit, collect or "tenx ladder ...", nproc, nodes)
    )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        out / "plan.json",
        {
            "ladder": cfglib.to_dict(lc),
            "runs": [r.record() for r in plan],
            "checks": [c.record() for c in checks],
            "time": time.time(),
        },
    )
    if launch is not None:
        scripts = write_launch_files(launch)
        print(format_ladder_plan(plan, footer=footer))
        print("launch scripts:\n  " + "\n  ".join(str(p) for p in scripts))
        return []
    print(format_ladder_plan(plan, footer=footer))
    found: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()
    labels = [f"[{i}/{len(plan)}] {run.name}" for i, run in enumerate(plan, 1)]
    for i, row in run_planned(plan, out, lc, labels=labels, command=collect):
        state = "reused" if row.get("reused") else f"{row['wall_s']:.0f} s"
        print(
            f"{labels[i]}: held-out {row['heldout_loss']:.4f} nats/token, "
            f"{row['heldout_bpb']:.4f} bits/byte ({state})",
            flush=True,
        )
        found[i] = row
    rows = [found[i] for i in range(len(plan))]
    print(f"ladder: {len(plan)} runs in {time.perf_counter() - t0:.0f} s; results: {out / 'results.jsonl'}")
    if lc.grid == "isoflop":  # the planner centred the windows on a guess; the runs measured the minima
        print(
            "IsoFLOP minima of held-out loss:\n  " + "\n  ".join(m["message"] for m in minimum_checks(rows))
        )
    sys.stdout.flush()
    return rows
