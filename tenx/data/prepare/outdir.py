"""The output directory of `tenx data prepare`: what may be written there, and what may be removed.

A directory is prepared into only when it is new, empty or a tenx data directory (its manifest, tokenizer,
shards, indexes, hidden work files); a re-prepare removes only files the previous manifest listed and the
new one does not: never a file tenx did not write.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tenx.data.manifest import MANIFEST_NAME
from tenx.data.ngrams import INDEX_FILE
from tenx.data.tokenizer import BPE_FILE
from tenx.errors import DataError

SHARD_NAME = re.compile(r"^(train|val|heldout)_\d{5}\.(bin|idx)$")
"""A shard's or its index's file name."""


def manifest_files(manifest: Any) -> set[str]:
    """The file names a data manifest lists (tokenizer, shards, indexes); empty for anything malformed."""
    try:
        names = {manifest["tokenizer"]["file"]}
        for entry in manifest["splits"].values():
            for shard in entry["shards"]:
                names.update((shard["file"], shard["index_file"]))
    except (KeyError, TypeError, AttributeError):
        return set()
    return {n for n in names if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")}


def listed_files(out: Path) -> set[str]:
    """The files the manifest already in `out` lists (none when there is no readable manifest)."""
    try:
        return manifest_files(json.loads((out / MANIFEST_NAME).read_text()))
    except (OSError, ValueError):
        return set()


def check_prepare_out(out: Path) -> None:
    """Refuse an output that is a file, or a non-empty directory that is not a tenx data directory."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a directory; give a directory (it is created if needed)")
    if not out.is_dir():
        return
    foreign = sorted(
        p.name
        for p in out.iterdir()
        if not (
            p.name == MANIFEST_NAME
            or p.name == BPE_FILE
            or SHARD_NAME.match(p.name)
            or INDEX_FILE.match(p.name)
            or p.name.startswith(".")
        )
    )
    if foreign:
        raise DataError(
            f"--out {out} holds files tenx did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); choose a new or empty directory, nothing was changed"
        )


def remove_stale_files(out: Path, manifest: dict[str, Any], previous: set[str]) -> None:
    # A re-prepare into the same directory may leave shards (or a tokenizer.json) the new manifest no longer
    # names. Only files the previous manifest listed are removed: never one tenx did not write.
    for name in sorted(previous - manifest_files(manifest)):
        path = out / name
        if path.is_file() and (SHARD_NAME.match(name) or name == BPE_FILE):
            path.unlink()
