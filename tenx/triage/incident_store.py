"""The incident store: every anomaly of a run as one incident in RUN_DIR/incidents.db (SQLite).

It is derived from RUN_DIR/events.jsonl, the source of truth (fsynced, written by any number of processes):
`ingest` adds an incident for each anomalous event not yet seen, so running it twice adds nothing. Only what
triage finds (verdict, confidence, evidence, cause) is kept nowhere else.

Events become incidents of these kinds (`_EVENT_KINDS`): crash; skipped-step -> non-finite or spike (by
reason); loss-rise (the guard saw the loss's level climb to a multiple of its lowest); hang, replica-mismatch, corrupt-shard, off-prediction; drift, growth, straggler, throughput-drop ->
trend; stopped -> signal; step-not-committed -> not-committed; a supervisor restart -> exit, but only when
the attempt that ended left no crash and no hang of its own (a SIGKILL): otherwise how it ended is kept as
evidence["exit"] of those. No other event is an incident: the drills' `fault` records are ground truth,
never evidence.

An event's attempt is the supervisor's last `launch` in the ledger before it (None when unsupervised).
The database is read with plain parameterized SELECTs; every stored value is type-checked on the way out,
so a damaged or hostile file is reported (TenxError), never trusted.
"""

from __future__ import annotations

import json
import shlex
import sqlite3
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenx.errors import TenxError
from tenx.monitor.events import read_events
from tenx.monitor.goodput import read_ledger
from tenx.rundir import RunDir
from tenx.utils.io import bytes_xxhash, json_line

SCHEMA_VERSION = 1
# fmt: off
_EVENT_KINDS = {
    "crash": "crash", "hang": "hang", "replica-mismatch": "replica-mismatch", "corrupt-shard": "corrupt-shard",
    "off-prediction": "off-prediction", "drift": "trend", "growth": "trend", "straggler": "trend",
    "throughput-drop": "trend", "stopped": "signal", "step-not-committed": "not-committed", "restart": "exit",
    "loss-rise": "loss-rise",
}
_SKIP_REASONS = {  # skipped-step events, by reason
    "nonfinite-loss": "non-finite", "nonfinite-grad": "non-finite", "loss-spike": "spike",
    "grad-norm-spike": "spike",
}
# fmt: on
KINDS = tuple(dict.fromkeys([*_EVENT_KINDS.values(), *_SKIP_REASONS.values()]))
"""Every kind of incident (`tenx incidents --kind`)."""

# fmt: off
_COLUMNS = {  # name -> SQL type
    "id": "INTEGER PRIMARY KEY", "kind": "TEXT NOT NULL", "symptom": "TEXT NOT NULL", "step": "INTEGER",
    "rank": "INTEGER", "host": "TEXT", "pid": "INTEGER", "attempt": "INTEGER", "time": "REAL NOT NULL",
    "exception": "TEXT", "message": "TEXT", "frames": "TEXT NOT NULL", "data": "TEXT NOT NULL",
    "config_hash": "TEXT", "version": "TEXT", "event": "TEXT NOT NULL", "verdict": "TEXT",
    "confidence": "REAL", "evidence": "TEXT NOT NULL", "cause": "TEXT",
}
# fmt: on
_JSON = {"frames": list, "data": list, "event": dict, "evidence": dict, "cause": dict}  # JSON in TEXT
_PYTHON = {"INTEGER": (int,), "TEXT": (str,), "REAL": (float, int)}
_ITEMS = {"frames": str, "data": dict}  # what the lists hold
# "ingested": each event that made or changed an incident, which ingest skips
_SCHEMA = {"incidents": tuple(_COLUMNS), "ingested": ("key", "incident")}
_OBJECTS = {("table", "incidents"), ("table", "ingested"), ("index", "sqlite_autoindex_ingested_1")}
_MALFORMED = object()  # a JSON column that does not parse
_DDL = (
    "CREATE TABLE incidents (" + ", ".join(f"{n} {t}" for n, t in _COLUMNS.items()) + ")",
    "CREATE TABLE ingested (key TEXT NOT NULL, incident INTEGER NOT NULL, PRIMARY KEY (key, incident))",
)


@dataclass
class Incident:
    """One anomaly of a run: what happened, where, on which data, and what triage made of it."""

    id: int
    run_dir: str
    kind: str
    symptom: str
    step: int | None
    rank: int | None
    host: str | None
    pid: int | None
    attempt: int | None  # the supervisor attempt it happened in (None when the run was not supervised)
    time: float
    exception: str | None  # the exception's type name (a crash)
    message: str | None
    frames: list[str] = field(default_factory=list)  # "file:line in func", innermost first (a crash)
    data: list[dict[str, Any]] = field(default_factory=list)  # in flight: {window, shard, offset} each
    config_hash: str | None = None
    version: str | None = None  # "tenx_version+commit" of the run
    event: dict[str, Any] = field(default_factory=dict)
    verdict: str | None = None  # None until triaged
    confidence: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)  # "exit": how the attempt ended (supervisor)
    cause: dict[str, Any] | None = None

    def signature(self) -> dict[str, Any]:
        """What makes two incidents the same failure: where, on what, with which code and config."""
        keys = ("kind", "step", "rank", "host", "exception", "frames", "data", "config_hash", "version")
        return {k: self.frames[:3] if k == "frames" else getattr(self, k) for k in keys}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _symptom(kind: str, event: dict[str, Any]) -> str:
    """One human line describing the event."""
    message = _str(event.get("message"))
    if kind == "crash":
        exception = _str(event.get("exception")) or "crash"
        text = f"{exception}: {message}" if message else exception
    elif kind == "non-finite":
        what = "gradient norm" if event.get("reason") == "nonfinite-grad" else "loss"
        value = event.get("grad_norm" if what == "gradient norm" else "loss")
        text = f"non-finite {what} ({_num(value)}); update skipped"
    elif kind == "spike":
        grad = event.get("reason") == "grad-norm-spike"
        what, key = ("gradient norm", "grad_norm") if grad else ("loss", "loss")
        text = f"{what} spike: {_num(event.get(key))} over threshold {_num(event.get('threshold'))}"
    elif kind == "loss-rise":
        text = (
            f"the loss's level rose to {_num(event.get('level'))}, {_num(event.get('ratio'))}x its lowest "
            f"({_num(event.get('lowest'))}), without a spike"
        )
    elif kind == "hang":
        text = f"no step completed for {_num(event.get('waited_s'))} s"
        if _str(event.get("detected_by")):
            text += f" ({event['detected_by']})"
    elif kind == "corrupt-shard":
        text = f"corrupt shard {event.get('shard')}: {message or 'unreadable'}"
    elif kind == "signal":
        text = f"stopped by {event.get('signal') or 'a signal'}"
    elif kind == "not-committed":
        text = "the step's update was not committed by the replica group"
    elif kind == "exit":
        attempt = _int(event.get("attempt"))
        ended = f"attempt {attempt - 1}" if attempt is not None else "the child"
        text = f"{ended} ended: {event.get('reason')} (exit status {event.get('returncode')})"
    else:
        text = message or f"{event.get('kind')} at step {event.get('step')}"
    return _one_line(text)


def _incident_kind(event: dict[str, Any]) -> str | None:
    kind = event.get("kind")
    if kind == "skipped-step":
        reason = event.get("reason")
        return _SKIP_REASONS.get(reason) if isinstance(reason, str) else None
    return _EVENT_KINDS.get(kind) if isinstance(kind, str) else None


def _time(event: dict[str, Any]) -> float:
    value = event.get("time")
    return float(value) if isinstance(value, (int, float)) else 0.0


def _event_keys(events: list[dict[str, Any]]) -> list[str]:
    """Each event's key: the hash of its canonical JSON and which of the identical lines it is."""
    keys: list[str] = []
    seen: dict[str, int] = {}
    for event in events:
        digest = bytes_xxhash(json.dumps(event, sort_keys=True).encode())
        seen[digest] = seen.get(digest, 0) + 1
        keys.append(f"{digest}:{seen[digest]}")
    return keys


def _attempts(events: list[dict[str, Any]], ledger: list[dict[str, Any]]) -> tuple[list[Any], list[int]]:
    """Each event's supervisor attempt (the last launch before it) and its launch's index: events of the
    same index come from the same child. Without launches in the ledger, restarts delimit the children."""
    launches = [(float(r["time"]), r.get("attempt")) for r in ledger if r["kind"] == "launch"]
    launches = sorted((t, attempt) for t, attempt in launches if _int(attempt) is not None)
    times = [t for t, _ in launches]
    attempts, children, restarts = [], [], 0
    for event in events:
        i = bisect_right(times, _time(event)) - 1
        attempts.append(launches[i][1] if i >= 0 else None)
        if event.get("kind") == "hang" and _int(event.get("attempt")) is not None:
            attempts[-1] = event["attempt"]  # the supervisor's heartbeat names it
        children.append(i if launches else restarts)
        restarts += event.get("kind") == "restart"
    return attempts, children


def _provenance(run: RunDir) -> tuple[str | None, str | None]:
    """(xxhash of config.toml, "tenx_version+commit" of run.json); None for what is missing or corrupt."""
    try:
        config_hash: str | None = bytes_xxhash(run.config.read_bytes())
    except OSError:
        config_hash = None
    try:
        info = json.loads(run.provenance.read_text())
    except (OSError, ValueError):
        info = None
    version = info.get("tenx_version") if isinstance(info, dict) else None
    commit = info.get("git_commit") if isinstance(info, dict) else None
    if isinstance(version, str) and isinstance(commit, str) and commit:
        version = f"{version}+{commit[:12]}"
    return config_hash, version if isinstance(version, str) else None


def _dumps(value: Any) -> str:
    """Strict JSON of `value` (NaN as "nan", NumPy scalars as numbers), as the event log writes it."""
    wrapped = json_line({"v": value})  # '{"v": VALUE}\n'
    return wrapped[len('{"v": ') : -len("}\n")]


def _row(
    kind: str, event: dict[str, Any], attempt: Any, evidence: dict[str, Any], provenance: tuple[Any, Any]
) -> dict[str, Any]:
    """The columns of the incident made from `event`; `provenance` is (config hash, version)."""
    frames = event.get("frames") if kind == "crash" else None
    data = event.get("data")
    return {
        "kind": kind,
        "symptom": _symptom(kind, event),
        "step": _int(event.get("step")),
        "rank": _int(event.get("rank")),
        "host": _str(event.get("host")),
        "pid": _int(event.get("pid")),
        "attempt": attempt,
        "time": _time(event),
        "exception": _str(event.get("exception")) if kind == "crash" else None,
        "message": _str(event.get("message")),
        "frames": _dumps([f for f in frames if isinstance(f, str)] if isinstance(frames, list) else []),
        "data": _dumps([d for d in data if isinstance(d, dict)] if isinstance(data, list) else []),
        "config_hash": provenance[0],
        "version": provenance[1],
        "event": _dumps(event),
        "evidence": _dumps(evidence),
    }


def _cannot_write(e: sqlite3.Error) -> bool:
    """Whether SQLite failed because it may not write the file or its directory (not because it is damaged)."""
    text = str(e).lower()
    return "readonly" in text or "read-only" in text or "unable to open database file" in text


class IncidentStore:
    """The incidents of one run directory (RUN_DIR/incidents.db); use as a context manager."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run = RunDir(run_dir)
        self.path = self.run.incidents_db
        if not self.run.root.is_dir():
            raise TenxError(f"{self.run.root} is not a directory: expected a run directory")
        marks = (self.run.config, self.run.provenance, self.run.events, self.path)
        if not any(mark.is_file() for mark in marks):  # nothing is written into a directory that is no run
            raise TenxError(
                f"{self.run.root}: not a tenx run directory (no {', '.join(m.name for m in marks[:3])}); "
                "give a directory that `tenx train --run-dir` wrote"
            )
        try:
            self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        except sqlite3.Error as e:
            raise (
                self._unwritable(e) if _cannot_write(e) else TenxError(f"cannot open {self.path}: {e}")
            ) from None
        try:
            self._db.execute("PRAGMA trusted_schema = OFF")
            self._open_schema()
        except (sqlite3.Error, TenxError) as e:
            self.close()
            if isinstance(e, sqlite3.Error):
                raise self._unwritable(e) if _cannot_write(e) else self._damaged(str(e)) from None
            raise

    def _unwritable(self, e: sqlite3.Error) -> TenxError:
        return TenxError(
            f"cannot write the incident store {self.path} ({e}): the run directory {self.run.root} is "
            "read-only (permissions or a read-only file system) and SQLite writes there, even to read. "
            "Copy the run directory somewhere writable (`cp -r`) and run the command on the copy"
        )

    def _damaged(self, why: str, incident: Any = None) -> TenxError:
        what = f"{self.path} is not a tenx incident store ({why})"
        what = what if incident is None else f"{self.path}: incident {incident!r} has a malformed {why}"
        return TenxError(
            f"{what}; the file is derived from {self.run.events}: delete it and run "
            f"`{shlex.join(['tenx', 'incidents', str(self.run.root)])}` to rebuild it (triage results are lost)"
        )

    def _open_schema(self) -> None:
        if not self._db.execute("SELECT 1 FROM sqlite_master").fetchone():
            self._db.execute("BEGIN IMMEDIATE")  # another process may be creating it too
            if not self._db.execute("SELECT 1 FROM sqlite_master").fetchone():
                for statement in _DDL:
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._db.execute("COMMIT")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version != SCHEMA_VERSION:
            raise self._damaged(f"schema version {version}, this tenx reads {SCHEMA_VERSION}")
        objects = self._db.execute("SELECT type, name FROM sqlite_master").fetchall()
        # Nothing else, views and triggers included: nothing in the file may run when it is written.
        foreign = [f"{kind} {name}" for kind, name in objects if (kind, name) not in _OBJECTS]
        if foreign:
            raise self._damaged(f"unexpected {', '.join(foreign)}")
        for table, names in _SCHEMA.items():
            found = tuple(row[1] for row in self._db.execute("SELECT * FROM pragma_table_info(?)", (table,)))
            if found != names:
                raise self._damaged(f"table {table} has columns {list(found)}")

    def close(self) -> None:
        """Close the database."""
        self._db.close()

    def __enter__(self) -> IncidentStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ingest(self) -> int:
        """Add an incident for each anomalous event of events.jsonl not yet ingested; return how many."""
        events = read_events(self.run.root)
        attempts, children = _attempts(events, read_ledger(self.run.root))
        provenance = _provenance(self.run)
        try:
            self._db.execute("BEGIN IMMEDIATE")  # one ingester at a time; each sees what the last added
            done: dict[str, list[int]] = {}  # event key -> the incidents it made or changed
            for key, incident in self._db.execute("SELECT key, incident FROM ingested"):
                done.setdefault(key, []).append(incident)
            crashes: dict[int, list[str]] = {}  # each child's crash and hang events
            added = 0
            for event, key, attempt, child in zip(events, _event_keys(events), attempts, children):
                kind = _incident_kind(event)
                if kind in ("crash", "hang"):
                    crashes.setdefault(child, []).append(key)
                if kind is None or key in done:
                    continue
                evidence: dict[str, Any] = {}
                if kind == "exit":  # a restart event names the attempt it starts
                    ended = event["attempt"] - 1 if _int(event.get("attempt")) else attempt
                    exit_ = {k: event.get(k) for k in ("returncode", "reason")}
                    evidence["exit"] = {"attempt": ended, **exit_, "time": _time(event)}
                    done[key] = [n for k in crashes.get(child, []) for n in done.get(k, [])]
                    for incident in done[key]:  # the child's own record says what happened: keep it
                        self._fold_exit(incident, evidence["exit"], key)
                    if done[key]:
                        continue
                    attempt = ended
                row = _row(kind, event, attempt, evidence, provenance)
                columns, marks = ", ".join(row), ", ".join("?" * len(row))
                insert = f"INSERT INTO incidents ({columns}) VALUES ({marks})"
                cursor = self._db.execute(insert, tuple(row.values()))
                done[key] = [int(cursor.lastrowid or 0)]
                self._db.execute("INSERT INTO ingested (key, incident) VALUES (?, ?)", (key, done[key][0]))
                added += 1
            self._db.execute("COMMIT")
        except sqlite3.Error as e:
            if _cannot_write(e):
                raise self._unwritable(e) from None
            raise TenxError(f"cannot ingest {self.run.events} into {self.path}: {e}") from None
        finally:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
        return added

    def _fold_exit(self, incident: int, exit_: dict[str, Any], key: str) -> None:
        """Keep how the attempt ended in the evidence of its crash or hang `incident`."""
        evidence = {**self.get(incident).evidence, "exit": exit_}
        self._db.execute("UPDATE incidents SET evidence = ? WHERE id = ?", (_dumps(evidence), incident))
        self._db.execute("INSERT INTO ingested (key, incident) VALUES (?, ?)", (key, incident))

    def _select(self, where: str, params: Sequence[Any]) -> list[Incident]:
        try:
            rows = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM incidents {where}", params).fetchall()
        except sqlite3.Error as e:
            raise self._damaged(str(e)) from None
        return [self._incident(row) for row in rows]

    def _incident(self, row: tuple[Any, ...]) -> Incident:
        values: dict[str, Any] = {}
        incident_id = row[0]
        for (name, sql), value in zip(_COLUMNS.items(), row):
            if name in _JSON and isinstance(value, str):
                try:
                    value = json.loads(value)
                except (ValueError, RecursionError):
                    value = _MALFORMED
            types = (_JSON[name],) if name in _JSON else _PYTHON[sql.split()[0]]
            if value is None and "NOT NULL" not in sql and name != "id":
                values[name] = value
                continue
            ok = isinstance(value, types) and not isinstance(value, bool)
            if ok and name in _ITEMS:
                ok = all(isinstance(item, _ITEMS[name]) for item in value)
            if not ok:
                raise self._damaged(f"{name} column", incident=incident_id)
            values[name] = value
        values["time"] = float(values["time"])
        if values["confidence"] is not None:
            values["confidence"] = float(values["confidence"])
        return Incident(run_dir=str(self.run.root), **values)

    def incidents(self, kinds: Iterable[str] | None = None) -> list[Incident]:
        """The run's incidents in id (event) order, only those of `kinds` if given."""
        if kinds is None:
            return self._select("ORDER BY id", ())
        wanted = sorted(set(kinds))
        return self._select(f"WHERE kind IN ({', '.join('?' for _ in wanted)}) ORDER BY id", wanted)

    def get(self, incident_id: int) -> Incident:
        """Incident `incident_id`."""
        found, root = self._select("WHERE id = ?", (int(incident_id),)), self.run.root
        if not found:
            raise TenxError(
                f"no incident {incident_id} in {root}; `{shlex.join(['tenx', 'incidents', str(root)])}` lists them"
            )
        return found[0]

    def record_triage(
        self,
        incident_id: int,
        *,
        verdict: str,
        confidence: float,
        evidence: dict[str, Any],
        cause: dict[str, Any] | None,
    ) -> None:
        """Store what triage found for incident `incident_id` (replacing an earlier triage; the
        supervisor's evidence["exit"] is kept unless `evidence` has its own)."""
        if not 0.0 <= float(confidence) <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {confidence}")
        previous = self.get(incident_id).evidence
        stored = _dumps({**({"exit": previous["exit"]} if "exit" in previous else {}), **evidence})
        values = (verdict, float(confidence), stored, None if cause is None else _dumps(cause), incident_id)
        update = "UPDATE incidents SET verdict = ?, confidence = ?, evidence = ?, cause = ? WHERE id = ?"
        try:
            self._db.execute(update, values)
        except sqlite3.Error as e:
            if _cannot_write(e):
                raise self._unwritable(e) from None
            raise TenxError(
                f"cannot record the triage of incident {incident_id} in {self.path}: {e}"
            ) from None


def list_incidents(run_dirs: Iterable[str | Path], kinds: Iterable[str] | None = None) -> list[Incident]:
    """The incidents of every run directory (each ingested first), oldest first."""
    found: list[Incident] = []
    kinds = None if kinds is None else list(kinds)
    for run_dir in run_dirs:
        run = RunDir(run_dir)
        if run.root.is_dir() and not run.events.exists() and not run.incidents_db.exists():
            continue  # nothing happened there yet: no store to create
        with IncidentStore(run.root) as store:  # a path that is not a directory is an error
            store.ingest()
            found += store.incidents(kinds)
    return sorted(found, key=lambda i: (i.time, i.run_dir, i.id))


def format_incidents(incidents: Sequence[Incident], run_dirs: Sequence[str | Path] = ()) -> str:
    """A table of incidents, one a line, then how many there are in how many runs."""
    names = [str(d) for d in run_dirs]
    if not incidents:
        return "no incidents in " + (", ".join(names) if names else "these runs")
    header = ("id", "run", "attempt", "step", "rank", "kind", "symptom", "verdict")
    rows: list[tuple[str, ...]] = [header]
    for i in incidents:
        cells = (i.id, Path(i.run_dir).name, i.attempt, i.step, i.rank, i.kind, _one_line(i.symptom, 60))
        rows.append(tuple("-" if c is None else str(c) for c in (*cells, i.verdict)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    runs = len(names) or len({i.run_dir for i in incidents})
    lines.append(f"{len(incidents)} incident{'s' * (len(incidents) != 1)} in {runs} run{'s' * (runs != 1)}")
    return "\n".join(lines)
