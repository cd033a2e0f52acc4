"""Fuzzing what a user hands tenx: a prepared data directory and a config file.

Thousands of mutated data directories (manifest.json, shards, indexes, tokenizer.json, the directory
itself) and config files (bytes, types, ranges, unknown keys, `--set` overrides) go through the real CLI,
`tenx.cli.main`, in this process: `train`, and `eval` / `sample` of a run whose data directory was
mutated after training. Every run must end either in success or in one `tenx: error: ...` line with a
non-zero status, never with a traceback, and no file of the user's (the data directory, the config file,
files outside both that a mutation points at) may change. Data cases then also go through the readers
underneath (manifest, tokenizer, checksums, token stream and loader, document decoding), which must
raise nothing but TenxError.

Each case draws from its own `random.Random(f"{SEED}:{kind}:{index}")`, so a failure names the case and
`TENX_FUZZ_ONLY=data:123` (or `config:45`) reruns just it. The default run (1,000 data directories,
2,000 configs) takes about 35 s on two idle CPU cores; `-m slow` runs 10,000 and 20,000 (about 6 minutes).

Not fuzzed here, on purpose: values the config accepts that make a run legitimately expensive or stop the
process by design (a 10^9-parameter model, a million steps, torch.compile, fault injection such as
`sigkill`, a watchdog timeout of a millisecond, replica groups that wait for a lighthouse, an online W&B
sink that would reach the network). `_affordable` recognises them with the product's own config loader and
draws another mutation instead.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import hashlib
import io
import json
import math
import os
import random
import re
import shutil
import stat
import sys
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest
import torch
import xxhash

import tenx.cli
from tenx.data.loader import TokenLoader, TokenStream
from tenx.data.manifest import SPLITS, read_manifest, split_documents_text, verify_split
from tenx.data.prepare.pipeline import PrepareConfig, prepare
from tenx.data.tokenizer import load_tokenizer
from tenx.errors import TenxError
from tenx.model.flops import count_params
from tenx.train.config import CONFIG_DIR, RunConfig, load_run_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SEED = 14_2026
DATA_CASES = 400
"""Mutated data directories in the default run (each: `train`, `eval` or `sample`, then the readers)."""
CONFIG_CASES = 1_000
"""Mutated config files and overrides in the default run (each: `train`)."""
SLOW_DATA_CASES, SLOW_CONFIG_CASES = 10_000, 20_000
"""The slow run (`-m slow`): the default cases and more."""
MAX_FAILURES = 8
"""Stop a run after this many failing cases (each is reported in full)."""

ERROR_PREFIX = "tenx: error:"


# ----- the user's files: snapshots ---------------------------------------------------------------------
def snapshot(*roots: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under `roots` (links not followed) with its kind and content hash, or mode."""
    out: dict[str, tuple[Any, ...]] = {}
    for root in roots:
        _snap(Path(root), out)
    return out


def _snap(path: Path, out: dict[str, tuple[Any, ...]]) -> None:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        out[str(path)] = ("absent",)
        return
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        out[str(path)] = ("link", os.readlink(path))
    elif stat.S_ISDIR(st.st_mode):
        out[str(path)] = ("dir", mode)
        for child in sorted(os.listdir(path)):
            _snap(path / child, out)
    elif stat.S_ISREG(st.st_mode):
        out[str(path)] = ("file", mode, hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest())
    else:
        out[str(path)] = ("other", stat.S_IFMT(st.st_mode), mode)


def snapshot_diff(before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]]) -> list[str]:
    changes = []
    for path in sorted(set(before) | set(after)):
        if before.get(path) != after.get(path):
            changes.append(f"{path}: {before.get(path, ('absent',))} -> {after.get(path, ('absent',))}")
    return changes


# ----- running the CLI in this process -----------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    code: Any
    stdout: str
    stderr: str
    crash: str | None  # the traceback of an exception that escaped tenx.cli.main


def run_cli(argv: list[str]) -> Outcome:
    out, err = io.StringIO(), io.StringIO()
    code: Any = None
    crash = None
    threads = torch.get_num_threads()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = tenx.cli.main(argv)
        except SystemExit as e:
            code = e.code
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - a crash is what this test looks for
            crash = traceback.format_exc()
    torch.set_num_threads(threads)  # a fuzzed train.threads must not slow the cases after it
    return Outcome(code, out.getvalue(), err.getvalue(), crash)


def outcome_problems(outcome: Outcome) -> list[str]:
    """Why an outcome is not 'success, or one clear error line' (empty when it is)."""
    problems = []
    if outcome.crash is not None:
        problems.append(f"an exception escaped tenx.cli.main:\n{outcome.crash}")
    elif outcome.code not in (0, None):
        if not any(line.startswith(ERROR_PREFIX) for line in outcome.stderr.splitlines()):
            problems.append(f"exit status {outcome.code!r} without a '{ERROR_PREFIX}' line")
    if "Traceback" in outcome.stderr or "Traceback" in outcome.stdout:
        problems.append("a traceback was printed")
    return problems


def _tail(text: str, limit: int = 3000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return (
        text
        if len(text) <= limit
        else text[: limit // 2] + f"...<{len(text)} chars>..." + text[-limit // 2 :]
    )


# ----- TOML written by hand (wrong types, non-finite floats, inline tables, datetimes) ---------------
def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        escaped = []
        for ch in value:
            if ch in '"\\':
                escaped.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                escaped.append(f"\\u{ord(ch):04x}")
            else:
                escaped.append(ch)
        return '"' + "".join(escaped) + '"'
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")


def toml_key(key: str) -> str:
    if key and all(c.isascii() and (c.isalnum() or c in "-_") for c in key):
        return key
    return toml_value(key)


def dump_toml(doc: dict[str, Any]) -> bytes:
    """Top-level scalars, then one [table] per top-level dict (nested dicts as inline tables)."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for key, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"\n[{toml_key(key)}]")
            lines.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items())
    # Lone surrogates (from fuzzed strings) become invalid UTF-8 in the file, as a broken editor would write.
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")


# ----- the fixtures: pristine inputs and trained runs ------------------------------------------------
@dataclasses.dataclass
class FuzzEnv:
    base: Path
    pristine: dict[str, Path]  # "bytes" / "bpe" -> a prepared data directory nobody mutates
    runs: dict[str, Path]  # "bytes" / "bpe" -> a trained run whose data directory is eval_data[kind]
    eval_data: dict[str, Path]
    config_doc: dict[str, Any]  # the base config (configs/tiny.toml, one step), data.dir unset


def base_config_doc() -> dict[str, Any]:
    doc = tomllib.loads((CONFIG_DIR / "tiny.toml").read_text())
    doc["train"].update(steps=1, eval_every=0, eval_batches=1, threads=1)
    doc["checkpoint"].update(every=0, at_end=False)
    doc["log"].update(tensorboard=False, progress=False)
    return doc


FUZZ_CORPUS = {"patterns": ["json/*.py", "email/mime/*.py"], "val_ratio": 0.2, "heldout_ratio": 0.2}
"""A part of the shared tiny corpus: 13 documents, about 60,000 tokens in 5 shards (so shard lists and
boundaries are fuzzed too), small enough to copy, hash and evaluate thousands of times."""


@pytest.fixture(scope="module")
def fuzz_env(corpus_dir, tmp_path_factory) -> FuzzEnv:
    from tenx.train.run import train

    base = tmp_path_factory.mktemp("fuzz")
    pristine = {}
    for kind in ("bytes", "bpe"):
        pristine[kind] = base / f"pristine-{kind}"
        cfg = PrepareConfig(
            source=str(corpus_dir),
            out=str(pristine[kind]),
            tokenizer=kind,
            vocab_size=300,
            shard_tokens=20_000,
        )
        prepare(dataclasses.replace(cfg, **FUZZ_CORPUS), progress=False)
    doc = base_config_doc()
    runs, eval_data = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tenx.train.parts.peak_flops", lambda device, dtype, float8=False: 1e12)
        for kind in ("bytes", "bpe"):
            eval_data[kind] = base / f"eval-{kind}" / "data"
            shutil.copytree(pristine[kind], eval_data[kind])
            runs[kind] = base / f"run-{kind}"
            overrides = [f"data.dir={json.dumps(str(eval_data[kind]))}", "checkpoint.at_end=true"]
            (base / "base.toml").write_bytes(dump_toml(doc))
            with contextlib.redirect_stdout(io.StringIO()):
                train(load_run_config(base / "base.toml", overrides), runs[kind])
    return FuzzEnv(base, pristine, runs, eval_data, doc)


@pytest.fixture
def fuzz(fuzz_env, monkeypatch, tmp_path):
    """The environment, with the CLI's run costs that do not depend on the inputs taken out."""
    # train measures the machine's matmul speed (0.4 s) for its MFU figure: the same on every case
    monkeypatch.setattr("tenx.train.parts.peak_flops", lambda device, dtype, float8=False: 1e12)
    # Relative paths a mutation names ('.', '..', 'runs') resolve inside this test's directory, whatever a
    # run does with them.
    cwd = tmp_path / "cwd" / "cwd"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    return fuzz_env


# ----- data directory mutations ------------------------------------------------------------------------
@dataclasses.dataclass
class DataCase:
    data: Path  # the data directory under test
    outside: Path  # files a mutation may point at (links, path traversal): they must not change
    rng: random.Random
    kind: str  # "bytes" or "bpe"

    @property
    def manifest_path(self) -> Path:
        return self.data / "manifest.json"

    def manifest(self) -> Any:
        return json.loads(read_own(self.manifest_path))

    def write_manifest(self, manifest: Any) -> None:
        write_own(self.manifest_path, json.dumps(manifest, indent=1).encode())

    def shard_files(self) -> list[Path]:
        return sorted(p for p in self.data.iterdir() if p.suffix in (".bin", ".idx") and is_own_file(p))


def is_own_file(path: Path) -> bool:
    """A regular file itself, not a link: what a mutation may read and rewrite (never the user's files
    outside the data directory that an earlier mutation linked to, never a FIFO, which would block)."""
    return path.is_file() and not path.is_symlink()


def read_own(path: Path) -> bytes:
    if not is_own_file(path):
        raise FileNotFoundError(f"{path} is not a plain file (an earlier mutation replaced it)")
    return path.read_bytes()


def write_own(path: Path, raw: bytes) -> None:
    """Write a file of the data directory, replacing (never writing through) a link, FIFO or directory."""
    if path.is_symlink() or (path.exists() and not path.is_dir() and not path.is_file()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.write_bytes(raw)

    def any_file(self) -> Path:
        return self.rng.choice(sorted(self.data.iterdir()))


def _replace_path(path: Path, how: str, case: DataCase) -> str:
    """Replace a file or directory with something else of the same name."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    if how == "missing":
        return f"removed {path.name}"
    if how == "directory":
        path.mkdir()
        (path / "inside.txt").write_text("not a shard")
        return f"{path.name} is a directory"
    if how == "link-outside-file":
        os.symlink(case.outside / "secret.bin", path)
        return f"{path.name} is a symlink to a file outside"
    if how == "link-outside-dir":
        os.symlink(case.outside, path)
        return f"{path.name} is a symlink to a directory outside"
    if how == "dangling-link":
        os.symlink(case.outside / "no-such-file", path)
        return f"{path.name} is a dangling symlink"
    if how == "link-loop":
        os.symlink(path.name, path)
        return f"{path.name} is a symlink to itself"
    if how == "fifo":
        os.mkfifo(path)
        return f"{path.name} is a FIFO"
    if how == "link-dev-zero":
        os.symlink("/dev/zero", path)
        return f"{path.name} is a symlink to /dev/zero"
    raise AssertionError(how)


REPLACEMENTS = (
    "missing",
    "directory",
    "link-outside-file",
    "link-outside-dir",
    "dangling-link",
    "link-loop",
    "fifo",
    "link-dev-zero",
)


def _file_bytes_mutation(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Truncate, extend, empty, flip or overwrite bytes of a file's content."""
    how = rng.choice(["truncate", "extend", "empty", "flip", "flip-many", "shift", "random", "odd-size"])
    if how == "truncate":
        n = rng.randrange(len(raw)) if raw else 0
        return raw[:n], f"truncated to {n} of {len(raw)} bytes"
    if how == "extend":
        extra = bytes(rng.randrange(256) for _ in range(rng.choice([1, 2, 7, 8, 64, 4096])))
        return raw + extra, f"extended by {len(extra)} bytes"
    if how == "empty":
        return b"", "emptied"
    if how == "odd-size":
        return raw[:-1] if raw else b"\x01", "one byte short"
    if how == "random":
        n = rng.choice([1, 3, 16, len(raw)])
        return bytes(rng.randrange(256) for _ in range(n)), f"replaced by {n} random bytes"
    if how == "shift":
        return raw[1:] + raw[:1], "rotated by one byte"
    data = bytearray(raw or b"\x00")
    for _ in range(1 if how == "flip" else rng.randrange(2, 50)):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8) if rng.random() < 0.5 else 0xFF
    return bytes(data), f"{how} ({len(raw)} bytes)"


def m_shard_file(case: DataCase) -> str:
    """Damage a shard or index file; sometimes update the manifest so the damage passes its checksums."""
    files = case.shard_files()
    if not files:
        return "no shard file to damage"
    path = case.rng.choice(files)
    if case.rng.random() < 0.25:
        return _replace_path(path, case.rng.choice(REPLACEMENTS), case)
    raw, what = _file_bytes_mutation(read_own(path), case.rng)
    if path.suffix == ".bin" and case.rng.random() < 0.3:
        # token ids beyond the vocabulary (a bit flip in the high byte, or a different tokenizer's ids)
        data = bytearray(read_own(path))
        for _ in range(case.rng.randrange(1, 5)):
            i = case.rng.randrange(0, len(data) // 2) * 2 if data else 0
            if data:
                data[i + 1] = case.rng.choice([0x01, 0x7F, 0xFF])
        raw, what = bytes(data), "token ids beyond the vocabulary"
    write_own(path, raw)
    label = f"{path.name}: {what}"
    if case.rng.random() < 0.4:
        try:  # the manifest agrees with the damage: only checks of the content itself can catch it
            manifest = case.manifest()
            for entry in manifest["splits"].values():
                for shard in entry["shards"]:
                    if shard["file"] == path.name:
                        shard["xxhash"] = xxhash.xxh3_64_hexdigest(raw)
                        if len(raw) % 2 == 0 and case.rng.random() < 0.5:
                            size = len(raw) // (2 if manifest["dtype"] == "uint16" else 4)
                            entry["tokens"] += size - shard["tokens"]
                            shard["tokens"] = size
                    if shard["index_file"] == path.name:
                        shard["index_xxhash"] = xxhash.xxh3_64_hexdigest(raw)
            case.write_manifest(manifest)
            label += " (manifest checksums updated to match)"
        except Exception as e:  # noqa: BLE001 - an earlier mutation broke the manifest; fine
            label += f" (manifest not updated: {type(e).__name__})"
    return label


def m_tokenizer_file(case: DataCase) -> str:
    """Damage tokenizer.json (bpe) or add one (bytes); sometimes update the manifest's hash to match."""
    path = case.data / "tokenizer.json"
    rng = case.rng
    if rng.random() < 0.2:
        return _replace_path(path, rng.choice(REPLACEMENTS), case)
    raw = read_own(path) if is_own_file(path) else b"{}"
    choice = rng.choice(["bytes", "garbage-json", "not-json", "non-utf8", "other-vocab", "no-eot"])
    if choice == "bytes":
        raw, what = _file_bytes_mutation(raw, rng)
    elif choice == "garbage-json":
        raw, what = (
            json.dumps(rng.choice([{}, [], None, 1, {"model": {"type": "BPE"}}])).encode(),
            "garbage JSON",
        )
    elif choice == "not-json":
        raw, what = b"this is not a tokenizer", "not JSON"
    elif choice == "non-utf8":
        raw, what = raw[: len(raw) // 2] + b"\xff\xfe\x80" + raw[len(raw) // 2 :], "invalid UTF-8"
    else:
        try:
            tok = json.loads(raw)
            vocab = tok["model"]["vocab"]
            if choice == "other-vocab":  # drop the last tokens: a smaller vocabulary than the manifest says
                for key in sorted(vocab, key=vocab.get)[-rng.randrange(1, 40) :]:
                    del vocab[key]
                tok["model"]["merges"] = tok["model"]["merges"][: max(0, len(vocab) - 257)]
            else:
                tok["added_tokens"] = []
                vocab.pop("<|endoftext|>", None)
            raw, what = json.dumps(tok).encode(), f"tokenizer with {choice}"
        except Exception:  # noqa: BLE001 - not a BPE tokenizer file (bytes data, or already damaged)
            raw, what = b'{"version": "1.0"}', "a minimal JSON object"
    write_own(path, raw)
    label = f"tokenizer.json: {what}"
    if rng.random() < 0.6:
        try:
            manifest = case.manifest()
            manifest["tokenizer"]["xxhash"] = xxhash.xxh3_64_hexdigest(raw)
            if rng.random() < 0.3:
                manifest["tokenizer"].update(kind="bpe", file="tokenizer.json")
            case.write_manifest(manifest)
            label += " (manifest hash updated to match)"
        except Exception as e:  # noqa: BLE001
            label += f" (manifest not updated: {type(e).__name__})"
    return label


WRONG_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    2**64 + 1,
    10**400,
    -(10**30),
    0.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "x",
    "uint16",
    "bpe",
    "tenx-shards/1",
    "../../etc/passwd",
    "/etc/passwd",
    "train_00000.bin",
    "x" * 10_000,
    "\x00",
    "日本語",
    [],
    [1, 2],
    ["train_00000.bin"],
    {},
    {"file": "train_00000.bin"},
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a JSON tree (dict keys and list indexes)."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:50]):
            out += _paths(v, (*prefix, i))
    return out


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        node = node[k]
    return node


def _interesting_path(manifest: Any, rng: random.Random) -> tuple[Any, ...]:
    paths = _paths(manifest)
    # Mostly the fields readers use (tokenizer, dtype, splits and shards), not the document id lists.
    weighted = [p for p in paths if "documents" not in p or p[-1] == "documents"]
    return rng.choice(weighted or paths)


def m_manifest_value(case: DataCase) -> str:
    """Replace one value of the manifest (anywhere in its tree) with a wrong one."""
    manifest = case.manifest()
    rng = case.rng
    path = _interesting_path(manifest, rng)
    if not path:
        return "manifest has no fields"
    old = _get(manifest, path)
    if isinstance(old, (int, float)) and not isinstance(old, bool) and rng.random() < 0.5:
        new = rng.choice([old - 1, old + 1, -old, old * 2, old // 2, 0, -1, 2**62, 10**18, old + 0.5])
    elif isinstance(old, str) and path[-1] in ("file", "index_file") and rng.random() < 0.7:
        new = rng.choice(
            [
                "../../etc/passwd",
                "/etc/passwd",
                str(case.outside / "secret.bin"),
                "../outside/secret.bin",
                "..",
                ".",
                "",
                "manifest.json",
                "tokenizer.json",
                "train_00000.bin",
                "val_00000.bin",
                "train_00000.idx",
                "train_99999.bin",
                "sub/train_00000.bin",
                "train_00000.bin\x00",
                "TRAIN_00000.BIN",
                " train_00000.bin",
                "train_00000.bin\n",
            ]
        )
    else:
        new = rng.choice(WRONG_VALUES)
    _get(manifest, path[:-1])[path[-1]] = new
    case.write_manifest(manifest)
    return f"manifest{''.join(f'[{k!r}]' for k in path)}: {_short(old, 60)} -> {_short(new, 60)}"


def m_manifest_key(case: DataCase) -> str:
    """Drop, rename or add a key somewhere in the manifest."""
    manifest = case.manifest()
    rng = case.rng
    dict_paths = [p for p in [(), *_paths(manifest)] if isinstance(_get(manifest, p), dict)]
    path = rng.choice(dict_paths)
    node = _get(manifest, path)
    how = rng.choice(["drop", "rename", "add"])
    where = "manifest" + "".join(f"[{k!r}]" for k in path)
    if how == "add" or not node:
        key = rng.choice(["extra", "val", "heldout", "train", "format", "__proto__", ""])
        node[key] = rng.choice(WRONG_VALUES)
        label = f"{where}: added {key!r}"
    else:
        key = rng.choice(sorted(node))
        value = node.pop(key)
        if how == "rename":
            node[key.upper() if key != key.upper() else key + "_"] = value
        label = f"{where}: {how} {key!r}"
    case.write_manifest(manifest)
    return label


def m_manifest_shards(case: DataCase) -> str:
    """Structural changes to a split's shard list: drop, duplicate, reorder, swap with another split."""
    manifest = case.manifest()
    rng = case.rng
    split = rng.choice(list(SPLITS))
    entry = manifest["splits"][split]
    how = rng.choice(["drop", "duplicate", "swap-splits", "empty-list", "split-not-dict", "tokens-mismatch"])
    if how == "drop" and entry["shards"]:
        entry["shards"].pop()
    elif how == "duplicate" and entry["shards"]:
        entry["shards"].append(copy.deepcopy(entry["shards"][0]))
    elif how == "swap-splits":
        other = rng.choice([s for s in SPLITS if s != split])
        manifest["splits"][split], manifest["splits"][other] = manifest["splits"][other], entry
    elif how == "empty-list":
        entry["shards"] = []
    elif how == "split-not-dict":
        manifest["splits"][split] = rng.choice([[], None, "train", 3])
    else:
        entry["tokens"] += rng.choice([-1, 1, 1000])
    case.write_manifest(manifest)
    return f"splits[{split!r}]: {how}"


def m_tokenizer_entry(case: DataCase) -> str:
    """The manifest's tokenizer entry disagrees with the data: vocabulary, end-of-document id, kind, dtype."""
    manifest = case.manifest()
    rng = case.rng
    tok = manifest["tokenizer"]
    how = rng.choice(["vocab", "eot", "both", "kind", "dtype", "file"])
    if how == "both":  # a consistent entry of another, bigger tokenizer (e.g. a re-prepare with more merges)
        tok["vocab_size"] = rng.choice([1000, 4096, 65535])
        tok["eot_id"] = tok["vocab_size"] - rng.choice([1, 100])
        tok["kind"], tok["file"] = "bpe", "tokenizer.json"
    elif how == "vocab":
        tok["vocab_size"] = rng.choice(
            [0, 1, 2, 100, 256, 257, 258, 299, 301, 1000, 65535, 65536, 2**32, 2**40]
        )
    elif how == "eot":
        tok["eot_id"] = rng.choice([-1, 0, 1, 255, 256, 257, 299, 300, 1000, 2**40])
    elif how == "kind":
        tok["kind"] = "bytes" if tok.get("kind") == "bpe" else "bpe"
        if tok["kind"] == "bpe" and rng.random() < 0.5:
            tok["file"] = "tokenizer.json"
    elif how == "dtype":
        manifest["dtype"] = rng.choice(["uint32", "uint16", "uint8", "int16", "float32", "<u2"])
    else:
        tok["file"] = rng.choice([None, "manifest.json", "train_00000.bin", "../outside/secret.bin", ""])
    case.write_manifest(manifest)
    return f"tokenizer entry: {how} -> {_short(tok if how != 'dtype' else manifest['dtype'], 120)}"


def m_manifest_text(case: DataCase) -> str:
    """Damage manifest.json as text: truncated, flipped bytes, invalid UTF-8, duplicate keys, deep nesting."""
    raw = read_own(case.manifest_path)
    rng = case.rng
    how = rng.choice(
        [
            "truncate",
            "flip",
            "non-utf8",
            "latin1",
            "duplicate-key",
            "deep",
            "nan",
            "not-object",
            "empty",
            "bom",
        ]
    )
    if how == "truncate":
        raw = raw[: rng.randrange(len(raw))]
    elif how == "flip":
        data = bytearray(raw)
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(len(data))
            data[i] = (
                rng.choice(b'{}[]",:0123456789 -.aeflnrstu\\') if rng.random() < 0.8 else rng.randrange(256)
            )
        raw = bytes(data)
    elif how == "non-utf8":
        i = rng.randrange(len(raw))
        raw = raw[:i] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"]) + raw[i:]
    elif how == "latin1":
        raw = raw.replace(b'"tokenizer"', '"tökenizer"'.encode("latin-1"), 1)
    elif how == "duplicate-key":
        key = rng.choice([b'"format"', b'"dtype"', b'"tokens"', b'"file"', b'"splits"', b'"vocab_size"'])
        raw = raw.replace(key + b":", key + b': "dup", ' + key + b":", 1)
        if rng.random() < 0.5:  # the duplicate last: it wins
            raw = raw.replace(key + b': "dup", ' + key + b":", key + b":", 1)
            raw = raw.rstrip()[:-1] + b", " + key + b': "dup"}'
    elif how == "deep":
        depth = rng.choice([100, 1000, 100_000])
        key = rng.choice([b'"source"', b'"stats"', b'"splits"', b'"tokenizer"'])
        raw = raw.replace(key + b":", key + b": " + b"[" * depth + b"]" * depth + b", " + key + b"_x:", 1)
        if rng.random() < 0.5:
            raw = raw.replace(
                key + b":", key + b": " + b'{"a":' * depth + b"1" + b"}" * depth + b", " + key + b"_y:", 1
            )
    elif how == "nan":
        raw = raw.replace(
            b'"tokens": ',
            b'"tokens": ' + rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e999"]) + b', "t": ',
            1,
        )
    elif how == "not-object":
        raw = rng.choice([b"[]", b"null", b"1", b'"manifest"', b"[" + raw + b"]"])
    elif how == "empty":
        raw = rng.choice([b"", b" ", b"\n"])
    else:
        raw = b"\xef\xbb\xbf" + raw
    write_own(case.manifest_path, raw)
    return f"manifest.json text: {how}"


def m_replace_manifest(case: DataCase) -> str:
    return _replace_path(case.manifest_path, case.rng.choice(REPLACEMENTS), case)


def m_directory(case: DataCase) -> str:
    """The data directory itself: missing, a file, empty, a link outside, or with a foreign file in it."""
    how = case.rng.choice(["missing", "file", "empty", "link-outside", "foreign-file", "extra-shard"])
    if how in ("missing", "file", "empty", "link-outside"):
        shutil.rmtree(case.data)
        if how == "file":
            case.data.write_text("not a directory")
        elif how == "empty":
            case.data.mkdir()
        elif how == "link-outside":
            os.symlink(case.outside, case.data)
    elif how == "foreign-file":
        write_own(case.data / "notes.txt", b"mine")
    else:
        write_own(case.data / "train_00009.bin", read_own(case.data / "train_00000.bin"))
    return f"data directory: {how}"


DATA_MUTATIONS: list[tuple[Callable[[DataCase], str], float]] = [
    (m_manifest_value, 6),
    (m_manifest_key, 3),
    (m_manifest_shards, 2),
    (m_tokenizer_entry, 3),
    (m_manifest_text, 4),
    (m_replace_manifest, 1),
    (m_shard_file, 5),
    (m_tokenizer_file, 2),
    (m_directory, 1),
]


def mutate_data(case: DataCase) -> list[str]:
    functions, weights = zip(*DATA_MUTATIONS)
    labels = []
    for _ in range(case.rng.choice([1, 1, 1, 2, 3])):
        if case.data.is_symlink() or not case.data.is_dir():  # m_directory left no directory to mutate
            break
        mutation = case.rng.choices(functions, weights)[0]
        try:
            labels.append(mutation(case))
        except Exception as e:  # noqa: BLE001 - an earlier mutation left nothing for this one to change
            labels.append(f"{mutation.__name__}: not applicable ({type(e).__name__}: {e})")
    return labels


OUTSIDE_FILES = {"secret.bin": bytes(range(256)) * 8, "notes.txt": b"the user's own file\n"}


def make_outside(root: Path) -> Path:
    """`root/outside`: files of the user's beside the data directory, which links and path traversal in a
    mutated data directory point at. Rebuilt when a case left it different."""
    outside = root / "outside"
    try:
        intact = sorted(os.listdir(outside)) == sorted(OUTSIDE_FILES) and all(
            is_own_file(outside / name) and (outside / name).read_bytes() == content
            for name, content in OUTSIDE_FILES.items()
        )
    except OSError:
        intact = False
    if not intact:
        if outside.is_symlink() or outside.is_file():
            outside.unlink()
        shutil.rmtree(outside, ignore_errors=True)
        outside.mkdir()
        for name, content in OUTSIDE_FILES.items():
            (outside / name).write_bytes(content)
    return outside


_CONTENTS: dict[Path, dict[str, bytes]] = {}


def restore(path: Path, pristine: Path) -> None:
    """Make `path` a copy of directory `pristine` again, whatever a mutation left there; rewrites only what
    differs (most cases change one or two files)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    if not path.is_dir():
        shutil.copytree(pristine, path)
        return
    if pristine not in _CONTENTS:
        _CONTENTS[pristine] = {p.name: p.read_bytes() for p in pristine.iterdir()}
    want = _CONTENTS[pristine]
    for entry in os.scandir(path):
        if entry.name not in want:
            _remove(Path(entry.path))
    for name, content in want.items():
        target = path / name
        if is_own_file(target) and target.stat().st_size == len(content) and target.read_bytes() == content:
            continue
        write_own(target, content)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def read_everything(data: Path) -> list[str]:
    """Every reader of a data directory on `data`; the problems (anything but success or TenxError)."""
    problems = []

    def attempt(name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except TenxError:
            return None
        except Exception:  # noqa: BLE001 - what this test looks for
            problems.append(f"{name} raised:\n{traceback.format_exc()}")
            return None

    manifest = attempt("read_manifest", lambda: read_manifest(data))
    tokenizer = attempt("load_tokenizer", lambda: load_tokenizer(data))

    def stream_all(split: str, verify: bool) -> None:
        stream = TokenStream(data, split, verify=verify)
        if len(stream):
            stream.read(0, len(stream))
        if len(stream) > 65:
            loader = TokenLoader(stream, 64, 4)
            for _ in range(3):
                loader.next_batch()

    for split in SPLITS:
        attempt(f"TokenStream({split!r})", lambda split=split: stream_all(split, True))
        attempt(f"TokenStream({split!r}, verify=False)", lambda split=split: stream_all(split, False))
        if manifest is not None:
            attempt(f"verify_split({split!r})", lambda split=split: verify_split(data, manifest, split))
            if tokenizer is not None:
                attempt(
                    f"split_documents_text({split!r})",
                    lambda split=split: sum(
                        1 for _ in split_documents_text(data, manifest, split, tokenizer)
                    ),
                )
    return problems


def run_data_case(env: FuzzEnv, index: int, scratch: Path) -> str | None:
    """One mutated data directory through the CLI and the readers; a report of what went wrong, or None."""
    rng = random.Random(f"{SEED}:data:{index}")
    kind = rng.choice(["bytes", "bytes", "bpe"])
    command = rng.choices(["train", "eval", "sample"], [8, 1, 1])[0]
    outside = make_outside(scratch)
    # eval and sample read the data directory the trained run's checkpoint names: mutate that one
    data = scratch / "data" if command == "train" else env.eval_data[kind]
    restore(data, env.pristine[kind])
    case = DataCase(data, outside, rng, kind)
    labels = mutate_data(case)
    config = scratch / "config.toml"
    config.write_bytes(dump_toml({**env.config_doc, "data": {"dir": str(data)}}))
    watched = (data, outside, config, Path("/etc/passwd"))
    before = snapshot(*watched)
    if command == "train":
        argv = ["train", "--config", str(config), "--run-dir", str(scratch / "run")]
    elif command == "eval":
        split = rng.choice(["val", "heldout", "train", str(outside / "notes.txt")])
        argv = ["eval", str(env.runs[kind]), "--split", split, "--device", "cpu", "--batch-size", "64"]
        argv += ["--out", str(scratch / "eval.json")]
    else:
        argv = [
            "sample",
            str(env.runs[kind]),
            "--prompt",
            "def f(",
            "--max-new-tokens",
            "3",
            "--device",
            "cpu",
        ]
    outcome = run_cli(argv)
    problems = outcome_problems(outcome)
    problems += read_everything(data)
    changes = snapshot_diff(before, snapshot(*watched))
    if changes:
        problems.append("user files changed:\n  " + "\n  ".join(changes[:20]))
    shutil.rmtree(scratch / "run", ignore_errors=True)
    if not problems:
        return None
    return (
        f"data case {index} ({kind} data, `tenx {command}`); rerun: TENX_FUZZ_ONLY=data:{index}\n"
        f"mutations: {labels}\nargv: {_short(argv, 400)}\nexit status: {outcome.code!r}\n"
        f"stderr: {_tail(outcome.stderr)}\n" + "\n".join(problems)
    )


# ----- config mutations ---------------------------------------------------------------------------------
def config_fields(cls: type, prefix: str = "") -> list[tuple[str, Any, dataclasses.Field]]:
    """(dotted key, annotation, field) of every leaf field of a config tree."""
    out = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += config_fields(tp, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, tp, f))
    return out


FIELDS = config_fields(RunConfig)


def _leaf_types(tp: Any) -> list[Any]:
    if get_origin(tp) in (Union, types.UnionType):
        return [t for arg in get_args(tp) for t in _leaf_types(arg)]
    return [tp]


def bad_value(tp: Any, f: dataclasses.Field, rng: random.Random, paths: list[str]) -> Any:
    """A value for a field of type `tp`: of a wrong type, out of its range, huge, non-finite or odd."""
    leaves = _leaf_types(tp)
    numeric = [t for t in leaves if t in (int, float)]
    category = rng.choices(["type", "range", "huge", "nonfinite", "string", "small"], [3, 3, 2, 1, 2, 5])[0]
    bounds = f.metadata.get("bounds", {})
    if category == "range" and numeric:
        candidates = [-1, 0, -(2**31)]
        for key, bound in bounds.items():
            if key in ("ge", "gt"):
                candidates += [bound - 1, bound - 1e-9, bound] if key == "gt" else [bound - 1, bound - 1e-9]
            else:
                candidates += [bound + 1, bound + 1e-9, bound] if key == "lt" else [bound + 1, bound + 1e-9]
        value = rng.choice(candidates)
        return int(value) if int in numeric and float not in numeric and float(value).is_integer() else value
    if category == "huge":
        return rng.choice([2**63, 2**64, 10**30, -(2**63) - 1, 1e308, -1e308, 5e-324, 1.7976931348623157e308])
    if category == "nonfinite":
        return rng.choice([float("nan"), float("inf"), float("-inf")])
    if category == "string":
        return rng.choice(
            [
                "",
                " ",
                "x" * rng.choice([1000, 100_000]),
                "a\x00b",
                "line\nbreak",
                "日本語🎉",
                "\u202eevil",
                "../../etc/passwd",
                "/etc/passwd",
                *paths,
                "cuda",
                "cuda:7",
                "meta",
                "gpu",
                "cpu:0",
                "auto",
                "bogus",
                "GPT2",
                "sigkill@step=1" if rng.random() < 0.01 else "nonsense@",
            ]
        )
    if category == "small":
        if int in numeric:
            return rng.choice([0, 1, 2, 3, 4, 5, 7, 8, 16, 33, 64])
        if float in numeric:
            return rng.choice([0.0, 1e-12, 0.1, 0.5, 1.0, 2.0, 100.0])
        literals = [a for t in leaves if get_origin(t) is Literal for a in get_args(t)]
        if literals:
            return rng.choice(literals)
        if get_origin(tp) is list:
            return rng.choice([[], ["x"], ["nonsense"], [1]])
    return rng.choice(
        [
            "ten",
            "1",
            1.5,
            True,
            [1, 2],
            [],
            {"a": 1},
            {},
            datetime.date(1979, 5, 27),
            datetime.time(7, 32),
            datetime.datetime(1979, 5, 27, 7, 32, tzinfo=datetime.timezone.utc),
            [["nested"]],
            [{"a": 1}],
        ]
    )


def override_text(rng: random.Random, paths: list[str]) -> str:
    """One `--set KEY=VALUE` argument: fuzzed keys and values, and malformed ones."""
    kind = rng.random()
    if kind < 0.15:
        return rng.choice(
            [
                "noequals",
                "=1",
                ".=1",
                "model.=1",
                ".model=1",
                "a..b=1",
                "model=1",
                "model.depth.x=1",
                "model.depth=",
                "model.depth==1",
                "x" * 5000 + "=1",
                "model=[1]",
                "train={steps=1}",
                "data.dir=\udcff\udcfe",
                "data.dir=" + "[" * 100_000,
                "model.family=" + "[" * 50,
                "model.depth=" + "{a=" * 1000,
                " model . depth = 3 ",
                "modle.depth=2",
                "model.depht=2",
                "parallel.consistency=3",
                "parallel.consistency.every.x=1",
                "data.dir=\\",
                "log.progress=tru",
                "train.steps=0x10",
                "train.steps=1_0",
                "train.steps=1e0",
                "train.steps=99999999999999999999999",
                "optim.lr=1e-99999",
                "optim.lr=1e99999",
            ]
        )
    key, tp, f = rng.choice(FIELDS)
    value = bad_value(tp, f, rng, paths)
    if isinstance(value, str) and rng.random() < 0.6:
        text = value  # a bare string, as a shell passes it
    else:
        try:
            text = toml_value(value)
        except TypeError:
            text = repr(value)
    if rng.random() < 0.05:
        text += rng.choice(["\udcff", "\x00", " # comment", "\n[x]", "'"])
    return f"{key}={text}"


def mutate_config_bytes(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    data = bytearray(raw)
    ops = []
    for _ in range(rng.randrange(1, 5)):
        op = rng.choice(["flip", "delete", "insert", "dup-line", "drop-line", "truncate", "swap-lines"])
        if not data:
            data += b"x"
        i = rng.randrange(len(data))
        if op == "flip":
            data[i] ^= 1 << rng.randrange(8)
        elif op == "delete":
            del data[i : i + rng.randrange(1, 4)]
        elif op == "insert":
            data[i:i] = bytes([rng.choice(b"[]{}=\".,#'\n\\ 0-+eix_\x00\x7f\x80\xc3\xff\xfe")])
        elif op == "truncate":
            del data[i:]
        else:
            lines = bytes(data).split(b"\n")
            j = rng.randrange(len(lines))
            if op == "dup-line":
                lines.insert(j, lines[j])
            elif op == "drop-line":
                del lines[j]
            else:
                k = rng.randrange(len(lines))
                lines[j], lines[k] = lines[k], lines[j]
            data = bytearray(b"\n".join(lines))
        ops.append(f"{op}@{i}")
    return bytes(data), "bytes: " + ", ".join(ops)


def mutate_config_doc(doc: dict[str, Any], rng: random.Random, paths: list[str]) -> str:
    """Structured changes: a wrong value for a field, an unknown key or section, a section of a wrong kind."""
    how = rng.choices(
        ["field", "unknown-key", "unknown-section", "section-value", "subtable"], [8, 1, 1, 1, 1]
    )[0]
    if how == "field":
        key, tp, f = rng.choice(FIELDS)
        value = bad_value(tp, f, rng, paths)
        *sections, name = key.split(".")
        node = doc
        for section in sections:  # parallel.consistency.every: an inline table inside [parallel]
            if not isinstance(node.get(section), dict):
                node[section] = {}
            node = node[section]
        node[name] = value
        return f"{key} = {_short(value, 80)}"
    if how == "unknown-key":
        section = rng.choice([k for k, v in doc.items() if isinstance(v, dict)] or ["model"])
        if not isinstance(doc.get(section), dict):
            doc[section] = {}
        doc[section][rng.choice(["depht", "stpes", "", "dir ", "DIR", "x.y"])] = 1
        return f"unknown key in [{section}]"
    if how == "unknown-section":
        doc[rng.choice(["modle", "x", "", "train2", "parallel2"])] = {"a": 1}
        return "unknown section"
    if how == "section-value":
        section = rng.choice(["model", "data", "train", "parallel", "checkpoint"])
        doc[section] = rng.choice([3, "model", [], [1], True])
        return f"[{section}] replaced by a value"
    section = rng.choice(["model", "train", "parallel", "data"])
    if not isinstance(doc.get(section), dict):
        doc[section] = {}
    doc[section][rng.choice(["depth", "consistency", "replicas", "extra", "dir"])] = {"x": {"y": 1}}
    return f"a sub-table in [{section}]"


def _affordable(config: Path, overrides: list[str]) -> bool:
    """False for configs the product accepts whose run would be slow or stop this process by design."""
    try:
        cfg = load_run_config(config, overrides)
        model = cfg.model.resolved(320)
        params = count_params(model).total
    except Exception:  # noqa: BLE001 - refused (or crashing) before any work: exactly what is fuzzed
        return True
    t = cfg.train
    tokens_per_step = t.micro_batch * (t.global_batch or t.grad_accum) * model.seq_len
    steps = t.steps if t.steps is not None else math.ceil((t.tokens or 0) / tokens_per_step)
    w = cfg.watchdog
    return (
        params <= 5_000_000
        and model.seq_len <= 4096
        and tokens_per_step <= 65_536
        and t.eval_batches * t.micro_batch * model.seq_len <= 1_000_000
        and steps <= 3
        and not t.compile
        and (t.threads or 1) <= 4
        and not cfg.faults.inject
        and cfg.parallel.replicas.mode == "off"
        and all(s == 0 or s >= 60 for s in (w.timeout_s, w.first_step_timeout_s))
        and (
            cfg.checkpoint.every == "auto" or cfg.checkpoint.every == 0 or steps // cfg.checkpoint.every <= 3
        )
        and (cfg.checkpoint.memory_every == 0 or steps // cfg.checkpoint.memory_every <= 3)
        and not (cfg.log.wandb and cfg.log.wandb_mode != "offline")  # would reach W&B over the network
    )


def run_config_case(env: FuzzEnv, index: int, scratch: Path) -> str | None:
    """One mutated config file (and overrides) through `tenx train`; a report of what went wrong, or None."""
    rng = random.Random(f"{SEED}:config:{index}")
    outside = make_outside(scratch)
    data = scratch / "data"
    if not (data / "manifest.json").is_file():  # config cases share one intact data directory
        restore(data, env.pristine["bytes"])
    config = scratch / "config.toml"
    paths = [str(data), str(outside), str(outside / "notes.txt"), str(config), "runs", ".", "..", "~", ""]
    labels: list[str] = []
    overrides: list[str] = []
    for _attempt in range(20):
        doc = copy.deepcopy(env.config_doc)
        doc["data"] = {"dir": str(data)}
        labels, overrides = [], []
        style = rng.choices(["doc", "bytes", "overrides", "mixed"], [5, 3, 3, 1])[0]
        if style in ("doc", "mixed"):
            labels += [mutate_config_doc(doc, rng, paths) for _ in range(rng.choice([1, 1, 2]))]
        raw = dump_toml(doc)
        if style == "bytes":
            raw, label = mutate_config_bytes(raw, rng)
            labels.append(label)
        if style in ("overrides", "mixed"):
            overrides = [override_text(rng, paths) for _ in range(rng.choice([1, 1, 2, 3]))]
            labels += [f"--set={_short(text, 120)}" for text in overrides]
        config.write_bytes(raw)
        if _affordable(config, overrides):
            break
    else:
        return None
    watched = (data, outside, config, Path("/etc/passwd"))
    before = snapshot(*watched)
    argv = ["train", "--config", str(config), "--run-dir", str(scratch / "run")]
    for text in overrides:
        argv.append(f"--set={text}")
    outcome = run_cli(argv)
    problems = outcome_problems(outcome)
    changes = snapshot_diff(before, snapshot(*watched))
    if changes:
        problems.append("user files changed:\n  " + "\n  ".join(changes[:20]))
    text = config.read_bytes()
    shutil.rmtree(scratch / "run", ignore_errors=True)
    if changes:  # the next case needs an intact data directory
        restore(data, env.pristine["bytes"])
    if not problems:
        return None
    return (
        f"config case {index}; rerun: TENX_FUZZ_ONLY=config:{index}\nmutations: {labels}\n"
        f"config file:\n{_short(text, 1500)}\nargv: {_short(argv, 600)}\nexit status: {outcome.code!r}\n"
        f"stderr: {_tail(outcome.stderr)}\n" + "\n".join(problems)
    )


# ----- the tests ------------------------------------------------------------------------------------------
def _indexes(kind: str, count: int) -> list[int]:
    only = os.environ.get("TENX_FUZZ_ONLY", "")
    if only:
        chosen, _, index = only.partition(":")
        return [int(index)] if chosen == kind else []
    return list(range(count))


def _fuzz(kind: str, count: int, env: FuzzEnv, scratch: Path) -> None:
    run = run_data_case if kind == "data" else run_config_case
    make_outside(scratch)
    pristine = snapshot(*env.pristine.values())
    failures = []
    for index in _indexes(kind, count):
        report = run(env, index, scratch)
        if report:
            failures.append(report)
            if len(failures) >= MAX_FAILURES:
                break
    assert snapshot(*env.pristine.values()) == pristine, "a case changed the pristine data directories"
    assert not failures, f"{len(failures)} failing case(s):\n\n" + "\n\n".join(failures)


def test_fuzz_data_directories(fuzz, tmp_path):
    _fuzz("data", DATA_CASES, fuzz, tmp_path)


def test_fuzz_config_files(fuzz, tmp_path):
    _fuzz("config", CONFIG_CASES, fuzz, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_data_directories_long(fuzz, tmp_path):
    _fuzz("data", SLOW_DATA_CASES, fuzz, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_config_files_long(fuzz, tmp_path):
    _fuzz("config", SLOW_CONFIG_CASES, fuzz, tmp_path)


# ----- the crashes the fuzzer found, one by one ---------------------------------------------------------
def _error(argv: list[str]) -> str:
    """Run the CLI; it must fail with one clear error line, which is returned."""
    outcome = run_cli(argv)
    assert not outcome_problems(outcome), outcome_problems(outcome)
    assert outcome.code == 2, (outcome.code, outcome.stdout[-500:])
    (line,) = [line for line in outcome.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    return line


@pytest.fixture
def inputs(fuzz, tmp_path) -> tuple[Path, Path]:
    """A fresh bytes data directory and a config file that trains on it."""
    data = tmp_path / "data"
    restore(data, fuzz.pristine["bytes"])
    config = tmp_path / "config.toml"
    config.write_bytes(dump_toml({**fuzz.config_doc, "data": {"dir": str(data)}}))
    return data, config


def _train(config: Path, *overrides: str) -> list[str]:
    return ["train", "--config", str(config), "--run-dir", str(config.parent / "run")] + [
        f"--set={o}" for o in overrides
    ]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[model]\ndepth = 2\n# caf\xe9\n", "not valid TOML: the file is not UTF-8 text (byte 0xe9"),
        (b"[model]\ndepth = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
        (b"[model]\ndepth = " + b"{a=" * 2000 + b"1" + b"}" * 2000 + b"\n", "nested too deeply"),
    ],
)
def test_config_files_that_are_not_toml(inputs, raw, message):
    _, config = inputs
    config.write_bytes(raw)
    line = _error(_train(config))
    assert str(config) in line and message in line


@pytest.mark.parametrize("kind", ["too-long", "directory", "fifo"])
def test_config_paths_that_are_no_file(tmp_path, kind):
    path = tmp_path / "c.toml"
    if kind == "too-long":
        path = tmp_path / ("x" * 5000)
    elif kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    line = _error(["train", "--config", str(path), "--run-dir", str(tmp_path / "run")])
    assert "cannot be used as a path" in line or "is not a regular file" in line


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.depth=" + "[" * 5000, "model.depth: expected int, got '[[[["),  # not TOML: a bare string
        (
            "train.steps=9223372036854775808",
            "train.steps: 9223372036854775808 does not fit in a 64-bit integer",
        ),
        ("model.d_model=-9223372036854775809", "does not fit in a 64-bit integer"),
        ("data.dir=runs/\udcff", "data.dir: 'runs/\\udcff' is not valid UTF-8 text"),
        ('data.dir="a\\u0000b"', "data.dir: 'a\\x00b' contains a NUL character"),
        ("train.device=gpu", "train.device: 'gpu' is not a device"),
        ("train.device=cuda:x", "train.device: 'cuda:x' is not a device"),
        ("train.device=meta", "train.device: tenx trains on cpu, cuda, mps, xpu devices, not 'meta'"),
        ("train.seed=-1", "train.seed: must be >= 0, got -1"),
        ("model.init_std=-0.02", "model.init_std: must be >= 0"),
        ("model.family=" + "x" * 100_000, "model.family: 'xxxx"),
    ],
)
def test_config_values_refused_before_any_work(inputs, override, message):
    _, config = inputs
    line = _error(_train(config, override))
    assert line.startswith(f"{ERROR_PREFIX} {config}: ") and message in line
    assert len(line) < 500  # a huge value is shown cut short


def _edit_manifest(data: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    manifest = json.loads((data / "manifest.json").read_text())
    edit(manifest)
    (data / "manifest.json").write_text(json.dumps(manifest))


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = manifest
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            _set("splits.train.shards.0.file", "../outside/secret.bin"),
            "splits.train.shards[0].file: expected",
        ),
        (_set("splits.train.shards.0.index_file", "/etc/passwd"), "splits.train.shards[0].index_file"),
        (_set("splits.val.shards.0.file", "val_00001.bin"), "splits.val.shards[0].file"),
        (_set("splits.train.shards.0.tokens", float("nan")), "manifest.json is not valid JSON (NaN is not"),
        (_set("splits.train.shards.0.tokens", "9406"), "splits.train.shards[0].tokens: expected an integer"),
        (_set("splits.train.shards.0.tokens", -1), "splits.train.shards[0].tokens: must be in [0, "),
        (_set("splits.train.tokens", 1), "splits.train.tokens: 1, but its shards hold"),
        (_set("splits.heldout.bytes", 0), "splits.heldout.bytes: 0 bytes cannot hold"),
        (_set("splits.val", []), "splits.val: expected a JSON object"),
        (_set("splits.extra", {}), "splits.'extra': unknown split"),
        (_set("splits.val.shards", {}), "splits.val.shards: expected a list of shards"),
        (_set("dtype", {"file": "x"}), "has dtype {'file': 'x'}"),
        (_set("tokenizer.vocab_size", 4096), "tokenizer.vocab_size: the bytes tokenizer has vocab_size 257"),
        (
            _set(
                "tokenizer", {"kind": "bpe", "vocab_size": 300, "eot_id": 300, "file": "t.json", "xxhash": ""}
            ),
            "tokenizer.eot_id: must be below vocab_size 300",
        ),
        (
            _set(
                "tokenizer",
                {"kind": "bpe", "vocab_size": 300, "eot_id": 0, "file": "../t.json", "xxhash": ""},
            ),
            "tokenizer.file: expected a file name inside the data directory",
        ),
        (_set("source", [[[[[[[[1]]]]]]]]), "source: expected a JSON object, got [[[[...]]]]"),
    ],
)
def test_manifest_fields_are_checked_when_read(inputs, edit, message):
    data, config = inputs
    _edit_manifest(data, edit)
    before = snapshot(data)
    line = _error(_train(config))
    assert str(data / "manifest.json") in line and message in line and "re-run `tenx data prepare" in line
    for reader in (
        lambda: read_manifest(data),
        lambda: load_tokenizer(data),
        lambda: TokenStream(data, "val"),
    ):
        with pytest.raises(TenxError, match=re.escape(message)):
            reader()
    assert snapshot(data) == before


def test_manifest_nested_too_deeply(inputs):
    data, config = inputs
    raw = (data / "manifest.json").read_bytes()
    (data / "manifest.json").write_bytes(
        raw.replace(b'"stats":', b'"x": ' + b"[" * 100_000 + b"]" * 100_000 + b', "stats":')
    )
    assert "is not valid JSON (nested too deeply)" in _error(_train(config))


@pytest.mark.parametrize("how", ["fifo", "directory", "link-outside-dir", "link-loop", "link-dev-zero"])
@pytest.mark.parametrize("name", ["val_00000.bin", "val_00000.idx", "manifest.json"])
def test_a_file_replaced_by_something_else_never_blocks_or_crashes(inputs, tmp_path, how, name):
    data, config = inputs
    case = DataCase(data, make_outside(tmp_path), random.Random(0), "bytes")
    _replace_path(data / name, how, case)
    assert not read_everything(data)
    if name != "val_00000.idx":  # training never reads index files
        line = _error(_train(config))
        assert "is missing" in line or "not a regular file" in line


def test_token_ids_beyond_the_vocabulary_never_reach_the_model(inputs):
    """A shard damaged with its checksum updated to match (or never verified) still cannot crash a run."""
    data, config = inputs
    raw = bytearray((data / "train_00000.bin").read_bytes())
    raw[1::32] = b"\xff" * len(raw[1::32])  # every 16th token becomes an id 0xffxx: every window has one
    (data / "train_00000.bin").write_bytes(bytes(raw))
    _edit_manifest(data, _set("splits.train.shards.0.xxhash", xxhash.xxh3_64_hexdigest(bytes(raw))))
    for verify in ("true", "false"):
        line = _error(_train(config, f"data.verify={verify}"))
        assert "train_00000.bin holds token id" in line and "outside the vocabulary of 257" in line
    manifest = read_manifest(data)
    with pytest.raises(TenxError, match="outside the vocabulary"):
        list(split_documents_text(data, manifest, "train", load_tokenizer(data)))


@pytest.mark.parametrize("content", [b"{}", b"not json", b'{"model": \xff}', b"[" * 10_000])
def test_a_tokenizer_file_that_matches_its_hash_but_is_no_tokenizer(fuzz, tmp_path, content):
    data = tmp_path / "data"
    restore(data, fuzz.pristine["bpe"])
    (data / "tokenizer.json").write_bytes(content)
    _edit_manifest(data, _set("tokenizer.xxhash", xxhash.xxh3_64_hexdigest(content)))
    with pytest.raises(TenxError, match="tokenizer.json is not a Hugging Face tokenizer"):
        load_tokenizer(data)


# ----- crashes the fuzz found outside the data and config readers ---------------------------------------
def test_optim_eps_must_be_positive(inputs):
    _, config = inputs
    assert "optim.eps" in _error(_train(config, "optim.eps=-1.0"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_a_device_this_machine_lacks(inputs, device):
    _, config = inputs
    assert "train.device" in _error(_train(config, f"train.device={device}"))


def test_memory_dir_never_deletes_the_users_files(inputs, tmp_path):
    data, config = inputs
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    before = snapshot(data, mine)
    run_cli(_train(config, f"checkpoint.memory_dir={json.dumps(str(mine))}"))
    assert snapshot(data, mine) == before


def test_eval_of_data_with_a_bigger_vocabulary_than_the_model(fuzz):
    data = fuzz.eval_data["bpe"]
    restore(data, fuzz.pristine["bpe"])
    _edit_manifest(data, lambda m: m["tokenizer"].update(vocab_size=4096, eot_id=4095))
    try:
        _error(
            [
                "eval",
                str(fuzz.runs["bpe"]),
                "--split",
                "val",
                "--device",
                "cpu",
                "--out",
                str(data.parent / "e.json"),
            ]
        )
    finally:
        restore(data, fuzz.pristine["bpe"])
