"""The run's event log: rare, notable happenings (faults, rollbacks, hangs, restarts) in RUN_DIR/events.jsonl.

Each event is one JSON line (tenx.utils.io.json_line: strict JSON), written with a single append and fsynced
before `emit` returns, so a record made just before a SIGKILL (a fault injector announcing the kill) is on
disk when the process dies.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tenx import rundir
from tenx.utils.io import append_line, json_line, read_jsonl, require_file


class EventLog:
    """Appends events to RUN_DIR/events.jsonl; any number of processes may append, one event at a time."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = rundir.RunDir(run_dir).events

    def emit(self, kind: str, step: int | None = None, **fields: Any) -> dict[str, Any]:
        """Write one event (fsynced before returning) and return it as written."""
        record = {"time": time.time(), "kind": kind, "step": step, "pid": os.getpid(), **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json_line(record)
        append_line(self.path, line, sync=True)
        return json.loads(line)


def event_problem(record: dict[str, Any]) -> str | None:
    """Why `record` is not an event tenx can use (its time not a finite number, its kind not a string, its
    step neither a whole number nor null), or None when it is one."""
    when = record.get("time")
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        return f"time {when!r} is not a finite number"
    if not isinstance(record.get("kind"), str):
        return f"kind {record.get('kind')!r} is not a string"
    step = record.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        return f"step {step!r} is not a whole number"
    return None


def read_events_counted(run_dir: str | Path) -> tuple[list[dict[str, Any]], int]:
    """(the run's usable events, oldest first; how many JSON objects were passed over because a field had the
    wrong type, see event_problem). Torn lines and lines that are not JSON objects are passed over uncounted:
    a killed writer leaves them. A directory where events.jsonl belongs is a DataError naming it."""
    path = rundir.RunDir(run_dir).events
    require_file(path, "the run's event log")
    events, malformed = [], 0
    for record in read_jsonl(path, torn="any", missing_ok=True):
        if event_problem(record) is None:
            events.append(record)
        else:
            malformed += 1
    return events, malformed


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """All usable events of a run, oldest first ([] when there are none; a torn line, a line that is not a
    JSON object and an event with a malformed time, kind or step are passed over: read_events_counted)."""
    return read_events_counted(run_dir)[0]
