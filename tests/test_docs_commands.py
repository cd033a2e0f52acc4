"""Every command block of README.md and docs/*.md runs as written.

What runs
---------
Every fenced ```bash / ```sh / ```shell / ```console / ```python block of README.md and docs/*.md (globbed
when the tests are collected, so a new page is picked up without editing this file), in document order, in
a fresh working directory per page, as a user would type it: one `bash -c` per command, the `tenx`,
`python` and `torchrun` of this interpreter's environment first on PATH, OMP_NUM_THREADS=1. Later commands
see what earlier ones wrote (`runs/data/stdlib` before `tenx train --set data.dir=runs/data/stdlib`).

Shell blocks are cut into commands: `\\` continuations are joined, comments dropped, `a && b` runs its parts
in order and stops at the first failure (as bash does), and `export`s carry over to later commands of the
page. A command ending in `&` starts in the background: a server (SERVERS: `tenx lighthouse`, `tenx dashboard`,
`tensorboard`) is stopped when its block ends, anything else is waited for and must succeed. A server
started in the foreground must still be running after SERVER_GRACE_S seconds, and is then stopped. A
```console block runs its `$ ` lines. A ```python block is written to a file and run with `python FILE` in
the working directory.

Tiny settings, where the docs say so
------------------------------------
An HTML comment right above a block (not rendered, but in front of whoever edits the block) says how the
test shrinks it, one directive per line:

    <!-- docs-test:
    tenx train --config quickstart += --set train.steps=4 --set checkpoint.every=2
    before: tenx data prepare --source stdlib --out runs/data/stdlib
    -->

  PREFIX += ARGS    append ARGS to every command of the block whose words start with PREFIX (after any
                    `VAR=value`; `torchrun ... -m tenx ...` and `python -m tenx ...` count as `tenx ...`)
  --ARGS ...        short for `tenx train += --ARGS ...`
  before: COMMAND   run COMMAND first: what the page takes as done (e.g. the README's data step)

Beyond those, the test itself only (tables below, printed with every command they touch):
  - GLOBAL_APPEND: `--max-documents 150` for `tenx data prepare --source stdlib` (the whole standard
    library takes ~25 s, 150 files 2 s) and `--steps 4` for `tenx quickstart` (8 minutes);
  - HOME is a fixture home, so `~/code/myrepo` and `~/code/private-repo` are small real directories (copies
    of standard-library packages), and the files a page takes for granted are put in the working directory
    (FIXTURES: `corpus.jsonl`, `results.csv`, `my_repo/`, `configs/my_run.toml` from
    tests/fixtures/docs/, and copies of the checkout's `configs/`, `bench/` and `tests/data/`);
    TENX_CACHE_DIR and MPLCONFIGDIR are one directory shared by the pages (the ladder's corpus, fonts);
  - PATHS: absolute `/tmp/...` paths are moved into the working directory;
  - SKIPS: commands that cannot run here are skipped with their reason (pip installs, the test suite
    itself, several machines or GPUs, templates with placeholders, pseudo-code), and so are commands whose
    program is not installed and python blocks that import a module that is not (REQUIRES: e.g. `tenx
    export` needs transformers); each skip is printed, and a missing tool is also a warning;
  - XFAILS: commands that fail because of a tenx bug with a known fix. The page's test is an xfail while
    they fail (the page goes on, and its other commands must pass); once one passes, a warning says to
    remove its entry.

Default run and slow run
------------------------
One test per page, named after it; a failure names the page, the block's line and the command, with the
tail of its output. Every page writes WORK/.docs-test/report.txt (pass, skip or xfail, line and seconds of
each command) beside each command's stdout and stderr. The pages in SLOW (time on 2 CPU cores beside each,
about 15 minutes together) run only with `-m slow`; the others run in the default `python -m pytest -q`:
about 2 minutes together on 2 CPU cores.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES_DIR = REPO / "tests" / "fixtures" / "docs"

# Pages that run only under `-m slow`, with their measured time (2 CPU cores, OMP_NUM_THREADS=1).
SLOW = {
    "README.md": "220 s: quickstart, chaos drill, torchrun, replica group, ladder, derisk",
    "docs/scaling.md": "150 s: a ladder and two derisk studies",
    "docs/eval.md": "100 s: tenx quickstart prepares the whole standard library",
    "docs/fault-tolerance.md": "95 s: two chaos drills",
    "docs/prediction.md": "110 s: a tiny ladder and bench/predict_accuracy.py on the stored ladder curves",
    "docs/monitoring.md": "130 s: a quickstart-sized ladder, a watched run, statistics, two dashboards",
    "docs/triage.md": "150 s: the triage drill (a supervised run with 10 crashes, then 26 incidents triaged)",
    "docs/plan.md": "30 s: GEMM shapes timed, a measured calibration, a scaling-law fit and the run it chooses",
    "docs/export.md": "30 s: a run exported to transformers, loaded back and compared",
    "docs/distributed.md": "21 s: torchrun DDP and FSDP2 runs",
    "docs/consistency.md": "15 s: the bitflip drill under torchrun",
    "docs/interop.md": "47 s: a run exported, its tokenizer prepared, an --init-from run, a W&B offline run",
}

# Appended to every matching command on every page: (program prefix, required word, args, why).
GLOBAL_APPEND = [
    (
        "tenx data prepare",
        "--source stdlib",
        "--max-documents 150",
        "the whole standard library takes ~25 s to prepare; its first 150 files take 2 s",
    ),
    ("tenx quickstart", "", "--steps 4", "the quickstart trains 2,000 steps (8 minutes)"),
]

# Absolute paths outside the working directory are moved into it ({work} is the working directory).
PATHS = [(re.compile(r"(?<![\w./~-])/tmp/"), "{work}/tmp/")]

# Files a page takes for granted: path in the working directory -> source (a fixture, a copy of the
# checkout, or stdlib:PACKAGE, a copy of a standard-library package). `~` is the fixture HOME.
FIXTURES = {
    "configs": REPO / "configs",
    "bench": REPO / "bench",
    "tests/data": REPO / "tests" / "data",
    "configs/my_run.toml": FIXTURES_DIR / "configs" / "my_run.toml",
    "corpus.jsonl": FIXTURES_DIR / "corpus.jsonl",
    "results.csv": FIXTURES_DIR / "results.csv",
    "my_repo": FIXTURES_DIR / "my_repo",
    "~/code/myrepo": "stdlib:json",
    "~/code/private-repo": "stdlib:http",
}

# Commands that cannot run here: (page glob, regex searched in the command or python block, reason).
SKIPS = [
    ("*", r"^pip install", "installs packages: the test runs the installed tenx (pip install -e .)"),
    ("README.md", r"^python -m pytest", "runs the whole test suite, this test included"),
    ("docs/distributed.md", r"--nnodes 4", "needs 4 machines with 8 GPUs each and a rendezvous host HOST0"),
    ("docs/distributed.md", r"^sbatch ", "submits to a Slurm cluster (tests/test_slurm.py runs the script)"),
    (
        "docs/multi-cluster.md",
        r"^TENX_REPLICA_GROUP=\d torchrun",
        "a template for two clusters of 8 GPUs: LIGHTHOUSE, ADDR_OF_THIS_MACHINE, /cluster-a and `...` "
        "are yours to fill in (README.md step 5 runs a group on this machine)",
    ),
    ("docs/training.md", r"^self\.write_provenance\(\)", "pseudo-code: the body of Trainer.fit"),
    (
        "*",
        r"^python bench/gpu_check\.py --device cuda",
        "needs a CUDA GPU (8 minutes on one H100); tests/test_gpu_check.py runs its CPU matrix",
    ),
    (
        "docs/scaling.md",
        r"^from tenx\.scaling\.fit import",
        "an API sketch: N, D, L and C stand for the caller's arrays of runs",
    ),
]

# Modules a command needs beyond tenx's own dependencies: program prefix -> modules.
REQUIRES = {"tenx export": ("transformers",)}

# Commands that fail because of a bug in tenx: (page glob, regex searched in the command, or in a python
# block's first line, reason). Not strict: one that passes is reported and warned about, not failed.
XFAILS: list[tuple[str, str, str]] = []  # (page glob, command regex, the bug); none known now

SERVERS = ("tenx lighthouse", "tensorboard", "tenx dashboard")  # run until stopped
SERVER_GRACE_S = 5.0
COMMAND_TIMEOUT_S = 900
TAIL_LINES = 40

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")
LANGS = {"bash": "shell", "sh": "shell", "shell": "shell", "console": "console", "python": "python"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
BUILTINS = {"export", "cd", "echo", "wait", "source", ".", "set", "unset", "true", "false", "test", "["}


# ----- reading the pages -----------------------------------------------------------------------------
@dataclass
class Block:
    doc: str  # path relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str  # shell | console | python
    text: str
    directives: list[str]


@dataclass
class Command:
    doc: str
    line: int  # 1-based line in the page where the command starts
    text: str  # as written, comments and continuations removed
    background: bool = False
    parts: list[str] = field(default_factory=list)  # `a && b` -> [a, b]


def doc_files() -> list[Path]:
    return sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def parse_blocks(path: Path) -> list[Block]:
    """The runnable fenced blocks of a markdown file, with the docs-test directives above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body, j = [], i + 1
        while j < len(lines) and not close.match(lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        lang = LANGS.get(m["info"].lower())
        if lang:
            blocks.append(Block(rel(path), i + 1, lang, "\n".join(body), directives_above(lines, i)))
        i = j + 1
    return blocks


def directives_above(lines: list[str], fence_index: int) -> list[str]:
    """The lines of a `<!-- docs-test: ... -->` comment right above the fence (blank lines between allowed)."""
    k = fence_index - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    if k < 0 or not lines[k].rstrip().endswith("-->"):
        return []
    end = k
    while k >= 0 and "<!--" not in lines[k]:
        k -= 1
    comment = "\n".join(lines[k : end + 1]).strip()
    comment = comment.removeprefix("<!--").removesuffix("-->").strip()
    if not comment.startswith("docs-test"):
        return []
    comment = comment.removeprefix("docs-test").lstrip().removeprefix(":")
    return [d.strip() for d in comment.splitlines() if d.strip()]


def strip_comment(line: str) -> str:
    """`line` without a shell comment (a `#` that starts a word outside quotes)."""
    quote, i = None, 0
    while i < len(line):
        c = line[i]
        if c == "\\" and quote != "'":
            i += 2  # an escaped character, quote or `#` included
            continue
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
        i += 1
    return line.rstrip()


def split_and(text: str) -> list[str]:
    """`a && b && c` -> [a, b, c] (outside quotes)."""
    parts, quote, start, i = [], None, 0, 0
    while i < len(text):
        c = text[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif text.startswith("&&", i):
            parts.append(text[start:i].strip())
            start = i + 2
            i += 1
        i += 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def shell_commands(block: Block) -> list[Command]:
    """The commands of a shell or console block, in order."""
    lines = block.text.splitlines()
    if block.lang == "console":  # `$ cmd` lines (and their continuations); the rest is output
        kept, going_on = [], False
        for n, line in enumerate(lines):
            if line.startswith("$ ") or going_on:
                kept.append((n, line[2:] if line.startswith("$ ") else line))
                going_on = line.rstrip().endswith("\\")
        numbered = kept
    else:
        numbered = list(enumerate(lines))
    commands: list[Command] = []
    pending, first = "", None
    for n, raw in numbered:
        line = strip_comment(raw)
        if not line.strip() and not pending:
            continue
        if first is None:
            first = n
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        text = (pending + line.strip()).strip()
        pending, start = "", first
        first = None
        if not text:
            continue
        background = text.endswith("&") and not text.endswith("&&")
        if background:
            text = text[:-1].strip()
        parts = [text] if background else split_and(text)
        commands.append(Command(block.doc, block.line + 1 + start, text, background, parts))
    return commands


def words_of(text: str) -> list[str]:
    """The words of a command as the program sees them, `VAR=value` prefixes and launchers removed."""
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words and words[0] == "torchrun" and "-m" in words:
        words = words[words.index("-m") + 1 :]
    elif len(words) > 2 and words[0] in ("python", "python3") and words[1] == "-m" and words[2] == "tenx":
        words = words[2:]
    return words


def starts_with(text: str, prefix: str) -> bool:
    want = shlex.split(prefix)
    return words_of(text)[: len(want)] == want


def contains(words: list[str], run: list[str]) -> bool:
    """Whether `run` occurs in `words` as consecutive words (an empty run always does)."""
    return any(words[i : i + len(run)] == run for i in range(len(words) - len(run) + 1))


def parse_directives(block: Block) -> tuple[list[tuple[str, str]], list[str]]:
    """(appends as (prefix, args), before-commands) of a block's docs-test comment."""
    appends, before = [], []
    for d in block.directives:
        if d.startswith("before:"):
            before.append(d.removeprefix("before:").strip())
        elif d.startswith("-"):
            appends.append(("tenx train", d))
        elif "+=" in d:
            prefix, _, args = d.partition("+=")
            appends.append((prefix.strip(), args.strip()))
        else:
            raise ValueError(f"{block.doc}:{block.line}: unknown docs-test directive {d!r}")
    return appends, before


def matching(table: list[tuple[str, str, str]], doc: str, text: str) -> str | None:
    for pattern, regex, reason in table:
        if fnmatch.fnmatch(doc, pattern) and re.search(regex, text, re.M):
            return reason
    return None


def missing_tool(text: str, env: dict[str, str]) -> str | None:
    """Why `text` cannot run here (its program or a module it needs is not installed), or None."""
    try:
        first = next(w for w in shlex.split(text) if not ASSIGNMENT.match(w))
    except (StopIteration, ValueError):
        return None
    if first not in BUILTINS and not shutil.which(first, path=env["PATH"]):
        return f"{first} is not installed"
    for prefix, modules in REQUIRES.items():
        if starts_with(text, prefix):
            for module in modules:
                if importlib.util.find_spec(module) is None:
                    return f"`{prefix}` needs {module}, which is not installed"
    return None


def missing_imports(source: str) -> str | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if importlib.util.find_spec(top) is None:
                return f"the block imports {top}, which is not installed"
    return None


# ----- running a page --------------------------------------------------------------------------------
class Page:
    """One page's working directory, environment and log of what ran."""

    def __init__(self, doc: str, work: Path, home: Path, cache: Path) -> None:
        self.doc, self.work = doc, work
        self.logs = work / ".docs-test"
        self.logs.mkdir(parents=True)
        (work / "tmp").mkdir()
        self.state = self.logs / "exports.sh"
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TENX_REPLICA_GROUP", "TORCHFT_LIGHTHOUSE", "TENX_REPLICA_SECRET", "XDG_CACHE_HOME")
        }
        self.env.update(
            PATH=os.pathsep.join([str(Path(sys.executable).parent), self.env.get("PATH", "")]),
            HOME=str(home),
            TENX_CACHE_DIR=str(cache),
            MPLCONFIGDIR=str(cache / "matplotlib"),  # one font cache, not one per fresh HOME
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        self.count = 0
        self.background: list[Job] = []
        self.report: list[str] = []  # one line per command: status, place, command
        self.failures: list[str] = []
        self.expected: list[str] = []
        self.unexpected_passes: list[str] = []

    def substitute(self, text: str) -> str:
        for regex, repl in PATHS:
            text = regex.sub(repl.format(work=self.work), text)
        return text

    def _start(self, script: str, name: str) -> tuple[subprocess.Popen, Path, Path]:
        self.count += 1
        out = self.logs / f"{self.count:03d}-{name}.out"
        err = out.with_suffix(".err")
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(
                ["bash", "-c", script],
                cwd=self.work,
                env=self.env,
                stdout=fo,
                stderr=fe,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return proc, out, err

    def _outcome(self, where: str, shown: str, rc: int | None, out: Path, err: Path, note: str = "") -> str:
        def tail(p: Path) -> str:
            lines = p.read_text(errors="replace").splitlines()
            return "\n".join("    " + x for x in lines[-TAIL_LINES:]) or "    (empty)"

        return (
            f"{where}: `{shown}` {note or f'exited with status {rc}'}\n"
            f"  stdout (last {TAIL_LINES} lines):\n{tail(out)}\n  stderr (last {TAIL_LINES} lines):\n{tail(err)}"
        )

    def _judge(self, where: str, text: str, ok: bool, message: str, seconds: float) -> bool:
        xfail = matching(XFAILS, self.doc, text)
        if ok and xfail:
            self.unexpected_passes.append(f"{where}: `{text}` passes now: remove its XFAILS entry ({xfail})")
            warnings.warn(self.unexpected_passes[-1], stacklevel=1)
        elif not ok and xfail:
            self.expected.append(f"{where}: {xfail}")
            self.report.append(f"xfail  {where}  {text}  ({xfail})")
            return True  # go on: the rest of the page must still pass
        elif not ok:
            self.failures.append(message)
        self.report.append(f"{'pass ' if ok else 'FAIL '}  {where}  {text}  [{seconds:.1f} s]")
        return ok

    def run(self, where: str, original: str, text: str, *, python: bool = False) -> bool:
        """Run one command (or, with `python`, the python file `text`) in the foreground and judge it;
        False when the page must stop here."""
        server = not python and any(starts_with(text, s) for s in SERVERS)
        if python:
            script, name = f"python {shlex.quote(text)}", "python"
        else:
            script = (
                f"[ -f {self.state} ] && source {self.state} >/dev/null 2>&1\n{text}\n__rc=$?\n"
                f"export -p > {self.state}\nexit $__rc\n"
            )
            name = re.sub(r"[^\w.-]", "_", (words_of(text) or ["cmd"])[0])[:40]
        shown = original if python or text == original else f"{text}  (as written: {original})"
        print(f"$ python {text}" if python else f"$ {text}", flush=True)
        t0 = time.monotonic()
        proc, out, err = self._start(script, name)
        try:
            if server:
                try:
                    rc = proc.wait(SERVER_GRACE_S)
                except subprocess.TimeoutExpired:  # still serving: what a server should do
                    return self._judge(where, original, True, "", time.monotonic() - t0)
                message = self._outcome(where, shown, rc, out, err, f"(a server) exited with status {rc}")
                return self._judge(where, original, rc == 0, message, time.monotonic() - t0)
            try:
                rc, note = proc.wait(COMMAND_TIMEOUT_S), ""
            except subprocess.TimeoutExpired:
                rc, note = None, f"did not finish in {COMMAND_TIMEOUT_S} s"
            message = self._outcome(where, shown, rc, out, err, note)
            return self._judge(where, original, rc == 0, message, time.monotonic() - t0)
        finally:
            stop(proc)

    def start_background(self, where: str, original: str, text: str) -> None:
        print(f"$ {text} &", flush=True)
        proc, out, err = self._start(text, "background")
        self.background.append(Job(where, original, text, proc, out, err, time.monotonic()))

    def end_block(self) -> bool:
        """Wait for the block's background commands, then stop its servers (which must still be running)."""
        ok = True
        jobs, self.background = self.background, []
        for job in sorted(jobs, key=lambda j: j.server):  # servers last: the others may need them
            shown = job.original if job.text == job.original else f"{job.text}  (as written: {job.original})"
            try:
                if job.server:
                    rc = job.proc.poll()
                    note = f"(a server, started with &) exited with status {rc} before its block ended"
                    good = rc is None or rc == 0
                else:
                    try:
                        rc = job.proc.wait(COMMAND_TIMEOUT_S)
                        note, good = f"(started with &) exited with status {rc}", rc == 0
                    except subprocess.TimeoutExpired:
                        rc, good = None, False
                        note = f"(started with &) did not finish in {COMMAND_TIMEOUT_S} s"
                message = self._outcome(job.where, shown, rc, job.out, job.err, note)
                seconds = time.monotonic() - job.started
                ok = self._judge(job.where, job.original + " &", good, message, seconds) and ok
            finally:
                stop(job.proc)
        return ok

    def stop_all(self) -> None:
        for job in self.background:
            stop(job.proc)


@dataclass
class Job:
    """A command started with `&`."""

    where: str
    original: str
    text: str
    proc: subprocess.Popen
    out: Path
    err: Path
    started: float

    @property
    def server(self) -> bool:
        return any(starts_with(self.text, s) for s in SERVERS)


def stop(proc: subprocess.Popen) -> None:
    """Stop a command's whole process group: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
    try:  # whatever the group left behind (a child that outlived its shell)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def set_up_fixtures(work: Path, home: Path) -> None:
    from tenx.data.prepare.sources import stdlib_dir

    for name, source in FIXTURES.items():
        dst = home / name[2:] if name.startswith("~/") else work / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, str) and source.startswith("stdlib:"):
            pkg = stdlib_dir() / source.removeprefix("stdlib:")
            shutil.copytree(pkg, dst, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        elif Path(source).is_dir():
            shutil.copytree(source, dst, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        else:
            shutil.copy2(source, dst)


def run_page(page: Page, blocks: list[Block]) -> None:
    """Run a page's blocks in order; stop at the first unexpected failure."""

    def skip(where: str, what: str, reason: str) -> None:
        page.report.append(f"skip   {where}  {what}  ({reason})")
        if "not installed" in reason:
            warnings.warn(f"{where}: {what} skipped: {reason}", stacklevel=1)

    for block in blocks:
        appends, before = parse_directives(block)
        where = f"{block.doc}:{block.line}"
        for setup in before:
            if not page.run(f"{where} (before:)", setup, page.substitute(with_appends(setup, []))):
                return
        if block.lang == "python":
            first = block.text.strip().splitlines()[0] + " ..."
            reason = matching(SKIPS, block.doc, block.text) or missing_imports(block.text)
            if reason:
                skip(where, f"python block `{first}`", reason)
                continue
            path = page.logs / f"{Path(block.doc).stem}_{block.line}.py"
            path.write_text(page.substitute(block.text) + "\n", encoding="utf-8")
            if not page.run(where, f"python block `{first}`", str(path), python=True):
                return
            continue
        for cmd in shell_commands(block):
            where = f"{block.doc}:{cmd.line}"
            for part in cmd.parts:
                reason = matching(SKIPS, block.doc, part) or missing_tool(part, page.env)
                if reason:
                    skip(where, f"`{part}`" + (" &" if cmd.background else ""), reason)
                    continue
                text = page.substitute(with_appends(part, appends))
                if cmd.background:
                    page.start_background(where, part, text)
                elif not page.run(where, part, text):
                    page.end_block()
                    return
        if not page.end_block():
            return


def with_appends(text: str, appends: list[tuple[str, str]]) -> str:
    """`text` with the block's and the global appended arguments."""
    extra = [args for prefix, args in appends if starts_with(text, prefix)]
    words = words_of(text)
    extra += [
        args
        for prefix, needs, args, _ in GLOBAL_APPEND
        if starts_with(text, prefix) and contains(words, shlex.split(needs))
    ]
    return " ".join([text, *extra])


def page_params() -> list:
    params = []
    for path in doc_files():
        doc = rel(path)
        marks = [pytest.mark.slow, pytest.mark.timeout(3600)] if doc in SLOW else [pytest.mark.timeout(900)]
        params.append(pytest.param(doc, marks=marks, id=doc))
    return params


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("docs-cache")


@pytest.mark.parametrize("doc", page_params())
def test_docs_commands(doc: str, tmp_path: Path, cache_dir: Path) -> None:
    blocks = parse_blocks(REPO / doc)
    if not blocks:
        pytest.skip(f"{doc} has no command blocks")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    set_up_fixtures(work, home)
    page = Page(doc, work, home, cache_dir)
    t0 = time.monotonic()
    try:
        run_page(page, blocks)
    finally:
        page.stop_all()
        report = f"{doc}: {time.monotonic() - t0:.0f} s in {work}\n" + "\n".join(page.report) + "\n"
        (page.logs / "report.txt").write_text(report, encoding="utf-8")
        print("\n" + report)
    if page.failures:
        pytest.fail("\n\n".join(page.failures), pytrace=False)
    if page.expected:
        pytest.xfail("; ".join(page.expected) + f" (every command: {page.logs / 'report.txt'})")
    if not any(line.startswith("pass") for line in page.report):
        pytest.skip(f"{doc}: every command was skipped: " + "; ".join(page.report))


# ----- the parser itself -----------------------------------------------------------------------------
def test_parser_handles_continuations_comments_chains_and_background(tmp_path: Path) -> None:
    md = tmp_path / "page.md"
    md.write_text(
        "intro\n\n<!-- docs-test:\ntenx train += --set train.steps=2\nbefore: echo hi\n-->\n"
        "```bash\n# a comment\ntenx train --config tiny \\\n    --set 'a=#b'   # trailing\n"
        "pip install x && tenx status runs/x\ntenx lighthouse --bind 127.0.0.1:1 &     # bg\n```\n"
        "```toml\nx = 1\n```\n  ```console\n  $ echo a\n  a\n  ```\n",
        encoding="utf-8",
    )
    blocks = parse_blocks(md)
    assert [(b.lang, b.line) for b in blocks] == [("shell", 7), ("console", 17)]
    cmds = shell_commands(blocks[0])
    assert [(c.line, c.text, c.background, c.parts) for c in cmds] == [
        (9, "tenx train --config tiny --set 'a=#b'", False, ["tenx train --config tiny --set 'a=#b'"]),
        (11, "pip install x && tenx status runs/x", False, ["pip install x", "tenx status runs/x"]),
        (12, "tenx lighthouse --bind 127.0.0.1:1", True, ["tenx lighthouse --bind 127.0.0.1:1"]),
    ]
    assert parse_directives(blocks[0]) == ([("tenx train", "--set train.steps=2")], ["echo hi"])
    assert [c.text for c in shell_commands(blocks[1])] == ["echo a"]
    assert strip_comment('echo "a \\" # b" \\# c # d') == 'echo "a \\" # b" \\# c'
    assert starts_with("X=1 torchrun --nproc_per_node 2 -m tenx train --config q", "tenx train --config q")
    assert with_appends("tenx quickstart", []) == "tenx quickstart --steps 4"
