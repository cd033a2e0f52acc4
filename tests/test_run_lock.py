"""One writer per run directory (tenx.utils.lock): a second `tenx train` (or ladder, or supervisor) on a run
another process is writing is refused at once, naming that process, before it writes anything; the ladder
never deletes files it did not write."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tenx.errors import TenxError
from tenx.rundir import RunDir, written_by_tenx
from tenx.scaling.ladder.runner import LadderConfig, plan_ladder, run_one
from tenx.train.run import train
from tenx.utils.lock import HOLDER_ENV, exclusive_writer, holder_environment

HOLD = """
import sys, time
from tenx.utils.lock import exclusive_writer
with exclusive_writer(sys.argv[1], "run directory"):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of run directory tmp_path/run."""
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(RunDir(run).writer_lock)], stdout=subprocess.PIPE, env=env
    )
    assert child.stdout is not None and child.stdout.readline().strip() == b"held"
    yield run, child
    child.kill()
    child.wait()


def test_a_second_writer_is_refused_naming_the_first_and_writes_nothing(holder, tiny_config, tiny_data):
    run, child = holder
    cfg = tiny_config(tiny_data, "train.steps=3", "checkpoint.every=0", "train.eval_every=0")
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(TenxError, match=f"being written by process {child.pid} on ") as caught:
        train(cfg, run)
    assert "Wait for it to finish or stop it" in str(caught.value)
    assert sorted(p.name for p in run.iterdir()) == before == ["writer.lock"]
    child.kill()
    child.wait()  # the kernel drops a dead holder's lock: no stale lock blocks the next run
    _, metrics = train(cfg, run)
    assert metrics["step"] == 3


def test_the_cli_refuses_with_one_error_line(holder, tiny_data, capsys):
    from tenx.cli import main

    run, child = holder
    args = ["train", "--config", "tiny", "--run-dir", str(run), "--set", f'data.dir="{tiny_data}"']
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"process {child.pid}" in err and "Traceback" not in err
    assert main([*args, "--supervise", "--max-restarts", "0"]) == 2  # the supervisor takes the lock too
    assert f"process {child.pid}" in capsys.readouterr().err
    assert not RunDir(run).events.exists()


def test_the_lock_nests_in_one_process_and_passes_to_the_holders_children(tmp_path, monkeypatch):
    lock = tmp_path / "writer.lock"
    with exclusive_writer(lock, "run directory"):
        with exclusive_writer(lock, "run directory"):  # the ladder holds it around train()
            pass
        env = {
            **os.environ,
            **holder_environment(lock),
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        }
        probe = "import sys; from tenx.utils.lock import exclusive_writer\nwith exclusive_writer(sys.argv[1], 'x'): print('in')"
        granted = subprocess.run(
            [sys.executable, "-c", probe, str(lock)], env=env, capture_output=True, text=True
        )
        assert granted.returncode == 0 and granted.stdout == "in\n", granted.stderr
        env.pop(HOLDER_ENV)
        refused = subprocess.run(
            [sys.executable, "-c", probe, str(lock)], env=env, capture_output=True, text=True
        )
        assert refused.returncode != 0 and f"process {os.getpid()}" in refused.stderr
        # a forged grant naming another holder does not let a process through
        env[HOLDER_ENV] = f"{os.getpid() + 1}:{lock.resolve()}"
        forged = subprocess.run(
            [sys.executable, "-c", probe, str(lock)], env=env, capture_output=True, text=True
        )
        assert forged.returncode != 0
    with exclusive_writer(lock, "run directory"):  # released
        pass


def test_the_ladder_never_deletes_files_it_did_not_write(tiny_config, tiny_data, tmp_path):
    base = tiny_config(tiny_data, "train.micro_batch=8", "train.threads=1")
    lc = LadderConfig(budgets=[2e10], grid="ratio", max_depth=1, min_steps=5, eval_bytes=2000)
    run = plan_ladder(base, lc)[0]
    run_dir = tmp_path / "lad" / "runs" / run.name
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("my notes")
    with pytest.raises(TenxError, match=r"holds files tenx did not write \(notes.txt\)"):
        run_one(run, tmp_path / "lad", lc)
    assert (run_dir / "notes.txt").read_text() == "my notes"
    # what a run that stopped before its first checkpoint left (tenx's files only) is cleared and retrained
    (run_dir / "notes.txt").unlink()
    for name in ("metrics.jsonl", "events.jsonl", ".metrics.jsonl.abc.tmp", "stacks-pid12.txt"):
        (run_dir / name).write_text("{}\n")
    (run_dir / "tensorboard").mkdir()
    row = run_one(dataclasses.replace(run), tmp_path / "lad", lc)
    assert row["heldout_loss"] < 6 and not (run_dir / "stacks-pid12.txt").exists()


def test_written_by_tenx_names_only_tenxs_entries():
    for name in (
        "config.toml",
        "metrics.jsonl",
        "incidents.db-wal",
        "stacks-pid7.txt",
        ".eval.json.x.tmp",
        "writer.lock",
        ".tenx-write-check.abc",
        "checkpoints",
    ):
        assert written_by_tenx(name), name
    for name in ("notes.txt", ".bashrc", "metrics.jsonl.bak", ".git", "my-checkpoints"):
        assert not written_by_tenx(name), name
