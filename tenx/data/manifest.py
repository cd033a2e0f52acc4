"""Reading and verifying a prepared data directory (`manifest.json` plus token shards)."""

from __future__ import annotations

import json
import re
import reprlib
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tenx.errors import DataError
from tenx.utils.io import file_xxhash

FORMAT = "tenx-shards/1"
MANIFEST_NAME = "manifest.json"
SPLITS: tuple[str, ...] = ("train", "val", "heldout")
INDEX_DTYPE = np.dtype("<i8")
"""Dtype of `.idx` files: the start offset (in tokens, within the shard) of each document."""

TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""Shard dtype names as recorded in the manifest, and the little-endian numpy dtype each stands for."""
_REQUIRED_KEYS = ("format", "source", "tokenizer", "dtype", "split", "stats", "splits")
_RERUN = "re-run `tenx data prepare --source ... --out DIR`"
BYTES_VOCAB_SIZE = 257
"""Ids of the bytes tokenizer: the 256 byte values and the end-of-document id."""
BYTES_EOT_ID = 256
_INT_LIMIT = 1 << 63
"""Counts in a manifest must fit in an int64 (numpy offsets)."""
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
"""A file name that stays inside the data directory (no separator, no '..', no leading dot)."""


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Load `manifest.json` of a prepared data directory and check every field a reader uses.

    A manifest that is missing, unreadable, not JSON, of another format version, or whose fields have the
    wrong type, an impossible value or a file name outside the directory is refused with a DataError that
    names the file and the field, so readers may index it without further checks.
    """
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST_NAME
    try:
        is_dir, is_file = data_dir.is_dir(), path.is_file()
    except (OSError, ValueError) as e:  # a name too long for the file system, an embedded NUL byte
        raise DataError(f"data directory {str(data_dir)!r} cannot be used: {e}") from None  # the whole path
    if not is_dir:
        what = "is not a directory" if data_dir.exists() else "does not exist"
        raise DataError(
            f"data directory {data_dir} {what}; run `tenx data prepare --source ... --out DIR` first"
        )
    if not is_file:
        what = "is not a regular file" if path.exists() or path.is_symlink() else "is missing"
        raise DataError(f"{path} {what}; run `{prepare_command(data_dir)}` first")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(
            f"{path} cannot be read ({e.strerror or e}); check its permissions or {_RERUN}"
        ) from None
    try:
        manifest = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; Recursion: deep nesting
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise DataError(f"{path} is not valid JSON ({reason}); {_RERUN}") from None
    check_manifest(manifest, path)
    return manifest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel = 3


def _show(value: Any) -> str:
    """repr of a value for a message, cut short when long or deep."""
    return _REPR.repr(value)


def prepare_command(data_dir: str | Path) -> str:
    """The `tenx data prepare` command line that writes `data_dir`, its path quoted for a shell."""
    return f"tenx data prepare --source ... --out {shlex.quote(str(data_dir))}"


class ManifestFieldError(Exception):
    """A manifest field is invalid: args are (field path, what is wrong); read_manifest turns it into a
    DataError naming the file."""


def _field(node: Any, key: str, where: str) -> Any:
    if not isinstance(node, dict):
        raise ManifestFieldError(where, f"expected a JSON object, got {_show(node)}")
    if key not in node:
        raise ManifestFieldError(f"{where}.{key}" if where else key, "missing")
    return node[key]


def _int(node: Any, key: str, where: str, low: int = 0, high: int = _INT_LIMIT) -> int:
    value = _field(node, key, where)
    path = f"{where}.{key}" if where else key
    if type(value) is not int:
        raise ManifestFieldError(path, f"expected an integer, got {_show(value)}")
    if not low <= value < high:
        raise ManifestFieldError(path, f"must be in [{low}, {high}), got {_show(value)}")
    return value


def _typed(node: Any, key: str, where: str, kind: type, name: str) -> Any:
    value = _field(node, key, where)
    if not isinstance(value, kind):
        raise ManifestFieldError(f"{where}.{key}" if where else key, f"expected {name}, got {_show(value)}")
    return value


def check_tokenizer_entry(entry: Any, dtype: str | None = None, where: str = "tokenizer") -> None:
    """Check a manifest's tokenizer entry (kind, vocab_size, eot_id, file, xxhash); ManifestFieldError names
    the field.

    `dtype`, when given, must hold every id of the vocabulary.
    """
    kind = _field(entry, "kind", where)
    if kind not in ("bpe", "bytes"):
        raise ManifestFieldError(f"{where}.kind", f"expected 'bpe' or 'bytes', got {_show(kind)}")
    vocab = _int(entry, "vocab_size", where, 1)
    eot = _int(entry, "eot_id", where)
    file = _field(entry, "file", where)
    _typed(entry, "xxhash", where, str, "a string")
    if kind == "bytes":
        if (vocab, eot) != (BYTES_VOCAB_SIZE, BYTES_EOT_ID):
            raise ManifestFieldError(
                f"{where}.vocab_size",
                f"the bytes tokenizer has vocab_size {BYTES_VOCAB_SIZE} and eot_id {BYTES_EOT_ID}, "
                f"got {vocab} and {eot}",
            )
        if file is not None:
            raise ManifestFieldError(f"{where}.file", f"the bytes tokenizer has no file, got {_show(file)}")
    else:
        if vocab < BYTES_VOCAB_SIZE:
            raise ManifestFieldError(
                f"{where}.vocab_size", f"a byte-level BPE has at least {BYTES_VOCAB_SIZE} ids, got {vocab}"
            )
        if eot >= vocab:
            raise ManifestFieldError(f"{where}.eot_id", f"must be below vocab_size {vocab}, got {eot}")
        if not isinstance(file, str) or not _PLAIN_NAME.fullmatch(file):
            raise ManifestFieldError(
                f"{where}.file", f"expected a file name inside the data directory, got {_show(file)}"
            )
    if dtype in TOKEN_DTYPES and vocab > 1 << (8 * TOKEN_DTYPES[dtype].itemsize):
        raise ManifestFieldError(f"{where}.vocab_size", f"{vocab} ids do not fit in dtype {dtype}")


def check_manifest(manifest: Any, path: str | Path = MANIFEST_NAME) -> None:
    """Check the structure of a parsed manifest: every field readers use, its type and its range, file names
    that stay inside the data directory, and counts that add up. DataError names `path` and the field."""
    rerun = f"re-run `{prepare_command(Path(path).parent)}`"
    if not isinstance(manifest, dict):
        raise DataError(f"{path} does not hold a JSON object; {rerun}")
    if manifest.get("format") != FORMAT:
        raise DataError(
            f"{path} has format {_show(manifest.get('format'))}, this tenx reads {FORMAT!r}; {rerun}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in manifest]
    splits = manifest.get("splits", {})
    missing += [f"splits.{name}" for name in SPLITS if isinstance(splits, dict) and name not in splits]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; {rerun}")
    if not isinstance(manifest["dtype"], str) or manifest["dtype"] not in TOKEN_DTYPES:
        raise DataError(
            f"{path} has dtype {_show(manifest['dtype'])}, expected one of {sorted(TOKEN_DTYPES)}; {rerun}"
        )
    try:
        for key in ("source", "split", "stats"):
            _typed(manifest, key, "", dict, "a JSON object")
        _typed(manifest["source"], "spec", "source", str, "a string")
        check_tokenizer_entry(manifest["tokenizer"], manifest["dtype"])
        _typed(manifest, "splits", "", dict, "a JSON object")
        for name, entry in splits.items():
            if name not in SPLITS:
                raise ManifestFieldError(
                    f"splits.{_show(name)}", f"unknown split; expected {', '.join(SPLITS)}"
                )
            _check_split(entry, name)
    except ManifestFieldError as e:
        field, problem = e.args
        raise DataError(f"{path}: field {field}: {problem}; {rerun}") from None


def _check_split(entry: Any, name: str) -> None:
    where = f"splits.{name}"
    documents = _int(entry, "num_documents", where)
    tokens = _int(entry, "tokens", where)
    num_bytes = _int(entry, "bytes", where)
    if num_bytes < documents:  # every document kept has text (bits per byte divides by this)
        raise ManifestFieldError(
            f"{where}.bytes", f"{num_bytes} bytes cannot hold {documents} non-empty documents"
        )
    ids = _typed(entry, "documents", where, list, "a list of document ids")
    if len(ids) != documents:
        raise ManifestFieldError(
            f"{where}.documents", f"lists {len(ids)} ids, num_documents says {documents}"
        )
    shards = _typed(entry, "shards", where, list, "a list of shards")
    shard_tokens = shard_documents = 0
    for i, shard in enumerate(shards):
        at = f"{where}.shards[{i}]"
        stem = f"{name}_{i:05d}"
        for key, expected in (("file", f"{stem}.bin"), ("index_file", f"{stem}.idx")):
            if _field(shard, key, at) != expected:
                raise ManifestFieldError(f"{at}.{key}", f"expected {expected!r}, got {_show(shard[key])}")
        for key in ("xxhash", "index_xxhash"):
            _typed(shard, key, at, str, "a string")
        n_tokens, n_documents = _int(shard, "tokens", at), _int(shard, "documents", at)
        if n_documents > n_tokens or (n_tokens and not n_documents):
            raise ManifestFieldError(
                f"{at}.documents", f"{n_documents} documents cannot make {n_tokens} tokens"
            )
        shard_tokens += n_tokens
        shard_documents += n_documents
    if shard_tokens != tokens:
        raise ManifestFieldError(f"{where}.tokens", f"{tokens}, but its shards hold {shard_tokens}")
    if shard_documents != documents:
        raise ManifestFieldError(
            f"{where}.num_documents", f"{documents}, but its shards hold {shard_documents}"
        )


def np_dtype(manifest: dict[str, Any]) -> np.dtype:
    """Little-endian numpy dtype of the token shards (use it for `np.memmap`)."""
    return TOKEN_DTYPES[manifest["dtype"]]


def verify_split(data_dir: str | Path, manifest: dict[str, Any], split: str) -> None:
    """Recompute the checksum of every shard and index file of `split`; DataError on any mismatch."""
    for shard in _split_entry(manifest, split)["shards"]:
        verify_shard(data_dir, shard)


def verify_shard(data_dir: str | Path, shard: dict[str, Any]) -> None:
    """Recompute the checksums of one shard's token and index files; DataError naming the bad file."""
    for file_key, hash_key in (("file", "xxhash"), ("index_file", "index_xxhash")):
        path = Path(data_dir) / shard[file_key]
        if regular_file_size(path) is None:
            raise DataError(f"shard file {path} is missing (or not a regular file); {_RERUN}")
        try:
            actual = file_xxhash(path)
        except OSError as e:
            raise DataError(f"shard file {path} cannot be read ({e.strerror or e}); {_RERUN}") from None
        if actual != shard[hash_key]:
            raise DataError(
                f"shard file {path} is corrupt: expected xxhash {shard[hash_key]}, got {actual}; {_RERUN}"
            )


def regular_file_size(path: Path) -> int | None:
    """Size of `path` when it is a regular file (after links), else None: never opens a FIFO or device."""
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def check_token_ids(ids: np.ndarray, vocab_size: int, path: str | Path, offset: int) -> None:
    """DataError when a token id read from shard `path` (at token `offset`) is not below `vocab_size`."""
    if ids.size and int(ids.max()) >= vocab_size:
        at = offset + int(np.argmax(ids >= vocab_size))
        raise DataError(
            f"shard file {path} holds token id {int(ids[at - offset])} at token {at}, outside the vocabulary "
            f"of {vocab_size} (manifest tokenizer.vocab_size): the shard or the manifest is damaged; {_RERUN}"
        )


class Decoder(Protocol):
    """What decoding documents needs of a tokenizer (tenx.data.tokenizer.Tokenizer is one)."""

    eot_id: int

    def decode(self, ids: Any) -> str: ...


def split_documents_text(
    data_dir: str | Path, manifest: dict[str, Any], split: str, tokenizer: Decoder
) -> Iterator[str]:
    """Decode each document of `split` back to its text, in manifest order, using the shard indexes.

    The shard and index files must have the sizes the manifest gives, the index must cut the shard into
    documents that each end with the end-of-document id, and every id must be in the vocabulary
    (DataError otherwise); checksums are not recomputed here (verify_split)."""
    data_dir = Path(data_dir)
    dtype = np_dtype(manifest)
    vocab_size = int(manifest["tokenizer"]["vocab_size"])
    for shard in _split_entry(manifest, split)["shards"]:
        path, index_path = data_dir / shard["file"], data_dir / shard["index_file"]
        n_tokens, n_documents = int(shard["tokens"]), int(shard["documents"])
        for file, expected in (
            (path, n_tokens * dtype.itemsize),
            (index_path, n_documents * INDEX_DTYPE.itemsize),
        ):
            size = regular_file_size(file)
            if size != expected:
                found = "is missing (or not a regular file)" if size is None else f"holds {size} bytes"
                raise DataError(f"shard file {file} {found}, the manifest says {expected} bytes; {_RERUN}")
        if not n_tokens:
            continue
        tokens = np.memmap(path, dtype=dtype, mode="r")
        starts = np.fromfile(index_path, dtype=INDEX_DTYPE)
        if starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= n_tokens:
            raise DataError(
                f"shard file {index_path} is corrupt: document offsets must start at 0 and increase within the "
                f"{n_tokens} tokens of {path.name}; {_RERUN}"
            )
        ends = np.append(starts[1:], n_tokens)
        for start, end in zip(starts.tolist(), ends.tolist()):
            # Each document ends with the end-of-document token, which is not part of its text.
            if tokens[end - 1] != tokenizer.eot_id:
                raise DataError(f"shard file {path}: document at token {start} lacks EOT; {_RERUN}")
            ids = tokens[start : end - 1]
            check_token_ids(ids, vocab_size, path, start)
            yield tokenizer.decode(ids)


def _split_entry(manifest: dict[str, Any], split: str) -> dict[str, Any]:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return manifest["splits"][split]
