"""One writer per directory: an advisory lock that names its holder and ends with the process.

`exclusive_writer(path, what)` holds `flock` on the file `path` (created if missing, never deleted: deleting
a lock file races with the next holder) for the duration of a `with` block, and writes into it who holds it
(process id, host, command line, since when). A second process is refused at once with a TenxError naming
the holder, before it has written anything. The kernel releases the lock when the holder exits, however it
exits (SIGKILL, a crash, a power loss), so a stale lock file never blocks anyone. A directory the lock
created is removed again when the block wrote nothing else into it (a command refused at its start
leaves no empty run directory behind).

A process that holds a lock may start children that write for it (`tenx train --supervise` starts the
training process): `holder_environment(path)` gives the environment variable that lets them through. The
same process taking the same lock again (the ladder holds a run's lock around `train`) nests.

Where the file system has no `flock` (some network file systems), the block runs unlocked after one warning
line: the lock keeps careless mistakes out, it is not a security boundary.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tenx.errors import TenxError
from tenx.rundir import RunDir

T = TypeVar("T")

HOLDER_ENV = "TENX_LOCK_HOLDER"
"""PID:PATH of a lock a parent process holds for its children (a line each)."""

_held: dict[str, int] = {}
"""The locks this process holds: resolved path -> nesting depth."""


def _key(path: Path) -> str:
    return str(path.resolve())


def holder_environment(path: str | os.PathLike[str]) -> dict[str, str]:
    """The environment entry that lets this process's children write under the lock on `path` it holds."""
    entry = f"{os.getpid()}:{_key(Path(path))}"
    inherited = os.environ.get(HOLDER_ENV)
    return {HOLDER_ENV: f"{inherited}\n{entry}" if inherited else entry}


def _granted_by_parent(key: str, holder: dict[str, Any]) -> bool:
    """Whether the process holding the lock on `key` handed it to this one (its environment says so)."""
    for entry in os.environ.get(HOLDER_ENV, "").splitlines():
        pid, _, path = entry.partition(":")
        if path == key and pid == str(holder.get("pid")) and holder.get("host") == socket.gethostname():
            return True
    return False


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        value = json.loads(os.pread(fd, 4096, 0).decode("utf-8", errors="replace") or "{}")
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def describe_holder(holder: dict[str, Any]) -> str:
    """'process 123 on host (tenx train ..., since 2026-11-27 02:10:00)', or 'another process'."""
    if not isinstance(holder.get("pid"), int):
        return "another process"
    since = holder.get("since")
    when = (
        datetime.datetime.fromtimestamp(since).strftime("%Y-%m-%d %H:%M:%S")
        if isinstance(since, (int, float)) and 0 < since < 1e11
        else "an unknown time"
    )
    return f"process {holder['pid']} on {holder.get('host', '?')} ({str(holder.get('command', '?'))[:200]}, since {when})"


@contextmanager
def exclusive_writer(path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Hold the lock on `path` while the block runs; a TenxError naming `what` and the holder if another
    process holds it (see the module docstring)."""
    path = Path(path)
    key = _key(path)
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        fcntl = None  # type: ignore[assignment]
    created = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise TenxError(
            f"cannot create the lock {path} of the {what}: {e.strerror or e}; nothing was written"
        ) from None
    locked = False
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                holder = _read_holder(fd)
                if not _granted_by_parent(key, holder):
                    raise TenxError(
                        f"the {what} {path.parent} is being written by {describe_holder(holder)}; two "
                        "processes writing one run interleave their files. Wait for it to finish or stop "
                        "it, or choose another directory"
                    ) from None
            except OSError as e:
                print(
                    f"tenx: cannot lock {path} ({e.strerror}): nothing stops a second writer", file=sys.stderr
                )
        if locked:
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:500],
                "since": time.time(),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
    finally:
        if created and locked and _only(path):  # a command that failed before writing leaves nothing behind
            path.unlink(missing_ok=True)
            for directory in created:  # the ones this call made, deepest first
                try:
                    directory.rmdir()
                except OSError:
                    break
        if locked and fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _only(path: Path) -> bool:
    """Whether the lock file is all its directory holds."""
    try:
        return [p.name for p in path.parent.iterdir()] == [path.name]
    except OSError:
        return False


def as_run_writer(run_dir: str | os.PathLike[str], rank: int, body: Callable[[RunDir], T]) -> T:
    """`body(RunDir(run_dir))` as the run's one writer: the directory is checked writable first, and rank 0
    holds its writer lock throughout (the other ranks of the job write through rank 0's lock)."""
    from tenx.utils.storage import ensure_writable

    run = RunDir(run_dir)
    ensure_writable(run.root, "run directory")
    if rank != 0:
        return body(run)
    with exclusive_writer(run.writer_lock, "run directory"):
        return body(run)
