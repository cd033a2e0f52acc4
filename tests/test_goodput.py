"""Goodput ledger and event log: exact accounting of synthetic runs, torn lines, and `tenx status`."""

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tenx.errors import TenxError
from tenx.monitor.events import EventLog, read_events
from tenx.monitor.goodput import (
    LEDGER_FILE,
    Ledger,
    compute_goodput,
    format_goodput,
    process_start_time,
)
from tenx.monitor.status import format_status

SUPERVISOR, A, B = 1, 10, 11


def clean_run(run_dir, skipped=()):
    """One process: starts at 100 (its `start` at 102), steps 1..10 of 1 s at 103..112, a save, end at 113."""
    with Ledger(run_dir, pid=A) as ledger:
        ledger.start(0, process_start=100.0, at=102.0)
        for i in range(1, 11):
            ledger.step(i, 1.0, skipped=i in skipped, at=102.0 + i)
        ledger.checkpoint(10, 0.5, at=112.5)
        ledger.end(10, at=113.0)


def restarted_run(run_dir):
    """Supervised: A trains 1..25 (save at 20) and is killed; B resumes at 20 and trains 21..30."""
    supervisor, a, b = Ledger(run_dir, pid=SUPERVISOR), Ledger(run_dir, pid=A), Ledger(run_dir, pid=B)
    supervisor.launch(0, at=0.0)
    a.start(0, process_start=0.5, at=2.0)
    for i in range(1, 26):
        a.step(i, 1.0, at=2.0 + i)
        if i == 20:
            a.checkpoint(20, 0.5, at=22.5)
    supervisor.exit(0, -9, "killed by SIGKILL", at=28.0)
    supervisor.launch(1, at=30.0)
    b.start(20, process_start=30.2, at=33.0)
    for i in range(21, 31):
        b.step(i, 1.0, at=13.0 + i)
    b.end(30, at=43.5)
    supervisor.exit(1, 0, "finished", at=44.0)
    for ledger in (supervisor, a, b):
        ledger.close()


def test_clean_run(tmp_path):
    clean_run(tmp_path)
    r = compute_goodput(tmp_path)
    assert r["wall_s"] == pytest.approx(13.0)  # process start 100 -> end 113
    assert r["productive_s"] == pytest.approx(10.0)
    assert r["startup_s"] == pytest.approx(2.0)
    assert r["checkpoint_s"] == pytest.approx(0.5)
    assert r["recompute_s"] == r["skipped_s"] == r["restart_s"] == 0.0
    assert r["other_s"] == pytest.approx(0.5)
    assert r["goodput"] == pytest.approx(10.0 / 13.0)
    assert (r["restarts"], r["rollbacks"], r["steps"], r["finished"]) == (0, 0, 10, True)
    assert r["mean_recovery_s"] is None
    assert r["attempts"][0]["startup_s"] == pytest.approx(2.0)
    assert r["attempts"][0]["last_step"] == 10


def test_every_record_carries_kind_time_and_pid(tmp_path):
    with Ledger(tmp_path) as ledger:
        ledger.start(0, process_start_time())
        ledger.step(1, 0.25)
    records = [json.loads(line) for line in (tmp_path / LEDGER_FILE).read_text().splitlines()]
    assert [r["kind"] for r in records] == ["start", "step"]
    assert all(r["pid"] == os.getpid() and abs(r["time"] - time.time()) < 60 for r in records)
    assert records[1] == {**records[1], "step": 1, "seconds": 0.25, "skipped": False}


def test_restart_moves_lost_steps_to_recompute(tmp_path):
    restarted_run(tmp_path)
    r = compute_goodput(tmp_path)
    assert r["wall_s"] == pytest.approx(44.0)  # first launch 0 -> last exit 44
    assert r["productive_s"] == pytest.approx(30.0)  # 1..20 from A, 21..30 from B
    assert r["recompute_s"] == pytest.approx(5.0)  # A's 21..25
    assert r["recomputed_steps"] == 5
    assert r["restart_s"] == pytest.approx(6.0)  # A's last record 27 -> B's start 33
    assert r["startup_s"] == pytest.approx(2.0)  # launch 0 -> A's start 2
    assert r["checkpoint_s"] == pytest.approx(0.5)
    assert r["other_s"] == pytest.approx(44.0 - 30 - 5 - 6 - 2 - 0.5)
    assert r["goodput"] == pytest.approx(30.0 / 44.0)
    assert (r["restarts"], r["steps"], r["finished"], r["launches"]) == (1, 30, True, 2)
    assert r["mean_recovery_s"] == pytest.approx(11.0)  # 6 s restart + 5 s recompute
    first, second = r["attempts"]
    assert (first["pid"], first["attempt"], first["returncode"], first["reason"]) == (
        A,
        0,
        -9,
        "killed by SIGKILL",
    )
    assert (first["start_step"], first["last_step"]) == (0, 25)
    assert first["startup_s"] == pytest.approx(1.5)  # OS start 0.5 -> start 2
    assert (second["pid"], second["attempt"], second["returncode"], second["start_step"]) == (B, 1, 0, 20)
    assert second["startup_s"] == pytest.approx(2.8)  # OS start 30.2 (after launch 30) -> start 33
    assert second["restart_s"] == pytest.approx(6.0) and second["recompute_s"] == pytest.approx(5.0)


def test_restart_that_dies_again_before_catching_up(tmp_path):
    """B resumes at 20 and dies at 22; C resumes at 20 again: A's 21..25 and B's 21..22 are both lost."""
    with Ledger(tmp_path, pid=A) as a:
        a.start(0, process_start=0.0, at=1.0)
        for i in range(1, 26):
            a.step(i, 1.0, at=1.0 + i)
    with Ledger(tmp_path, pid=B) as b:
        b.start(20, process_start=27.0, at=30.0)
        b.step(21, 1.0, at=31.0)
        b.step(22, 1.0, at=32.0)
    with Ledger(tmp_path, pid=12) as c:
        c.start(20, process_start=33.0, at=35.0)
        for i in range(21, 31):
            c.step(i, 1.0, at=14.0 + i)
        c.end(30, at=44.0)
    r = compute_goodput(tmp_path)
    # three separate commands: the second after the first crashed, the third after the second crashed;
    # the idle seconds between them (26 -> 27 and 32 -> 33) belong to no command
    assert r["jobs"] == 3 and r["idle_s"] == pytest.approx(2.0)
    assert r["wall_s"] == pytest.approx(44.0 - 2.0)
    assert r["productive_s"] == pytest.approx(30.0)
    assert r["recompute_s"] == pytest.approx(7.0) and r["recomputed_steps"] == 7
    assert r["restart_s"] == pytest.approx((30.0 - 27.0) + (35.0 - 33.0))  # each one's own start-up
    assert r["restarts"] == 2
    assert r["mean_recovery_s"] == pytest.approx(((3.0 + 5.0) + (2.0 + 2.0)) / 2)
    assert r["attempts"][1]["attempt"] is None and r["attempts"][1]["returncode"] is None


def test_rollback_within_a_process(tmp_path):
    """Steps 8..10 are skipped, the guard rolls back to the save at 5, and 6..10 are trained again."""
    with Ledger(tmp_path, pid=A) as ledger:
        ledger.start(0, process_start=0.0, at=1.0)
        for i in range(1, 11):
            ledger.step(i, 0.5, skipped=i >= 8, at=1.0 + i)
            if i == 5:
                ledger.checkpoint(5, 0.25, at=6.25)
        ledger.rollback(10, 5, at=11.5)
        for i in range(6, 11):
            ledger.step(i, 2.0, at=12.0 + 2 * (i - 5))
        ledger.end(10, at=22.5)
    r = compute_goodput(tmp_path)
    assert r["wall_s"] == pytest.approx(22.5)
    assert r["productive_s"] == pytest.approx(5 * 0.5 + 5 * 2.0)
    assert r["recompute_s"] == pytest.approx(2 * 0.5)  # the applied 6 and 7 of the first pass
    # the skipped 8..10 stay skipped steps, as their three `skipped-step` events say, though the rollback
    # threw them away (the ledger said 0 skipped steps while the events held 3)
    assert r["skipped_s"] == pytest.approx(3 * 0.5) and r["skipped_steps"] == 3
    assert r["recomputed_steps"] == 2
    assert r["checkpoint_s"] == pytest.approx(0.25) and r["startup_s"] == pytest.approx(1.0)
    assert r["other_s"] == pytest.approx(22.5 - 12.5 - 2.5 - 0.25 - 1.0)
    assert (r["rollbacks"], r["restarts"], r["steps"], r["finished"]) == (1, 0, 10, True)
    assert r["mean_recovery_s"] is None


def test_skipped_steps_in_the_final_history(tmp_path):
    clean_run(tmp_path, skipped={3, 7})
    r = compute_goodput(tmp_path)
    assert r["productive_s"] == pytest.approx(8.0)
    assert r["skipped_s"] == pytest.approx(2.0) and r["skipped_steps"] == 2
    assert r["recompute_s"] == 0.0
    assert r["goodput"] == pytest.approx(8.0 / 13.0)


def test_torn_last_line_is_ignored_and_the_next_writer_starts_a_new_line(tmp_path):
    clean_run(tmp_path)
    expected = compute_goodput(tmp_path)
    with open(tmp_path / LEDGER_FILE, "a") as f:
        f.write('{"kind": "step", "time": 113.5, "pi')
    assert compute_goodput(tmp_path) == expected
    with Ledger(tmp_path, pid=B) as ledger:
        ledger.start(10, process_start=114.0, at=115.0)
    r = compute_goodput(tmp_path)
    assert r["records"] == expected["records"] + 1
    # B continues a finished run in a command of its own: its start-up, not a restart; 113 -> 114 is idle
    assert r["restarts"] == 0 and r["startup_s"] == pytest.approx(2.0 + 1.0)
    assert r["idle_s"] == pytest.approx(1.0) and r["wall_s"] == pytest.approx(13.0 + 1.0)
    assert r["finished"] is False  # the newest process has not ended


def test_lost_start_record_still_counts_the_process(tmp_path):
    """A start line lost to a torn write: the process's steps still land in the history."""
    clean_run(tmp_path)
    with open(tmp_path / LEDGER_FILE, "a") as f:
        f.write('{"kind": "start", "ti\n')
    with Ledger(tmp_path, pid=B) as ledger:
        ledger.step(11, 1.0, at=120.0)
    r = compute_goodput(tmp_path)
    assert r["steps"] == 11 and r["jobs"] == 2
    assert r["productive_s"] == pytest.approx(11.0)
    assert r["idle_s"] == pytest.approx(120.0 - 113.0)  # B's start (and its time) are unknown


def test_idle_time_between_separate_commands_is_not_counted(tmp_path):
    """A finished run, resumed by hand a day later for 10 more steps: goodput stays what the two commands
    achieved (it fell from 49% to 1% when the gap counted as restart time)."""
    clean_run(tmp_path)  # 100 -> 113
    day = 86400.0
    with Ledger(tmp_path, pid=B) as b:
        b.start(10, process_start=113.0 + day, at=115.0 + day)
        for i in range(11, 21):
            b.step(i, 1.0, at=115.0 + day + i - 10)
        b.end(20, at=126.0 + day)
    r = compute_goodput(tmp_path)
    assert r["jobs"] == 2 and r["idle_s"] == pytest.approx(day)
    assert r["wall_s"] == pytest.approx(13.0 + 13.0)
    assert r["productive_s"] == pytest.approx(20.0) and r["goodput"] == pytest.approx(20.0 / 26.0)
    assert r["restarts"] == 0 and r["restart_s"] == 0.0 and r["startup_s"] == pytest.approx(2.0 + 2.0)

    # two supervised commands: restarts inside each count, the night between them does not
    run = tmp_path / "supervised"
    restarted_run(run)  # supervisor 1: 0 -> 44, one restart
    later = Ledger(run, pid=SUPERVISOR + 100)
    c = Ledger(run, pid=12)
    later.launch(0, at=44.0 + day)
    c.start(30, process_start=44.5 + day, at=46.0 + day)
    c.end(30, at=47.0 + day)
    later.exit(0, 0, "finished", at=47.5 + day)
    later.close(), c.close()
    r = compute_goodput(run)
    assert r["jobs"] == 2 and r["idle_s"] == pytest.approx(day)
    assert r["wall_s"] == pytest.approx(44.0 + 3.5)
    assert r["restarts"] == 1 and r["restart_s"] == pytest.approx(6.0)
    assert r["startup_s"] == pytest.approx(2.0 + 2.0)


@pytest.mark.parametrize("content", [None, "", "\n", "not json\n"])
def test_missing_or_empty_ledger(tmp_path, content):
    if content is not None:
        (tmp_path / LEDGER_FILE).write_text(content)
    r = compute_goodput(tmp_path)
    assert (r["records"], r["wall_s"], r["goodput"], r["steps"], r["attempts"]) == (0, 0.0, 0.0, 0, [])
    assert "no ledger records" in format_goodput(r)


def test_format_goodput_lists_every_category(tmp_path):
    restarted_run(tmp_path)
    text = format_goodput(compute_goodput(tmp_path))
    assert text.splitlines()[0].startswith(
        f"goodput     {100 * 30 / 44:.1f}% of 44.0 s wall (finished at step 30)"
    )
    for name, seconds in [("productive", 30.0), ("restarts", 6.0), ("recompute", 5.0), ("checkpoint", 0.5)]:
        line = next(line for line in text.splitlines() if line.strip().startswith(name))
        assert f"{seconds:,.1f} s" in line and f"{100 * seconds / 44:.1f}%" in line
    assert "restarts 1 | rollbacks 0 | mean recovery per restart 11.0 s" in text


def test_process_start_time_is_when_the_interpreter_started():
    code = (
        "import time; t = time.time(); from tenx.monitor.goodput import process_start_time; "
        "print(t - process_start_time())"
    )
    lag = float(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    assert -0.05 <= lag < 10.0


def test_format_status_on_an_empty_run_dir(tmp_path):
    text = format_status(tmp_path)
    assert f"run         {tmp_path}" in text
    assert "no steps trained yet" in text
    assert "checkpoint  none saved yet" in text
    assert "metrics     none yet" in text
    assert "no ledger records" in text
    assert "events      none" in text


def test_format_status_on_a_missing_run_dir(tmp_path):
    with pytest.raises(TenxError, match="does not exist"):
        format_status(tmp_path / "nope")


def test_format_status_of_a_run(tmp_path):
    restarted_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"total_steps": 60}))
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 29, "loss": 3.5, "val_loss": 3.75}) + "\n")
        f.write(json.dumps({"step": 30, "loss": 3.25}) + "\n")
    (tmp_path / "checkpoints" / "step_00000020").mkdir(parents=True)  # no manifest: does not verify
    events = EventLog(tmp_path)
    for i in range(6):
        events.emit("fault" if i % 2 else "restart", i, note=f"n{i}")
    text = format_status(tmp_path)
    assert "progress    step 30 of 60 (50.0%), finished" in text
    assert "checkpoint  none verifies" in text and "not verifying:" in text and "step_00000020" in text
    assert "metrics     step 30 | loss 3.2500 | val_loss 3.7500 (step 29)" in text
    assert f"goodput     {100 * 30 / 44:.1f}%" in text
    assert "events      fault 3, restart 3" in text
    event_lines = [line for line in text.splitlines() if "note=n" in line]
    assert [line.split("note=")[1] for line in event_lines] == ["n1", "n2", "n3", "n4", "n5"]


def _strict(text):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def test_event_round_trip(tmp_path):
    log = EventLog(tmp_path)
    written = log.emit("fault", 20, fault="kill@20", attempt=np.int64(2))
    log.emit("rollback", None, to_step=10)
    events = read_events(tmp_path)
    assert events[0] == written
    assert [(e["kind"], e["step"]) for e in events] == [("fault", 20), ("rollback", None)]
    assert events[0]["attempt"] == 2 and events[1]["to_step"] == 10
    assert all(e["pid"] == os.getpid() and isinstance(e["time"], float) for e in events)


def test_event_non_finite_and_numpy_values_stay_strict_json(tmp_path):
    EventLog(tmp_path).emit(
        "skipped-step",
        5,
        loss=float("nan"),
        grad_norm=np.float32("inf"),
        low=-math.inf,
        norms=np.array([1.5, np.nan]),
        nested={"x": (np.float64(2.5), float("-inf"))},
    )
    (event,) = _strict((tmp_path / "events.jsonl").read_text())
    assert (event["loss"], event["grad_norm"], event["low"]) == ("nan", "inf", "-inf")
    assert event["norms"] == [1.5, "nan"] and event["nested"] == {"x": [2.5, "-inf"]}


def test_event_torn_line(tmp_path):
    log = EventLog(tmp_path)
    log.emit("fault", 1)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"time": 1.0, "kind": "fau')
    assert [e["step"] for e in read_events(tmp_path)] == [1]
    log.emit("restart", 2)
    assert [e["kind"] for e in read_events(tmp_path)] == ["fault", "restart"]
    assert read_events(tmp_path / "missing") == []


def test_malformed_records_are_skipped(tmp_path):
    clean_run(tmp_path)
    expected = compute_goodput(tmp_path)
    with open(tmp_path / LEDGER_FILE, "a") as f:
        f.write(json.dumps({"kind": "step", "time": 113.5, "pid": A, "step": "eleven"}) + "\n")
        f.write(json.dumps({"kind": "rollback", "time": 113.6, "pid": A}) + "\n")
        f.write(json.dumps({"time": 113.7, "pid": A}) + "\n")
        f.write("[1, 2]\n")
    assert compute_goodput(tmp_path) == expected


def test_runs_trained_one_after_another_in_one_process_each_start_at_their_own_start(tmp_path, monkeypatch):
    """`tenx ladder` trains its runs in one process: each run's start-up runs from its own start
    (mark_run_start), not from the process's, which charged it every earlier run (3.4 s growing to 190.5 s)."""
    from tenx.monitor import goodput

    monkeypatch.setattr(goodput, "_run_start", None)
    assert goodput.run_start_time() == pytest.approx(process_start_time(), abs=0.05)
    t = time.time()
    for i, name in enumerate("abc"):  # three runs of 10 s each, one after another
        began = goodput.mark_run_start(at=t + 10 * i)
        assert goodput.run_start_time() == began
        with Ledger(tmp_path / name, pid=A) as ledger:
            ledger.start(0, goodput.run_start_time(), at=began + 2.0)
            for step in range(1, 8):
                ledger.step(step, 1.0, at=began + 2.0 + step)
            ledger.end(7, at=began + 10.0)
    for name in "abc":
        report = compute_goodput(tmp_path / name)
        assert report["startup_s"] == pytest.approx(2.0) and report["wall_s"] == pytest.approx(10.0)
        assert report["goodput"] == pytest.approx(0.7)
