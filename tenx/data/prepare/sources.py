"""Document sources: a directory, a .txt/.jsonl/.parquet file, a Hugging Face dataset, or the Python stdlib."""

from __future__ import annotations

import json
import os
import stat
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenx.errors import DataError
from tenx.utils.io import regular_input_file

DEFAULT_PATTERNS: list[str] = ["**/*.py", "**/*.md", "**/*.txt"]
"""Glob patterns used for a directory source when none are given."""

STDLIB_PATTERNS: list[str] = ["**/*.py"]
"""Glob patterns used for the `stdlib` source when none are given."""

ACCEPTED_FORMS = (
    "a directory, a .txt, .jsonl or .parquet file, hf:NAME[:SPLIT] (needs `pip install tenx[hf]`), or stdlib"
)

_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_PARQUET_BATCH_ROWS = 4096


@dataclass(frozen=True)
class RawDocument:
    """One document as read from a source, before cleaning."""

    id: str
    """Stable identifier: a relative path, `file:line`, `file:row`, or the record's id field."""
    data: bytes | str
    """Raw file bytes (files) or the text value (jsonl, parquet, hf)."""


def stdlib_dir() -> Path:
    """Directory holding the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def copy_stdlib_packages(packages: Iterable[str], dest: str | Path) -> Path:
    """Copy the `.py` files of some standard-library packages under `dest` (files already there are kept):
    a small real corpus for drills, benchmarks and tests."""
    dest = Path(dest)
    for pkg in packages:
        for src in sorted((stdlib_dir() / pkg).rglob("*.py")):
            dst = dest / pkg / src.relative_to(stdlib_dir() / pkg)
            if not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(src.read_bytes())
    return dest


def source_kind(spec: str) -> str:
    """Classify `spec` as "stdlib", "hf", "dir", "txt", "jsonl" or "parquet"; DataError if it is none."""
    if spec == "stdlib":
        return "stdlib"
    if spec.startswith("hf:"):
        return "hf"
    path = Path(spec)
    if path.is_dir():
        return "dir"
    if not path.exists():
        raise DataError(f"data source {spec!r} does not exist; accepted forms: {ACCEPTED_FORMS}")
    regular_input_file(path, "data source")  # a FIFO would block, /dev/zero never end
    kind = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"data source {spec!r} has an unknown suffix; accepted forms: {ACCEPTED_FORMS}")
    return kind


def effective_patterns(spec: str, patterns: list[str] | None) -> list[str] | None:
    """The glob patterns a source uses: defaults filled in for directories and stdlib, None for the rest."""
    kind = source_kind(spec)
    if kind == "stdlib":
        return list(patterns) if patterns is not None else list(STDLIB_PATTERNS)
    if kind == "dir":
        return list(patterns) if patterns is not None else list(DEFAULT_PATTERNS)
    if patterns is not None:
        raise DataError(f"patterns apply only to a directory or stdlib source, not to {spec!r}")
    return None


def source_provenance(spec: str) -> dict[str, str]:
    """Extra facts that pin down what a source contained (the Python version for stdlib, else nothing)."""
    if source_kind(spec) == "stdlib":
        return {"python_version": sys.version}
    return {}


def iter_documents(
    spec: str,
    *,
    patterns: list[str] | None = None,
    text_field: str = "text",
    id_field: str | None = None,
    column: str = "text",
    select: Callable[[int], bool] | None = None,
) -> Iterator[RawDocument]:
    """Yield the documents of a source in a deterministic order. With `select`, a document whose position
    it rejects may come with empty data (a directory's file is then not read: a task of a distributed
    prepare reads only its own share)."""
    kind = source_kind(spec)
    globs = effective_patterns(spec, patterns)
    if kind == "stdlib":
        assert globs is not None
        yield from _iter_directory(stdlib_dir(), globs, _STDLIB_EXCLUDED_DIRS, select)
    elif kind == "dir":
        assert globs is not None
        yield from _iter_directory(Path(spec), globs, frozenset(), select)
    elif kind == "txt":
        path = Path(spec)
        yield RawDocument(id=path.name, data=path.read_bytes())
    elif kind == "jsonl":
        yield from _iter_jsonl(Path(spec), text_field, id_field)
    elif kind == "parquet":
        yield from _iter_parquet(Path(spec), column)
    else:
        yield from _iter_hf(spec[len("hf:") :], column)


def _iter_directory(
    root: Path,
    patterns: list[str],
    excluded_dirs: frozenset[str],
    select: Callable[[int], bool] | None = None,
) -> Iterator[RawDocument]:
    relative: set[str] = set()
    skipped: dict[str, list[str]] = {}
    base = root.resolve()
    for pattern in patterns:
        try:
            matches = list(root.glob(pattern))
        except (ValueError, NotImplementedError) as e:
            raise DataError(f"glob pattern {pattern!r} is not usable under {root}: {e}") from e
        for path in matches:
            rel = path.relative_to(root)
            if excluded_dirs.intersection(rel.parts[:-1]) or path.is_dir():
                continue
            why = _unusable(path, base)
            if why:
                skipped.setdefault(why, []).append(rel.as_posix())
            else:
                relative.add(rel.as_posix())
    for why, names in sorted(skipped.items()):
        names = sorted(set(names))
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        print(f"tenx: skipped {len(names):,} {why} under {root}: {shown}", file=sys.stderr)
    for i, rel_path in enumerate(sorted(relative)):
        wanted = select is None or select(i)
        yield RawDocument(id=rel_path, data=_read_document(root / rel_path) if wanted else b"")


SKIP_REASONS = {
    "outside": "symbolic link(s) leading outside the source",
    "broken": "broken or looping symbolic link(s)",
    "special": "special file(s) (FIFOs, devices, sockets)",
    "unreadable": "unreadable file(s)",
}
"""Why a file a directory source's patterns match is not read (prepare says how many of each it skipped)."""


def _unusable(path: Path, base: Path) -> str | None:
    """Why the matched `path` of the source directory `base` (resolved) is not read, or None to read it.

    A link is followed only to a file inside the source: one leaving it (`zz.py -> /etc/passwd`) would put
    a file the source's owner never chose into the training data. A FIFO or device would block or never end."""
    try:
        real = path.resolve(strict=True)
        mode = real.stat().st_mode
    except (OSError, RuntimeError):  # RuntimeError: a link loop (Python < 3.13)
        return SKIP_REASONS["broken"]
    if real != base and base not in real.parents:
        return SKIP_REASONS["outside"]
    if not stat.S_ISREG(mode):
        return SKIP_REASONS["special"]
    if not os.access(real, os.R_OK):
        return SKIP_REASONS["unreadable"]
    return None


def _read_document(path: Path) -> bytes:
    """The bytes of a source file; a DataError naming it when it cannot be read (it was listed readable)."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(
            f"cannot read source file {path}: {e.strerror or e}; make it readable, or move it out of the "
            "source (or narrow --pattern), then run prepare again"
        ) from None


def _iter_jsonl(path: Path, text_field: str, id_field: str | None) -> Iterator[RawDocument]:
    # Not tenx.utils.io.jsonl_records: a user's corpus, streamed (it may be larger than memory), which no
    # crash of tenx wrote, so an unparsable last line is a broken corpus to report, not a torn write to drop.
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_no}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(
                    f"{where}: not valid JSON ({e}); expected an object with field {text_field!r}"
                ) from e
            if not isinstance(record, dict) or text_field not in record:
                raise DataError(f"{where}: missing field {text_field!r} (set text_field to the text's key)")
            text = record[text_field]
            if not isinstance(text, str):
                raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, expected a string")
            if id_field is None:
                doc_id = f"{path.name}:{line_no}"
            else:
                if id_field not in record:
                    raise DataError(f"{where}: missing id field {id_field!r}")
                doc_id = str(record[id_field])
            yield RawDocument(id=doc_id, data=text)


def _iter_parquet(path: Path, column: str) -> Iterator[RawDocument]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read as parquet ({e})") from e
    schema = parquet.schema_arrow
    if column not in schema.names:
        raise DataError(f"{path}: no column {column!r}; available columns: {', '.join(schema.names)}")
    column_type = schema.field(column).type
    if not (
        pa.types.is_string(column_type)
        or pa.types.is_large_string(column_type)
        or pa.types.is_binary(column_type)
        or pa.types.is_large_binary(column_type)
    ):
        raise DataError(f"{path}: column {column!r} has type {column_type}, expected string or binary")
    row = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[column]):
        for value in batch.column(0).to_pylist():
            yield RawDocument(id=f"{path.name}:{row}", data=_cell_data(value, f"{path}, row {row}"))
            row += 1


def _iter_hf(name_and_split: str, column: str) -> Iterator[RawDocument]:
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise DataError(
            "the hf: source needs the optional `datasets` package: pip install tenx[hf]"
        ) from None
    name, split = name_and_split, "train"
    # A local path may itself contain ':', so only an unresolvable name is split at its last ':'.
    if ":" in name_and_split and not Path(name_and_split).exists():
        name, split = name_and_split.rsplit(":", 1)
    is_parquet = name.endswith(".parquet")
    try:
        if is_parquet:
            dataset = datasets.load_dataset("parquet", data_files=name, split=split)
        else:
            dataset = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many unrelated types for "not found", "no such split", ...
        raise DataError(f"hf:{name_and_split}: cannot load dataset {name!r} split {split!r} ({e})") from e
    label = Path(name).name if is_parquet else name
    if column not in dataset.column_names:
        raise DataError(
            f"hf:{name_and_split}: no column {column!r}; available columns: {', '.join(dataset.column_names)}"
        )
    row = 0
    for batch in dataset.iter(batch_size=_PARQUET_BATCH_ROWS):
        for value in batch[column]:
            yield RawDocument(id=f"{label}:{row}", data=_cell_data(value, f"hf:{name_and_split}, row {row}"))
            row += 1


def _cell_data(value: Any, where: str) -> bytes | str:
    # A null cell is an empty document; cleaning then counts it as skipped rather than failing the run.
    if value is None:
        return ""
    if not isinstance(value, (str, bytes)):
        raise DataError(f"{where}: value is {type(value).__name__}, expected a string")
    return value
