"""Any codebase as text: every regular file under a directory, with `.gitignore` files, include/exclude
globs and a size limit applied, binary files skipped by content, and each file's language named.

The walk is deterministic (names sorted, byte-wise on their UTF-8); version-control directories (`.git`,
`.hg`, `.svn`, ...) are never entered and directories reached through symbolic links are not followed. A
file is read as `tenx data prepare` reads it (tenx.data.prepare.clean.clean_text: a NUL in the first 8 KB
makes it binary; text that is not UTF-8 has its bad bytes replaced by U+FFFD), and every file left out is
counted under one reason of CODEBASE_SKIP_REASONS.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tenx.data.prepare.clean import CleaningStats, clean_text
from tenx.data.prepare.sources import SKIP_REASONS as _SOURCE_SKIPS
from tenx.data.prepare.sources import _unusable
from tenx.errors import DataError

DEFAULT_MAX_FILE_BYTES = 1_000_000
"""Files larger than this are skipped by default (generated code, data dumps); 0 means no limit."""

MAX_DEPTH = 256
"""Directories nested deeper than this below the root are not entered (each counts once as `too_deep`)."""

VCS_DIRS = frozenset({".git", ".hg", ".svn", ".bzr", "_darcs", "CVS", ".jj", ".pijul"})
"""Directories of version-control systems: never entered."""

CODEBASE_SKIP_REASONS = {
    "gitignored": "ignored by a .gitignore (a directory counts once)",
    "excluded": "left out by --include/--exclude",
    "too_large": "larger than --max-file-bytes",
    "binary": "binary (a NUL byte in the first 8 KB)",
    "empty": "empty or only whitespace",
    "linked_directory": "symbolic link to a directory (not followed)",
    "too_deep": f"a directory nested deeper than {MAX_DEPTH} levels (not entered; counts once)",
    "outside": _SOURCE_SKIPS["outside"],
    "broken": _SOURCE_SKIPS["broken"],
    "special": _SOURCE_SKIPS["special"],
    "unreadable": _SOURCE_SKIPS["unreadable"],
}
"""Why a file under the directory is not scored: key (as in eval.json) -> what it means."""

_REASON_KEY = {text: key for key, text in CODEBASE_SKIP_REASONS.items()}

LANGUAGES = {
    ".c": "C",
    ".h": "C",
    ".cc": "C++",
    ".cpp": "C++",
    ".cxx": "C++",
    ".hh": "C++",
    ".hpp": "C++",
    ".hxx": "C++",
    ".cs": "C#",
    ".go": "Go",
    ".rs": "Rust",
    ".py": "Python",
    ".pyi": "Python",
    ".js": "JavaScript",
    ".mjs": "JavaScript",
    ".cjs": "JavaScript",
    ".jsx": "JavaScript",
    ".ts": "TypeScript",
    ".tsx": "TypeScript",
    ".java": "Java",
    ".kt": "Kotlin",
    ".scala": "Scala",
    ".rb": "Ruby",
    ".php": "PHP",
    ".swift": "Swift",
    ".m": "Objective-C",
    ".lua": "Lua",
    ".pl": "Perl",
    ".r": "R",
    ".sql": "SQL",
    ".sh": "shell",
    ".bash": "shell",
    ".zsh": "shell",
    ".html": "HTML",
    ".htm": "HTML",
    ".css": "CSS",
    ".scss": "CSS",
    ".json": "JSON",
    ".toml": "TOML",
    ".yaml": "YAML",
    ".yml": "YAML",
    ".xml": "XML",
    ".md": "Markdown",
    ".markdown": "Markdown",
    ".rst": "reStructuredText",
    ".txt": "text",
    ".proto": "Protocol Buffers",
}
"""Extension (lower case) -> language name; any other extension is its own group (`.ext`), none `(none)`."""


def language_of(path: str) -> str:
    """The language of a file from its extension: a name of LANGUAGES, else the extension, else `(none)`."""
    suffix = PurePosixPath(path).suffix.lower()
    if not suffix:
        return "(none)"
    return LANGUAGES.get(suffix, suffix)


_ANY_SEGMENTS = "**"
"""A whole `**` segment of a glob: any number of directories (see Glob)."""
_MAX_RE_STARS = 2
"""A name pattern with more `*` than this is matched by _star_match (linear) rather than `re` (backtracking:
each further `*` multiplies the worst case by the name's length)."""


class Glob:
    """A glob over `/`-separated paths, matched in time linear in the path and the pattern (no backtracking
    blow-up: twenty `**/` segments cost what one does). `*` and `?` stay within one name (a `**` inside a name,
    as in `a**b`, is a `*`, as in git), a whole `**` segment is any number of directories (`**/x`: x at any
    depth; a trailing `x/**`: everything inside x, not x itself), `[...]` a class (`[!...]` negated), a
    backslash escapes the next character. `anchored=False`: the pattern may match the path's last names at any
    depth (a .gitignore line without a `/` in its middle)."""

    def __init__(self, pattern: str, anchored: bool = True) -> None:
        self.pattern = pattern
        parts: list[object] = [] if anchored else [_ANY_SEGMENTS]
        names = pattern.split("/")
        for k, name in enumerate(names):
            if name == _ANY_SEGMENTS:
                if k == len(names) - 1:  # a trailing `**`: at least one name
                    parts.append(_name_matcher("*"))
                if not parts or parts[-1] is not _ANY_SEGMENTS:  # `**/**/`: one is enough
                    parts.append(_ANY_SEGMENTS)
            else:
                parts.append(_name_matcher(name))
        self._parts = parts

    def fullmatch(self, path: str) -> bool:
        """Whether the glob matches the whole of `path` (names joined by `/`)."""
        return _star_match(self._parts, path.split("/"), _ANY_SEGMENTS)


def _star_match(parts: list, items: list, star: object) -> bool:
    """Wildcard matching of `items` by `parts`, each a callable matching one item or `star` (any run of
    items): the greedy algorithm that, on a mismatch, only moves the last star on; O(len(parts) x len(items))
    calls, never exponential."""
    i = j = 0
    star_at, mark = -1, 0
    while j < len(items):
        if i < len(parts) and parts[i] is star:
            star_at, mark = i, j
            i += 1
        elif i < len(parts) and parts[i](items[j]):
            i += 1
            j += 1
        elif star_at >= 0:
            mark += 1
            i, j = star_at + 1, mark
        else:
            return False
    while i < len(parts) and parts[i] is star:
        i += 1
    return i == len(parts)


_ANY_CHARS = object()
"""A `*` inside a name, for _star_match over the name's characters."""


def _name_matcher(name: str):
    """A callable telling whether one path name matches the glob `name` (no `/` in it)."""
    tokens: list[
        object
    ] = []  # single characters (str), compiled one-character classes, `?` (None), _ANY_CHARS
    regex: list[str] = []
    i, n = 0, len(name)
    while i < n:
        c = name[i]
        if c == "*":
            while i + 1 < n and name[i + 1] == "*":
                i += 1
            tokens.append(_ANY_CHARS)
            regex.append(".*")
        elif c == "?":
            tokens.append(None)
            regex.append(".")
        elif c == "\\" and i + 1 < n:
            i += 1
            tokens.append(name[i])
            regex.append(re.escape(name[i]))
        elif c == "[":
            end = name.find("]", i + 2 if name[i + 1 : i + 2] in ("!", "^") else i + 1)
            if end < 0:
                tokens.append(c)
                regex.append(re.escape(c))
            else:
                body = name[i + 1 : end]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                cls = "[" + body.replace("\\", "\\\\") + "]"
                try:
                    tokens.append(re.compile(cls, re.DOTALL))
                except re.error as e:
                    raise ValueError(f"the class {name[i : end + 1]!r}: {e}") from None
                regex.append(cls)
                i = end
        else:
            tokens.append(c)
            regex.append(re.escape(c))
        i += 1
    if all(isinstance(t, str) for t in tokens):
        literal = "".join(t for t in tokens if isinstance(t, str))
        return literal.__eq__
    if tokens.count(_ANY_CHARS) <= _MAX_RE_STARS:
        return re.compile("".join(regex), re.DOTALL).fullmatch
    parts = [_char_matcher(t) if t is not _ANY_CHARS else t for t in tokens]
    return lambda item: _star_match(parts, item, _ANY_CHARS)


def _char_matcher(token: object):
    if token is None:
        return lambda ch: True
    if isinstance(token, str):
        return token.__eq__
    return token.fullmatch  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _Rule:
    regex: Glob
    negated: bool
    dir_only: bool


def parse_gitignore(text: str, where: str = ".gitignore") -> list[_Rule]:
    """The rules of a .gitignore: blank lines and `#` comments skipped, `!` negates, a trailing `/` matches
    directories only, a `/` at the start or in the middle anchors the pattern to the file's directory (else
    it matches a name at any depth below it); `\\#`, `\\!` and `\\ ` escape."""
    rules = []
    for line in text.splitlines():
        if line.endswith("\r"):
            line = line[:-1]
        # trailing spaces are ignored unless escaped with a backslash
        stripped = line.rstrip(" ")
        if stripped.endswith("\\") and len(stripped) < len(line):
            stripped += " "
        line = stripped
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        if negated:
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        line = line.lstrip("/")
        try:
            regex = Glob(line, anchored=anchored)
        except ValueError as e:
            raise DataError(
                f"{where}: pattern {line!r} is not usable ({e}); fix or remove that line"
            ) from None
        rules.append(_Rule(regex, negated, dir_only))
    return rules


def _path_glob(pattern: str, flag: str) -> Glob:
    """An --include/--exclude glob: with a `/` matched against the whole relative path, else a name at any
    depth."""
    p = pattern.strip().lstrip("/").rstrip("/")
    if not p:
        raise DataError(f"{flag} {pattern!r}: an empty pattern; give a glob such as '*.c' or 'src/**'")
    try:
        return Glob(p, anchored="/" in p)
    except ValueError as e:
        raise DataError(f"{flag} {pattern!r} is not a usable glob ({e})") from None


@dataclass
class CodebaseFile:
    """One file scored: its path relative to the root, cleaned text and that text's UTF-8 size."""

    path: str
    text: str
    num_bytes: int


@dataclass
class Codebase:
    """The text files of a directory and the counts of files left out, by CODEBASE_SKIP_REASONS key."""

    root: Path
    files: list[CodebaseFile] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_examples: dict[str, list[str]] = field(default_factory=dict)
    decoded_with_replacement: list[str] = field(default_factory=list)
    """Files whose bytes were not all valid UTF-8 (scored with U+FFFD in place of the bad bytes)."""

    def skip(self, reason: str, path: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        examples = self.skipped_examples.setdefault(reason, [])
        if len(examples) < 5:
            examples.append(path)

    def summary(self) -> dict[str, object]:
        """The counts for a report (eval.json's `files`)."""
        return {
            "scored": len(self.files),
            "skipped": dict(sorted(self.skipped.items())),
            "skipped_examples": {k: v for k, v in sorted(self.skipped_examples.items())},
            "decoded_with_replacement": len(self.decoded_with_replacement),
        }


def read_codebase(
    root: str | Path,
    *,
    include: list[str] | tuple[str, ...] = (),
    exclude: list[str] | tuple[str, ...] = (),
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    gitignore: bool = True,
) -> Codebase:
    """Every text file under `root`, in sorted path order. `include`: when given, a file must match one of
    these globs; `exclude`: a file (or a directory above it) matching one is left out; `max_file_bytes`:
    larger files are skipped (0: no limit); `gitignore`: respect the `.gitignore` files of the tree."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: not a directory")
    if max_file_bytes < 0:
        raise DataError(f"max_file_bytes must be >= 0 (0: no limit), got {max_file_bytes}")
    includes = [_path_glob(p, "--include") for p in include]
    excludes = [_path_glob(p, "--exclude") for p in exclude]
    base = root.resolve()
    found = Codebase(root)
    stats = CleaningStats()
    # (directory relative to root, its rules), outermost first; later rules win
    layers: list[tuple[str, list[_Rule]]] = []

    def ignored(rel: str, is_dir: bool) -> bool:
        verdict = False
        for prefix, rules in layers:
            if prefix and not rel.startswith(prefix + "/"):
                continue
            local = rel[len(prefix) + 1 :] if prefix else rel
            for rule in rules:
                if rule.dir_only and not is_dir:
                    continue
                if rule.regex.fullmatch(local):
                    verdict = not rule.negated
        return verdict

    def listing(directory: Path, rel_dir: str) -> tuple[list[os.DirEntry], bool] | None:
        """The sorted entries of a directory, and whether its .gitignore pushed a layer of rules (None: its
        path is longer than the system allows, counted as too deep)."""
        pushed = False
        if gitignore:
            ignore_file = directory / ".gitignore"
            if ignore_file.is_file() and not ignore_file.is_symlink():
                try:
                    text = ignore_file.read_bytes().decode("utf-8", errors="replace")
                except OSError as e:
                    raise DataError(f"cannot read {ignore_file}: {e.strerror or e}") from None
                layers.append((rel_dir, parse_gitignore(text, str(ignore_file))))
                pushed = True
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name.encode("utf-8", "surrogateescape"))
        except OSError as e:
            if pushed:
                layers.pop()
            if e.errno == errno.ENAMETOOLONG:
                return None
            raise DataError(f"cannot list {directory}: {e.strerror or e}") from None
        return entries, pushed

    # Depth first in sorted order, with a stack of open directories rather than recursion (a tree deeper than
    # Python's recursion limit is walked the same); a directory deeper than MAX_DEPTH is skipped and counted.
    entries, pushed = listing(root, "") or ([], False)
    stack: list[tuple[str, Iterator[os.DirEntry], bool]] = [("", iter(entries), pushed)]
    while stack:
        rel_dir, it, pushed = stack[-1]
        entry = next(it, None)
        if entry is None:
            stack.pop()
            if pushed:
                layers.pop()
            continue
        rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
        try:
            is_link = entry.is_symlink()
            is_dir = entry.is_dir(follow_symlinks=False)
            is_dir_target = entry.is_dir(follow_symlinks=True)
        except OSError:
            found.skip("broken", rel)
            continue
        if is_dir and entry.name in VCS_DIRS:
            continue
        if gitignore and ignored(rel, is_dir or is_dir_target):
            found.skip("gitignored", rel)
            continue
        if any(rx.fullmatch(rel) for rx in excludes):
            found.skip("excluded", rel)
            continue
        if is_dir:
            opened = listing(Path(entry.path), rel) if len(stack) <= MAX_DEPTH else None
            if opened is None:
                found.skip("too_deep", rel)
                continue
            entries, pushed = opened
            stack.append((rel, iter(entries), pushed))
            continue
        if is_link and is_dir_target:
            found.skip("linked_directory", rel)
            continue
        if includes and not any(rx.fullmatch(rel) for rx in includes):
            found.skip("excluded", rel)
            continue
        _read_file(Path(entry.path), rel, base, max_file_bytes, found, stats)
    return found


def _read_file(path: Path, rel: str, base: Path, limit: int, found: Codebase, stats: CleaningStats) -> None:
    why = _unusable(path, base)
    if why:
        found.skip(_REASON_KEY[why], rel)
        return
    try:
        size = path.stat().st_size
        if limit and size > limit:
            found.skip("too_large", rel)
            return
        # O_NONBLOCK: a file swapped for a FIFO since the check must not block the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                found.skip("special", rel)
                return
            data = f.read(limit + 1) if limit else f.read()
    except OSError:
        found.skip("unreadable", rel)
        return
    if limit and len(data) > limit:  # it grew since the stat
        found.skip("too_large", rel)
        return
    binary, replaced = stats.binary_skipped, stats.decoded_with_replacement
    cleaned = clean_text(data, stats)
    if cleaned is None:
        found.skip("binary" if stats.binary_skipped > binary else "empty", rel)
        return
    if stats.decoded_with_replacement > replaced:
        found.decoded_with_replacement.append(rel)
    found.files.append(CodebaseFile(rel, cleaned[0], len(cleaned[1])))
