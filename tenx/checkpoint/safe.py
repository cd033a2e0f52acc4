"""Reading DCP's `.metadata` pickle without running code, and loading tensors only.

The bytes that are parsed are the bytes hashed against the manifest, and they pass two gates. A scan of
the opcodes (_scan_pickle) admits only those that plain data and DCP's records need (not INST, OBJ,
EXT1/2/4, PERSID, BINPERSID, NEWOBJ_EX) and refuses a BUILD aimed at anything but a fresh DCP record (on a
class or a function it would set attributes for the whole process). Then _SafeUnpickler resolves exact
(module, name) pairs from a fixed table (DCP's record dataclasses, torch.Size, the dtypes, a layout
lookup, pathlib paths), never a dotted or Python 2 name. The object must be DCP metadata whose every read
lies inside a data file that the manifest lists and hashes, so DCP opens nothing outside the checkpoint.
A refusal, or metadata that matches its hash and still does not parse, is an UnsafeCheckpointError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import pathlib
import pickle
import pickletools
import threading
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from tenx.checkpoint.manifest import _METADATA, MANIFEST, _is_count, _is_plain_name, _short
from tenx.errors import CheckpointError, UnsafeCheckpointError
from tenx.utils.io import bytes_xxhash

# ----- DCP's .metadata: a pickle, read without running code ----------------------------------------------
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout_by_name(name: Any) -> torch.layout:
    """Stands in for torch.serialization._get_layout (how DCP pickles a layout): a lookup, nothing else."""
    if type(name) is not str or name not in _LAYOUTS:
        raise CheckpointError(f"unknown tensor layout {_short(name)}")
    return _LAYOUTS[name]


def _build_allowed_globals() -> dict[tuple[str, str], Any]:
    """Every (module, name) a tenx checkpoint's .metadata may name, mapped to the object it stands for.

    Measured on the metadata that DCP writes for a 1-process, a 2-process DDP and a 2-process FSDP2 tenx
    checkpoint: the record types of torch.distributed.checkpoint.metadata, filesystem._StorageInfo,
    torch.Size, dtypes, torch.serialization._get_layout and pathlib paths (StorageMeta.checkpoint_id).
    BytesStorageMetadata is admitted so a checkpoint with a pickled entry gets TensorOnlyLoadPlanner's
    clear refusal. Python 3.13 pickles paths as pathlib._local.
    """
    from torch.distributed.checkpoint import filesystem, metadata

    table: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls
        for cls in (
            metadata.Metadata,
            metadata.MetadataIndex,
            metadata.StorageMeta,
            metadata.TensorProperties,
            metadata.TensorStorageMetadata,
            metadata.BytesStorageMetadata,
            metadata.ChunkStorageMetadata,
            metadata._MEM_FORMAT_ENCODING,
        )
    }
    table[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    table[("torch.serialization", "_get_layout")] = _layout_by_name
    table[("torch", "Size")] = torch.Size
    table.update({("torch", k): v for k, v in vars(torch).items() if isinstance(v, torch.dtype)})
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
        table[("pathlib", cls.__name__)] = table[("pathlib._local", cls.__name__)] = cls
    return table


_ALLOWED_GLOBALS = _build_allowed_globals()
# Instances that BUILD may fill in (DCP's dataclasses, made fresh by NEWOBJ or REDUCE). Anything else, a
# class, a function, an enum member or a layout that other code shares, must never receive state.
_BUILDABLE = {
    key
    for key, obj in _ALLOWED_GLOBALS.items()
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and key[0].startswith("torch.distributed.")
}
# The opcodes a pickle of plain data and DCP's records needs. INST, OBJ, EXT1/2/4, PERSID, BINPERSID and
# NEWOBJ_EX (other ways to reach a callable) and Python 2 strings are not among them.
_PICKLE_OPCODES = frozenset(
    "PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 "
    "FLOAT BINFLOAT UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8 "
    "EMPTY_LIST APPEND APPENDS LIST EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_DICT DICT SETITEM SETITEMS "
    "EMPTY_SET ADDITEMS FROZENSET GET BINGET LONG_BINGET PUT BINPUT LONG_BINPUT MEMOIZE GLOBAL STACK_GLOBAL "
    "REDUCE BUILD NEWOBJ".split()
)
_PUSH_VALUE = frozenset(
    "NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT BINBYTES SHORT_BINBYTES "
    "BINBYTES8 EMPTY_LIST EMPTY_TUPLE EMPTY_DICT EMPTY_SET".split()
)
_VALUE: tuple[str, ...] = ("value",)


class _MalformedPickle(Exception):
    """The opcode stream does not make sense (a missing mark, an empty stack): damage."""


def _scan_pickle(data: bytes) -> None:
    """Walk the opcodes before anything is unpickled, tracking what each stack slot holds.

    Refused (UnsafeCheckpointError): opcodes outside _PICKLE_OPCODES, and BUILD or an item assignment
    aimed at anything but a fresh instance of a DCP record (BUILD on a class or a function would set
    attributes that the whole process shares). The names of globals are checked by find_class.
    """
    stack: list[tuple[Any, ...]] = []
    marks: list[int] = []
    memo: dict[Any, tuple[Any, ...]] = {}

    def pop(n: int = 1) -> list[tuple[Any, ...]]:
        if n > len(stack) - (marks[-1] if marks else 0):
            raise _MalformedPickle("the stack is empty")
        taken = stack[len(stack) - n :]
        del stack[len(stack) - n :]
        return taken

    def pop_mark() -> None:
        if not marks:
            raise _MalformedPickle("no mark")
        del stack[marks.pop() :]

    def target_ok(what: str, fresh: bool) -> None:
        target = stack[-1] if stack else _VALUE
        if target[0] == "global" or (fresh and target[0] != "fresh"):
            raise UnsafeCheckpointError(f"{what} would modify {_describe(target)}")

    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name not in _PICKLE_OPCODES:
            raise UnsafeCheckpointError(f"uses pickle opcode {name}, which tenx does not load")
        if name in _PUSH_VALUE:
            stack.append(_VALUE)
        elif name in ("UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"):
            stack.append(("str", arg))
        elif name == "MARK":
            marks.append(len(stack))
        elif name in ("TUPLE", "LIST", "DICT", "FROZENSET"):
            pop_mark()
            stack.append(_VALUE)
        elif name == "POP_MARK":
            pop_mark()
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            pop(int(name[-1]))
            stack.append(_VALUE)
        elif name == "POP":
            if marks and len(stack) == marks[-1]:
                marks.pop()  # POP on an empty frame drops the mark (as pickle does)
            else:
                pop()
        elif name == "DUP":
            stack.append(pop()[0])
            stack.append(stack[-1])
        elif name in ("APPEND", "SETITEM"):
            pop(1 if name == "APPEND" else 2)
            target_ok(name, fresh=False)
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            pop_mark()
            target_ok(name, fresh=False)
        elif name == "MEMOIZE":
            memo[len(memo)] = pop()[0]
            stack.append(memo[len(memo) - 1])
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = pop()[0]
            stack.append(memo[arg])
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in memo:
                raise _MalformedPickle(f"memo entry {arg} is missing")
            stack.append(memo[arg])
        elif name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            stack.append(("global", module, attr))
        elif name == "STACK_GLOBAL":
            module_slot, attr_slot = pop(2)
            if module_slot[0] != "str" or attr_slot[0] != "str":
                raise _MalformedPickle("STACK_GLOBAL needs two strings")
            stack.append(("global", module_slot[1], attr_slot[1]))
        elif name in ("REDUCE", "NEWOBJ"):
            callee, _args = pop(2)
            stack.append(("fresh",) if callee[0] == "global" and callee[1:] in _BUILDABLE else _VALUE)
        elif name == "BUILD":
            pop()
            target_ok("BUILD", fresh=True)
        elif name == "STOP":
            pop()
    # pickletools.genops stops at STOP and raises ValueError on a stream that ends without one.


def _describe(slot: tuple[Any, ...]) -> str:
    if slot[0] == "global":
        return f"{_name(str(slot[1]))}.{_name(str(slot[2]))}, which other code shares"
    return "an object that is not a fresh DCP record"


class _SafeUnpickler(pickle.Unpickler):
    """Resolves exactly the (module, name) pairs of _ALLOWED_GLOBALS and nothing else.

    pickle.Unpickler.find_class is never called: it maps Python 2 names and resolves dotted names
    attribute by attribute (`torch.serialization` + `os.system` is os.system), which is how a pickle
    reaches code from a module it was allowed to name.
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file, fix_imports=False)

    def find_class(self, module: str, name: str) -> Any:
        obj = _ALLOWED_GLOBALS.get((module, name))
        if obj is None:
            raise UnsafeCheckpointError(f"refers to {_name(module)}.{_name(name)}, which tenx does not load")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("refers to a persistent id, which tenx does not load")


# SHA-256 digests of pickles that passed _scan_pickle: a resume reads the same metadata three times, and
# the scan (pure Python) costs more than the unpickling. Bounded; shared by the writer thread's pruning.
_SCANNED: dict[bytes, None] = {}
_SCANNED_LOCK = threading.Lock()


def _scan_pickle_once(data: bytes) -> None:
    key = hashlib.sha256(data).digest()
    with _SCANNED_LOCK:
        if key in _SCANNED:
            return
    _scan_pickle(data)
    with _SCANNED_LOCK:
        _SCANNED[key] = None
        while len(_SCANNED) > 64:
            del _SCANNED[next(iter(_SCANNED))]


def _unpickle_metadata(data: bytes) -> Any:
    """Scan, then unpickle `data`; every failure is a CheckpointError (a refusal: UnsafeCheckpointError)."""
    try:
        _scan_pickle_once(data)
        return _SafeUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except _MalformedPickle as e:
        raise CheckpointError(f"is not a valid pickle ({e})") from None
    except Exception as e:  # only the admitted records' own code ran: any other failure is damage
        raise CheckpointError(f"is not a valid pickle ({type(e).__name__}: {_short(str(e), 200)})") from None


def _name(text: str) -> str:
    """A name read from an untrusted file, as is when it is short and printable, else as a bounded repr."""
    return text if text.isprintable() and len(text) <= 80 else _short(text)


def _check_dcp_metadata(md: Any, files: dict[str, Any]) -> None:
    """The unpickled object is DCP metadata whose every read stays inside the checkpoint's listed files."""
    from torch.distributed.checkpoint import filesystem, metadata

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"is not DCP metadata: {what}")

    need(type(md) is metadata.Metadata, f"the pickle holds a {type(md).__name__}, not Metadata")
    sdm = md.state_dict_metadata
    need(type(sdm) is dict, "state_dict_metadata is not a dict")
    for fqn, entry in sdm.items():
        need(type(fqn) is str, "a state_dict_metadata key is not a string")
        if type(entry) is metadata.BytesStorageMetadata:
            continue
        need(type(entry) is metadata.TensorStorageMetadata, f"entry {fqn!r} is a {type(entry).__name__}")
        props = entry.properties
        need(type(props) is metadata.TensorProperties, f"entry {fqn!r} has no TensorProperties")
        need(isinstance(props.dtype, torch.dtype), f"entry {fqn!r} has no dtype")
        need(type(entry.size) is torch.Size and all(d >= 0 for d in entry.size), f"entry {fqn!r} has no size")
        need(type(entry.chunks) is list, f"entry {fqn!r} has no chunk list")
        numel = 0
        for chunk in entry.chunks:
            need(type(chunk) is metadata.ChunkStorageMetadata, f"entry {fqn!r} has a malformed chunk")
            offsets, sizes = chunk.offsets, chunk.sizes
            need(
                type(offsets) is torch.Size
                and type(sizes) is torch.Size
                and len(offsets) == len(sizes) == len(entry.size)
                and all(o >= 0 and s >= 0 and o + s <= d for o, s, d in zip(offsets, sizes, entry.size)),
                f"entry {fqn!r} has a chunk outside the tensor",
            )
            numel += math.prod(sizes)
        need(numel == math.prod(entry.size), f"the chunks of entry {fqn!r} do not cover it")
    storage = md.storage_data
    need(type(storage) is dict, "storage_data is not a dict")
    for index, info in storage.items():
        need(
            type(index) is metadata.MetadataIndex
            and type(index.fqn) is str
            and index.fqn in sdm
            and (index.offset is None or type(index.offset) is torch.Size),
            "a storage_data key is not an index into state_dict_metadata",
        )
        need(
            type(info) is filesystem._StorageInfo, f"the storage of {index.fqn!r} is a {type(info).__name__}"
        )
        where = info.relative_path
        if not _is_plain_name(where) or where not in files or where == _METADATA:
            raise UnsafeCheckpointError(
                f"sends DCP to read {_short(where)}, which is not a data file of this checkpoint's manifest"
            )
        if info.transform_descriptors:
            raise UnsafeCheckpointError(
                f"asks for stream transforms on {index.fqn!r}, which tenx does not write"
            )
        need(
            _is_count(info.offset)
            and _is_count(info.length)
            and info.offset + info.length <= files[where]["bytes"],
            f"the storage of {index.fqn!r} lies outside {where}",
        )
    for fqn, entry in sdm.items():  # a tensor's bytes are on disk: its size is bounded by the files' sizes
        if type(entry) is metadata.TensorStorageMetadata:
            for chunk in entry.chunks:
                info = storage.get(metadata.MetadataIndex(fqn, chunk.offsets))
                need(
                    info is not None
                    and info.length >= math.prod(chunk.sizes) * entry.properties.dtype.itemsize,
                    f"a chunk of entry {fqn!r} has no storage that can hold it",
                )
    planner = md.planner_data
    need(
        planner is None
        or (
            type(planner) is dict
            and all(
                type(k) is str and type(v) in (tuple, list) and all(type(p) in (str, int) for p in v)
                for k, v in planner.items()
            )
        ),
        "planner_data is not a map of names to key paths",
    )
    need(md.version is None or type(md.version) is str, "version is not a string")
    meta = md.storage_meta
    need(
        meta is None
        or (
            type(meta) is metadata.StorageMeta
            and (meta.checkpoint_id is None or isinstance(meta.checkpoint_id, (str, pathlib.PurePath)))
            and all(v is None or type(v) is str for v in (meta.save_id, meta.load_id))
            and type(meta.modules) is list
        ),
        "storage_meta is malformed",
    )


def read_dcp_metadata(path: str | Path, manifest: dict[str, Any], rank: int | None = None) -> Metadata:
    """DCP's metadata of the checkpoint at `path`, unpickled safely and checked against its manifest.

    The bytes are read once, hashed against the manifest (so they are the bytes that verified), scanned,
    unpickled with _SafeUnpickler and checked by _check_dcp_metadata. A refusal (a global, an opcode,
    a BUILD target or a file name that tenx does not admit) is an UnsafeCheckpointError; anything else
    wrong is a CheckpointError. Both name the checkpoint.
    """
    path = Path(path)
    name = _METADATA if rank is None else f"__{rank}{_METADATA}"
    files = manifest["files"]
    if name not in files:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists no {name}")
    try:
        data = (path / name).read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: {name} cannot be read ({e.strerror or e})") from None
    if len(data) != files[name]["bytes"] or bytes_xxhash(data) != files[name]["xxhash"]:
        raise CheckpointError(f"checkpoint {path}: file {name} fails its checksum (corrupt)")
    try:
        md = _unpickle_metadata(data)
        _check_dcp_metadata(md, files)
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(
            f"checkpoint {path}: {name} {e}; refusing to load it (the checkpoint was not written by tenx "
            "or has been tampered with: delete it or restore it from a trusted copy)"
        ) from None
    except CheckpointError as e:
        # The bytes matched their recorded hash, so this is no accident of storage: whoever wrote (or
        # re-hashed) them made metadata that tenx does not load. Refused like an attack, not skipped.
        raise UnsafeCheckpointError(
            f"checkpoint {path}: {name} {e}, although it matches its recorded checksum; refusing to load "
            "it (not written by this tenx and torch, or tampered with: restore it from a trusted copy)"
        ) from None
    return md


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that refuses pickled (non-tensor) entries; tenx keeps such state in JSON."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; tenx loads only tensors"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP reader whose metadata is read by read_dcp_metadata: checked against `manifest`, never run.

    The metadata is read once and kept, so DCP's own read gets the object that was checked.
    """

    def __init__(self, path: str | Path, manifest: dict[str, Any]) -> None:
        super().__init__(path)
        self._checkpoint = Path(path)
        self._manifest = manifest
        self._metadata: dict[Any, Metadata] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._metadata:
            self._metadata[rank] = read_dcp_metadata(self._checkpoint, self._manifest, rank)
        metadata = self._metadata[rank]
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ----- the JSON manifest: parsed, self-checked and schema-checked once ----------------------------------
