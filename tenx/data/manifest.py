"""Reading and verifying a prepared data directory (`manifest.json` plus token shards)."""

from __future__ import annotations

import json
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


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Load and sanity-check `manifest.json` of a prepared data directory."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST_NAME
    if not data_dir.is_dir():
        raise DataError(
            f"data directory {data_dir} does not exist; run `tenx data prepare --source ... --out DIR` first"
        )
    if not path.is_file():
        raise DataError(f"{path} is missing; run `tenx data prepare --source ... --out {data_dir}` first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); {_RERUN}") from e
    if not isinstance(manifest, dict):
        raise DataError(f"{path} does not hold a JSON object; {_RERUN}")
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path} has format {manifest.get('format')!r}, this tenx reads {FORMAT!r}; {_RERUN}")
    missing = [key for key in _REQUIRED_KEYS if key not in manifest]
    missing += [f"splits.{name}" for name in SPLITS if name not in manifest.get("splits", {})]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; {_RERUN}")
    if manifest["dtype"] not in TOKEN_DTYPES:
        raise DataError(f"{path} has dtype {manifest['dtype']!r}, expected one of {sorted(TOKEN_DTYPES)}")
    return manifest


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
        if not path.is_file():
            raise DataError(f"shard file {path} is missing; {_RERUN}")
        actual = file_xxhash(path)
        if actual != shard[hash_key]:
            raise DataError(
                f"shard file {path} is corrupt: expected xxhash {shard[hash_key]}, got {actual}; {_RERUN}"
            )


class Decoder(Protocol):
    """What decoding documents needs of a tokenizer (tenx.data.tokenizer.Tokenizer is one)."""

    eot_id: int

    def decode(self, ids: Any) -> str: ...


def split_documents_text(
    data_dir: str | Path, manifest: dict[str, Any], split: str, tokenizer: Decoder
) -> Iterator[str]:
    """Decode each document of `split` back to its text, in manifest order, using the shard indexes."""
    data_dir = Path(data_dir)
    dtype = np_dtype(manifest)
    for shard in _split_entry(manifest, split)["shards"]:
        tokens = np.memmap(data_dir / shard["file"], dtype=dtype, mode="r")
        starts = np.fromfile(data_dir / shard["index_file"], dtype=INDEX_DTYPE)
        ends = np.append(starts[1:], len(tokens))
        for start, end in zip(starts.tolist(), ends.tolist()):
            # Each document ends with the end-of-document token, which is not part of its text.
            if end <= start or tokens[end - 1] != tokenizer.eot_id:
                raise DataError(
                    f"shard file {data_dir / shard['file']}: document at token {start} lacks EOT; {_RERUN}"
                )
            yield tokenizer.decode(tokens[start : end - 1])


def _split_entry(manifest: dict[str, Any], split: str) -> dict[str, Any]:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return manifest["splits"][split]
