"""Checkpoints: torch.distributed.checkpoint (DCP) tensors plus a JSON manifest with checksums.

A checkpoint directory `step_00000020/` holds DCP's files (the format a sharded run writes too) and
`tenx_checkpoint.json`: step, token count, loader position, Python/NumPy RNG states, callback states,
the resolved config, an xxhash for every file and `manifest_xxhash`, the manifest's own checksum. It is
written under a temporary name, fsynced and renamed, so a crash mid-save never damages an existing
checkpoint; a directory without a manifest, or with a file whose size or hash differs, does not verify
and is never loaded.

A checkpoint is data, never code, even when whoever wrote it also rewrote its checksums (they are not
signed: they catch damage, not forgery):
- The manifest is checked once when read (validate_manifest): its self-checksum when it has one (older
  checkpoints do not, and still load), and the type and range of every field tenx reads, so a bad value is
  a CheckpointError naming the checkpoint and the field, not a traceback later.
- DCP's `.metadata` is a pickle. The bytes that are parsed are the bytes hashed against the manifest,
  and they pass two gates. A scan of the opcodes (_scan_pickle) admits only those that plain data and
  DCP's records need (not INST, OBJ, EXT1/2/4, PERSID, BINPERSID, NEWOBJ_EX) and refuses a BUILD aimed
  at anything but a fresh DCP record (on a class or a function it would set attributes for the whole
  process). Then _SafeUnpickler resolves exact (module, name) pairs from a fixed table (DCP's record
  dataclasses, torch.Size, the dtypes, a layout lookup, pathlib paths), never a dotted or Python 2 name.
  The object must be DCP metadata whose every read lies inside a data file that the manifest lists and
  hashes, so DCP opens nothing outside the checkpoint (listed files that are symbolic links are refused).
  DCP reads the tensors themselves with torch.load(weights_only=True).
- A refusal is an UnsafeCheckpointError (a forgery); anything else malformed is a CheckpointError
  (damage). latest_verified, hence `--resume auto`, `tenx eval RUN_DIR` and `tenx status`, skips a damaged
  checkpoint for an older one but stops at a forged one, naming it.
What none of this does is authenticate a checkpoint: whoever can write the directory can still replace the
weights and the training state with other well-formed values.

`AsyncCheckpointer` saves in the background: the training loop blocks only while the state is copied into
memory (`snapshot_tensors`), and `prune_checkpoints` then applies the retention policy (the last K, every
M-th, and never the only checkpoint that verifies; a forged one counts as not verifying).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from tenx.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    _short,
    manifest_digest,
    require_fields,
    validate_manifest,
)
from tenx.checkpoint.safe import SafeFileSystemReader, TensorOnlyLoadPlanner, read_dcp_metadata
from tenx.errors import CheckpointError, UnsafeCheckpointError
from tenx.rundir import STEP_GLOB, step_dir_name, step_of
from tenx.utils.io import (
    atomic_write_json,
    file_xxhash,
    publish_dir,
    recover_interrupted_publishes,
    staging_dir,
)
from tenx.utils.storage import LOW_SPACE, free_bytes, storage_error

# DCP warns that it saves/loads in a single process: that is intended here. Installed once rather than per
# call with warnings.catch_warnings(), which swaps the process-wide filter list and is not thread-safe:
# saves run on a background thread while the training loop (and its own warnings) carries on.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def step_dir(root: Path, step: int) -> Path:
    """The directory name of the checkpoint at `step`."""
    return root / step_dir_name(step)


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
    tmp = staging_dir(final, "dist" if distributed else str(os.getpid()))
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
    try:
        if not distributed:
            dcp.save(tensors, storage_writer=FileSystemWriter(tmp, sync_files=True))
        _publish(root, final, tmp, step, meta, before_publish)
    except BaseException as e:
        # a failed save (a full disk, say) must not leave its partial files filling the disk (under
        # several ranks only rank 0 gets here, after every rank's files are written). torch's writer
        # does not always report a full disk as one ("unexpected pos"): look before freeing the space.
        free = free_bytes(tmp)
        full = storage_error(e) is None and free is not None and free < LOW_SPACE
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp)) from e
        raise
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
    """Hash the written files, write the manifest and rename the temporary directory into place
    (a re-save of the same step, after a resume, replaces the published one)."""
    files = {
        p.name: {"bytes": p.stat().st_size, "xxhash": file_xxhash(p)}
        for p in sorted(tmp.iterdir())
        if p.is_file()
    }
    manifest = {**meta, "format": FORMAT, "step": step, "files": files}
    manifest["manifest_xxhash"] = manifest_digest(manifest)
    atomic_write_json(tmp / MANIFEST, manifest)
    hook = (lambda: before_publish(tmp)) if before_publish is not None else None
    publish_dir(tmp, final, sync_files=False, before_rename=hook)  # DCP and the manifest synced their files


def read_checkpoint_meta(path: str | Path, require: Iterable[str] = ()) -> dict[str, Any]:
    """The checkpoint's JSON manifest, checked by validate_manifest, without hashing its files.

    `require`: fields the caller needs (see require_fields). See verify_checkpoint for the files.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        meta = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: {MANIFEST} is missing") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} cannot be read ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} is not valid JSON ({_short(str(e), 200)})"
        ) from None
    validate_manifest(path, meta)
    require_fields(path, meta, require)
    return meta


def verify_checkpoint(path: str | Path, require: Iterable[str] = ()) -> dict[str, Any]:
    """Return the checkpoint's manifest after checking every file's size and hash and DCP's metadata.

    A file missing or damaged, or a manifest or metadata that is malformed: CheckpointError. A checkpoint
    that asks for something tenx refuses (code named in the metadata pickle, a file outside the
    checkpoint, a symbolic link): UnsafeCheckpointError, which callers never treat as mere damage.
    """
    path = Path(path)
    meta = read_checkpoint_meta(path, require)
    for name, info in meta["files"].items():
        f = path / name
        if f.is_symlink():
            raise UnsafeCheckpointError(
                f"checkpoint {path}: file {name} is a symbolic link; tenx reads only the checkpoint's own files"
            )
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        try:
            size = f.stat().st_size
            digest = file_xxhash(f) if size == info["bytes"] else None
        except OSError as e:
            raise CheckpointError(
                f"checkpoint {path}: file {name} cannot be read ({e.strerror or e})"
            ) from None
        if size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: file {name} has {size} bytes, expected {info['bytes']} (truncated or damaged)"
            )
        if digest != info["xxhash"]:
            raise CheckpointError(f"checkpoint {path}: file {name} fails its checksum (corrupt)")
    read_dcp_metadata(path, meta)
    return meta


def load_checkpoint(
    path: str | Path,
    tensors: dict[str, Any],
    *,
    process_group: Any = None,
    verify: bool = True,
    require: Iterable[str] = (),
) -> dict[str, Any]:
    """Verify, then load DCP tensors in place into `tensors`; returns the JSON manifest.

    Several ranks: every rank calls this with its own (sharded) state; DCP reads what each rank needs,
    whatever the number of ranks that saved it. `verify=False` skips the hashing of the data files when
    another rank has just verified the same files (DCP's metadata is still hashed and checked here).
    `require`: manifest fields the caller needs (see require_fields).
    """
    path = Path(path)
    meta = verify_checkpoint(path, require) if verify else read_checkpoint_meta(path, require)
    reader = SafeFileSystemReader(path, meta)
    reader.read_metadata()  # refusals surface here with their own type, before DCP wraps errors in its own
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
    found = [(step, p) for p in root.iterdir() if (step := step_of(p)) is not None and p.is_dir()]
    return sorted(found)


def latest_verified(root: str | Path, before_step: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies (of a step below `before_step`, when given), and a note for each
    newer one that did not.

    A damaged checkpoint is skipped (an older one is used); an unsafe one raises UnsafeCheckpointError.
    """
    skipped: list[str] = []
    for step, path in reversed(list_checkpoints(root)):
        if before_step is not None and step >= before_step:
            continue
        try:
            verify_checkpoint(path)
            return path, skipped
        except UnsafeCheckpointError:
            raise  # a forged checkpoint stops the run: falling back would hide it
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

    Leftovers of interrupted saves go first (clean_interrupted_saves): `.step_N.tmp-*` directories are
    deleted, and a `.step_N.old-*` (a re-save of step N killed between its two renames) is renamed back to
    step_N when that is missing.
    Any process's leftovers qualify, so pruning must not run while a save into `root` is in flight:
    AsyncCheckpointer prunes in its writer thread after the save it just completed.
    """
    root = Path(root)
    clean_interrupted_saves(root)
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
    except CheckpointError:  # UnsafeCheckpointError included: never something to keep as the fallback
        return False


def clean_interrupted_saves(root: str | Path) -> None:
    """Delete the temporary directories of interrupted saves under `root`, and put back a checkpoint whose
    re-save was killed between its two renames (no save into `root` may be in flight)."""
    recover_interrupted_publishes(root, STEP_GLOB)
