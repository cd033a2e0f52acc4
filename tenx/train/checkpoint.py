"""Checkpoints: torch.distributed.checkpoint (DCP) tensors plus a JSON manifest with checksums.

A checkpoint directory `step_00000020/` holds DCP's files (the format a sharded run writes too) and
`tenx_checkpoint.json`: step, token count, loader position, Python/NumPy RNG states, callback states,
the resolved config and an xxhash for every file. It is written under a temporary name, fsynced and
renamed, so a crash mid-save never damages an existing checkpoint; a directory without a manifest, or
with a file whose size or hash differs, does not verify and is never loaded. DCP's metadata is a pickle:
it is read only after its checksum matched, through an unpickler that admits DCP's own record types.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from tenx.errors import CheckpointError
from tenx.utils.io import atomic_write_json, file_xxhash, fsync_dir

FORMAT = "tenx-ckpt/1"
MANIFEST = "tenx_checkpoint.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class _SafeUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata record types and plain torch descriptors (dtype, layout, Size)."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or module in (
            "collections",
            "torch.serialization",
        ):
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if name == "Size" or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)
        if module == "builtins" and name in ("set", "frozenset", "slice", "tuple", "list", "dict"):
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which tenx does not load")


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that refuses pickled (non-tensor) entries; tenx keeps such state in JSON."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; tenx loads only tensors"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP reader whose metadata load never runs arbitrary pickled code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with open(path, "rb") as f:
            metadata = _SafeUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def step_dir(root: Path, step: int) -> Path:
    """The directory name of the checkpoint at `step`."""
    return root / f"step_{step:08d}"


def save_checkpoint(root: str | Path, step: int, tensors: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write `tensors` (nested state dicts) with DCP and `meta` as JSON; atomically publish step_N/."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with warnings.catch_warnings():  # DCP warns that it saves in a single process: that is intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=FileSystemWriter(tmp, sync_files=True))
    files = {
        p.name: {"bytes": p.stat().st_size, "xxhash": file_xxhash(p)}
        for p in sorted(tmp.iterdir())
        if p.is_file()
    }
    atomic_write_json(tmp / MANIFEST, {**meta, "format": FORMAT, "step": step, "files": files})
    fsync_dir(tmp)
    if final.exists():  # a re-save of the same step (after a resume): replace it in two renames
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    return final


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's JSON manifest, without hashing its files (see verify_checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        meta = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: {MANIFEST} is missing") from None
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not valid JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Return the checkpoint's manifest after checking every file's size and hash; else CheckpointError."""
    path = Path(path)
    meta = read_checkpoint_meta(path)
    for name, info in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: file {name} has {size} bytes, expected {info['bytes']} (truncated or damaged)"
            )
        if file_xxhash(f) != info["xxhash"]:
            raise CheckpointError(f"checkpoint {path}: file {name} fails its checksum (corrupt)")
    return meta


def load_checkpoint(path: str | Path, tensors: dict[str, Any]) -> dict[str, Any]:
    """Verify, then load DCP tensors in place into `tensors`; returns the JSON manifest."""
    meta = verify_checkpoint(path)
    reader = SafeFileSystemReader(path)
    reader.read_metadata()  # refuses foreign pickled objects with a clear error, before DCP's own read
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=reader, planner=TensorOnlyLoadPlanner())
    except (Exception, CheckpointException) as e:  # DCP's exception derives from BaseException
        text = str(e).strip()
        last_line = text.splitlines()[-1] if text else type(e).__name__
        raise CheckpointError(
            f"checkpoint {path} could not be loaded into this model/optimizer: {last_line}"
        ) from None
    return meta


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Published checkpoints under `root`, oldest first (temporary directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_verified(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and a note for each newer one that did not."""
    skipped: list[str] = []
    for _, path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path)
            return path, skipped
        except CheckpointError as e:
            skipped.append(str(e))
    return None, skipped


def prune_checkpoints(root: str | Path, keep_last: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (0 keeps all), and leftovers of interrupted saves.

    `protect` (the checkpoint just saved, hashed as it was written) is never deleted, even when newer but
    damaged checkpoints from before a resume outrank it.
    """
    for stale in [*Path(root).glob(".step_*.tmp-*"), *Path(root).glob(".step_*.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last <= 0:
        return []
    removed = []
    for _, path in list_checkpoints(root)[:-keep_last]:
        if protect is not None and path == Path(protect):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
