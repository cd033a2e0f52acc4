"""The place a file is written, when it fails: a full, read-only or forbidden file system named in words
(storage_error, describe_storage_problem), the free space left, and the check that a directory can be
written before a run starts (ensure_writable)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from tenx.errors import TenxError

# Errors of the place a file is written, not of tenx: the user frees space or picks another directory.
STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "file too large for this file system",
}
_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
LOW_SPACE = 1 << 20


def storage_error(error: BaseException) -> OSError | None:
    """The OSError of a full, read-only or forbidden filesystem behind `error` (its causes and contexts,
    and the per-rank failures of a torch.distributed.checkpoint exception), or None."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: exception or traceback}
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent), None if unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def describe_storage_problem(error: BaseException, path: str | os.PathLike[str]) -> str | None:
    """'no space left on device (12 KB free on /mnt/x)'-style words for a failed write under `path`,
    or None when the failure is not the filesystem's. A write into a full filesystem does not always
    surface as ENOSPC (torch's zip writer reports a position mismatch), so a filesystem with under 1 MiB
    free counts as full too."""
    found = storage_error(error)
    free = free_bytes(path)
    where = f"{format_bytes(free)} free on the file system of {path}" if free is not None else str(path)
    if found is not None:
        words, target = STORAGE_ERRNOS[found.errno or 0], found.filename or path
        low = found.errno in _SPACE and free is not None and free < LOW_SPACE
        return f"{words} ({target}; {where})" if low else f"{words} ({target})"
    if free is not None and free < LOW_SPACE:
        return f"no space left on device ({where})"
    return None


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KB' (powers of 1024, one decimal)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def ensure_writable(directory: str | os.PathLike[str], what: str) -> None:
    """Check that a file can be created in `directory`, or raise TenxError naming it and what to do.

    The probe goes into the deepest folder that already exists and creates no folder: several ranks
    check the same run directory at once, and a check that created and removed folders raced with them
    (one rank removed the folder another was probing). Each probe file has a unique name."""
    directory = Path(directory)
    probe_dir = next((p for p in (directory, *directory.parents) if p.exists()), Path("."))
    try:
        if not probe_dir.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(probe_dir))
        fd, name = tempfile.mkstemp(dir=probe_dir, prefix=".tenx-write-check.")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        problem = STORAGE_ERRNOS.get(e.errno or 0, e.strerror or type(e).__name__)
        raise TenxError(
            f"cannot write the {what} {directory}: {problem} ({e.filename or directory}); nothing was "
            f"written: choose a directory on a writable file system with free space"
        ) from e
