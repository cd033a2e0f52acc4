"""Durable file I/O: atomic writes (temp + fsync + rename) and xxhash checksums."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import xxhash

from tenx.errors import TenxError

_CHUNK = 1 << 22


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; published files get the permissions a plain open() would give them.
FILE_MODE = 0o666 & ~_current_umask()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory entry so a rename inside it survives a power loss."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Atomically write UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> None:
    """Atomically write JSON with sorted keys (so equal content gives identical bytes)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


def file_xxhash(path: str | os.PathLike[str]) -> str:
    """xxh3-64 hex digest of a file's bytes, read in chunks."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def bytes_xxhash(data: bytes) -> str:
    """xxh3-64 hex digest of bytes."""
    return xxhash.xxh3_64_hexdigest(data)


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


def cache_dir() -> Path:
    """Where tenx keeps data it prepares on its own (the ladder's corpus): $TENX_CACHE_DIR, else
    $XDG_CACHE_HOME/tenx, else ~/.cache/tenx. Never a path relative to the working directory."""
    explicit = os.environ.get("TENX_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "tenx"
