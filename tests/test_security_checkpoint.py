"""No code runs from a checkpoint, and no damaged checkpoint gives a traceback (issue 12).

A corpus of malicious DCP `.metadata` pickles, each written into a copy of a real checkpoint with the
manifest's size, hash and self-checksum updated to match (as anyone who can write the directory could),
is refused by every load path: `Trainer.resume` by path and `auto`, `load_model` (eval, sample) and
`format_status` (status) in process, and the real CLI in subprocesses for a few of them. A fuzz test
mutates a checkpoint directory: every load succeeds, falls back to the older checkpoint, or raises a
TenxError (printed by the CLI as one `tenx: error:` line), and nothing is ever created.
"""

from __future__ import annotations

import collections
import copy
import copyreg
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from tenx import checkpoint as ckpt
from tenx.checkpoint.models import load_model
from tenx.errors import CheckpointError, TenxError, UnsafeCheckpointError
from tenx.monitor.status import format_status
from tenx.train.config import CONFIG_DIR, load_run_config
from tenx.train.run import train
from tenx.train.trainer import Trainer
from tenx.utils.io import bytes_xxhash

# The tiny config made smaller still, so that one load takes ~30 ms on one thread.
SMALL = (
    "train.steps=4",
    "checkpoint.every=2",
    "train.eval_every=0",
    "train.threads=1",
    "train.micro_batch=2",
    "model.depth=1",
    "model.d_model=32",
    "model.head_dim=16",
    "model.seq_len=32",
)
OLDER, NEWEST = "step_00000002", "step_00000004"
EXT_CODE = 0xF1  # a copyreg extension code that the corpus uses (registered only where a test says so)


# ----- pickle opcodes by hand ---------------------------------------------------------------------
def u(text: str) -> bytes:
    """SHORT_BINUNICODE (or BINUNICODE when long)."""
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw if len(raw) < 256 else b"X" + struct.pack("<I", len(raw)) + raw


def glob(module: str, name: str) -> bytes:
    """GLOBAL: module and name on text lines (protocol 0's way)."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def sglob(module: str, name: str) -> bytes:
    """STACK_GLOBAL from two strings (protocol 4's way)."""
    return u(module) + u(name) + b"\x93"


def call1(callee: bytes, arg: bytes) -> bytes:
    """callee(arg): TUPLE1 + REDUCE."""
    return callee + arg + b"\x85R"


P4, P2 = b"\x80\x04", b"\x80\x02"
STOP, MARK, POP, MEMOIZE, REDUCE, BUILD, NEWOBJ = b".", b"(", b"0", b"\x94", b"R", b"b", b"\x81"
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, NONE = b"}", b"]", b")", b"N"
SETITEM, SETITEMS, APPENDS, TUPLE, TUPLE2 = b"s", b"u", b"e", b"t", b"\x86"
MD = "torch.distributed.checkpoint.metadata"


def binget(i: int) -> bytes:
    return b"h" + bytes([i])


# BUILD with the state (None, {"tenx_pwned": "yes"}): sets an attribute on whatever is below it, a class too
BUILD_PWNED = NONE + EMPTY_DICT + u("tenx_pwned") + u("yes") + SETITEM + TUPLE2 + BUILD


class _Evil:
    """pickle.dumps of this is the textbook attack: __reduce__ to os.system."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@dataclass
class Entry:
    """One malicious .metadata (every one is refused as unsafe); `live`: plain pickle.loads of it runs
    the command (checked by test_corpus_is_live, so the corpus is real)."""

    name: str
    data: bytes
    live: bool = True


def build_corpus(marker: Path, metadata: dcp_md.Metadata) -> list[Entry]:
    """Every route in issue 12 and then some. The `live` ones create `marker` under plain pickle.loads;
    `metadata` (a real checkpoint's) is the base of the forged but well-formed ones."""
    cmd = f"touch {marker}"
    expr = f"__import__('os').system({cmd!r})"
    shell = u(cmd)
    os_system = sglob("os", "system")

    def pathlib_write(method: str) -> bytes:
        path = call1(sglob("pathlib", "PosixPath"), u(str(marker)))
        return P4 + sglob("pathlib", method) + MARK + path + u("pwned") + TUPLE + REDUCE + STOP

    def forged(mutate) -> bytes:
        md = copy.deepcopy(metadata)
        mutate(md)
        return pickle.dumps(md, protocol=4)

    def storage_path(where: str):
        def mutate(md: dcp_md.Metadata) -> None:
            index = next(iter(md.storage_data))
            md.storage_data[index] = dcp_fs._StorageInfo(where, 0, 16)

        return mutate

    def transforms(md: dcp_md.Metadata) -> None:
        index = next(iter(md.storage_data))
        md.storage_data[index].transform_descriptors = ["zstd/1"]

    metadata_then = (
        sglob(MD, "Metadata") + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + MARK + u("state_dict_metadata")
    )
    popen_args = EMPTY_LIST + MARK + u("touch") + u(str(marker)) + APPENDS
    evil_module = "torch.distributed.checkpoint.tenx_evil"
    return [
        # dotted names through modules that the old unpickler trusted whole
        Entry(
            "dcp_filesystem_os_system_GLOBAL",
            P4 + call1(glob("torch.distributed.checkpoint.filesystem", "os.system"), shell) + STOP,
        ),
        Entry(
            "dcp_filesystem_os_system_STACK_GLOBAL",
            P4 + call1(sglob("torch.distributed.checkpoint.filesystem", "os.system"), shell) + STOP,
        ),
        Entry("dcp_metadata_os_system", P4 + call1(sglob(MD, "os.system"), shell) + STOP),
        Entry(
            "torch_serialization_os_system",
            P4 + call1(sglob("torch.serialization", "os.system"), shell) + STOP,
        ),
        Entry("torch_os_system", P4 + call1(sglob("torch", "os.system"), shell) + STOP),
        # collections._sys: put os into sys.modules under a trusted-looking name, then name it
        Entry(
            "collections_sys_modules",
            P4
            + sglob("collections", "_sys.modules.__setitem__")
            + u(evil_module)
            + call1(sglob("collections", "_sys.modules.get"), u("os"))
            + TUPLE2
            + REDUCE
            + POP
            + call1(sglob(evil_module, "system"), shell)
            + STOP,
        ),
        Entry(
            "collections_builtins_eval",
            P4 + call1(call1(sglob("collections", "__builtins__.get"), u("eval")), u(expr)) + STOP,
        ),
        # __reduce__ to os.system, as pickle itself writes it, in three protocols
        *(Entry(f"reduce_os_system_protocol{p}", pickle.dumps(_Evil(cmd), protocol=p)) for p in (0, 2, 4)),
        Entry("posix_system", P2 + call1(glob("posix", "system"), shell) + STOP),
        Entry("nt_system", P2 + call1(glob("nt", "system"), shell) + STOP, live=sys.platform == "win32"),
        Entry("builtins_eval", P4 + call1(sglob("builtins", "eval"), u(expr)) + STOP),
        Entry("builtins_exec", P4 + call1(sglob("builtins", "exec"), u(expr)) + STOP),
        Entry(
            "builtins_getattr",
            P4
            + sglob("builtins", "getattr")
            + MARK
            + call1(sglob("builtins", "__import__"), u("os"))
            + u("system")
            + TUPLE
            + REDUCE
            + shell
            + b"\x85R"
            + STOP,
        ),
        Entry("py2_builtin_eval", P2 + call1(glob("__builtin__", "eval"), u(expr)) + STOP),
        Entry("subprocess_Popen", P4 + call1(sglob("subprocess", "Popen"), popen_args) + STOP),
        Entry("subprocess_check_call", P4 + call1(sglob("subprocess", "check_call"), popen_args) + STOP),
        # the command nested inside a valid-looking Metadata
        Entry(
            "nested_in_metadata",
            P4
            + metadata_then
            + EMPTY_DICT
            + u("planner_data")
            + call1(os_system, shell)
            + SETITEMS
            + BUILD
            + STOP,
        ),
        Entry(
            "nested_in_a_list_in_a_dict",
            P4
            + metadata_then
            + EMPTY_DICT
            + MARK
            + u("x")
            + EMPTY_LIST
            + MARK
            + call1(os_system, shell)
            + APPENDS
            + SETITEMS
            + SETITEMS
            + BUILD
            + STOP,
        ),
        # memo tricks
        Entry(
            "memo_allowed_class_as_callable",
            P4 + sglob("torch", "Size") + MEMOIZE + POP + binget(0) + shell + b"\x85R" + STOP,
            live=False,
        ),
        Entry(
            "memo_PUT_GET_protocol0",
            b"cos\nsystem\np0\n0g0\n(V" + cmd.encode() + b"\ntR.",
        ),
        Entry(
            "memo_overwrites_an_allowed_global",
            P4
            + sglob("torch", "Size")
            + MEMOIZE
            + POP
            + os_system
            + b"q\x00"
            + POP
            + binget(0)
            + shell
            + b"\x85R"
            + STOP,
        ),
        Entry(
            "STACK_GLOBAL_from_memoized_strings",
            P4
            + u("os")
            + MEMOIZE
            + POP
            + u("system")
            + MEMOIZE
            + POP
            + binget(0)
            + binget(1)
            + b"\x93"
            + shell
            + b"\x85R"
            + STOP,
        ),
        Entry(
            "STACK_GLOBAL_trusted_module_memoized",
            P4
            + u("torch.serialization")
            + MEMOIZE
            + u("os.system")
            + MEMOIZE
            + b"\x93"
            + shell
            + b"\x85R"
            + STOP,
        ),
        # other opcodes that reach a callable
        Entry("EXT1_copyreg_extension", P2 + b"\x82" + bytes([EXT_CODE]) + shell + b"\x85R" + STOP),
        Entry("PERSID", b"P" + cmd.encode() + b"\n.", live=False),
        Entry("BINPERSID", P4 + shell + b"Q" + STOP, live=False),
        Entry("INST", b"(V" + cmd.encode() + b"\nios\nsystem\n."),
        Entry("OBJ", b"(cos\nsystem\nV" + cmd.encode() + b"\no."),
        # the admitted callables, given hostile arguments or used as BUILD targets
        Entry(
            "get_layout_of_a_non_layout",
            P4 + call1(sglob("torch.serialization", "_get_layout"), u("os.system")) + STOP,
            live=False,
        ),
        Entry(
            "BUILD_poisons_get_layout_cache",
            P4
            + sglob("torch.serialization", "_get_layout")
            + EMPTY_DICT
            + u("cache")
            + EMPTY_DICT
            + u("torch.strided")
            + u("evil")
            + SETITEM
            + SETITEM
            + BUILD
            + STOP,
            live=False,
        ),
        Entry(
            "BUILD_sets_a_class_attribute",
            P4 + sglob(MD, "Metadata") + BUILD_PWNED + STOP,
            live=False,
        ),
        Entry(
            "BUILD_on_a_memoized_class",
            P4 + sglob(MD, "StorageMeta") + MEMOIZE + POP + binget(0) + BUILD_PWNED + STOP,
            live=False,
        ),
        Entry(
            "torch_Size_of_a_command",
            P4 + call1(sglob("torch", "Size"), shell) + STOP,
            live=False,
        ),
        Entry(
            "torch_Size_huge",
            P4
            + sglob("torch", "Size")
            + EMPTY_LIST
            + b"\x8a\x11"
            + b"\xff" * 16
            + b"\x7f"
            + b"a"
            + b"\x85R"
            + STOP,
            live=False,
        ),
        Entry("pathlib_Path_write_text", pathlib_write("Path.write_text")),
        Entry("pathlib_PosixPath_write_text_dotted", pathlib_write("PosixPath.write_text")),
        Entry(
            "torch_save", P4 + sglob("torch", "save") + u("pwned") + u(str(marker)) + TUPLE2 + REDUCE + STOP
        ),
        Entry("torch_load", P4 + call1(sglob("torch", "load"), u(str(marker))) + STOP, live=False),
        Entry(
            "functools_partial",
            P4
            + sglob("functools", "partial")
            + os_system
            + shell
            + TUPLE2
            + REDUCE
            + EMPTY_TUPLE
            + REDUCE
            + STOP,
        ),
        Entry(
            "typing_ForwardRef_evaluate",
            P4
            + sglob("typing", "ForwardRef._evaluate")
            + MARK
            + call1(sglob("typing", "ForwardRef"), u(expr))
            + NONE
            + NONE
            + MARK
            + b"\x91"  # FROZENSET (empty)
            + TUPLE
            + REDUCE
            + STOP,
        ),
        # a valid Metadata whose storage points outside the checkpoint's listed files
        Entry("relative_path_parent_escape", forged(storage_path("../../etc/passwd")), live=False),
        Entry("relative_path_absolute", forged(storage_path("/etc/passwd")), live=False),
        Entry(
            "relative_path_sibling_checkpoint", forged(storage_path(f"../{OLDER}/__0_0.distcp")), live=False
        ),
        Entry("relative_path_the_manifest", forged(storage_path(ckpt.MANIFEST)), live=False),
        Entry("relative_path_unlisted_file", forged(storage_path("__9_9.distcp")), live=False),
        Entry("stream_transforms", forged(transforms), live=False),
    ]


# ----- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> Path:
    """A run of the small model: checkpoints at steps 2 and 4."""
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("trained") / "run"
    train(_config(tiny_data), run)
    assert [p.name for _, p in ckpt.list_checkpoints(run / "checkpoints")] == [OLDER, NEWEST]
    return run


def _config(data: Path):
    return load_run_config(CONFIG_DIR / "tiny.toml", [f'data.dir="{data}"', "log.progress=false", *SMALL])


class Bench:
    """A copy of the trained run, one Trainer on it, and the load paths to try on its newest checkpoint."""

    def __init__(self, trained: Path, root: Path, data: Path) -> None:
        self.root = root
        self.run = root / "run"
        shutil.copytree(trained, self.run)
        self.older = self.run / "checkpoints" / OLDER
        self.newest = self.run / "checkpoints" / NEWEST
        self.pristine = {p.name: p.read_bytes() for p in self.newest.iterdir()}
        self.manifest = json.loads(self.pristine[ckpt.MANIFEST])
        self.trainer = Trainer(_config(data), self.run, [])
        self.cwd = root / "cwd"
        self.cwd.mkdir()

    def restore(self) -> None:
        for p in self.newest.iterdir():
            if p.name not in self.pristine:
                p.unlink()
        for name, data in self.pristine.items():
            (self.newest / name).write_bytes(data)

    def write_metadata(self, data: bytes) -> None:
        """Replace the newest .metadata and update the manifest to match, self-checksum included."""
        (self.newest / ".metadata").write_bytes(data)
        manifest = copy.deepcopy(self.manifest)
        manifest["files"][".metadata"] = {"bytes": len(data), "xxhash": bytes_xxhash(data)}
        self.write_manifest(manifest)

    def write_manifest(self, manifest: dict, rehash: bool = True) -> None:
        if rehash:
            manifest["manifest_xxhash"] = ckpt.manifest_digest(manifest)
        (self.newest / ckpt.MANIFEST).write_text(json.dumps(manifest))

    def snapshot(self) -> set[str]:
        """Every path under the bench and the working directory (what a payload could have created)."""
        found = set()
        for top in (self.root, Path.cwd()):
            for dirpath, dirnames, filenames in os.walk(top):
                found.update(os.path.join(dirpath, n) for n in dirnames + filenames)
        return found

    def paths(self) -> dict[str, object]:
        """Each load path's outcome: a checkpoint name (loaded), or the exception it raised (the tests
        accept a TenxError only: the CLI prints it as one line, anything else as a traceback)."""
        t = self.trainer
        tries = {
            "resume_auto": lambda: t.resume("auto").name,
            "resume_path": lambda: t.resume(str(self.newest)).name,
            "load_model_run": lambda: load_model(self.run, "cpu").checkpoint.name,
            "load_model_path": lambda: load_model(self.newest, "cpu").checkpoint.name,
            "status": lambda: format_status(self.run),
        }
        out: dict[str, object] = {}
        for name, attempt in tries.items():
            try:
                out[name] = attempt()
            except Exception as e:
                out[name] = e
        return out


@pytest.fixture(scope="module")
def bench(trained, tiny_data, tmp_path_factory) -> Bench:
    return Bench(trained, tmp_path_factory.mktemp("bench"), tiny_data)


@pytest.fixture(scope="module")
def corpus(bench) -> list[Entry]:
    metadata = ckpt.read_dcp_metadata(bench.newest, bench.manifest)
    return build_corpus(bench.root / "MARKER", metadata)


def _names() -> list[str]:
    dummy = dcp_md.Metadata({}, storage_data={dcp_md.MetadataIndex("x"): dcp_fs._StorageInfo("a", 0, 0)})
    return [e.name for e in build_corpus(Path("/m"), dummy)]


CORPUS_NAMES = _names()


# ----- the corpus ---------------------------------------------------------------------------------
def test_corpus_is_live(bench, tmp_path):
    """Plain pickle.loads of the `live` entries does run the command: the corpus tests something real."""
    metadata = ckpt.read_dcp_metadata(bench.newest, bench.manifest)
    live = [e.name for e in build_corpus(Path("/m"), metadata) if e.live]
    for i, name in enumerate(live):
        (tmp_path / f"d{i}").mkdir()
        entry = next(e for e in build_corpus(tmp_path / f"d{i}" / "MARKER", metadata) if e.name == name)
        (tmp_path / f"{i}.pkl").write_bytes(entry.data)
    script = textwrap.dedent(
        f"""
        import copyreg, os, pickle, time
        copyreg.add_extension("os", "system", {EXT_CODE})
        for i in range({len(live)}):
            os.chdir(os.path.join({str(tmp_path)!r}, "d%d" % i))
            try:
                pickle.loads(open(os.path.join({str(tmp_path)!r}, "%d.pkl" % i), "rb").read())
            except Exception:
                pass
        time.sleep(1)  # subprocess.Popen runs its command in the background
        """
    )
    subprocess.run([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    dead = [name for i, name in enumerate(live) if not (tmp_path / f"d{i}" / "MARKER").exists()]
    assert dead == [], f"these corpus entries do not run their command under plain pickle: {dead}"
    assert len(live) >= 25


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_malicious_metadata_is_refused_by_every_load_path(bench, corpus, name, monkeypatch):
    entry = next(e for e in corpus if e.name == name)
    monkeypatch.chdir(bench.cwd)
    copyreg.add_extension("os", "system", EXT_CODE)  # so that EXT1 would reach os.system if admitted
    layout_cache = dict(torch.serialization._get_layout.cache)
    before = bench.snapshot()
    try:
        bench.write_metadata(entry.data)
        outcomes = bench.paths()
    finally:
        copyreg.remove_extension("os", "system", EXT_CODE)
        bench.restore()
    time.sleep(0.5 if "Popen" in name else 0)  # Popen would run its command in the background
    assert not (bench.root / "MARKER").exists()
    assert bench.snapshot() == before, "a load created a file"
    assert not hasattr(dcp_md.Metadata, "tenx_pwned") and not hasattr(dcp_md.StorageMeta, "tenx_pwned")
    assert dict(torch.serialization._get_layout.cache) == layout_cache
    where = str(bench.newest)
    # Every entry matches its recorded checksum, so whatever fails in it was made so: refused as unsafe
    # (not skipped for an older checkpoint) by every path, naming the checkpoint.
    for path, outcome in outcomes.items():
        assert isinstance(outcome, UnsafeCheckpointError), (path, outcome)
        assert where in str(outcome) and "refusing to load it" in str(outcome), (path, outcome)


def test_valid_checkpoint_loads_by_every_path(bench):
    """The control: with nothing forged, every path loads the newest checkpoint."""
    bench.restore()
    outcomes = bench.paths()
    assert {k: v for k, v in outcomes.items() if k != "status"} == dict.fromkeys(
        ("resume_auto", "resume_path", "load_model_run", "load_model_path"), NEWEST
    )
    assert f"{NEWEST} verifies" in outcomes["status"]


def test_old_checkpoint_without_manifest_checksum_still_loads(bench):
    manifest = copy.deepcopy(bench.manifest)
    del manifest["manifest_xxhash"]
    try:
        bench.write_manifest(manifest, rehash=False)
        assert bench.trainer.resume("auto") == bench.newest and bench.trainer.step == 4
    finally:
        bench.restore()


def test_manifest_self_checksum_and_schema_name_the_field(bench):
    try:
        manifest = copy.deepcopy(bench.manifest)
        manifest["tokens"] = 1
        bench.write_manifest(manifest, rehash=False)
        with pytest.raises(CheckpointError, match="tenx_checkpoint.json is corrupt"):
            ckpt.verify_checkpoint(bench.newest)
        manifest["loader"]["cursor"] = "x"
        bench.write_manifest(manifest)
        with pytest.raises(
            CheckpointError, match=rf"{NEWEST}: .* field 'loader.cursor' must be a whole number"
        ):
            bench.trainer.resume(str(bench.newest))
        manifest = copy.deepcopy(bench.manifest)
        del manifest["python_rng"]
        bench.write_manifest(manifest)
        with pytest.raises(CheckpointError, match="has no 'python_rng'"):
            bench.trainer.resume(str(bench.newest))
        manifest["python_rng"] = [3, [1, 2, 3], None]  # well-typed, but not a Mersenne Twister state
        bench.write_manifest(manifest)
        with pytest.raises(CheckpointError, match="training state cannot be restored"):
            bench.trainer.resume(str(bench.newest))
        manifest = copy.deepcopy(bench.manifest)
        manifest["files"]["../evil"] = {"bytes": 1, "xxhash": "0"}
        bench.write_manifest(manifest)
        with pytest.raises(UnsafeCheckpointError, match="not a file name inside the checkpoint"):
            ckpt.latest_verified(bench.run / "checkpoints")
    finally:
        bench.restore()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("depth", 10**6, "holds only"),  # would allocate far more than the checkpoint holds
        ("vocab_size", 2**40, "holds only"),
        (
            "init_std",
            -1.0,
            "field .model. is invalid: model.init_std: must be >= 0",
        ),  # range-checked by ModelConfig.validate now
        ("d_model", "x", "field 'model' is invalid"),
    ],
)
def test_eval_refuses_a_forged_model_config(bench, field, value, message):
    manifest = copy.deepcopy(bench.manifest)
    manifest["model"][field] = value
    try:
        bench.write_manifest(manifest)
        with pytest.raises(CheckpointError, match=message):
            load_model(bench.newest, "cpu")
    finally:
        bench.restore()


def test_a_symlinked_data_file_is_refused(bench):
    data = bench.newest / "__0_0.distcp"
    outside = bench.root / "outside.distcp"
    try:
        shutil.move(data, outside)
        data.symlink_to(outside)
        with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
            ckpt.latest_verified(bench.run / "checkpoints")
    finally:
        data.unlink()
        outside.unlink()
        bench.restore()


def test_prune_treats_an_unsafe_checkpoint_as_not_verifying(tmp_path, bench):
    root = tmp_path / "checkpoints"
    shutil.copytree(bench.run / "checkpoints", root)
    evil = root / NEWEST / ".metadata"
    evil.write_bytes(pickle.dumps(_Evil("true")))
    manifest = json.loads((root / NEWEST / ckpt.MANIFEST).read_text())
    manifest["files"][".metadata"] = {"bytes": evil.stat().st_size, "xxhash": bytes_xxhash(evil.read_bytes())}
    manifest["manifest_xxhash"] = ckpt.manifest_digest(manifest)
    (root / NEWEST / ckpt.MANIFEST).write_text(json.dumps(manifest))
    # keep_last=1 would keep only the unsafe newest: the older one that verifies is kept as the fallback
    assert ckpt.prune_checkpoints(root, keep_last=1) == []
    assert [p.name for _, p in ckpt.list_checkpoints(root)] == [OLDER, NEWEST]


# ----- the real CLI -------------------------------------------------------------------------------
def _cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize(
    "name",
    [
        "dcp_filesystem_os_system_STACK_GLOBAL",
        pytest.param("reduce_os_system_protocol4", marks=pytest.mark.slow),
        pytest.param("relative_path_parent_escape", marks=pytest.mark.slow),
    ],
)
def test_cli_refuses_malicious_metadata(bench, corpus, tiny_data, tmp_path, name):
    """`tenx train --resume PATH|auto`, `eval`, `sample`, `status`: exit 2, one `tenx: error:` line."""
    entry = next(e for e in corpus if e.name == name)
    run = tmp_path / "run"
    shutil.copytree(bench.run, run)
    newest = run / "checkpoints" / NEWEST
    (newest / ".metadata").write_bytes(entry.data)
    manifest = json.loads((newest / ckpt.MANIFEST).read_text())
    manifest["files"][".metadata"] = {"bytes": len(entry.data), "xxhash": bytes_xxhash(entry.data)}
    manifest["manifest_xxhash"] = ckpt.manifest_digest(manifest)
    (newest / ckpt.MANIFEST).write_text(json.dumps(manifest))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    train_args = [
        "train",
        "--config",
        "tiny",
        "--set",
        f'data.dir="{tiny_data}"',
        "--set",
        "log.progress=false",
    ]
    for item in SMALL:
        train_args += ["--set", item]
    commands = {
        "train_resume_path": [*train_args, "--run-dir", str(tmp_path / "other"), "--resume", str(newest)],
        "train_resume_auto": [*train_args, "--run-dir", str(run), "--resume", "auto"],
        "eval": ["eval", str(run), "--device", "cpu"],
        "sample": ["sample", str(newest), "--prompt", "def", "--device", "cpu"],
        "status": ["status", str(run)],
    }
    before = _tree(tmp_path) | _tree(bench.root)
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-m", "tenx", *args],
            cwd=cwd,
            env=_cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, args in commands.items()
    }
    results = {key: (p.wait(timeout=240), *p.communicate()) for key, p in procs.items()}
    for key, (code, _out, err) in results.items():
        assert code == 2, (key, err[-2000:])
        assert err.startswith("tenx: error: ") and err.count("\n") == 1, (key, err[-2000:])
        assert str(newest) in err and "Traceback" not in err, (key, err)
    assert not (bench.root / "MARKER").exists()
    assert _tree(tmp_path) | _tree(bench.root) == before, "a command created a file"


def _tree(top: Path) -> set[str]:
    return {os.path.join(d, n) for d, dirs, files in os.walk(top) for n in dirs + files}


# ----- fuzz ---------------------------------------------------------------------------------------
def _fuzz(bench: Bench, cases: int, seed: int) -> collections.Counter:
    """Mutate the newest checkpoint `cases` times; check every load path; count the outcomes."""
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    files = sorted(bench.pristine)
    for case in range(cases):
        before = bench.snapshot()
        try:
            kind = _mutate(bench, rng, files)
            outcomes = bench.paths()
            try:
                ckpt.verify_checkpoint(bench.newest)
                verdict = "verifies"
            except UnsafeCheckpointError:
                verdict = "unsafe"
            except CheckpointError:
                verdict = "damaged"
        finally:
            bench.restore()
        where = f"case {case} of seed {seed} ({kind}, newest {verdict})"
        assert bench.snapshot() == before, f"{where} created a file"
        for path, outcome in outcomes.items():
            if not isinstance(outcome, (str, TenxError)):
                trace = "".join(traceback.format_exception(outcome))
                pytest.fail(f"{where}: {path} raised what the CLI would print as a traceback:\n{trace}")
            if path == "status":
                label = type(outcome).__name__ if isinstance(outcome, TenxError) else "printed"
            else:
                label = type(outcome).__name__ if isinstance(outcome, TenxError) else f"loaded {outcome}"
            counts[path, label] += 1
        counts["mutation", kind.split(":")[0]] += 1
        counts["newest", verdict] += 1
        # The oracle: the older, intact checkpoint is used exactly when the newest does not verify; a
        # forged one stops every path; one that verifies is loaded or refused, never skipped.
        auto, by_run = outcomes["resume_auto"], outcomes["load_model_run"]
        if verdict == "damaged":
            assert auto == OLDER and by_run == OLDER, (where, auto, by_run)
            assert isinstance(outcomes["resume_path"], CheckpointError), where
            assert isinstance(outcomes["load_model_path"], CheckpointError), where
            assert f"{OLDER} verifies" in outcomes["status"], where
        elif verdict == "unsafe":
            assert all(isinstance(o, UnsafeCheckpointError) for o in outcomes.values()), (where, outcomes)
        else:
            assert auto in (NEWEST,) or isinstance(auto, CheckpointError), (where, auto)
            assert by_run in (NEWEST,) or isinstance(by_run, CheckpointError), (where, by_run)
            assert outcomes["resume_path"] == NEWEST or isinstance(outcomes["resume_path"], TenxError), where
            assert f"{NEWEST} verifies" in outcomes["status"], where
    return counts


def _report(counts: collections.Counter, seconds: float, cases: int) -> None:
    print(f"\nfuzz: {cases} cases in {seconds:.1f} s")
    for group in (
        "mutation",
        "newest",
        "resume_auto",
        "resume_path",
        "load_model_run",
        "load_model_path",
        "status",
    ):
        row = sorted((k[1], v) for k, v in counts.items() if k[0] == group)
        print(f"  {group:16} " + ", ".join(f"{label} {n}" for label, n in row))


def test_fuzz_checkpoint_directory(bench, monkeypatch):
    """300 mutations (the slow variant runs 3000): a load, the older checkpoint, or a TenxError."""
    monkeypatch.chdir(bench.cwd)
    t0 = time.perf_counter()
    counts = _fuzz(bench, 300, seed=12)
    _report(counts, time.perf_counter() - t0, 300)


@pytest.mark.slow
def test_fuzz_checkpoint_directory_thousands(bench, monkeypatch):
    monkeypatch.chdir(bench.cwd)
    t0 = time.perf_counter()
    counts = _fuzz(bench, 3000, seed=1212)
    _report(counts, time.perf_counter() - t0, 3000)


FLIP, RANDOM, TRUNCATE, EXTEND = "flip", "random bytes", "truncate", "extend"
HOSTILE_NAMES = ["../x", "/etc/passwd", "", ".", "..", "a/b", "x\x00", "__0_1.distcp"]
HOSTILE_VALUES = [
    None,
    -1,
    0,
    1,
    2**63,
    1.5,
    float("inf"),
    "x",
    "",
    "../../x",
    [],
    {},
    [0, 0],
    True,
    "a" * 300,
]


def _damage(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    how = rng.choice((FLIP, FLIP, RANDOM, TRUNCATE, EXTEND))
    raw = bytearray(data)
    if how == FLIP and raw:
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] ^= rng.randint(1, 255)
    elif how == RANDOM and raw:
        start = rng.randrange(len(raw))
        n = min(rng.randint(1, 64), len(raw) - start)
        raw[start : start + n] = rng.randbytes(n)
    elif how == TRUNCATE:
        del raw[rng.randrange(len(raw) + 1) :]
    else:
        raw += rng.randbytes(rng.randint(1, 64))
    return how, bytes(raw)


def _json_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:4]):
            yield from _json_paths(v, (*prefix, i))


def _mutate(bench: Bench, rng: random.Random, files: list[str]) -> str:
    """Damage the newest checkpoint one way; returns a label for the outcome table."""
    kind = rng.choice(("raw", "raw", "delete", "rehashed", "rehashed", "json", "json", "json", "files"))
    newest = bench.newest
    if kind == "raw":
        name = rng.choice(files)
        how, data = _damage(bench.pristine[name], rng)
        (newest / name).write_bytes(data)
        return f"raw {how}: {'manifest' if name == ckpt.MANIFEST else name}"
    if kind == "delete":
        name = rng.choice(files)
        (newest / name).unlink()
        return f"delete: {'manifest' if name == ckpt.MANIFEST else name}"
    manifest = copy.deepcopy(bench.manifest)
    if kind == "rehashed":  # reach the deep parsers: the damaged file's hash is made to match
        name = rng.choice([n for n in files if n != ckpt.MANIFEST])
        how, data = _damage(bench.pristine[name], rng)
        (newest / name).write_bytes(data)
        manifest["files"][name] = {"bytes": len(data), "xxhash": bytes_xxhash(data)}
        bench.write_manifest(manifest)
        return f"rehashed {how}: {name}"
    if kind == "files":  # the file list, which says what may be read: renamed or retyped entries
        name = rng.choice(sorted(manifest["files"]))
        if rng.random() < 0.5:
            manifest["files"][rng.choice(HOSTILE_NAMES)] = manifest["files"].pop(name)
        else:
            manifest["files"][name][rng.choice(("bytes", "xxhash"))] = copy.deepcopy(
                rng.choice(HOSTILE_VALUES)
            )
        bench.write_manifest(manifest)
        return "files entry (rehashed)"
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _json_paths(manifest) if p]
        path = rng.choice(paths)
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and rng.random() < 0.2:
            del parent[path[-1]]
        elif isinstance(parent, dict) and rng.random() < 0.1:
            parent[rng.choice(HOSTILE_NAMES)] = parent.pop(path[-1])
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
    stale = rng.random() < 0.1
    bench.write_manifest(manifest, rehash=not stale)
    return "json (stale self-checksum)" if stale else "json (rehashed)"
