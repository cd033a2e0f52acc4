"""A full disk or a read-only run directory ends in one clear error that names the path and what was
kept, leaves no partial checkpoint behind, and the run continues with --resume auto once there is room.

The always-run tests make the filesystem fail through the writer's own calls; where this process may
mount a tmpfs (root on Linux), the same is also checked on a real full and a real read-only filesystem.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

import tenx.checkpoint.store as store
from tenx.cli import main
from tenx.train.config import CONFIG_DIR


def _train_argv(data: Path, run: Path, *sets: str) -> list[str]:
    base = [f'data.dir="{data}"', "log.progress=false", "train.threads=1", "train.eval_every=0", *sets]
    return ["train", "--config", str(CONFIG_DIR / "tiny.toml"), "--run-dir", str(run)] + [
        x for s in base for x in ("--set", s)
    ]


def _leftovers(run: Path) -> list[str]:
    return [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_full_disk_during_a_save_names_the_path_and_the_kept_checkpoint(
    tiny_data, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    argv = _train_argv(tiny_data, run, "train.steps=12", "checkpoint.every=4")
    real_save = store.dcp.save
    calls = []

    def save(state, storage_writer, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second save finds the disk full halfway through its files
            (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(storage_writer.path))
        return real_save(state, storage_writer=storage_writer, **kwargs)

    monkeypatch.setattr(store.dcp, "save", save)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tenx: error: saving checkpoint step 8 in ")
    assert "no space left on device" in err and ".step_00000008.tmp" in err
    assert "kept: checkpoint step 4 (newest: " in err and "--resume auto" in err
    assert "Traceback" not in err
    assert _leftovers(run) == []  # the partial files were removed

    monkeypatch.setattr(store.dcp, "save", real_save)  # space freed: the run continues from step 4
    assert main([*argv, "--resume", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert "step_00000012" in [p.name for p in (run / "checkpoints").iterdir()]


def test_a_read_only_run_directory_is_refused_before_anything_is_written(
    tiny_data, tmp_path, capsys, monkeypatch
):
    import tenx.utils.io as io

    run = tmp_path / "run"

    def mkstemp(*args, dir=None, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))

    monkeypatch.setattr(io.tempfile, "mkstemp", mkstemp)
    assert main(_train_argv(tiny_data, run, "train.steps=2")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tenx: error: cannot write the run directory {run}: read-only file system")
    assert "nothing was written" in err
    assert not run.exists()


def test_the_write_check_creates_no_folder_and_ranks_may_run_it_at_once(tmp_path):
    """Every rank checks the run directory when it starts. A check that created the folders it needed and
    removed them afterwards raced with its peers: one rank removed the folder another was probing, which
    then failed with 'No such file or directory' (seen in CI under torchrun)."""
    import threading

    from tenx.utils.storage import ensure_writable

    target = tmp_path / "runs" / "a" / "b"
    ensure_writable(target, "run directory")
    assert list(tmp_path.iterdir()) == []  # nothing created, nothing left behind

    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def rank(i: int) -> None:
        start.wait()
        try:
            for _ in range(50):
                ensure_writable(target, "run directory")
                if i == 0:
                    target.mkdir(parents=True, exist_ok=True)  # one rank goes on to write the run
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in target.iterdir()] == []  # every probe file was removed


def test_a_full_disk_elsewhere_in_the_step_is_one_clear_line(tiny_data, tmp_path, capsys, monkeypatch):
    """A metrics line that cannot be appended stops the run with the same words."""
    from tenx.train.callbacks import metrics

    run = tmp_path / "run"
    argv = _train_argv(tiny_data, run, "train.steps=6", "checkpoint.every=2")

    def fail(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run / "metrics.jsonl"))

    monkeypatch.setattr(metrics.MetricsLogger, "on_step_end", fail)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tenx: error: training {run} stopped at step ")
    assert f"no space left on device ({run / 'metrics.jsonl'})" in err and "--resume auto" in err


# ----- real filesystems (root on Linux may mount a tmpfs) -------------------------------------------
def _mount(path: Path, *options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


@pytest.fixture
def tmpfs(tmp_path):
    mounts: list[Path] = []

    def make(name: str, size: str) -> Path:
        path = tmp_path / name
        if not _mount(path, f"size={size}"):
            pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
        mounts.append(path)
        return path

    yield make
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_real_full_disk(tiny_data, tmpfs, capsys):
    disk = tmpfs("disk", "1m")
    (disk / "filler").write_bytes(b"\0" * (1024 * 1024 - 64 * 1024))  # the user's file: 64 KB remain
    run = disk / "run"
    assert main(_train_argv(tiny_data, run, "train.steps=4", "checkpoint.every=2")) == 2
    err = capsys.readouterr().err
    assert "no space left on device" in err and "Traceback" not in err
    assert (disk / "filler").stat().st_size == 1024 * 1024 - 64 * 1024  # nothing of the user's removed
    if (run / "checkpoints").exists():
        assert _leftovers(run) == []


def test_a_real_read_only_file_system(tiny_data, tmpfs, capsys):
    disk = tmpfs("ro", "1m")
    (disk / "run").mkdir()
    if subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True).returncode != 0:
        pytest.skip("cannot remount the tmpfs read-only")
    assert main(_train_argv(tiny_data, disk / "run", "train.steps=2")) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"tenx: error: cannot write the run directory {disk / 'run'}: read-only file system"
    )
