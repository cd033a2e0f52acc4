"""The run's event log: rare, notable happenings (faults, rollbacks, hangs, restarts) in RUN_DIR/events.jsonl.

Each event is one JSON line, written with a single append and fsynced before `emit` returns, so a record
made just before a SIGKILL (a fault injector announcing the kill) is on disk when the process dies. The
file stays strict JSON: NaN and infinities are written as the strings "nan", "inf" and "-inf", and NumPy or
torch scalars as plain numbers.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tenx import rundir
from tenx.errors import DataError
from tenx.utils.io import fsync_dir, read_jsonl


def _plain(value: Any) -> Any:
    """`value` with non-finite floats as strings and containers converted, recursively."""
    if isinstance(value, float):  # numpy.float64 included: it subclasses float
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return float(value)
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    return value


def _fallback(value: Any) -> Any:
    """json.dumps hook: NumPy/torch scalars and arrays become numbers and lists, anything else its str()."""
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if hasattr(value, "item"):
        return _plain(value.item())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def json_line(record: dict[str, Any]) -> str:
    """`record` as one line of strict JSON (no NaN/Infinity tokens), newline included."""
    return json.dumps(_plain(record), default=_fallback, allow_nan=False) + "\n"


def append_line(path: Path, line: str, sync: bool) -> None:
    """Append `line` with one write; first end a torn last line left by a killed writer."""
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        if ends_mid_line(path):
            line = "\n" + line
        os.write(fd, line.encode("utf-8"))
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if created and sync:
        fsync_dir(path.parent)


def ends_mid_line(path: Path) -> bool:
    """Whether `path` ends in a line without its newline (the torn write of a killed process)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


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


def require_file(path: Path, what: str) -> None:
    """A DataError naming `path` when it exists but is not a regular file (a directory in a file's place)."""
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise DataError(
            f"{path} is {kind}, not {what}; move it out of the way (tenx writes this file itself)"
        )


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
