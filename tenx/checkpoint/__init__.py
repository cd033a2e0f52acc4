"""Checkpoints: DCP tensors plus a verified JSON manifest; loading one never runs code.

- `manifest`: the manifest's name and format, its self-checksum and field checks (untrusted input).
- `safe`: DCP's `.metadata` pickle read through an opcode scan and an exact table of globals; tensors only.
- `store`: save (atomic publish), read, verify, load, list, newest verified, retention pruning.
- `writer`: `AsyncCheckpointer`, background saves that block the loop only for an in-memory snapshot.
"""

from tenx.checkpoint.manifest import FORMAT, MANIFEST, manifest_digest, require_fields, validate_manifest
from tenx.checkpoint.safe import (
    SafeFileSystemReader,
    TensorOnlyLoadPlanner,
    _SafeUnpickler,
    _scan_pickle,
    read_dcp_metadata,
)
from tenx.checkpoint.store import (
    clean_interrupted_saves,
    latest_verified,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_checkpoint_meta,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)
from tenx.checkpoint.writer import AsyncCheckpointer, snapshot_tensors

__all__ = [
    "FORMAT",
    "MANIFEST",
    "AsyncCheckpointer",
    "SafeFileSystemReader",
    "TensorOnlyLoadPlanner",
    "_SafeUnpickler",
    "_scan_pickle",
    "clean_interrupted_saves",
    "latest_verified",
    "list_checkpoints",
    "load_checkpoint",
    "manifest_digest",
    "prune_checkpoints",
    "read_checkpoint_meta",
    "read_dcp_metadata",
    "require_fields",
    "save_checkpoint",
    "snapshot_tensors",
    "step_dir",
    "validate_manifest",
    "verify_checkpoint",
]
