"""Durable file I/O: atomic writes (temp + fsync + rename) and xxhash checksums."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import xxhash

_CHUNK = 1 << 22


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; published files get the permissions a plain open() would give them.
_FILE_MODE = 0o666 & ~_current_umask()


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
        os.fchmod(fd, _FILE_MODE)
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
