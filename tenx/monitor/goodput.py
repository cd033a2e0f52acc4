"""The goodput ledger: where a run's wall time went, across every process that worked on it.

RUN_DIR/ledger.jsonl is append-only, one JSON object per line with "kind", "time" (unix seconds) and "pid".
The supervisor writes `launch` and `exit` around each child it starts; the trainer (rank 0) writes `start`
once it has resumed (its `process_start` is when the run began: the OS process's start, or the run's own
start in a process that trains several runs one after another, run_start_time), then `step`, `checkpoint`,
`rollback` and finally `end`. Lines are flushed but not
fsynced: a process killed mid-write leaves at most a torn last line, which the reader skips.

`compute_goodput` replays the records against one "current history" of trained steps. A `start` resumed
at step S (a restart) or a `rollback` to step S throws away every step after S recorded so far: their
time moves from productive to recompute. What is left at the end is the run's real history:

    wall_s       the time inside jobs: each job from its first launch (or its process's start) to its
                 latest record. A job is one command: a supervisor with every child it launched, or one
                 unsupervised process. The idle time between two commands (a manual `--resume auto`
                 hours after the last one ended) is no one's loss: it is reported as idle_s, outside wall_s
    productive_s step seconds of the final history's steps whose update was applied
    skipped_s    step seconds of every step the numerics guard skipped (its update was never applied),
                 also those a rollback or restart later threw away: `skipped_steps` counts them all, as
                 the `skipped-step` events do
    recompute_s  step seconds of applied steps thrown away by a restart or rollback
    checkpoint_s time the loop was blocked by checkpoint saves
    startup_s    the first process of each job that continues a finished (or no) earlier process: its
                 job's start -> its `start` record
    restart_s    a process relaunched within its job: the previous process's last record -> its `start`
                 record; the first process of a job that continues a process that did not finish (a
                 crash, then a manual resume): its own start -> its `start` record
    other_s      wall_s minus all of the above (evaluation, logging, a step cut off by a kill)
    goodput      productive_s / wall_s
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tenx import rundir
from tenx.utils.io import ends_mid_line, json_line, read_jsonl, require_file
from tenx.utils.text import counted

LEDGER_FILE = rundir.LEDGER
_STEP_FIELD = {"step": "step", "rollback": "to_step"}  # records that are meaningless without this integer
_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """Unix time at which this OS process started; when tenx was imported if /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        since_boot = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    except (OSError, IndexError, ValueError):
        return _IMPORTED_AT
    try:  # /proc/uptime has 10 ms resolution; /proc/stat's btime is rounded to whole seconds
        with open("/proc/uptime") as f:
            started = time.time() - (float(f.read().split()[0]) - since_boot)
    except (OSError, IndexError, ValueError):
        started = _boot_time() + since_boot if _boot_time() else _IMPORTED_AT
    return min(started, _IMPORTED_AT)


_run_start: float | None = None  # mark_run_start's latest mark in this process


def mark_run_start(at: float | None = None) -> float:
    """Say that this process begins a new run now (or `at`): a process that trains several runs one after
    another (`tenx ladder`, `tenx derisk`) calls it before each, so that each run's start-up in the ledger
    runs from its own start, not from the process's (which would charge it every earlier run)."""
    global _run_start
    _run_start = time.time() if at is None else at
    return _run_start


def run_start_time() -> float:
    """When the run this process trains began: the latest `mark_run_start`, else the process's own start
    (process_start_time: its imports and set-up are the run's start-up). The trainer's `start` record
    carries it."""
    started = process_start_time()
    return started if _run_start is None else max(started, _run_start)


def _boot_time() -> float:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, IndexError, ValueError):
        pass
    return 0.0


class Ledger:
    """Appends goodput records to RUN_DIR/ledger.jsonl; one writer per process (the supervisor, or rank 0).

    Every method takes `at=` to record a time other than now (replays and tests); `pid` likewise
    overrides the process id written into each record.
    """

    def __init__(self, run_dir: str | Path, pid: int | None = None) -> None:
        self.path = rundir.RunDir(run_dir).ledger
        self.pid = pid
        self._file: TextIO | None = None

    def _write(self, kind: str, at: float | None, **fields: Any) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torn = ends_mid_line(self.path)
            self._file = open(self.path, "a", encoding="utf-8")
            if torn:  # end a line left torn by a killed writer, so this first record stays parsable
                self._file.write("\n")
        record = {
            "kind": kind,
            "time": time.time() if at is None else at,
            "pid": os.getpid() if self.pid is None else self.pid,
            **fields,
        }
        self._file.write(json_line(record))
        self._file.flush()

    def launch(self, attempt: int, *, at: float | None = None) -> None:
        """Supervisor: a child process (attempt 0, 1, ...) is about to start."""
        self._write("launch", at, attempt=attempt)

    def exit(self, attempt: int, returncode: int, reason: str, *, at: float | None = None) -> None:
        """Supervisor: the child of `attempt` ended."""
        self._write("exit", at, attempt=attempt, returncode=returncode, reason=reason)

    def start(self, step: int, process_start: float, *, at: float | None = None) -> None:
        """Trainer: everything is built and resumed at `step` (0 if fresh); the first step comes next."""
        self._write("start", at, step=step, process_start=process_start)

    def step(self, step: int, seconds: float, skipped: bool = False, *, at: float | None = None) -> None:
        """Trainer: `step` took `seconds` of math; `skipped` when the guard did not apply its update."""
        self._write("step", at, step=step, seconds=seconds, skipped=skipped)

    def checkpoint(self, step: int, blocking_s: float, *, at: float | None = None) -> None:
        """Trainer: saving the checkpoint of `step` blocked the loop for `blocking_s`."""
        self._write("checkpoint", at, step=step, blocking_s=blocking_s)

    def rollback(self, from_step: int, to_step: int, *, at: float | None = None) -> None:
        """Trainer: the guard reloaded the checkpoint of `to_step`; steps after it will be trained again."""
        self._write("rollback", at, from_step=from_step, to_step=to_step)

    def end(self, step: int, *, at: float | None = None) -> None:
        """Trainer: training finished normally at `step`."""
        self._write("end", at, step=step)

    def close(self) -> None:
        """Close the file (a later record opens it again)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """The ledger's records in file order; torn or malformed lines are skipped, a missing ledger is []."""
    records = []
    path = rundir.RunDir(run_dir).ledger
    require_file(path, "the run's goodput ledger")
    for record in read_jsonl(path, torn="any", missing_ok=True):
        kind = record.get("kind")
        if not isinstance(kind, str) or not isinstance(record.get("time"), (int, float)):
            continue
        if kind in _STEP_FIELD and not isinstance(record.get(_STEP_FIELD[kind]), int):
            continue
        records.append(record)
    return records


@dataclass
class _Process:
    """One trainer process, from its `start` record (or its first record, if that was lost)."""

    pid: Any
    start_step: int | None
    start_time: float
    process_start: float | None
    last_time: float
    last_step: int | None
    last_kind: str
    restart_s: float = 0.0
    recompute_s: float = 0.0
    attempt: int | None = None
    launch_time: float | None = None
    supervisor: Any = None
    returncode: int | None = None
    reason: str | None = None


def _empty_report() -> dict[str, Any]:
    return {
        "records": 0,
        "wall_s": 0.0,
        "productive_s": 0.0,
        "recompute_s": 0.0,
        "skipped_s": 0.0,
        "checkpoint_s": 0.0,
        "restart_s": 0.0,
        "startup_s": 0.0,
        "other_s": 0.0,
        "goodput": 0.0,
        "restarts": 0,
        "rollbacks": 0,
        "steps": 0,
        "skipped_steps": 0,
        "recomputed_steps": 0,
        "finished": False,
        "mean_recovery_s": None,
        "idle_s": 0.0,
        "jobs": 0,
        "launches": 0,
        "attempts": [],
        "exits": [],
    }


def compute_goodput(run_dir: str | Path) -> dict[str, Any]:
    """Replay RUN_DIR/ledger.jsonl into the goodput report (see the module docstring for each figure)."""
    records = read_ledger(run_dir)
    report = _empty_report()
    report["records"] = len(records)
    if not records:
        return report

    processes: list[_Process] = []
    by_pid: dict[Any, _Process] = {}
    launches: list[dict[str, Any]] = []
    exits: list[dict[str, Any]] = []
    history: list[tuple[int, float, bool]] = []  # (step, seconds, skipped) of the still-current history
    skipped_lost: list[tuple[int, float, bool]] = []  # skipped steps a rollback or restart threw away
    recompute_s = checkpoint_s = 0.0
    rollbacks = recomputed_steps = 0
    floor = 0  # the step the newest start or rollback resumed at: done, even if its records were lost

    def throw_away(last_kept: int, retried: bool = False) -> float:
        """Drop steps after `last_kept`; with `retried`, `last_kept` too unless its update was skipped.
        Returns the seconds of the applied steps dropped (to train again); dropped skipped steps stay
        skipped steps (`skipped_lost`): they never had an update to lose."""
        nonlocal history, recomputed_steps
        kept: list[tuple[int, float, bool]] = []
        lost: list[tuple[int, float, bool]] = []
        for entry in history:
            step, _, skipped = entry
            keep = step < last_kept or (step == last_kept and (not retried or skipped))
            (kept if keep else skipped_lost if skipped else lost).append(entry)
        history = kept
        recomputed_steps += len(lost)
        return sum((seconds for _, seconds, _ in lost), 0.0)

    def new_process(pid: Any, step: int | None, t: float, process_start: float | None, kind: str) -> _Process:
        proc = _Process(pid, step, t, process_start, t, step, kind)
        processes.append(proc)
        by_pid[pid] = proc
        return proc

    for rec in records:
        kind, t, pid = rec["kind"], float(rec["time"]), rec.get("pid")
        if kind == "launch":
            launches.append(rec)
        elif kind == "exit":
            exits.append(rec)
        elif kind == "start":
            resumed = int(rec.get("step") or 0)
            started = rec.get("process_start")
            process_start = float(started) if isinstance(started, (int, float)) else None
            proc = new_process(pid, resumed, t, process_start, kind)
            proc.recompute_s = throw_away(resumed)
            recompute_s += proc.recompute_s
            floor = resumed
        else:
            proc = by_pid.get(pid) or new_process(pid, None, t, None, kind)
            proc.last_time, proc.last_kind = t, kind
            if kind == "step":
                step = int(rec["step"])
                # A step number seen again without a start/rollback record: the earlier one was lost, unless
                # it was a skipped update (its number may be retried).
                recompute_s += throw_away(step, retried=True)
                history.append((step, float(rec.get("seconds") or 0.0), bool(rec.get("skipped"))))
                proc.last_step = step
            elif kind == "checkpoint":
                checkpoint_s += float(rec.get("blocking_s") or 0.0)
            elif kind == "rollback":
                rollbacks += 1
                floor = int(rec["to_step"])
                recompute_s += throw_away(floor)

    _match_supervisor(processes, launches, exits)
    jobs = _jobs(processes, records)
    startup_s, restarted = 0.0, []
    for i, proc in enumerate(processes):
        previous = processes[i - 1] if i else None
        job_begin = jobs[_job_of(proc)][0]
        if previous is not None and _job_of(previous) == _job_of(proc):  # relaunched within its job
            proc.restart_s = max(0.0, proc.start_time - previous.last_time)
            restarted.append(proc)
        elif previous is not None and previous.last_kind != "end":  # a manual resume after a crash
            proc.restart_s = max(0.0, proc.start_time - max(job_begin, previous.last_time))
            restarted.append(proc)
        elif proc.start_step is not None:
            startup_s += proc.start_time - job_begin
    spans = sorted(jobs.values())
    wall_s = sum(end - begin for begin, end in spans)
    idle_s = sum(max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:]))
    restart_s = sum((p.restart_s for p in restarted), 0.0)
    productive_s = sum((seconds for _, seconds, skipped in history if not skipped), 0.0)
    skipped_s = sum((seconds for _, seconds, skipped in history + skipped_lost if skipped), 0.0)
    accounted = productive_s + recompute_s + skipped_s + checkpoint_s + restart_s + startup_s

    report.update(
        wall_s=wall_s,
        productive_s=productive_s,
        recompute_s=recompute_s,
        skipped_s=skipped_s,
        checkpoint_s=checkpoint_s,
        restart_s=restart_s,
        startup_s=startup_s,
        other_s=wall_s - accounted,
        goodput=productive_s / wall_s if wall_s > 0 else 0.0,
        restarts=len(restarted),
        rollbacks=rollbacks,
        steps=max([step for step, _, _ in history] + [floor]),
        skipped_steps=sum(1 for _, _, skipped in history if skipped) + len(skipped_lost),
        recomputed_steps=recomputed_steps,
        finished=bool(processes) and processes[-1].last_kind == "end",
        mean_recovery_s=(
            sum(p.restart_s + p.recompute_s for p in restarted) / len(restarted) if restarted else None
        ),
        idle_s=idle_s,
        jobs=len(jobs),
        launches=len(launches),
        attempts=[_attempt(p) for p in processes],
        exits=[{k: rec.get(k) for k in ("attempt", "returncode", "reason", "time")} for rec in exits],
    )
    return report


def _job_of(proc: _Process) -> tuple[str, Any]:
    return ("supervisor", proc.supervisor) if proc.supervisor is not None else ("process", id(proc))


def _jobs(processes: list[_Process], records: list[dict[str, Any]]) -> dict[tuple[str, Any], list[float]]:
    """Each job's [begin, end]: a supervisor's first launch -> its last record or its children's; an
    unsupervised process's OS start -> its last record. Overlapping jobs are merged into one span."""
    spans: dict[tuple[str, Any], list[float]] = {}

    def cover(job: tuple[str, Any], begin: float, end: float) -> None:
        span = spans.setdefault(job, [begin, end])
        span[0], span[1] = min(span[0], begin), max(span[1], end)

    for rec in records:
        if rec["kind"] in ("launch", "exit"):
            cover(("supervisor", rec.get("pid")), float(rec["time"]), float(rec["time"]))
    for proc in processes:
        begin = proc.start_time
        if proc.supervisor is None and proc.process_start is not None:
            begin = min(begin, proc.process_start)
        cover(_job_of(proc), begin, proc.last_time)
    merged: dict[tuple[str, Any], list[float]] = {}
    for job, span in sorted(spans.items(), key=lambda item: item[1][0]):
        last = next(reversed(merged.values()), None) if merged else None
        if last is not None and span[0] < last[1]:  # jobs that overlap in time: one span
            last[1] = max(last[1], span[1])
        else:
            merged[job] = list(span)
    for job in spans:  # every job still names a span (the merged one it fell into)
        if job not in merged:
            merged[job] = next(s for s in merged.values() if s[0] <= spans[job][0] <= s[1])
    return merged


def _match_supervisor(
    processes: list[_Process], launches: list[dict[str, Any]], exits: list[dict[str, Any]]
) -> None:
    """Give each trainer process the supervisor attempt whose launch precedes its start, and that exit."""
    for i, launch in enumerate(launches):
        opened = float(launch["time"])
        closes = float(launches[i + 1]["time"]) if i + 1 < len(launches) else float("inf")
        proc = next(
            (p for p in processes if p.start_step is not None and opened <= p.start_time < closes), None
        )
        if proc is None:  # the child died before it started training
            continue
        proc.attempt, proc.launch_time, proc.supervisor = launch.get("attempt"), opened, launch.get("pid")
        for rec in exits:
            if rec.get("attempt") == proc.attempt and opened <= float(rec["time"]) < closes:
                proc.returncode, proc.reason = rec.get("returncode"), rec.get("reason")
                break


def _attempt(p: _Process) -> dict[str, Any]:
    """A process's row of the report; its startup_s runs from its launch or OS start, whichever is later."""
    began = [t for t in (p.process_start, p.launch_time) if t is not None]
    return {
        "pid": p.pid,
        "attempt": p.attempt,
        "start_step": p.start_step,
        "last_step": p.last_step,
        "start_time": p.start_time,
        "last_time": p.last_time,
        "startup_s": p.start_time - max(began) if began and p.start_step is not None else None,
        "restart_s": p.restart_s,
        "recompute_s": p.recompute_s,
        "returncode": p.returncode,
        "reason": p.reason,
    }


def _share(seconds: float, wall: float) -> str:
    return f"{100 * seconds / wall:5.1f}%" if wall > 0 else "    -"


def format_goodput(report: dict[str, Any]) -> str:
    """The report as a readable block: goodput, then each category's seconds and share of wall time."""
    if not report.get("records"):
        return "goodput     no ledger records yet (RUN_DIR/ledger.jsonl is written once training starts)"
    wall = report["wall_s"]
    state = "finished" if report["finished"] else "not finished"
    lines = [
        f"goodput     {100 * report['goodput']:.1f}% of {wall:,.1f} s wall ({state} at step {report['steps']})"
    ]
    rows = [
        ("productive", report["productive_s"], ""),
        ("startup", report["startup_s"], ""),
        ("restarts", report["restart_s"], counted(report["restarts"], "restart")),
        ("recompute", report["recompute_s"], f"{counted(report['recomputed_steps'], 'step')} trained again"),
        ("checkpoint", report["checkpoint_s"], "blocking saves"),
        ("skipped", report["skipped_s"], f"{counted(report['skipped_steps'], 'step')} without an update"),
        ("other", report["other_s"], "eval, logging, steps cut off by a kill"),
    ]
    for name, seconds, note in rows:
        lines.append(f"  {name:<11}{seconds:>12,.1f} s {_share(seconds, wall)}  {note}".rstrip())
    recovery = report["mean_recovery_s"]
    lines.append(
        f"  restarts {report['restarts']} | rollbacks {report['rollbacks']} | mean recovery per restart "
        + (f"{recovery:,.1f} s" if recovery is not None else "-")
    )
    if report.get("jobs", 0) > 1:
        lines.append(
            f"  {report['jobs']} separate commands; {report['idle_s']:,.1f} s between them not counted"
        )
    return "\n".join(lines)
