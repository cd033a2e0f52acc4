"""Issue 47, inputs round four, part A: outputs that are not regular files are written through or refused,
never replaced (item 2); `tenx fit --json` checks its output like every other command (item 1); inputs that
are not regular files are refused before they are opened (item 8); a forged thread count cannot slow decoding
down (item 9); suggested commands quote the paths in them (item 15)."""

from __future__ import annotations

import csv
import os
import re
import shlex
import socket
import stat
import time
from pathlib import Path

import pytest
import torch

from tenx.cli import main
from tenx.compress import codec as codec_mod
from tenx.compress.codec import compress_bytes, decode_threads, decompress_bytes, load_codec
from tenx.compress.container import _digest, header_bytes, read_header
from tenx.errors import DataError, TenxError
from tenx.launch.slurm import write_job_script
from tenx.utils.io import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    check_output_file,
    publish_file,
    regular_input_file,
)


@pytest.fixture(scope="module")
def run(train_tiny, tiny_data):
    """A tiny byte-level model trained two steps (what compress, decompress and eval need)."""
    return train_tiny(tiny_data, "train.steps=2")


def char_device(path: Path) -> Path:
    """A character device node at `path` (the null device's numbers: writing to it is harmless)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError as e:  # not root, or a file system without device nodes
        pytest.skip(f"mknod is not permitted here: {e}")
    return path


def is_char_device(path: Path) -> bool:
    return stat.S_ISCHR(os.lstat(path).st_mode)


def is_fifo(path: Path) -> bool:
    return stat.S_ISFIFO(os.lstat(path).st_mode)


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def error_line(capsys) -> str:
    """The one `tenx: error:` line a refused command printed."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tenx: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----- item 2: the atomic writers ------------------------------------------------------------------------


def test_writers_refuse_a_fifo_a_socket_and_a_directory_naming_the_type(tmp_path):
    pipe = fifo(tmp_path / "pipe")
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    (tmp_path / "dir").mkdir()
    cases = {pipe: "FIFO", sock_path: "socket", tmp_path / "dir": "directory"}
    try:
        for path, kind in cases.items():
            for write in (
                lambda p: atomic_write_bytes(p, b"data"),
                lambda p: atomic_write_text(p, "data"),
                lambda p: atomic_write_json(p, {"a": 1}),
            ):
                started = time.monotonic()
                with pytest.raises(TenxError, match=re.escape(f"{path} is a {kind}, not a regular file")):
                    write(path)
                assert time.monotonic() - started < 5  # a FIFO with no reader is never opened
            tmp = tmp_path / "finished.tmp"
            tmp.write_bytes(b"new")
            with pytest.raises(TenxError, match=re.escape(kind)):
                publish_file(tmp, path)
            assert tmp.read_bytes() == b"new"  # left to the caller
            tmp.unlink()
        assert is_fifo(pipe) and stat.S_ISSOCK(os.lstat(sock_path).st_mode) and (tmp_path / "dir").is_dir()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "pipe", "sock"]  # no temporary left
    finally:
        sock.close()


def test_check_output_file_names_the_flag_and_the_type(tmp_path):
    pipe = fifo(tmp_path / "pipe")
    for force in (False, True):
        with pytest.raises(TenxError, match="^" + re.escape(f"--json {pipe} is a FIFO, not a regular file")):
            check_output_file(pipe, force=force, flag="--json")
    assert is_fifo(pipe)


def test_a_block_device_is_refused_and_kept(tmp_path):
    block = tmp_path / "blk"
    try:
        os.mknod(block, stat.S_IFBLK | 0o600, os.makedev(7, 0))
    except OSError as e:
        pytest.skip(f"mknod is not permitted here: {e}")
    with pytest.raises(TenxError, match=re.escape(f"-o {block} is a block device")):
        check_output_file(block, force=True)
    with pytest.raises(TenxError, match=re.escape(f"{block} is a block device")):
        atomic_write_bytes(block, b"x")
    assert stat.S_ISBLK(os.lstat(block).st_mode)


def test_a_character_device_is_written_through_never_replaced(tmp_path):
    dev = char_device(tmp_path / "null")
    before = os.lstat(dev)
    assert check_output_file(dev) == dev  # nothing would be replaced: no --force needed
    atomic_write_bytes(dev, b"x" * 100_000)
    atomic_write_json(dev, {"a": 1})
    tmp = tmp_path / ".shard.tmp"
    tmp.write_bytes(b"y" * 5_000_000)
    publish_file(tmp, dev)
    assert not tmp.exists()
    write_job_script(dev, "#!/bin/bash")  # its 0755 is the new file's mode: a device keeps its own
    after = os.lstat(dev)
    assert is_char_device(dev) and (after.st_ino, after.st_mode, after.st_rdev) == (
        before.st_ino,
        before.st_mode,
        before.st_rdev,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]
    # a link to the device is followed: the link and the device both stay
    link = tmp_path / "link"
    link.symlink_to(dev)
    atomic_write_text(link, "through the link")
    assert link.is_symlink() and is_char_device(dev)


def test_a_job_script_is_written_executable(tmp_path):
    script = write_job_script(tmp_path / "job.sbatch", "#!/bin/bash")
    assert stat.S_IMODE(script.stat().st_mode) == 0o755 and script.read_text() == "#!/bin/bash\n"


# ----- item 2 through the commands -----------------------------------------------------------------------


def test_compress_and_decompress_write_through_a_device_and_refuse_a_fifo(run, tmp_path, capsys):
    src = tmp_path / "a.py"
    src.write_bytes(b"print('hello')\n" * 20)
    dev, pipe = char_device(tmp_path / "null"), fifo(tmp_path / "pipe")
    assert main(["compress", str(run), str(src), "-o", str(dev), "--force"]) == 0
    assert main(["compress", str(run), str(src), "-o", str(dev)]) == 0  # nothing replaced: no --force needed
    assert main(["compress", str(run), str(src), "-o", str(pipe), "--force"]) == 2
    assert f"-o {pipe} is a FIFO" in error_line(capsys)
    assert main(["compress", str(run), str(src)]) == 0
    packed = Path(f"{src}.tenx")
    assert main(["decompress", str(run), str(packed), "-o", str(dev)]) == 0
    assert main(["decompress", str(run), str(packed), "-o", str(pipe), "--force"]) == 2
    assert "FIFO" in error_line(capsys)
    assert is_char_device(dev) and is_fifo(pipe)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py", "a.py.tenx", "null", "pipe"]


def test_eval_out_writes_through_a_device_and_refuses_a_fifo(run, tmp_path, capsys):
    dev, pipe = char_device(tmp_path / "null"), fifo(tmp_path / "pipe")
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 10)
    assert main(["eval", str(run), "--split", str(text), "--out", str(pipe), "--force"]) == 2
    assert f"--out {pipe} is a FIFO" in error_line(capsys)
    assert main(["eval", str(run), "--split", str(text), "--out", str(dev)]) == 0
    assert is_char_device(dev) and is_fifo(pipe)


def test_plan_train_emit_and_fit_write_through_a_device_and_refuse_a_fifo(tmp_path, capsys):
    dev, pipe = char_device(tmp_path / "null"), fifo(tmp_path / "pipe")
    table = fit_table(tmp_path / "runs.csv")
    commands = {
        "--json": ["plan", "--config", "tiny", "--cluster", "cpu", "--json"],
        "--script": ["train", "--config", "tiny", "--run-dir", str(tmp_path / "r"), "--emit", "slurm", "-o"],
        "fit --json": ["fit", str(table), "--bootstrap", "0", "--no-plot", "--json"],
    }
    for flag, argv in commands.items():
        assert main([*argv, str(pipe), "--force"]) == 2, flag
        assert f"{flag.split()[-1]} {pipe} is a FIFO" in error_line(capsys)
        assert main([*argv, str(dev)]) == 0, flag
        capsys.readouterr()
        assert is_char_device(dev) and is_fifo(pipe)


# ----- item 1: tenx fit --json ---------------------------------------------------------------------------


def fit_table(path: Path) -> Path:
    """A run table that follows a Chinchilla law exactly (5 sizes x 3 token counts)."""
    rows = []
    for n in (1e7, 3e7, 1e8, 3e8, 1e9):
        for ratio in (10, 20, 40):
            d = ratio * n
            loss = 1.7 + 400 / n**0.34 + 410 / d**0.28
            rows.append({"params": n, "tokens": d, "heldout_loss": loss})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


FIT = ["--bootstrap", "0", "--no-plot"]


def test_fit_json_never_replaces_the_run_table(tmp_path, capsys):
    table = fit_table(tmp_path / "runs.csv")
    before = table.read_bytes()
    for force in ([], ["--force"]):
        assert main(["fit", str(table), *FIT, "--json", str(table), *force]) == 2
        assert f"--json {table} is the command's own input {table}" in error_line(capsys)
        assert table.read_bytes() == before
    # the same file under another spelling, and the ladder directory's results.jsonl
    assert main(["fit", str(table), *FIT, "--json", str(tmp_path / "." / "runs.csv"), "--force"]) == 2
    assert "own input" in error_line(capsys) and table.read_bytes() == before
    ladder = tmp_path / "ladder"
    ladder.mkdir()
    results = ladder / "results.jsonl"
    results.write_text("".join(f'{{"params": {n}, "tokens": {20 * n}, "heldout_loss": 3}}\n' for n in (1, 2)))
    kept = results.read_bytes()
    assert main(["fit", str(ladder), *FIT, "--json", str(results), "--force"]) == 2
    assert f"own input {results}" in error_line(capsys) and results.read_bytes() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ladder", "runs.csv"]


def test_fit_json_replaces_an_existing_file_only_with_force(tmp_path, capsys):
    table = fit_table(tmp_path / "runs.csv")
    mine = tmp_path / "notes.json"
    mine.write_text("my notes\n")
    assert main(["fit", str(table), *FIT, "--json", str(mine)]) == 2
    assert f"{mine} exists; pass --force to replace it, or choose another --json" in error_line(capsys)
    assert mine.read_text() == "my notes\n"
    assert main(["fit", str(table), *FIT, "--json", str(mine), "--force"]) == 0
    import json

    assert json.loads(mine.read_text())["law"] == "chinchilla"
    # the default report is the command's own: rewritten each time without --force
    default = tmp_path / "runs_fit_chinchilla.json"
    for _ in range(2):
        assert main(["fit", str(table), *FIT]) == 0
        assert json.loads(default.read_text())["input"] == str(table)


# ----- item 8: inputs that are not regular files ---------------------------------------------------------


def test_regular_input_file_names_the_type_without_opening(tmp_path):
    pipe = fifo(tmp_path / "pipe.txt")
    link = tmp_path / "zero.txt"
    link.symlink_to("/dev/zero")
    started = time.monotonic()
    with pytest.raises(DataError, match="^" + re.escape(f"the input {pipe} is a FIFO, not a regular file")):
        regular_input_file(pipe)
    with pytest.raises(DataError, match="^" + re.escape(f"the data source {link} is a character device")):
        regular_input_file(link, "data source")
    with pytest.raises(DataError, match=re.escape(f"the input {tmp_path} is a directory")):
        regular_input_file(tmp_path)
    with pytest.raises(
        DataError, match=re.escape(f"cannot read the input {tmp_path / 'missing'}: No such file")
    ):
        regular_input_file(tmp_path / "missing")
    assert time.monotonic() - started < 5
    good = tmp_path / "good.txt"
    good.write_text("x")
    assert regular_input_file(good) == good


def test_compress_decompress_and_eval_refuse_a_fifo_and_dev_zero(run, tmp_path, capsys):
    pipe = fifo(tmp_path / "pipe.txt")
    packed = fifo(tmp_path / "pipe.tenx")
    out = tmp_path / "out"
    started = time.monotonic()
    assert main(["compress", str(run), str(pipe), "-o", str(out)]) == 2
    assert f"the input {pipe} is a FIFO, not a regular file" in error_line(capsys)
    assert main(["compress", str(run), "/dev/zero", "-o", str(out)]) == 2
    assert "the input /dev/zero is a character device, not a regular file" in error_line(capsys)
    assert main(["decompress", str(run), str(packed), "-o", str(out)]) == 2
    assert f"the input {packed} is a FIFO" in error_line(capsys)
    assert main(["eval", str(run), "--split", str(pipe), "--out", str(out)]) == 2
    assert f"the data source {pipe} is a FIFO" in error_line(capsys)
    zero = tmp_path / "zero.txt"
    zero.symlink_to("/dev/zero")
    assert main(["eval", str(run), "--split", str(zero), "--out", str(out)]) == 2
    assert f"the data source {zero} is a character device" in error_line(capsys)
    assert main(["fit", str(pipe), *FIT, "--json", str(out)]) == 2
    assert f"the run table {pipe} is a FIFO" in error_line(capsys)
    assert time.monotonic() - started < 60  # each refused before anything opened the input
    assert not out.exists() and is_fifo(pipe) and is_fifo(packed)


# ----- item 9: the thread count of a .tenx header --------------------------------------------------------


def forge_threads(blob: bytes, threads: int) -> bytes:
    """`blob` with its header's threads byte set and the header checksum recomputed (what a forger does)."""
    size = header_bytes(blob[4])
    head = bytearray(blob[: size - 8])
    head[5] = threads  # magic (4 bytes), version, then threads
    return bytes(head) + _digest(bytes(head)) + blob[size:]


def test_a_forged_thread_count_only_caps_decoding_at_the_usable_cpus(run, monkeypatch):
    codec = load_codec(run)
    data = b"def forged(x):\n    return x * 2\n" * 8
    forged = forge_threads(compress_bytes(codec, data), 255)
    assert read_header(forged).threads == 255
    monkeypatch.setattr(codec_mod, "usable_cpu_count", lambda: 2)
    assert decode_threads(read_header(forged), "f.tenx") == 2
    asked: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (asked.append(n), real(n))[1])
    assert decompress_bytes(codec, forged, name="f.tenx") == data
    assert max(asked) == 2  # never 255 threads on 2 CPUs
    # a file written with fewer threads than the CPUs decodes on its own count
    one = compress_bytes(codec, data, threads=1)
    assert decode_threads(read_header(one), "one.tenx") == 1


def test_a_format1_file_asking_for_more_threads_than_cpus_is_refused(run, monkeypatch):
    codec = load_codec(run)
    data = b"x = 1\n" * 10
    blob = compress_bytes(codec, data, version=1)
    monkeypatch.setattr(codec_mod, "usable_cpu_count", lambda: 2)
    assert decompress_bytes(codec, blob, name="v1.tenx") == data
    forged = forge_threads(blob, 255)
    with pytest.raises(TenxError, match="^v1.tenx: its header's threads field asks for 255 torch threads"):
        decompress_bytes(codec, forged, name="v1.tenx")
    with pytest.raises(TenxError, match=r"--threads must be 1\.\.255, got 256"):
        compress_bytes(codec, data, threads=256)


def test_decompress_of_a_forged_thread_count_ends_within_seconds(run, tmp_path, monkeypatch, capsys):
    src = tmp_path / "a.py"
    src.write_bytes(b"import os\nprint(os.getcwd())\n" * 4)
    assert main(["compress", str(run), str(src)]) == 0
    packed = Path(f"{src}.tenx")
    packed.write_bytes(forge_threads(packed.read_bytes(), 255))
    asked: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (asked.append(n), real(n))[1])
    assert main(["decompress", str(run), str(packed), "-o", str(tmp_path / "b.py")]) == 0
    assert (tmp_path / "b.py").read_bytes() == src.read_bytes()
    assert 255 not in asked and max(asked) <= os.cpu_count()


# ----- item 15: suggested commands quote the paths in them -----------------------------------------------


def test_a_suggested_command_quotes_the_whole_path(tmp_path, capsys):
    hostile = tmp_path / "my ladder $(touch PWNED)"
    hostile.mkdir()
    assert main(["predict", "--from", str(hostile), "--config", "tiny"]) == 2
    line = error_line(capsys)
    assert f"run `tenx ladder --out {shlex.quote(str(hostile))}` first" in line
    assert shlex.split(line.split("run `")[1].split("`")[0]) == ["tenx", "ladder", "--out", str(hostile)]


def test_data_suggestions_quote_the_whole_path(tiny_data, tmp_path):
    import shutil

    from tenx.data.manifest import read_manifest
    from tenx.data.ngrams import load_index

    hostile = tmp_path / "d $(touch PWNED)"
    hostile.mkdir()
    with pytest.raises(DataError) as missing:
        read_manifest(hostile)
    assert f"run `tenx data prepare --source ... --out {shlex.quote(str(hostile))}` first" in str(
        missing.value
    )
    data = tmp_path / "data `x` $(touch PWNED)"
    shutil.copytree(tiny_data, data)
    with pytest.raises(DataError) as stale:
        load_index(data, n=7)
    assert f"`tenx data index {shlex.quote(str(data))} --n 7` rebuilds it" in str(stale.value)
    assert not list(tmp_path.rglob("PWNED"))


def test_errors_name_the_whole_path(tmp_path, capsys):
    run_dir = tmp_path / "my run"
    assert main(["train", "--config", "tiny", "--run-dir", str(run_dir), "--emit", "slurm"]) == 2
    assert f"--run-dir {str(run_dir)!r} cannot go into a #SBATCH line" in error_line(capsys)
    long_name = "c" * 300
    assert main(["train", "--config", long_name]) == 2
    assert f"config {long_name!r}: cannot be used as a path (File name too long)" in error_line(capsys)
    split = str(tmp_path / ("s" * 300)) + ".txt"
    with pytest.raises(SystemExit) as exited:
        main(["eval", str(tmp_path), "--split", split])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"{split!r} cannot be used as a path (File name too long)" in err and "Traceback" not in err


def test_the_submit_command_quotes_the_script(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script = "it's $(touch PWNED).sbatch"
    argv = ["train", "--config", "tiny", "--run-dir", str(tmp_path / "r1"), "--emit", "slurm", "-o", script]
    assert main(argv) == 0
    said = capsys.readouterr().out
    command = said.split("submit it with `")[1].split("`;")[0]
    assert shlex.split(command) == ["sbatch", script] and not list(tmp_path.rglob("PWNED"))


def test_derisk_and_incident_suggestions_quote_the_run_path(tmp_path):
    from tenx.scaling.derisk.compute_multiplier import read_result
    from tenx.triage.incident_store import IncidentStore

    hostile = tmp_path / "study $(touch PWNED) `x`"
    hostile.mkdir()
    with pytest.raises(TenxError) as missing:
        read_result(hostile)
    assert f"run `tenx derisk ... --out {shlex.quote(str(hostile))}` first" in str(missing.value)
    (hostile / "events.jsonl").write_text("")
    with IncidentStore(hostile) as store, pytest.raises(TenxError) as absent:
        store.get(7)
    said = str(absent.value).split("; `", 1)[1].removesuffix("` lists them")
    assert shlex.split(said) == ["tenx", "incidents", str(hostile)]
    assert not list(tmp_path.rglob("PWNED"))
