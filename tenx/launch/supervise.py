"""The supervisor: run training as a child process and restart it after a crash, a hang or a kill.

`tenx train ... --supervise` runs `python -m tenx train ...` (or a launcher such as torchrun) as a child.
When the child ends with a failure it is started again with `--resume auto`, which continues from the
newest checkpoint that verifies. What is retried and what is not:

- exit 0: done.
- exit 2: an error tenx reports to the user (bad config, corrupt data, a guard that gave up): restarting
  cannot fix it, so the supervisor stops and says so.
- anything else (an exception: 1; the watchdog: 3; a signal such as SIGKILL): restart.

An exception at the same step in two attempts in a row is deterministic (a bad batch, or a library bug
it triggers): before the next attempt the data of that step is skipped (RUN_DIR/data_skips.json, a
`data-skipped` event), as the guard does after a streak of bad steps.

Restarts are limited: at most `max_restarts` in all, and the supervisor gives up when the same failure
(same exit status at the same step) happens `same_failure_limit` times in a row. Attempts that made no
progress wait `backoff_s`, doubling up to a minute, before the next start. These options are the
`[supervisor]` section, SupervisorConfig (its fields are `tenx train`'s supervisor flags).

A warm spare cuts restart time: while the child trains, the next interpreter (tenx/commands/worker.py) is
already started with torch and tenx imported and waits on its stdin for its arguments (single-process runs
only). The
supervisor also watches the run's ledger as a heartbeat (`heartbeat_timeout_s`): a child that writes no
step for that long gets SIGUSR1 (its stacks are dumped to the run directory) and then SIGKILL, which
catches hangs the in-process watchdog cannot see (C code that never releases the GIL).

A multi-node job runs one supervisor per node around that node's torchrun (the Slurm script of
tenx/launch/slurm.py). `node_env` names the environment variable holding the node's index (SLURM_NODEID):
then no supervisor holds the run directory's lock (training rank 0 does, on whichever node the rendezvous
puts it), and only node 0's writes the ledger's launch and exit records, its events and data skips, so the
run's records count each attempt once. Every node's supervisor restarts its own torchrun; the restarted
torchruns meet again at the rendezvous.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tenx import config as cfglib
from tenx.errors import TenxError
from tenx.monitor.events import EventLog, read_events
from tenx.monitor.goodput import Ledger, read_ledger
from tenx.rundir import RunDir
from tenx.train.watchdog import EXIT_HANG
from tenx.utils.io import atomic_write_json
from tenx.utils.lock import exclusive_writer, holder_environment
from tenx.utils.text import counted

EXIT_USAGE = 2
"""Exit status of a run that stopped with an error restarting cannot fix."""
SUPERVISED_ENV = "TENX_SUPERVISED"
"""Set to 1 in the environment of the children: their `tenx train` leaves the goodput to the supervisor,
which prints it once for the whole run (a child's own figure would stop at its own exit)."""
_FATAL_FAULTS = ("crash", "sigkill", "hang")
"""Injected faults that end an attempt (a `fault` event of one names the step it fired at)."""


@dataclass
class SupervisorConfig:
    """How the supervisor restarts a run: `tenx train --supervise`'s options."""

    SECTION: ClassVar[str] = "supervisor"
    """Where its fields sit in the config tree (errors name `supervisor.FIELD`)."""

    max_restarts: int = cfglib.field(10, ge=0, help="with --supervise: restarts before giving up")
    same_failure_limit: int = cfglib.field(
        3,
        ge=1,
        help="with --supervise: give up when the same failure repeats this many times at the same step",
    )
    backoff_s: float = cfglib.field(
        1.0,
        ge=0,
        help="with --supervise: seconds before restarting an attempt "
        "that made no progress (doubles each time, up to 60)",
    )
    heartbeat_timeout_s: float = cfglib.field(
        0.0,
        ge=0,
        help="with --supervise: kill a child whose ledger has not grown for this many seconds (0: off; "
        "the in-process watchdog, [watchdog] timeout_s, is on by default)",
    )
    launcher: str = cfglib.field(
        "",
        help="with --supervise: the command that runs `tenx` (default `python -m tenx`), e.g. "
        "'torchrun --nproc_per_node 2 -m tenx' to restart a whole multi-process job",
    )
    warm_spare: bool = cfglib.field(
        True, help="keep the next interpreter started, torch imported (default launcher only)"
    )
    node_env: str = cfglib.field(
        "",
        help="with --supervise in a multi-node job: the environment variable holding this node's index "
        "(SLURM_NODEID); rank 0 then holds the run's lock, and only node 0's supervisor writes the ledger",
    )

    def validate(self) -> None:
        """Check bounds; names the offending field."""
        cfglib.check_bounds(self)


def describe_exit(returncode: int) -> str:
    """A short human reason for a child's exit status."""
    if returncode == 0:
        return "finished"
    if returncode == EXIT_USAGE:
        return "error that a restart cannot fix (exit 2)"
    if returncode == EXIT_HANG:
        return "hang detected by the watchdog (exit 3)"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"crashed (exit {returncode})"


@dataclass
class Attempt:
    """One child process: its exit and how far it got."""

    index: int
    pid: int
    returncode: int
    reason: str
    start_step: int | None
    last_step: int | None
    seconds: float


@dataclass
class SupervisorReport:
    """What happened under supervision."""

    attempts: list[Attempt] = field(default_factory=list)
    finished: bool = False
    gave_up: str | None = None
    wall_s: float = 0.0

    @property
    def restarts(self) -> int:
        """Child processes started after the first."""
        return max(0, len(self.attempts) - 1)


def _steps_of(run_dir: Path, attempt: int) -> tuple[int | None, int | None]:
    """(resumed-at step, last completed step) that attempt `attempt` wrote to the run's ledger.

    Records are attributed by position (after the supervisor's `launch` of that attempt), not by process
    id: under a launcher such as torchrun the supervisor's child is the launcher, not the training rank.
    """
    start = last = None
    current = None
    for rec in read_ledger(run_dir):
        if rec["kind"] == "launch":
            current = rec.get("attempt")
            continue
        if current != attempt:
            continue
        if rec["kind"] == "start" and start is None:
            start = int(rec["step"])
        elif rec["kind"] == "step":
            last = int(rec["step"])
    return start, last if last is not None else start


def describe_failure_point(events: list[dict[str, Any]], last_step: int | None) -> str:
    """Where an attempt failed, from its events (oldest first) and its last completed step.

    The last event that ends a process names the step it happened in: an injected crash, SIGKILL or hang
    (`fault`, fired as step N is about to run, or during step N's checkpoint save with `phase=save`), an
    exception (`crash`) or the watchdog (`hang`); the crash an injected crash raises and the watchdog's
    report of an injected hang defer to the fault. Without one (a kill from outside) only the last step
    the ledger recorded as finished is known, and that is what the text says.
    """
    if last_step is None:
        done = "before its first step finished"
    else:
        done = f"after step {last_step} finished" if last_step else "before any step finished"
    fatal = [
        e
        for e in events
        if isinstance(e.get("step"), int)
        and (e.get("kind") in ("crash", "hang") or e.get("fault_kind") in _FATAL_FAULTS)
    ]
    for i in reversed(range(len(fatal))):
        event, cause = fatal[i], fatal[i - 1] if i else {}
        kind, step = event.get("kind"), event["step"]
        if cause.get("kind") == "fault" and (
            (kind == "crash" and event.get("exception") == "InjectedFault")
            or (kind == "hang" and cause.get("fault_kind") == "hang")
        ):
            continue  # the consequence of the injected fault before it, which names the step it fired at
        if kind == "fault":
            text = str(event.get("fault", event.get("fault_kind")))
            if "phase=save" in text.replace(" ", ""):
                return f"while saving step {step}'s checkpoint (fault {text})"
            return f"at step {step} (fault {text}), {done}"
        if kind == "crash":
            exception = event.get("exception", "an exception")
            if event.get("phase") == "after-step":
                return f"after step {step} finished ({exception})"
            return f"at step {step} ({exception}), {done}"
        if kind == "hang":
            return f"at step {step} (no progress), {done}"
    return done


class _Spares:
    """Keeps one pre-started interpreter (torch and tenx imported) waiting for its arguments."""

    def __init__(self, enabled: bool, env: dict[str, str] | None) -> None:
        self.enabled, self.env = enabled, env
        self.spare: subprocess.Popen[bytes] | None = None

    def warm(self) -> None:
        if self.enabled and self.spare is None:
            self.spare = subprocess.Popen(
                [sys.executable, "-m", "tenx.commands.worker"], stdin=subprocess.PIPE, env=self.env
            )

    def take(self, argv: list[str]) -> subprocess.Popen[bytes] | None:
        spare, self.spare = self.spare, None
        if spare is None or spare.poll() is not None or spare.stdin is None:
            return None
        spare.stdin.write((json.dumps(argv) + "\n").encode())
        spare.stdin.close()
        return spare

    def close(self) -> None:
        if self.spare is not None and self.spare.stdin is not None:
            self.spare.stdin.close()
            try:
                self.spare.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.spare.kill()
        self.spare = None


def supervise(
    train_args: list[str],
    run_dir: str | Path,
    cfg: SupervisorConfig | None = None,
    *,
    resume: str | None = None,
    env: dict[str, str] | None = None,
) -> SupervisorReport:
    """Run `tenx <train_args>` until it finishes, restarting it with `--resume auto` after failures.

    `train_args` start with `train` and must not contain `--resume` (give `resume` for the first start).
    `cfg.launcher` replaces `python -m tenx` (e.g. `torchrun --nproc_per_node 2 -m tenx`); a warm spare is
    used only with the default launcher.
    """
    cfg = cfg or SupervisorConfig()
    cfg.validate()
    launcher = shlex.split(cfg.launcher) or None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    node = node_index(cfg.node_env)
    if node is not None:  # one supervisor per node: the lock is rank 0's, the records node 0's
        env = {**(os.environ if env is None else env), SUPERVISED_ENV: "1"}
        return _supervise(train_args, run_dir, cfg, launcher, resume, env, records=node == 0)
    lock = RunDir(run_dir).writer_lock
    with exclusive_writer(lock, "run directory"):  # its children write under it
        env = {**(os.environ if env is None else env), SUPERVISED_ENV: "1", **holder_environment(lock)}
        return _supervise(train_args, run_dir, cfg, launcher, resume, env)


def _supervise(
    train_args: list[str],
    run_dir: Path,
    cfg: SupervisorConfig,
    launcher: list[str] | None,
    resume: str | None,
    env: dict[str, str],
    records: bool = True,
) -> SupervisorReport:
    max_restarts, same_failure_limit = cfg.max_restarts, cfg.same_failure_limit
    events, ledger = EventLog(run_dir), Ledger(run_dir)
    prefix = launcher or [sys.executable, "-m", "tenx"]
    spares = _Spares(cfg.warm_spare and launcher is None, env)
    report = SupervisorReport()
    t0 = time.monotonic()
    stop_signal: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: Any) -> None:
        stop_signal.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    same_failures, no_progress = 0, 0
    try:
        spares.warm()
        while True:
            attempt = len(report.attempts)
            args = (
                [*train_args, "--resume", "auto" if attempt else str(resume)]
                if (attempt or resume)
                else train_args
            )
            if records:
                ledger.launch(attempt)
            started, launched_at = time.monotonic(), time.time()
            child = spares.take(args)
            if child is None:
                child = subprocess.Popen([*prefix, *args], env=env)
            spares.warm()
            returncode = _wait(child, run_dir, cfg.heartbeat_timeout_s, events, attempt)
            reason = describe_exit(returncode)
            if records:
                ledger.exit(attempt, returncode, reason)
            start_step, last_step = _steps_of(run_dir, attempt)
            report.attempts.append(
                Attempt(
                    attempt, child.pid, returncode, reason, start_step, last_step, time.monotonic() - started
                )
            )
            if returncode == 0:
                report.finished = True
                break
            if stop_signal:
                report.gave_up = f"stopped by {signal.Signals(stop_signal[0]).name}"
                break
            if returncode == EXIT_USAGE:
                report.gave_up = f"attempt {attempt} ended with an {reason}; see its message above"
                break
            prev = report.attempts[-2] if len(report.attempts) > 1 else None
            same = prev is not None and (prev.returncode, prev.last_step) == (returncode, last_step)
            same_failures = same_failures + 1 if same else 1
            if same and returncode == 1 and records:
                _skip_crashing_data(run_dir, events, launched_at)
            where = describe_failure_point(
                [e for e in read_events(run_dir) if float(e.get("time", 0)) >= launched_at], last_step
            )
            if same_failures >= same_failure_limit:
                report.gave_up = (
                    f"the same failure ({reason} {where}) happened {same_failures} times in a row; "
                    "not restarting"
                )
                break
            if report.restarts >= max_restarts:
                report.gave_up = f"{reason}; reached --max-restarts {max_restarts}"
                break
            progressed = last_step is not None and (start_step is None or last_step > start_step)
            no_progress = 0 if progressed else no_progress + 1
            delay = min(60.0, cfg.backoff_s * 2 ** (no_progress - 1)) if no_progress else 0.0
            if records:
                events.emit(
                    "restart",
                    last_step,
                    attempt=attempt + 1,
                    returncode=returncode,
                    reason=reason,
                    delay_s=delay,
                )
            print(
                f"tenx supervise: attempt {attempt} {reason} {where}; restarting"
                + (f" in {delay:.1f} s" if delay else ""),
                file=sys.stderr,
                flush=True,
            )
            if delay:
                time.sleep(delay)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        spares.close()
    report.wall_s = time.monotonic() - t0
    if not records:
        return report
    events.emit(
        "supervisor-end",
        report.attempts[-1].last_step if report.attempts else None,
        finished=report.finished,
        restarts=report.restarts,
        gave_up=report.gave_up,
    )
    return report


def node_index(node_env: str) -> int | None:
    """This node's index in a multi-node job, from the environment variable `node_env` (None when it is
    empty: a single-node supervisor); a TenxError naming --node-env when it is unset or not an index."""
    if not node_env:
        return None
    value = os.environ.get(node_env)
    if value is None or not value.isdigit():
        raise TenxError(
            f"--node-env {node_env}: the variable is {'unset' if value is None else repr(value)}, not this "
            "node's index; run the supervisor as a task of the job (srun sets SLURM_NODEID)"
        )
    return int(value)


def _skip_crashing_data(run_dir: Path, events: EventLog, since: float) -> None:
    """A crash that repeats at the same step after a restart is deterministic: its data is skipped.

    The attempt's last `crash` event names the loader positions [start, end) of the step it died in; they
    join RUN_DIR/data_skips.json (as a guard rollback's do), so the next attempt trains past them, and a
    `data-skipped` event records it. `tenx triage` then finds out why the step crashed."""
    crashes = [
        e
        for e in read_events(run_dir)
        if e.get("kind") == "crash" and float(e.get("time", 0)) >= since and e.get("phase") == "step"
    ]
    position = crashes[-1].get("position") if crashes else None
    if not (isinstance(position, list) and len(position) == 2 and all(isinstance(p, int) for p in position)):
        return
    start, end = position
    if not 0 <= start < end:
        return
    path = RunDir(run_dir).data_skips
    try:
        skips = json.loads(path.read_text())["skips"] if path.exists() else []
    except (OSError, ValueError, KeyError, TypeError):
        return  # leave a damaged file alone: the trainer names it when it reads it
    if [start, end] in skips:
        return
    atomic_write_json(path, {"skips": [*skips, [start, end]]})
    events.emit(
        "data-skipped",
        crashes[-1].get("step"),
        positions=[start, end],
        reason=f"{crashes[-1].get('exception')} at the same step in two attempts in a row",
    )
    print(
        f"tenx supervise: step {crashes[-1].get('step')} crashed twice in a row; skipping its data "
        f"(loader positions {start}..{end}) on the next attempt",
        file=sys.stderr,
        flush=True,
    )


def _wait(
    child: subprocess.Popen[bytes], run_dir: Path, heartbeat_timeout_s: float, events: EventLog, attempt: int
) -> int:
    """Wait for the child; kill it when the ledger (written every step) goes stale for too long."""
    if heartbeat_timeout_s <= 0:
        return child.wait()
    ledger = RunDir(run_dir).ledger
    last_seen = time.monotonic()
    last_mtime = ledger.stat().st_mtime if ledger.exists() else 0.0
    while True:
        try:
            return child.wait(timeout=min(1.0, heartbeat_timeout_s / 4))
        except subprocess.TimeoutExpired:
            pass
        mtime = ledger.stat().st_mtime if ledger.exists() else 0.0
        if mtime != last_mtime:
            last_mtime, last_seen = mtime, time.monotonic()
        elif time.monotonic() - last_seen > heartbeat_timeout_s:
            events.emit(
                "hang",
                None,
                attempt=attempt,
                detected_by="supervisor heartbeat",
                waited_s=heartbeat_timeout_s,
            )
            child.send_signal(signal.SIGUSR1)  # the trainer's faulthandler dumps its stacks
            time.sleep(1.0)
            child.kill()
            child.wait()
            return EXIT_HANG


def format_supervision(report: SupervisorReport) -> str:
    """One line per attempt, then the outcome."""
    lines = ["tenx supervise:"]
    for a in report.attempts:
        lines.append(
            f"  attempt {a.index} (pid {a.pid}): {a.reason}; steps {a.start_step} -> {a.last_step} "
            f"in {a.seconds:.1f} s"
        )
    outcome = "finished" if report.finished else f"gave up: {report.gave_up}"
    # no wall time here: the goodput block printed after this one gives the run's (from its ledger)
    lines.append(f"  {outcome} after {counted(report.restarts, 'restart')}")
    return "\n".join(lines)


def child_environment() -> dict[str, str]:
    """The environment for children (unbuffered output so their lines interleave in order)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}
