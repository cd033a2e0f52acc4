"""Durable file I/O: atomic writes (temp + fsync + rename) of files, streamed files and directories, the
JSON-lines format (the one reader, and the one line writer of append logs), and xxhash checksums."""

from __future__ import annotations

import io
import json
import math
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal

import xxhash

from tenx.errors import DataError, TenxError
from tenx.utils.storage import format_bytes

_CHUNK = 1 << 22


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; published files get the permissions a plain open() would give them.
FILE_MODE = 0o666 & ~_current_umask()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory entry so a rename inside it survives a power loss."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_FILE_TYPES = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISLNK, "symbolic link"),
)


def file_type(mode: int) -> str:
    """What an `st_mode` is, in words: "regular file", "directory", "FIFO" (a named pipe), "socket", ..."""
    if stat.S_ISREG(mode):
        return "regular file"
    return next((words for test, words in _FILE_TYPES if test(mode)), "special file")


def _mode(path: str | os.PathLike[str]) -> int | None:
    """`path`'s st_mode, following links (os.stat: it never opens the file), or None when nothing is there."""
    try:
        return os.stat(path).st_mode
    except OSError:  # missing, or a dangling or looping link: a rename replaces the link itself
        return None


def regular_input_file(path: str | os.PathLike[str], what: str = "input") -> Path:
    """`path` once os.stat shows it is a regular file (a link: its target), or a DataError naming the type.

    Checked without opening it: opening a FIFO blocks until a writer comes, and a device such as /dev/zero
    never ends, so an input that is not a regular file is refused before anything reads it."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise DataError(f"cannot read the {what} {os.fspath(path)}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise DataError(
            f"the {what} {os.fspath(path)} is a {file_type(mode)}, not a regular file: name a regular file"
        )
    return Path(path)


def _writes_through(path: Path) -> bool:
    """Whether an output `path` is written in place (a character device such as /dev/null, as xz and cat
    write to it) rather than replaced by a rename; a TenxError naming the type for any other existing path
    that is not a regular file (a FIFO, socket, block device or directory is never replaced, and a FIFO
    with no reader would block)."""
    mode = _mode(path)
    if mode is None or stat.S_ISREG(mode):
        return False
    if stat.S_ISCHR(mode):
        return True
    raise TenxError(
        f"{path} is a {file_type(mode)}, not a regular file: tenx writes regular files (or a character "
        "device such as /dev/null, written through) and never replaces anything else; choose another output"
    )


def _write_through(path: Path, chunks: Iterable[bytes]) -> None:
    """Write `chunks` into the character device `path` in place (opened non-blocking, then checked again on
    the open descriptor: what replaced it since the check is refused, never blocked on)."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISCHR(mode):
            raise TenxError(f"{path} became a {file_type(mode)} while being written: choose another output")
        os.set_blocking(fd, True)
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def publish_file(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Put the finished file `tmp` in place as its sibling `final`, by a rename, the one way tenx replaces a
    file. A `final` that is a character device (/dev/null) is written through instead (`tmp` copied into
    it, then deleted); any other existing `final` that is not a regular file is refused, its type named
    (`tmp` is left to the caller), never replaced."""
    final = Path(final)
    if _writes_through(final):
        with open(tmp, "rb") as f:
            _write_through(final, iter(lambda: f.read(_CHUNK), b""))
        os.unlink(tmp)
        return
    os.replace(tmp, final)


class AtomicOutput:
    """A file written as a stream and put in place whole: `with AtomicOutput(path) as f:` writes into `f`, an
    open binary file on a temporary sibling `.NAME.*.tmp` (permissions `mode`); on a clean exit it is
    fsynced and published as `path` (publish_file, then the directory fsynced), so readers see the old file
    or the complete new one; on an error the temporary file is removed and `path` is left as it was.
    Outside a `with`, `file`, `publish()` and `discard()` do the same for a writer that opens and finishes
    its output in different calls. An existing `path` that is neither a regular file nor a character
    device is refused (TenxError naming its type) before anything is written."""

    def __init__(self, path: str | os.PathLike[str], *, mode: int = FILE_MODE) -> None:
        self.path = Path(path)
        _writes_through(self.path)  # refuses a FIFO, socket, block device or directory here, unopened
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self.file: BinaryIO = os.fdopen(fd, "wb")
        try:
            os.fchmod(fd, mode)
        except BaseException:
            self.discard()
            raise

    def publish(self) -> None:
        """fsync the written file and put it in place as `path` (the temporary file removed if that fails)."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            publish_file(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Close and remove the temporary file; `path` stays as it was."""
        self.file.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> BinaryIO:
        return self.file

    def __exit__(self, error_type: type[BaseException] | None, *rest: object) -> None:
        if error_type is None:
            self.publish()
        else:
            self.discard()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int = FILE_MODE) -> None:
    """Write `data` to `path` so that readers see either the old file or the complete new one; `mode`: the
    new file's permissions. A character device (/dev/null) is written through, and any other existing path
    that is not a regular file is refused (TenxError naming its type): renaming over it would replace it."""
    if _writes_through(Path(path)):
        _write_through(Path(path), [data])
        return
    with AtomicOutput(path, mode=mode) as f:
        f.write(data)


def save_png(figure: Any, path: str | os.PathLike[str]) -> Path:
    """Lay out a matplotlib figure (tight_layout), write it atomically as a PNG (a dashboard or reader never
    sees half an image) and close it; returns the path."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    atomic_write_bytes(path, buffer.getvalue())
    plt.close(figure)
    return Path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, mode: int = FILE_MODE) -> None:
    """Atomically write UTF-8 text (as atomic_write_bytes; `mode`: the new file's permissions)."""
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> None:
    """Atomically write JSON with sorted keys (so equal content gives identical bytes)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON file's object, or {} when it is missing, unreadable, not JSON or not an object: for optional
    records (a run's provenance, a data-skips file) whose absence means "nothing recorded"."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def staging_dir(final: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The sibling `.NAME.tmp-TAG` in which a directory `final` is built before publish_dir (TAG: a fresh
    unique one when not given; a fixed one lets several processes write into the same staging directory)."""
    final = Path(final)
    return final.parent / f".{final.name}.tmp-{tag if tag is not None else _unique_tag()}"


def _unique_tag() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def publish_dir(
    tmp: str | os.PathLike[str],
    final: str | os.PathLike[str],
    *,
    sync_files: bool = True,
    before_rename: Callable[[], object] | None = None,
) -> None:
    """Publish the finished directory `tmp` as its sibling `final` atomically: a reader sees the previous
    `final` or the complete new one, never a mix, and a crash leaves one of them whole (its leftovers are
    for recover_interrupted_publishes).

    The files of `tmp` are fsynced (`sync_files=False`: its writer did already), then `tmp` itself; then
    `before_rename` runs (it raises to refuse, or kills the process to test a crash). A missing or empty
    `final` is replaced in one rename; any other in two, `final` -> `.NAME.old-*` and `tmp` -> `final`, the
    old one put back if the second fails and deleted once the new one is in place. Whether `final` may be
    replaced at all (never what tenx did not write) is the caller's to check, in `before_rename`.
    """
    tmp, final = Path(tmp), Path(final)
    if sync_files:
        for p in tmp.iterdir():
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
    fsync_dir(tmp)
    if before_rename is not None:
        before_rename()
    if final.is_dir() and any(final.iterdir()):
        old = final.parent / f".{final.name}.old-{_unique_tag()}"
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            os.replace(old, final)  # put the previous one back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def recover_interrupted_publishes(parent: str | os.PathLike[str], names: str = "*") -> None:
    """Undo what interrupted publishes of the directories of `parent` named like the glob `names` left:
    staging directories (`.NAME.tmp-*`) are deleted, and a `.NAME.old-*` (a replace killed between its two
    renames) is renamed back to NAME when that is missing, else deleted. Nothing may be publishing there
    meanwhile: any process's leftovers qualify."""
    parent = Path(parent)
    for stale in parent.glob(f".{names}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in parent.glob(f".{names}.old-*"):
        final = parent / old.name[1:].partition(".old-")[0]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)


def jsonl_records(
    path: str | os.PathLike[str],
    *,
    torn: Literal["last", "any"] = "last",
    missing_ok: bool = False,
    passed_over: list[int] | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each line of the JSON-lines file `path`, in order; blank lines are passed over.

    One policy: what a crash leaves is ignored, anything else malformed is a DataError naming the file and
    the line. Where a crash leaves a cut-short line depends on how the file is written:
    - torn="last" (one writer at a time, and a resume rewrites the file whole): only as the last line,
      unterminated; any other line that is not a JSON object is an error.
    - torn="any" (an append log whose next writer ends a torn last line with a newline and carries on,
      append_line): on any line, so every line that is not a JSON object is passed over.
    `passed_over` (a list), for a reader that shows what it can: a line that would be an error is passed
    over instead and its number appended to the list. A missing file raises FileNotFoundError, or yields
    nothing with `missing_ok`.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        # a last piece that is not blank has no newline: the write that a crash cut short, maybe
        try:
            record = _jsonl_record(line, path, i + 1, skip_bad=torn == "any", maybe_torn=i == len(lines) - 1)
        except DataError:
            if passed_over is None:
                raise
            passed_over.append(i + 1)
            continue
        if record is not None:
            yield i + 1, record


def read_jsonl(
    path: str | os.PathLike[str], *, torn: Literal["last", "any"] = "last", missing_ok: bool = False
) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file, in order (see jsonl_records for what is passed over)."""
    return [record for _, record in jsonl_records(path, torn=torn, missing_ok=missing_ok)]


def _jsonl_record(
    line: bytes, path: str | os.PathLike[str], line_no: int, *, skip_bad: bool, maybe_torn: bool
) -> dict[str, Any] | None:
    """The object on one line of a JSON-lines file; None for a blank line or one to pass over."""
    if not line.strip():
        return None
    try:  # NaN is allowed: metrics.jsonl writes it for a skipped step's loss
        record = json.loads(line.decode("utf-8", errors="replace"))
    except ValueError as e:
        if skip_bad or maybe_torn:
            return None
        raise DataError(
            f"{path}: line {line_no}: not valid JSON ({getattr(e, 'msg', e)}); fix or remove the line"
        ) from e
    if isinstance(record, dict):
        return record
    if skip_bad:
        return None
    raise DataError(
        f"{path}: line {line_no}: expected a JSON object, got {type(record).__name__}; fix or remove the line"
    )


def _plain(value: Any) -> Any:
    """`value` with non-finite floats as strings and containers converted, recursively."""
    if isinstance(value, float):  # numpy.float64 included: it subclasses float
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return float(value)
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    return value


def _fallback(value: Any) -> Any:
    """json.dumps hook: NumPy/torch scalars and arrays become numbers and lists, anything else its str()."""
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if hasattr(value, "item"):
        return _plain(value.item())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def json_line(record: dict[str, Any]) -> str:
    """`record` as one line of strict JSON, newline included: NaN and infinities as the strings "nan", "inf"
    and "-inf" (no NaN/Infinity tokens), NumPy or torch scalars as plain numbers."""
    return json.dumps(_plain(record), default=_fallback, allow_nan=False) + "\n"


def append_line(path: Path, line: str, sync: bool) -> None:
    """Append `line` to the JSON-lines log `path` with one write (any number of processes may append, a
    line at a time); first end a torn last line left by a killed writer. `sync`: fsync before returning."""
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        if ends_mid_line(path):
            line = "\n" + line
        os.write(fd, line.encode("utf-8"))
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if created and sync:
        fsync_dir(path.parent)


def ends_mid_line(path: Path) -> bool:
    """Whether `path` ends in a line without its newline (the torn write of a killed process)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def require_file(path: Path, what: str) -> None:
    """A DataError naming `path` when it exists but is not a regular file (a directory in a file's place)."""
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise DataError(
            f"{path} is {kind}, not {what}; move it out of the way (tenx writes this file itself)"
        )


class JsonlTail:
    """The objects of a JSON-lines file that is being appended to, read incrementally: each `read()` parses
    the complete lines added since the last one (a line still being written waits for the next read), and
    starts over when the file was replaced or truncated. The policy is jsonl_records' torn="last": only
    complete lines are read, so a line that is not a JSON object stops the reading there and `error` names
    it (the records before it stay)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.records: list[dict[str, Any]] = []
        self.error: str | None = None
        self._file_id: tuple[int, int] | None = None
        self._offset = 0
        self._lines = 0

    def read(self) -> list[dict[str, Any]]:
        """Every object read so far ([] while the file does not exist)."""
        try:
            st = os.stat(self.path)
        except OSError:
            self._file_id, self._offset, self._lines, self.records, self.error = None, 0, 0, [], None
            return self.records
        if (st.st_dev, st.st_ino) != self._file_id or st.st_size < self._offset:  # replaced or truncated
            self._file_id, self._offset, self._lines, self.records = (st.st_dev, st.st_ino), 0, 0, []
            self.error = None
        if st.st_size > self._offset:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(st.st_size - self._offset)
            self.error = None
            for line in chunk.split(b"\n")[:-1]:  # what follows the last newline is still being written
                try:
                    record = _jsonl_record(line, self.path, self._lines + 1, skip_bad=False, maybe_torn=False)
                except DataError as e:
                    self.error = str(e)  # read again from this line next time
                    break
                self._offset += len(line) + 1
                self._lines += 1
                if record is not None:
                    self.records.append(record)
        return self.records


def file_xxhash(path: str | os.PathLike[str]) -> str:
    """xxh3-64 hex digest of a file's bytes, read in chunks."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def bytes_xxhash(data: bytes) -> str:
    """xxh3-64 hex digest of bytes."""
    return xxhash.xxh3_64_hexdigest(data)


def check_output_file(
    path: str | os.PathLike[str],
    *,
    force: bool = False,
    flag: str = "-o",
    inputs: tuple[str | os.PathLike[str], ...] = (),
) -> Path:
    """`path` as a file a command may write (atomically, after this check), or a TenxError naming `flag`:
    a directory (or a path ending in a separator) is not a file; an existing file is replaced only with
    `force`, and never when it is one of the command's `inputs` (the same file, whatever the spelling).
    A character device (/dev/null) is written through, with or without `force` (nothing is replaced); any
    other path that is not a regular file (a FIFO, a socket, a block device) is refused, its type named."""
    text = os.fspath(path)
    out = Path(text)
    if not text or text.endswith(os.sep) or out.is_dir():
        raise TenxError(f"{flag} {text or repr(text)} is a directory, not a file: name the file to write")
    try:
        through = _writes_through(out)
    except TenxError as e:
        raise TenxError(f"{flag} {e}") from None
    for given in inputs:
        try:
            same = out.exists() and os.path.samefile(out, given)
        except OSError:
            same = False
        if same or out.resolve() == Path(given).resolve():
            raise TenxError(f"{flag} {text} is the command's own input {given}: choose another output file")
    if (out.exists() or out.is_symlink()) and not force and not through:
        raise TenxError(f"{text} exists; pass --force to replace it, or choose another {flag}")
    return out


def cache_dir() -> Path:
    """Where tenx keeps data it prepares on its own (the ladder's corpus): $TENX_CACHE_DIR, else
    $XDG_CACHE_HOME/tenx, else ~/.cache/tenx. Never a path relative to the working directory."""
    explicit = os.environ.get("TENX_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "tenx"


def read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of `path`, a regular file (links followed) of at most `limit` bytes, or a TenxError naming the
    path and what it is instead: a FIFO, device, socket or directory is refused unopened (opened without
    blocking and checked again, so one swapped in meanwhile is refused too), and a larger file unread."""

    def check(mode: int, size: int) -> None:
        if not stat.S_ISREG(mode):
            raise TenxError(
                f"{path}: is a {file_type(mode)}, not a regular file; tenx reads only regular files here"
            )
        if size > limit:
            raise TenxError(
                f"{path}: {format_bytes(size)}, more than the {format_bytes(limit)} tenx reads of such a file"
            )

    try:
        check(os.stat(path).st_mode, 0)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise TenxError(f"{path}: cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        check(st.st_mode, st.st_size)
        data = f.read(limit + 1)
    check(stat.S_IFREG, len(data))  # grew since
    return data
