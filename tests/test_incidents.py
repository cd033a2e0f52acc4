"""The incident store: events.jsonl -> incidents.db, idempotent ingest, attempts, triage, `tenx incidents`."""

import json
import sqlite3

import pytest

from tenx.cli import main
from tenx.errors import TenxError
from tenx.monitor.events import EventLog
from tenx.monitor.goodput import Ledger
from tenx.rundir import RunDir
from tenx.triage.incident_store import IncidentStore, format_incidents, list_incidents
from tenx.utils.io import bytes_xxhash

CRASH = {
    "rank": 1,
    "host": "node-3",
    "exception": "RuntimeError",
    "message": "CUDA error: an illegal memory access\nwas encountered",
    "frames": [
        "tenx/model/gpt.py:88 in forward",
        "tenx/train/trainer.py:170 in step",
        "a.py:1 in f",
        "b:2 in g",
    ],
    "traceback": "Traceback ...",
    "data": [{"window": 12, "shard": "train-00003.bin", "offset": 4096}],
    "position": [1000, 1100],
}


def emit(run_dir, kind, step=None, at=None, **fields):
    """One event, with its time set to `at` (EventLog stamps the wall clock)."""
    log = EventLog(run_dir)
    record = log.emit(kind, step, **fields)
    if at is not None:  # rewrite the line just written with the wanted time
        lines = log.path.read_text().splitlines()
        lines[-1] = json.dumps({**record, "time": at})
        log.path.write_text("\n".join(lines) + "\n")
    return record


def incidents(run_dir):
    with IncidentStore(run_dir) as store:
        store.ingest()
        return store.incidents()


def test_each_event_kind_maps_to_its_incident_kind(tmp_path):
    emit(tmp_path, "crash", 7, **CRASH)
    for reason in ("nonfinite-loss", "nonfinite-grad", "loss-spike", "grad-norm-spike"):
        emit(
            tmp_path,
            "skipped-step",
            8,
            reason=reason,
            loss=float("nan"),
            grad_norm=3.0,
            threshold=2.5,
            rank=0,
        )
    emit(tmp_path, "hang", 9, waited_s=300.0, stacks="x.txt")
    emit(
        tmp_path,
        "replica-mismatch",
        10,
        check="params",
        scope="dp",
        ranks=[2],
        message="rank 2 differs",
        reporter=0,
    )
    emit(tmp_path, "corrupt-shard", 11, shard="s.bin", message="bad checksum", action="skipped")
    emit(tmp_path, "off-prediction", 12, direction="above", message="loss above the band")
    for kind in ("drift", "growth", "straggler", "throughput-drop"):
        emit(tmp_path, kind, 13, message=f"{kind} seen")
    emit(tmp_path, "stopped", 14, signal="SIGTERM", checkpoint="c")
    emit(tmp_path, "step-not-committed", 15, rank=3)
    found = incidents(tmp_path)
    assert [i.kind for i in found] == [
        "crash", "non-finite", "non-finite", "spike", "spike", "hang", "replica-mismatch", "corrupt-shard",
        "off-prediction", "trend", "trend", "trend", "trend", "signal", "not-committed",
    ]  # fmt: skip
    assert [i.id for i in found] == list(range(1, 16))
    crash = found[0]
    assert (crash.step, crash.rank, crash.host, crash.exception) == (7, 1, "node-3", "RuntimeError")
    assert crash.symptom == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert crash.frames == CRASH["frames"] and crash.data == CRASH["data"]
    assert crash.signature()["frames"] == CRASH["frames"][:3]
    assert crash.event["position"] == [1000, 1100] and crash.attempt is None and crash.verdict is None
    assert found[1].symptom == "non-finite loss (nan); update skipped"
    assert found[4].symptom == "gradient norm spike: 3 over threshold 2.5"
    assert found[6].symptom == "rank 2 differs" and found[7].symptom == "corrupt shard s.bin: bad checksum"
    assert found[13].symptom == "stopped by SIGTERM" and found[14].rank == 3


def test_faults_rollbacks_and_other_events_are_not_incidents(tmp_path):
    emit(tmp_path, "fault", 5, fault="nan-loss@5", fault_kind="nan-loss")
    for kind in ("rollback", "resume", "replica-listen", "close", "supervisor-end", "on-prediction", "novel"):
        emit(tmp_path, kind, 6)
    emit(tmp_path, "skipped-step", 5, reason="something-else")
    assert incidents(tmp_path) == []


def test_restart_folds_into_the_crash_of_its_attempt_but_a_sigkill_is_an_exit(tmp_path):
    with Ledger(tmp_path, pid=1) as ledger:
        ledger.launch(0, at=100.0)
        ledger.launch(1, at=200.0)
        ledger.launch(2, at=300.0)
    emit(tmp_path, "crash", 7, at=150.0, **CRASH)
    assert [i.kind for i in incidents(tmp_path)] == ["crash"]  # ingested before its restart is written
    emit(tmp_path, "restart", 6, at=160.0, attempt=1, returncode=1, reason="exited with status 1")
    emit(tmp_path, "fault", 30, at=250.0, fault="sigkill@30")
    emit(tmp_path, "restart", 29, at=260.0, attempt=2, returncode=-9, reason="killed by SIGKILL")
    emit(tmp_path, "hang", 40, at=350.0, waited_s=60.0)
    found = incidents(tmp_path)
    assert [(i.id, i.kind, i.attempt, i.step) for i in found] == [
        (1, "crash", 0, 7),
        (2, "exit", 1, 29),
        (3, "hang", 2, 40),
    ]
    assert found[0].evidence["exit"] == {
        "attempt": 0,
        "returncode": 1,
        "reason": "exited with status 1",
        "time": 160.0,
    }
    assert found[1].symptom == "attempt 1 ended: killed by SIGKILL (exit status -9)"
    assert found[1].evidence["exit"]["returncode"] == -9 and "exit" not in found[2].evidence


def test_attempt_is_the_last_launch_before_the_event(tmp_path):
    with Ledger(tmp_path, pid=1) as ledger:
        ledger.launch(0, at=10.0)
        ledger.launch(1, at=20.0)
    emit(tmp_path, "stopped", 1, at=5.0, signal="SIGINT")  # before any launch
    emit(tmp_path, "corrupt-shard", 2, at=15.0, shard="a")
    emit(tmp_path, "corrupt-shard", 3, at=25.0, shard="b")
    emit(tmp_path, "hang", None, at=26.0, attempt=7, detected_by="supervisor heartbeat", waited_s=9)
    assert [i.attempt for i in incidents(tmp_path)] == [None, 0, 1, 7]


def test_ingest_is_idempotent_and_incremental(tmp_path):
    RunDir(tmp_path).config.write_text("[train]\nsteps = 10\n")
    RunDir(tmp_path).provenance.write_text(
        json.dumps({"tenx_version": "0.4.0", "git_commit": "0123456789abcdef"})
    )
    emit(tmp_path, "crash", 1, **CRASH)
    emit(tmp_path, "crash", 1, **CRASH)  # the same crash twice (another rank's identical record)
    with IncidentStore(tmp_path) as store:
        assert store.ingest() == 2
        assert store.ingest() == 0
    emit(tmp_path, "hang", 2, waited_s=1.0)
    with IncidentStore(tmp_path) as store:
        assert store.ingest() == 1
        found = store.incidents()
        assert [i.id for i in found] == [1, 2, 3] and found[2].kind == "hang"
        assert [i.id for i in store.incidents(["hang", "spike"])] == [3]
    assert found[0].config_hash == bytes_xxhash(b"[train]\nsteps = 10\n")
    assert found[0].version == "0.4.0+0123456789ab"


def test_missing_or_corrupt_provenance_gives_no_version(tmp_path):
    emit(tmp_path, "hang", 2, waited_s=1.0)
    assert incidents(tmp_path)[0].version is None and incidents(tmp_path)[0].config_hash is None
    RunDir(tmp_path).provenance.write_text("{not json")
    emit(tmp_path, "hang", 3, waited_s=1.0)
    assert incidents(tmp_path)[1].version is None


def test_record_triage_round_trip_keeps_the_exit(tmp_path):
    emit(tmp_path, "crash", 7, at=150.0, **CRASH)
    emit(tmp_path, "restart", 6, at=160.0, attempt=1, returncode=1, reason="exited with status 1")
    with IncidentStore(tmp_path) as store:
        store.ingest()
        cause = {"op": "matmul", "data": [{"window": 12}]}
        store.record_triage(
            1, verdict="hardware", confidence=0.9, evidence={"replay": "differs"}, cause=cause
        )
    with IncidentStore(tmp_path) as store:
        got = store.get(1)
        with pytest.raises(TenxError, match=r"no incident 9 in .*`tenx incidents"):
            store.get(9)
    assert (got.verdict, got.confidence, got.cause) == ("hardware", 0.9, cause)
    assert got.evidence["replay"] == "differs" and got.evidence["exit"]["reason"] == "exited with status 1"


def test_list_across_runs_in_time_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    emit(a, "hang", 1, at=10.0, waited_s=1)
    emit(b, "corrupt-shard", 2, at=5.0, shard="x")
    emit(a, "stopped", 3, at=20.0, signal="SIGTERM")
    (tmp_path / "clean").mkdir()
    found = list_incidents([a, b, tmp_path / "clean"])
    assert [(i.run_dir, i.id, i.kind) for i in found] == [
        (str(b), 1, "corrupt-shard"),
        (str(a), 1, "hang"),
        (str(a), 2, "signal"),
    ]
    assert not RunDir(tmp_path / "clean").incidents_db.exists()
    table = format_incidents(found, [a, b, tmp_path / "clean"])
    assert table.splitlines()[0].split() == [
        "id",
        "run",
        "attempt",
        "step",
        "rank",
        "kind",
        "symptom",
        "verdict",
    ]
    assert table.splitlines()[1].split()[:6] == ["1", "b", "-", "2", "-", "corrupt-shard"]
    assert table.splitlines()[-1] == "3 incidents in 3 runs"
    with pytest.raises(TenxError, match="nowhere"):
        list_incidents([tmp_path / "nowhere"])


def test_a_corrupt_database_names_the_file_and_how_to_rebuild(tmp_path):
    emit(tmp_path, "hang", 1, waited_s=1)
    db = RunDir(tmp_path).incidents_db
    db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(TenxError, match=r"incidents\.db is not a tenx incident store.*delete it and run"):
        IncidentStore(tmp_path)
    db.unlink()
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE other (x)")
    with pytest.raises(TenxError, match=r"incidents\.db is not a tenx incident store"):
        list_incidents([tmp_path])
    db.unlink()
    incidents(tmp_path)
    with sqlite3.connect(db) as con:  # a trigger would run SQL of the file's own on the next ingest
        con.execute("CREATE TRIGGER t AFTER INSERT ON incidents BEGIN DELETE FROM incidents; END")
    with pytest.raises(TenxError, match=r"unexpected trigger t"):
        IncidentStore(tmp_path)


def test_a_hostile_json_column_is_an_error_not_a_traceback(tmp_path):
    emit(tmp_path, "crash", 1, **CRASH)
    emit(tmp_path, "hang", 2, waited_s=1)
    incidents(tmp_path)
    db = RunDir(tmp_path).incidents_db
    with sqlite3.connect(db) as con:
        con.execute(
            "UPDATE incidents SET frames = ? WHERE id = 1", (json.dumps([{"__class__": "os.system"}]),)
        )
        con.execute("UPDATE incidents SET event = ? WHERE id = 2", ("[" * 100_000,))
    with IncidentStore(tmp_path) as store:
        with pytest.raises(TenxError, match=r"incidents\.db: incident 1 has a malformed frames"):
            store.get(1)
        with pytest.raises(TenxError, match=r"incident 2 has a malformed event"):
            store.get(2)
    assert main(["incidents", str(tmp_path)]) == 2


def test_cli_lists_incidents_as_json(tmp_path, capsys):
    emit(tmp_path, "crash", 7, **CRASH)
    emit(tmp_path, "stopped", 9, signal="SIGTERM")
    assert main(["incidents", str(tmp_path), "--json", "--kind", "signal"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(i["id"], i["kind"], i["step"], i["symptom"]) for i in listed] == [
        (2, "signal", 9, "stopped by SIGTERM")
    ]
    assert listed[0]["run_dir"] == str(tmp_path) and listed[0]["verdict"] is None
    assert main(["incidents", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "RuntimeError: CUDA error" in out and out.strip().endswith("2 incidents in 1 run")


def test_a_clean_run_has_no_incidents(tmp_path, capsys):
    emit(tmp_path, "resume", 0)
    emit(tmp_path, "close", 10)
    assert main(["incidents", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"no incidents in {tmp_path}"


def test_triage_of_a_directory_that_is_no_run_writes_nothing_and_fails(tmp_path, capsys):
    """`tenx triage DIR --all` on a directory holding no run refuses it by name and creates no incidents.db."""
    from tenx.cli import main
    from tenx.errors import TenxError
    from tenx.triage.incident_store import IncidentStore

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine\n")
    assert main(["triage", str(notes), "--all"]) == 2
    assert "not a tenx run directory" in capsys.readouterr().err
    with pytest.raises(TenxError, match="not a tenx run directory"):
        IncidentStore(notes)
    assert sorted(p.name for p in notes.iterdir()) == ["todo.txt"]
