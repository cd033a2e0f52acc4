"""The file versions of the codec: `tenx compress` / `tenx decompress` write their outputs atomically,
never over their inputs, and report size and speed. `decompress_files` decodes many `.tenx` files at once
(`decompress_many`: the chunks of small files side by side in one model step).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tenx.checkpoint.models import LoadedModel
from tenx.compress.codec import MAX_BYTES, compress_bytes, decompress_bytes, decompress_many
from tenx.compress.container import CodecAdaptation, read_header
from tenx.compress.model import CodecModel, load_codec
from tenx.errors import TenxError
from tenx.utils.io import atomic_write_bytes, check_output_file, regular_input_file


def compress_file(
    run: CodecModel | LoadedModel | str | Path,
    src: str | Path,
    dst: str | Path,
    force: bool = False,
    *,
    threads: int = 1,
    device: str = "cpu",
    adapt: CodecAdaptation | None = None,
) -> dict[str, Any]:
    """Compress file `src` into `dst` (atomically; an existing `dst` only with `force`) and report the
    figures: bits per byte of the whole `.tenx` file, coding speed in KB/s (1 KB = 1000 bytes of input).
    `adapt`: the output layer learns as it codes (compress_bytes)."""
    data = _read(src, dst, force)
    started = time.perf_counter()
    codec = load_codec(run, device)
    loaded = time.perf_counter()
    blob = compress_bytes(codec, data, threads=threads, adapt=adapt)
    coded = time.perf_counter()
    atomic_write_bytes(dst, blob)
    return _report(src, dst, len(data), len(blob), loaded - started, coded - loaded, adapt)


def decompress_file(
    run: CodecModel | LoadedModel | str | Path,
    src: str | Path,
    dst: str | Path,
    force: bool = False,
    max_bytes: int = MAX_BYTES,
    device: str = "cpu",
) -> dict[str, Any]:
    """Decompress `.tenx` file `src` into `dst` (written atomically after its xxhash matched; an existing
    `dst` only with `force`) on `device` (a version-1 file: where it was compressed) and report the
    figures, as compress_file does."""
    blob = _read(src, dst, force)
    started = time.perf_counter()
    header = read_header(blob, str(src))
    codec = load_codec(run, header.device if header.version == 1 else device)
    loaded = time.perf_counter()
    data = decompress_bytes(codec, blob, name=str(src), max_bytes=max_bytes)
    coded = time.perf_counter()
    atomic_write_bytes(dst, data)
    return _report(src, dst, len(data), len(blob), loaded - started, coded - loaded, header.adapt)


def decompress_files(
    run: CodecModel | LoadedModel | str | Path,
    pairs: list[tuple[str | Path, str | Path]],
    force: bool = False,
    max_bytes: int = MAX_BYTES,
    device: str = "cpu",
) -> dict[str, Any]:
    """Decompress each `.tenx` file `src` of `pairs` into its `dst` (as decompress_file does each), decoding
    them together (`decompress_many`). A file that fails (unreadable, damaged, another model's, an output
    that exists without `force`) is reported under "errors" and the others are still written. The figures:
    totals over the files written, "files" one report each (their speed is the batch's)."""
    started = time.perf_counter()
    codec = load_codec(run, device)
    loaded = time.perf_counter()
    blobs: list[bytes] = []
    todo: list[tuple[str | Path, str | Path]] = []
    errors: list[str] = []
    for src, dst in pairs:
        try:
            blobs.append(_read(src, dst, force))
            todo.append((src, dst))
        except TenxError as e:
            errors.append(str(e))
    results = decompress_many(codec, blobs, names=[str(src) for src, _ in todo], max_bytes=max_bytes)
    coded = time.perf_counter()
    written = []
    for (src, dst), blob, result in zip(todo, blobs, results):
        if isinstance(result, TenxError):
            errors.append(str(result))
            continue
        atomic_write_bytes(dst, result)
        written.append((src, dst, len(result), len(blob), read_header(blob, str(src)).adapt))
    raw, packed = sum(w[2] for w in written), sum(w[3] for w in written)
    total = _report("", "", raw, packed, loaded - started, coded - loaded, None)
    total["files"] = [_report(*w[:4], loaded - started, coded - loaded, w[4]) for w in written]
    total["errors"] = errors
    return total


def _read(src: str | Path, dst: str | Path, force: bool) -> bytes:
    """`src`'s bytes, once `src` is known to be a regular file (a FIFO would block, /dev/zero never end) and
    `dst` a file this command may write: not a directory, not `src` itself (even with `force`), an existing
    file only with `force`, nothing else that is not a regular file but a character device (/dev/null)."""
    regular_input_file(src)
    check_output_file(dst, force=force, inputs=(src,))
    try:
        return Path(src).read_bytes()
    except OSError as e:
        raise TenxError(f"cannot read {src}: {e.strerror or e}") from None


def _report(
    src: str | Path,
    dst: str | Path,
    raw: int,
    packed: int,
    load_s: float,
    code_s: float,
    adapt: CodecAdaptation | None,
) -> dict[str, Any]:
    return {
        "src": str(src),
        "dst": str(dst),
        "bytes": raw,
        "compressed_bytes": packed,
        "bits_per_byte": 8 * packed / raw if raw else None,
        "kb_per_s": raw / 1000 / code_s if code_s > 0 else None,
        "seconds": code_s,
        "load_seconds": load_s,
        "adapt": None if adapt is None else {"lr": adapt.lr, "every": adapt.every},
    }
