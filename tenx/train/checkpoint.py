"""Checkpoints: torch.distributed.checkpoint (DCP) tensors plus a JSON manifest with checksums.

A checkpoint directory `step_00000020/` holds DCP's files (the format a sharded run writes too) and
`tenx_checkpoint.json`: step, token count, loader position, Python/NumPy RNG states, callback states,
the resolved config and an xxhash for every file. It is written under a temporary name, fsynced and
renamed, so a crash mid-save never damages an existing checkpoint; a directory without a manifest, or
with a file whose size or hash differs, does not verify and is never loaded. DCP's metadata is a pickle:
it is read only after its checksum matched, through an unpickler that admits DCP's own record types.

`AsyncCheckpointer` saves in the background: the training loop blocks only while the state is copied into
memory (`snapshot_tensors`), and `prune_checkpoints` then applies the retention policy (the last K, every
M-th, and never the only checkpoint that verifies).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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

# DCP warns that it saves/loads in a single process: that is intended here. Installed once rather than per
# call with warnings.catch_warnings(), which swaps the process-wide filter list and is not thread-safe:
# saves run on a background thread while the training loop (and its own warnings) carries on.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


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


def save_checkpoint(
    root: str | Path,
    step: int,
    tensors: dict[str, Any],
    meta: dict[str, Any],
    *,
    before_publish: Callable[[Path], None] | None = None,
    process_group: Any = None,
    rank: int = 0,
) -> Path:
    """Write `tensors` (nested state dicts) with DCP and `meta` as JSON; atomically publish step_N/.

    `before_publish` is called with the temporary directory once every file and the manifest are written
    and fsynced, just before the rename that publishes it (fault injection kills the process there).

    Several ranks (`process_group` given): every rank calls this with its own shards (DTensors under
    FSDP, replicated tensors under DDP, which DCP writes once). Rank 0 prepares the temporary directory,
    every rank writes its files into it, and after DCP's final collective rank 0 hashes every file,
    writes the manifest and publishes; a last barrier returns no rank before the checkpoint is published.
    The directory must be on a filesystem every rank sees.
    """
    root = Path(root)
    final = step_dir(root, step)
    distributed = process_group is not None
    tmp = root / (f".{final.name}.tmp-dist" if distributed else f".{final.name}.tmp-{os.getpid()}")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if distributed:
        import torch.distributed as dist

        dist.barrier(group=process_group)
        dcp.save(tensors, storage_writer=FileSystemWriter(tmp, sync_files=True), process_group=process_group)
        if rank != 0:
            dist.barrier(group=process_group)
            return final
    else:
        dcp.save(tensors, storage_writer=FileSystemWriter(tmp, sync_files=True))
    try:
        _publish(root, final, tmp, step, meta, before_publish)
    finally:
        if distributed:
            dist.barrier(group=process_group)
    return final


def _publish(
    root: Path,
    final: Path,
    tmp: Path,
    step: int,
    meta: dict[str, Any],
    before_publish: Callable[[Path], None] | None,
) -> None:
    """Hash the written files, write the manifest and rename the temporary directory into place."""
    files = {
        p.name: {"bytes": p.stat().st_size, "xxhash": file_xxhash(p)}
        for p in sorted(tmp.iterdir())
        if p.is_file()
    }
    atomic_write_json(tmp / MANIFEST, {**meta, "format": FORMAT, "step": step, "files": files})
    fsync_dir(tmp)
    if before_publish is not None:
        before_publish(tmp)
    if final.exists():  # a re-save of the same step (after a resume): replace it in two renames
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(root)


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


def load_checkpoint(
    path: str | Path, tensors: dict[str, Any], *, process_group: Any = None, verify: bool = True
) -> dict[str, Any]:
    """Verify, then load DCP tensors in place into `tensors`; returns the JSON manifest.

    Several ranks: every rank calls this with its own (sharded) state; DCP reads what each rank needs,
    whatever the number of ranks that saved it. `verify=False` skips the hashing when another rank
    has just verified the same files.
    """
    meta = verify_checkpoint(path) if verify else read_checkpoint_meta(path)
    reader = SafeFileSystemReader(path)
    reader.read_metadata()  # refuses foreign pickled objects with a clear error, before DCP's own read
    try:
        dcp.load(
            tensors,
            storage_reader=reader,
            planner=TensorOnlyLoadPlanner(),
            process_group=process_group,
        )
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


def prune_checkpoints(
    root: str | Path, keep_last: int, keep_every: int = 0, protect: Path | None = None
) -> list[Path]:
    """Apply the retention policy under `root`; returns the checkpoints deleted.

    Kept: the newest `keep_last` (0 keeps all), every checkpoint whose step is a multiple of `keep_every`
    (when > 0), and `protect` (the checkpoint just saved, even when newer but damaged checkpoints from
    before a resume outrank it). If none of the kept checkpoints verifies, the newest one that does among
    those due for deletion is kept too, so pruning never deletes the only checkpoint to resume from. The
    kept ones are verified newest first and the search stops at the first that verifies: in the normal
    case that hashes one checkpoint.

    Leftovers of interrupted saves go first: `.step_N.tmp-*` directories are deleted, and a `.step_N.old-*`
    (a re-save of step N killed between its two renames) is renamed back to step_N when that is missing.
    Any process's leftovers qualify, so pruning must not run while a save into `root` is in flight:
    AsyncCheckpointer prunes in its writer thread after the save it just completed.
    """
    root = Path(root)
    _clean_interrupted_saves(root)
    found = list_checkpoints(root)
    if keep_last <= 0:
        return []
    keep = {path for _, path in found[-keep_last:]}
    if keep_every > 0:
        keep |= {path for step, path in found if step % keep_every == 0}
    if protect is not None:
        keep.add(Path(protect))
    doomed = [path for _, path in found if path not in keep]
    if not doomed:
        return []
    kept_newest_first = [path for _, path in reversed(found) if path in keep]
    if not any(_verifies(path) for path in kept_newest_first):
        fallback = next((path for path in reversed(doomed) if _verifies(path)), None)
        doomed = [path for path in doomed if path != fallback]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _verifies(path: Path) -> bool:
    try:
        verify_checkpoint(path)
        return True
    except CheckpointError:
        return False


def _clean_interrupted_saves(root: Path) -> None:
    for stale in root.glob(".step_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in root.glob(".step_*.old-*"):
        final = root / old.name[1:].split(".old-")[0]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)


def snapshot_tensors(tree: Any, into: Any = None) -> Any:
    """A copy of a nested dict/list/tuple of tensors in CPU memory that no later update of `tree` reaches.

    CPU tensors are copied; CUDA tensors are copied into pinned memory without blocking, then waited for
    once. Tensors that alias each other (tied embeddings) stay one tensor in the copy. Other leaves are
    shared as they are (they are immutable scalars and strings in a state dict).

    `into` is an earlier snapshot no longer in use: its tensors are overwritten where shape, dtype and
    layout match. That is most of the cost saved: filling freshly allocated memory is dominated by page
    faults (measured: 1.1 s for 600 MB against 0.02 s into buffers already touched, on 2 CPU cores).
    """
    copies: dict[int, torch.Tensor] = {}
    used: set[int] = set()  # a buffer aliased in `into` must not receive two different tensors
    on_cuda = False

    def copy(node: Any, old: Any) -> Any:
        nonlocal on_cuda
        if isinstance(node, torch.Tensor):
            if id(node) not in copies:
                source = node.detach()
                pinned = source.device.type == "cuda"
                on_cuda |= pinned
                if _fits(old, source, pinned) and id(old) not in used:
                    target = old
                else:
                    target = torch.empty_like(source, device="cpu", pin_memory=pinned)
                used.add(id(target))
                copies[id(node)] = target.copy_(source, non_blocking=pinned)
            return copies[id(node)]
        if isinstance(node, dict):
            old = old if isinstance(old, dict) else {}
            return {k: copy(v, old.get(k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            old = old if isinstance(old, (list, tuple)) and len(old) == len(node) else [None] * len(node)
            return type(node)(copy(v, o) for v, o in zip(node, old))
        return node

    snapshot = copy(tree, into)
    if on_cuda:
        torch.cuda.synchronize()
    return snapshot


def _fits(buffer: Any, source: torch.Tensor, pinned: bool) -> bool:
    return (
        isinstance(buffer, torch.Tensor)
        and buffer.device.type == "cpu"
        and buffer.dtype == source.dtype
        and buffer.shape == source.shape
        and buffer.stride() == source.stride()
        and (not pinned or buffer.is_pinned())
    )


class AsyncCheckpointer:
    """Saves checkpoints on one background thread; the caller blocks only for the in-memory snapshot.

    `save()` first waits for the previous save (at most one is in flight), then copies the tensors with
    `snapshot_tensors` into the previous snapshot's buffers and the metadata through JSON, and hands the
    write, the fsyncs, the rename and the pruning to the writer thread. The snapshot is kept between saves
    so the next one reuses it: one copy of the state stays in host memory, pinned when it comes from CUDA.
    A failure in the writer thread is raised as CheckpointError, naming the step, by the next `save()`,
    `wait()` or `poll()`, once. With `async_save=False` the same work runs inline, without a snapshot.

    The writer thread is not a daemon: a process that exits without `close()` still completes the save in
    flight. Killed mid-save, it leaves the previous checkpoints intact (see save_checkpoint).

    Several ranks: DCP's save is collective, and run on the default process group from a background thread
    its collectives interleave with FSDP's and the run hangs; so the saves get a group of their own,
    `dist.new_group(backend="gloo")` (`process_group`). Rank 0 publishes and prunes.
    """

    last_blocking_s: float
    """Seconds the last `save()` kept its caller waiting, including the wait for the previous save."""
    last_write_s: float
    """Seconds the last completed background job took to write, publish and prune."""
    last_path: Path | None
    """The last checkpoint published."""
    saves: int
    """Checkpoints published so far."""

    def __init__(
        self,
        root: str | Path,
        keep_last: int = 3,
        keep_every: int = 0,
        async_save: bool = True,
        *,
        process_group: Any = None,
        rank: int = 0,
    ) -> None:
        self.root = Path(root)
        self.process_group = process_group
        """Several ranks: a group of its own (gloo) for the saves' collectives, never the training one."""
        self.rank = rank
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.last_blocking_s = 0.0
        self.last_write_s = 0.0
        self.last_path = None
        self.saves = 0
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="tenx-checkpoint") if async_save else None
        )
        self._pending: tuple[int, Future[Path]] | None = None
        self._snapshot: dict[str, Any] | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a background save has been submitted and has not finished."""
        pending = self._pending
        return pending is not None and not pending[1].done()

    def save(
        self,
        step: int,
        tensors: dict[str, Any],
        meta: dict[str, Any],
        before_publish: Callable[[Path], None] | None = None,
    ) -> float:
        """Checkpoint `tensors` and `meta` as step `step`; returns the seconds the caller was blocked."""
        t0 = time.perf_counter()
        self.wait()
        try:
            if self._executor is None:
                self._write(step, tensors, meta, before_publish)
            else:
                snapshot = self._snapshot = snapshot_tensors(tensors, into=self._snapshot)
                meta_copy = json.loads(json.dumps(meta))
                future = self._executor.submit(self._write, step, snapshot, meta_copy, before_publish)
                self._pending = (step, future)
        except Exception as e:
            raise _save_failed(step, e) from e
        self.last_blocking_s = time.perf_counter() - t0
        return self.last_blocking_s

    def wait(self) -> None:
        """Block until no save is in flight; a failed one is raised as CheckpointError."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, future = pending
        error = future.exception()
        if error is not None:
            raise _save_failed(step, error) from error

    def poll(self) -> None:
        """Without blocking: raise the failure of the save in flight if it has failed."""
        pending = self._pending
        if pending is not None and pending[1].done():
            self.wait()

    def close(self) -> None:
        """Wait for the save in flight, then stop the writer thread."""
        try:
            self.wait()
        finally:
            self._snapshot = None
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(
        self,
        step: int,
        tensors: dict[str, Any],
        meta: dict[str, Any],
        before_publish: Callable[[Path], None] | None,
    ) -> Path:
        t0 = time.perf_counter()
        path = save_checkpoint(
            self.root,
            step,
            tensors,
            meta,
            before_publish=before_publish if self.rank == 0 else None,
            process_group=self.process_group,
            rank=self.rank,
        )
        if self.rank == 0:
            prune_checkpoints(self.root, self.keep_last, self.keep_every, protect=path)
        self.last_write_s = time.perf_counter() - t0
        self.last_path = path
        self.saves += 1
        return path


def _save_failed(step: int, error: BaseException) -> CheckpointError:
    cause = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    return CheckpointError(f"saving checkpoint step {step} failed: {cause}")
