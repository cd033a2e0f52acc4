"""`tenx data prepare --engine datatrove`: the two heavy passes as tasks of Hugging Face datatrove's executors.

Where one machine's cores are not enough, the scan and the tokenize pass (tenx/data/prepare/stream.py) run as
datatrove pipeline steps over `tasks` ranks: locally with `LocalPipelineExecutor` (a process pool), or on a
cluster with `SlurmPipelineExecutor` (job arrays; the driver waits for every rank's completion marker, and
stops naming the job, task, rank and logs as soon as sacct or squeue shows a task failed: `wait_for_slurm`).
Task r handles the documents whose read position is r modulo the task count (a directory's other files are
not even read), writes its results to `OUT/.prepare-work/` (a shared filesystem on a cluster) under a
temporary name and renames them when done; datatrove records completed ranks in its logging directory and
skips them when the preparation is started again (`--resume`), so a lost node costs only its tasks.

The driver (the `tenx data prepare` process) merges between the passes, in read order: the scan's outcomes
go through the same `Scanner` as local workers' (exact duplicates, repeated ids, counts), and the tokens are
copied into the one spill file the local pipeline writes. Everything after (near-duplicates, tokenizer,
decontamination, shards, index) is the local pipeline's, so the output is byte-identical to a local prepare
with any number of workers (tested with 2 local tasks against 1 worker).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from tenx.data.prepare import stream
from tenx.errors import ConfigError, DataError
from tenx.utils.cpus import usable_cpu_count
from tenx.utils.io import AtomicOutput

TASK = np.dtype([("seq", "<u8"), ("code", "u1"), ("num_bytes", "<u8"), ("digest", "V16")])
OUTCOMES = ("kept", "kept-replaced", "empty_skipped", "binary_skipped")


def _task_path(work_dir: Path, stage: str, rank: int, suffix: str) -> Path:
    return work_dir / f"{stage}-task-{rank:05d}.{suffix}"


def scan_task(cfg: Any, rank: int, world: int) -> None:
    """One rank of the scan: outcome, bytes, digest, id and signature of each of its documents, in order."""
    from tenx.data.prepare.dedup import NUM_PERM

    work_dir = Path(cfg.out) / stream.WORK_DIR
    paths = [_task_path(work_dir, "scan", rank, s) for s in ("rows", "ids", "sigs")]
    stream._scan_init(cfg.near_dup_shingle, bool(cfg.near_dup_threshold))
    empty = np.zeros(NUM_PERM, dtype=np.uint64).tobytes()
    mine = stream._source(cfg, 0, select=lambda seq: seq % world == rank)
    with AtomicOutput(paths[0]) as rows, AtomicOutput(paths[1]) as ids, AtomicOutput(paths[2]) as sigs:
        for batch in stream._batches(d for d in mine if d[0] % world == rank):
            for (seq, doc_id, _), (outcome, digest, num_bytes, sig) in zip(
                batch, stream._scan_batch(batch), strict=True
            ):
                code = OUTCOMES.index(outcome)
                rows.write(np.array([(seq, code, num_bytes, digest or bytes(16))], dtype=TASK).tobytes())
                ids.write(json.dumps(doc_id).encode() + b"\n")
                sigs.write(sig.tobytes() if sig is not None else empty)


def merge_scan(cfg: Any, work: stream.Work, world: int) -> dict[str, Any]:
    """The ranks' outcomes through the Scanner in read order (position p is rank p % world's p // world-th)."""
    from tenx.data.prepare.dedup import NUM_PERM

    scanner = stream.Scanner(cfg, work)
    rows = [np.fromfile(_task_path(work.dir, "scan", r, "rows"), dtype=TASK) for r in range(world)]
    sigs = [
        np.memmap(
            _task_path(work.dir, "scan", r, "sigs"), dtype=np.uint64, mode="r", shape=(len(rows[r]), NUM_PERM)
        )
        if len(rows[r])
        else None
        for r in range(world)
    ]
    ids = [open(_task_path(work.dir, "scan", r, "ids"), "rb") for r in range(world)]  # noqa: SIM115
    try:
        for seq in range(sum(len(r) for r in rows)):
            r, i = seq % world, seq // world
            row = rows[r][i]
            if int(row["seq"]) != seq:
                raise DataError(
                    f"{work.dir}: scan task {r} skipped position {seq}; prepare again without --resume"
                )
            sig = np.asarray(sigs[r][i]) if sigs[r] is not None else None  # type: ignore[index]
            outcome = OUTCOMES[int(row["code"])]
            scanner.take(  # ids.txt: one JSON string per row of rows.bin, read in step with it
                seq, json.loads(ids[r].readline()), outcome, bytes(row["digest"]), int(row["num_bytes"]), sig
            )
        scanner.commit(None, final=True)
    finally:
        scanner.close()
        for f in ids:
            f.close()
    return dataclasses.asdict(scanner.stats)


def tokenize_task(cfg: Any, rank: int, world: int, entry: dict[str, Any], dtype: str) -> None:
    """One rank of the tokenize pass: kept documents k with k % world == rank, tokens and lengths in order."""
    work_dir = Path(cfg.out) / stream.WORK_DIR
    rows = np.fromfile(work_dir / "rows.bin", dtype=stream.ROW)
    own = {int(s): k for k, s in enumerate(rows["seq"]) if k % world == rank}
    stream._tokenize_init(str(cfg.out), entry, dtype)
    paths = [_task_path(work_dir, "tokenize", rank, s) for s in ("tokens", "lengths")]
    mine = stream._source(cfg, 0, select=lambda seq: seq in own)
    itemsize = np.dtype(dtype).itemsize
    with AtomicOutput(paths[0]) as tokens, AtomicOutput(paths[1]) as lengths:
        for batch in stream._batches(d for d in mine if d[0] in own):
            for data in stream._tokenize_batch(batch):
                tokens.write(data)
                lengths.write(np.array([len(data) // itemsize], dtype="<u8").tobytes())


def merge_tokenize(work: stream.Work, world: int, count: int, dtype: str) -> None:
    """The ranks' tokens copied into tokens.bin and offsets.bin in kept order (each rank's file read once)."""
    itemsize = np.dtype(dtype).itemsize
    lengths = [np.fromfile(_task_path(work.dir, "tokenize", r, "lengths"), dtype="<u8") for r in range(world)]
    if sum(len(x) for x in lengths) != count:
        raise DataError(f"{work.dir}: the tokenize tasks hold {sum(map(len, lengths))} of {count} documents")
    sources = [open(_task_path(work.dir, "tokenize", r, "tokens"), "rb") for r in range(world)]  # noqa: SIM115
    try:
        with open(work.path("tokens.bin"), "wb") as tokens, open(work.path("offsets.bin"), "wb") as offsets:
            start = 0
            for k in range(count):
                n = int(lengths[k % world][k // world])
                tokens.write(sources[k % world].read(n * itemsize))
                offsets.write(np.array([(start, n)], dtype=stream.OFFSET).tobytes())
                start += n
            tokens.flush()
            os.fsync(tokens.fileno())
            offsets.flush()
            os.fsync(offsets.fileno())
            work.commit(
                "tokenize", {"seq": None, "tokens": start * itemsize, "offsets": count * 16, "final": True}
            )
    finally:
        for f in sources:
            f.close()


def _step(stage: str, cfg: Any, extra: tuple) -> Any:
    """A datatrove pipeline step that runs one rank of `stage` (defined lazily: datatrove is optional)."""
    from datatrove.pipeline.base import PipelineStep

    class TenxPrepareStep(PipelineStep):
        name = f"tenx prepare {stage}"
        type = "tenx"

        def __init__(self) -> None:
            super().__init__()
            self.cfg = cfg  # a PrepareConfig: pickled to each task's process

        def run(self, data: Any, rank: int = 0, world_size: int = 1) -> Any:
            (scan_task if stage == "scan" else tokenize_task)(self.cfg, rank, world_size, *extra)
            yield from data or ()

    return TenxPrepareStep()


def run_stage(stage: str, cfg: Any, work: stream.Work, extra: tuple = ()) -> int:
    """Run `stage` as datatrove tasks (locally, or as a Slurm job array the driver waits for); the task count."""
    try:
        from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor
    except ImportError:
        raise ConfigError(
            "engine 'datatrove' needs the datatrove package: pip install datatrove (or use --engine local)"
        ) from None
    tasks = cfg.tasks or cfg.workers or usable_cpu_count()
    logs = str(work.dir / f"datatrove-{stage}")
    pipeline = [_step(stage, cfg, extra)]
    if cfg.engine == "datatrove":
        workers = min(tasks, cfg.workers or usable_cpu_count())
        executor = LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=workers, logging_dir=logs)
        executor.run()
    else:
        if not cfg.slurm_partition:
            raise ConfigError(
                "engine 'datatrove-slurm' needs --slurm-partition (the partition the tasks run on)"
            )
        job_ids = SlurmJobIds()
        executor = SlurmPipelineExecutor(
            pipeline=pipeline,
            tasks=tasks,
            time=cfg.slurm_time,
            partition=cfg.slurm_partition,
            logging_dir=logs,
            job_name=f"tenx-prepare-{stage}",
            cpus_per_task=1,
            job_id_retriever=job_ids,
        )
        executor.run()
        # datatrove submits one job array per max_array_size ranks to run, then a job merging their stats
        # (afterok: it never runs when a task fails, so it is cancelled then).
        launched = math.ceil(len(_ranks_to_run(executor)) / _array_size(executor)) if job_ids.ids else 0
        arrays = job_ids.ids[:launched]
        try:
            wait_for_slurm(executor, arrays, stage, logs)
        except DataError:
            for job in job_ids.ids[len(arrays) :]:
                _run_slurm(["scancel", job])
            raise
    missing = [r for r in range(tasks) if not executor.is_rank_completed(r)]
    if missing:
        raise DataError(f"{stage}: datatrove tasks {missing[:5]} did not complete; see {logs}, then --resume")
    return tasks


SLURM_POLL_S = 30.0
"""Seconds between two looks at the job arrays (completion markers, then sacct or squeue)."""
SLURM_QUERY_TIMEOUT_S = 60.0
"""A sacct or squeue call that takes longer counts as no answer."""
SLURM_QUERY_FAILURES = 20
"""Consecutive polls without an answer from sacct or squeue (10 minutes) after which the driver stops."""
SLURM_GONE_POLLS = 2
"""Polls a task may have left the queue while its completion marker is still missing (a shared filesystem
can show a file late) before it counts as failed."""
SLURM_FAILED_STATES = (
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
)
"""Final Slurm job states of a task that did not finish its work (sacct prints `CANCELLED by UID`)."""


class SlurmJobIds:
    """datatrove's `job_id_retriever` (the id is sbatch's last word) that also records every id, in order."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def __call__(self, sbatch_output: str) -> str:
        words = sbatch_output.split()
        if not words:
            raise DataError("sbatch printed no job id; check the Slurm submission (partition, account)")
        self.ids.append(words[-1].split(";")[0])  # `--parsable` on a federation prints ID;CLUSTER
        return self.ids[-1]


def _run_slurm(argv: list[str]) -> str | None:
    """stdout of a Slurm command, or None when it is missing, fails or hangs."""
    import subprocess

    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=SLURM_QUERY_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def slurm_task_states(job_ids: list[str]) -> dict[str, str] | None:
    """The state of each task of the jobs `job_ids` ('123_4': 'FAILED'; a pending range such as '123_[5-9]'
    is one entry): sacct's when accounting answers for them, else squeue's (which lists active tasks only,
    so a finished task is absent); None when neither command answers."""
    import getpass

    if not job_ids:
        return {}
    ours = set(job_ids)
    states: dict[str, str] = {}
    out = _run_slurm(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o", "JobID,State"])
    for line in (out or "").splitlines():
        task, _, state = line.strip().partition("|")
        if task.split("_")[0] in ours and state:
            states[task] = state.split()[0]
    if states:
        return states
    out = _run_slurm(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%i|%T"])
    if out is None:
        return None
    for line in out.splitlines():
        task, _, state = line.strip().partition("|")
        if task.split("_")[0] in ours and state:
            states[task] = state
    return states


def wait_for_slurm(executor: Any, job_ids: list[str], stage: str, logs: str) -> None:
    """Wait until every rank of the job arrays `job_ids` has its completion marker; raise DataError naming
    the job, the failed tasks, their ranks and their logs as soon as Slurm reports a task failed, cancelled
    or timed out, or when tasks left the queue without their marker, or when Slurm cannot be asked."""
    gone = unanswered = 0
    while True:
        incomplete = executor.get_incomplete_ranks()
        if not incomplete:
            return
        states = slurm_task_states(job_ids)
        if states is None:
            unanswered += 1
            if unanswered >= SLURM_QUERY_FAILURES:
                raise DataError(
                    f"{stage}: neither sacct nor squeue answered about Slurm jobs {', '.join(job_ids)} for "
                    f"{unanswered} polls; the tasks may still run (see squeue), then rerun with --resume"
                )
        else:
            unanswered = 0
            task_rank = _task_ranks(executor, job_ids)
            waiting = {*incomplete, -1}  # -1: a task whose rank is unknown
            failed = {
                task: state
                for task, state in sorted(states.items(), key=lambda item: (task_rank.get(item[0], -1), item))
                if state in SLURM_FAILED_STATES and task_rank.get(task, -1) in waiting
            }
            active = [task for task, state in states.items() if state != "COMPLETED" and task not in failed]
            if failed:
                _raise_failed(executor, stage, logs, job_ids, failed, task_rank, active)
            gone = 0 if active else gone + 1
            if gone > SLURM_GONE_POLLS:  # no task queued or running, yet ranks lack their marker
                lost = {
                    task: "left the queue without its completion marker"
                    for task, rank in sorted(task_rank.items(), key=lambda item: item[1])
                    if rank in waiting
                } or {f"rank {rank}": "has no completion marker" for rank in incomplete}
                _raise_failed(executor, stage, logs, job_ids, lost, task_rank, [])
        time.sleep(SLURM_POLL_S)


def _ranks_to_run(executor: Any) -> list[int]:
    """The ranks the last launch submitted, in array order (datatrove's ranks_to_run.json)."""
    with executor.logging_dir.open("ranks_to_run.json", "r") as f:
        return json.load(f)


def _array_size(executor: Any) -> int:
    """Tasks per job array (datatrove's max_array_size, -1: all in one; one rank per task)."""
    return executor.max_array_size if executor.max_array_size > 0 else max(1, executor.tasks)


def _task_ranks(executor: Any, job_ids: list[str]) -> dict[str, int]:
    """'JOB_INDEX' -> datatrove rank, for each task of the arrays (job k's index i runs rank
    ranks_to_run[k * max_array_size + i], as SlurmPipelineExecutor.run reads it)."""
    ranks = _ranks_to_run(executor)
    step = _array_size(executor)
    return {
        f"{job}_{i}": ranks[k * step + i]
        for k, job in enumerate(job_ids)
        for i in range(min(step, len(ranks) - k * step))
    }


def _raise_failed(
    executor: Any,
    stage: str,
    logs: str,
    job_ids: list[str],
    failed: dict[str, str],
    task_rank: dict[str, int],
    active: list[str],
) -> NoReturn:
    """Raise the DataError of failed tasks: job, tasks, states, ranks, their logs, and what to do."""
    shown = list(failed.items())[:5]
    tasks = "; ".join(
        f"task {task} {state}"
        + (
            f" (rank {task_rank[task]}: {Path(logs) / 'logs' / f'task_{task_rank[task]:05d}.log'})"
            if task in task_rank
            else ""
        )
        for task, state in shown
    )
    more = f" and {len(failed) - len(shown)} more" if len(failed) > len(shown) else ""
    slurm_log = Path(executor.slurm_logs_folder) / (f"{shown[0][0]}.out" if shown[0][0] in task_rank else "")
    still = (
        f"; {len(active)} other tasks are still queued or running: let them finish (their ranks are kept) "
        f"or `scancel {' '.join(job_ids)}` before resuming"
        if active
        else ""
    )
    raise DataError(
        f"{stage}: Slurm job {', '.join(job_ids)}: {tasks}{more}; Slurm's output of a task is "
        f"{slurm_log} (one JOB_INDEX.out per task){still}; fix the cause, then rerun with --resume "
        "(completed ranks are skipped)"
    )


def emit_slurm(cfg: Any, argv: list[str]) -> Path:
    """Write `OUT.sbatch` beside the output directory: a one-CPU job that runs this prepare as the driver of
    datatrove-slurm job arrays (`argv`: the command's arguments without --emit), resuming what a previous
    job finished; submit it with `sbatch OUT.sbatch`."""
    import shlex

    from tenx.utils.io import atomic_write_text
    from tenx.utils.scripts import sbatch_value, slurm_time

    if not cfg.slurm_partition:
        raise ConfigError("--emit slurm needs --slurm-partition, the partition the tasks run on")
    args = list(argv)
    for flag in ("--engine", "--resume"):
        while flag in args:
            at = args.index(flag)
            del args[at : at + (2 if flag == "--engine" else 1)]
    out = Path(cfg.out).resolve()
    if out == out.parent:
        raise ConfigError(f"--out {cfg.out} is the file system's root: name a data directory to prepare into")
    sbatch_value(out, "--out")  # the job's name and log path
    command = [
        "python",
        "-m",
        "tenx",
        "data",
        "prepare",
        *args,
        "--engine",
        "datatrove-slurm",
        "--resume",
    ]
    text = "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --job-name=tenx-prepare-{sbatch_value(out.name, '--out')}",
            "#SBATCH --ntasks=1",
            "#SBATCH --cpus-per-task=2",
            f"#SBATCH --partition={sbatch_value(cfg.slurm_partition, '--slurm-partition')}",
            f"#SBATCH --time={slurm_time(cfg.slurm_time, '--slurm-time')}",
            f"#SBATCH --output={sbatch_value(out, '--out')}.slurm-%j.out",
            "# The driver: submits the scan and tokenize passes as datatrove job arrays, waits for them, merges,",
            "# and writes the shards; resubmitting this script resumes (completed tasks are skipped).",
            "set -euo pipefail",
            f"cd {shlex.quote(str(Path.cwd()))}",
            shlex.join(command),
        ]
    )
    path = out.with_name(f"{out.name}.sbatch")
    if path.is_dir():
        raise ConfigError(
            f"{path} is a directory; the script goes there: move it away or choose another --out"
        )
    # a path that is not a regular file is never read (a FIFO blocks): atomic_write_text refuses or writes through
    if path.is_file() and "#SBATCH --job-name=tenx-prepare-" not in path.read_text(errors="replace"):
        raise ConfigError(f"{path} exists and tenx did not write it; move it away or choose another --out")
    atomic_write_text(path, text + "\n", mode=0o755)
    return path
