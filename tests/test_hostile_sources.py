"""A directory source with hostile entries: `data prepare` reads only regular files inside the source, says
how many of each kind it skipped, and never blocks on a FIFO or reads through a link that leaves it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tenx.data.loader import TokenStream
from tenx.data.manifest import SPLITS
from tenx.data.prepare import sources
from tenx.data.prepare.sources import iter_documents

SECRET = b"SECRET-PASSWD-LINE root:x:0:0"


def _all_bytes(data_dir: Path) -> bytes:
    """Every token of every split of a byte-tokenized data directory, as bytes."""
    out = []
    for split in SPLITS:
        stream = TokenStream(data_dir, split, verify=True)
        tokens = stream.read(0, len(stream))
        out.append(tokens[tokens < 256].astype(np.uint8).tobytes())
    return b"".join(out)


@pytest.fixture
def hostile_source(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_bytes(SECRET)
    (outside / "lib.py").write_bytes(b"# " + SECRET)
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    for i in range(6):
        (src / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}  # module {i}\n" * 20)
    (src / "zz.py").symlink_to(outside / "passwd")  # a file link leaving the source
    (src / "ext").symlink_to(outside, target_is_directory=True)  # a directory link leaving it
    (src / "inside.py").symlink_to(src / "pkg" / "m0.py")  # a link inside: read
    (src / "broken.py").symlink_to(tmp_path / "nowhere")
    (src / "loop.py").symlink_to(src / "loop.py")
    os.mkfifo(src / "fifo.py")  # opening it would block until a writer came
    (src / "new\nline.py").write_text("print('a name with a newline')\n")
    return src


def test_prepare_skips_what_leaves_the_source_and_says_so(hostile_source, tmp_path):
    out = tmp_path / "data"
    argv = ["data", "prepare", "--source", str(hostile_source), "--out", str(out), "--tokenizer", "bytes"]
    argv += ["--pattern", "**/*.py", "--pattern", "ext/*.py", "--pattern", "*.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # in a child with a timeout: the FIFO would block the old code forever
    done = subprocess.run(
        [sys.executable, "-m", "tenx", *argv], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "skipped 2 symbolic link(s) leading outside the source" in done.stderr  # zz.py, ext/lib.py
    assert "skipped 2 broken or looping symbolic link(s)" in done.stderr
    assert "skipped 1 special file(s) (FIFOs, devices, sockets)" in done.stderr
    data = _all_bytes(out)
    assert SECRET not in data
    assert b"a name with a newline" in data and b"module 5" in data


def test_unreadable_files_are_skipped_and_counted(hostile_source, monkeypatch, capsys):
    unreadable = hostile_source / "pkg" / "m1.py"
    real_access = os.access
    monkeypatch.setattr(
        sources.os, "access", lambda p, mode: False if Path(p) == unreadable else real_access(p, mode)
    )
    ids = [doc.id for doc in iter_documents(str(hostile_source), patterns=["**/*.py"])]
    assert "pkg/m1.py" not in ids and "pkg/m2.py" in ids and "inside.py" in ids
    assert "zz.py" not in ids and "fifo.py" not in ids
    assert "skipped 1 unreadable file(s)" in capsys.readouterr().err


def test_a_file_that_fails_to_read_is_named(hostile_source, monkeypatch):
    from tenx.errors import DataError

    target = hostile_source / "pkg" / "m3.py"
    real = Path.read_bytes

    def failing(self):
        if self == target:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", failing)
    with pytest.raises(DataError, match=r"cannot read source file .*m3.py: Permission denied"):
        list(iter_documents(str(hostile_source), patterns=["**/*.py"]))
