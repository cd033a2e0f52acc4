"""The W&B sink (log.wandb): an offline run holds every scalar of metrics.jsonl, the events and the prediction
band, read back from the run's .wandb log; off, wandb is never imported; missing, a clear error."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tenx.errors import ConfigError
from tenx.monitor.events import read_events
from tenx.monitor.metrics_file import read_metrics
from tenx.monitor.prediction_file import Prediction, write_prediction
from tenx.rundir import RunDir

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of records with 7-byte headers
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> list[Any]:
    """Every protobuf Record of a W&B transaction log (run-ID.wandb), in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B log"
    records, chunks, pos = [], b"", HEADER  # the file's own header: ":W&B", magic 0xBEE1, version
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # the block's tail is zero padding
            pos += left_in_block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:  # the zeroed rest of a block
            pos += left_in_block
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        chunks = chunk if kind in (FULL, FIRST) else chunks + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
    return records


def _item_value(item: Any) -> Any:
    which = item.WhichOneof("value")
    if which is None:
        return json.loads(item.value_json)
    if which == "none":
        return None
    return json.loads(item.json) if which == "json" else getattr(item, which)


def wandb_rows_and_alerts(log: Path) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the history rows, the alert records) of a W&B transaction log; the summary's updates are the row
    with the key `_summary`."""
    wandb.teardown()  # W&B's service writes the log's last records after finish() returns; this waits for it
    rows, alerts = [], []
    for record in read_wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append(
                {(item.key or "/".join(item.nested_key)): _item_value(item) for item in record.history.item}
            )
        elif kind == "alert":
            alerts.append(record.alert)
        elif kind == "summary":
            summary = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.summary.update
            }
            rows.append({"_summary": summary})
    return rows, alerts


def wandb_history(run_dir: Path) -> tuple[list[dict[str, Any]], list[Any], Path]:
    """(the history rows, the alerts, the offline run's folder) of the one W&B run under `run_dir`/wandb."""
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    (log,) = runs[0].glob("run-*.wandb")
    return (*wandb_rows_and_alerts(log), runs[0])


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline, quiet, its settings and caches under tmp_path: nothing reaches the network."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    # runs go where the config says: RUN_DIR/wandb
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)


def _band(steps: int, loss: float) -> Prediction:
    s = list(range(4, steps + 1))
    return Prediction(
        step=s,
        tokens=[512 * i for i in s],
        loss=[loss] * len(s),
        lower=[0.9 * loss] * len(s),
        upper=[1.1 * loss] * len(s),
        window=2,
        target={"steps": steps, "tokens_per_step": 512},
    )


def test_the_offline_run_holds_every_scalar_of_metrics_jsonl_the_events_and_the_band(
    tiny_config, tiny_data, tmp_path, offline
):
    from tenx.train.run import train

    steps = 12
    # a band far above the run's loss: the run is off-prediction from its first watched steps (an event)
    path = write_prediction(tmp_path / "predicted.json", _band(steps, loss=50.0))
    cfg = tiny_config(
        tiny_data,
        f"train.steps={steps}",
        "train.eval_every=5",
        "checkpoint.every=0",
        f'monitor.prediction="{path}"',
        "monitor.off_prediction_steps=2",
        "log.wandb=true",
        "log.wandb_mode=offline",
        'log.wandb_project="tenx-test"',
    )
    run = tmp_path / "run"
    train(cfg, run)

    metrics = read_metrics(RunDir(run).metrics)
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    rows, alerts, wb_dir = wandb_history(run)
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        if "step" in row:
            by_step.setdefault(row["step"], {}).update(row)
    scalars = 0
    for record in metrics:
        logged = by_step[record["step"]]
        for key, value in record.items():
            if isinstance(value, (int, float, str)):
                assert logged.get(key) == value, (record["step"], key, value, logged.get(key))
                scalars += 1
    assert scalars >= 9 * steps  # loss, lr, grad_norm, tokens, ... on every row
    assert sum("val_loss" in r for r in metrics) >= 2 and sum("pred_dev" in r for r in metrics) >= 5

    # the band, step by step, from the first predicted step (4)
    for step in range(1, steps + 1):
        band = [by_step[step].get(f"prediction/{k}") for k in ("loss", "lower", "upper")]
        if step < 4:
            assert band == [None, None, None]
        else:
            assert band == pytest.approx([50.0, 45.0, 55.0])

    # events: counted at their steps, every one in the events table, the off-prediction one an alert
    events = read_events(run)
    off = [e for e in events if e["kind"] == "off-prediction"]
    assert len(off) == 1
    assert by_step[off[0]["step"]].get("events/off-prediction") == 1
    counted = sum(v for row in rows for k, v in row.items() if k.startswith("events/"))
    assert counted == len(events)
    table_path = next(row["events_table/path"] for row in rows if "events_table/path" in row)
    table = json.loads((wb_dir / "files" / table_path).read_text())
    assert [r[2] for r in table["data"]] == [e["kind"] for e in events]
    assert [a.title for a in alerts] == [f"tenx: off-prediction at step {off[0]['step']}"]
    assert alerts[0].text == off[0]["message"]
    summary: dict[str, Any] = {}
    for row in rows:
        summary.update(row.get("_summary", {}))
    assert {k: summary.get(f"prediction/final_{k}") for k in ("loss", "lower", "upper")} == pytest.approx(
        {"loss": 50.0, "lower": 45.0, "upper": 55.0}
    )
    state = json.loads(RunDir(run).wandb_state.read_text())
    assert state == {"id": wb_dir.name.rsplit("-", 1)[-1], "events_sent": len(events)}


def test_a_resumed_run_continues_the_same_wandb_run_and_sends_no_event_twice(
    tiny_config, tiny_data, tmp_path, offline
):
    from tenx.monitor.events import EventLog
    from tenx.train.run import train

    common = ["checkpoint.every=0", "train.eval_every=0", "log.wandb=true", "log.wandb_mode=offline"]
    run = tmp_path / "run"
    train(tiny_config(tiny_data, "train.steps=4", *common), run)
    first = json.loads(RunDir(run).wandb_state.read_text())
    EventLog(run).emit("restart", 4, message="the supervisor restarts the run")  # between the two processes
    # W&B names an offline run's directory by the second it started: a tiny run that resumes within the same
    # second would write into the first process's directory (never so for a real restart, which takes longer)
    time.sleep(1.1)
    train(tiny_config(tiny_data, "train.steps=7", *common), run, resume="auto")
    second = json.loads(RunDir(run).wandb_state.read_text())
    assert second["id"] == first["id"]
    events = read_events(run)
    assert second["events_sent"] == len(events) == first["events_sent"] + 1

    logs = sorted((run / "wandb").glob(f"offline-run-*-{first['id']}/run-{first['id']}.wandb"))
    assert len(logs) == 2  # one per process, one W&B run: `wandb sync` uploads both into it
    counted, titles, steps = 0, [], []
    for log in logs:
        rows, alerts = wandb_rows_and_alerts(log)
        counted += sum(v for row in rows for k, v in row.items() if k.startswith("events/"))
        titles += [a.title for a in alerts]
        steps += [row["step"] for row in rows if "loss" in row]
    assert counted == len(events)
    assert titles == ["tenx: restart at step 4"]
    assert steps == [1, 2, 3, 4, 5, 6, 7]


def test_with_the_sink_off_wandb_is_never_imported(tiny_data, tmp_path):
    script = f"""
import sys
from tenx.train.config import CONFIG_DIR, load_run_config
from tenx.train.run import train
cfg = load_run_config(CONFIG_DIR / "tiny.toml", ['data.dir="{tiny_data}"', "log.progress=false", "train.steps=2",
                                               "train.eval_every=0", "checkpoint.every=0"])
assert cfg.log.wandb is False
train(cfg, {str(tmp_path / "run")!r})
print("wandb imported:", "wandb" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "wandb imported: False" in out.stdout
    assert not (tmp_path / "run" / "wandb").exists() and not RunDir(tmp_path / "run").wandb_state.exists()


def test_without_the_package_the_run_stops_before_its_first_step_saying_pip_install_wandb(
    tiny_config, tiny_data, tmp_path, monkeypatch
):
    from tenx.train.run import train

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = tiny_config(tiny_data, "train.steps=2", "log.wandb=true")
    with pytest.raises(ConfigError, match=r"log\.wandb: true needs the wandb package.*pip install wandb"):
        train(cfg, tmp_path / "run")
    assert not RunDir(tmp_path / "run").metrics.exists()


def test_a_blank_or_malformed_project_is_refused_naming_the_field(tiny_config, tiny_data):
    with pytest.raises(ConfigError, match="log.wandb_project"):
        tiny_config(tiny_data, "log.wandb=true", 'log.wandb_project="  "')
    with pytest.raises(ConfigError, match="log.wandb_project"):
        tiny_config(tiny_data, "log.wandb=true", 'log.wandb_project="a/b"')


def test_wandb_mode_from_the_environment_runs_offline_where_the_config_says_nothing(
    tiny_config, tiny_data, tmp_path, offline, monkeypatch
):
    """WANDB_MODE=offline with log.wandb=true and no log.wandb_mode: the run trains offline (the config's
    old default, online, overrode the variable: "No API key configured"); WANDB_DIR holds the W&B run."""
    from tenx.train.run import train

    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-default"))
    cfg = tiny_config(
        tiny_data, "train.steps=3", "checkpoint.every=0", "train.eval_every=0", "log.wandb=true"
    )
    assert cfg.log.wandb_mode == "" and cfg.log.wandb_project == ""
    run = tmp_path / "run"
    train(cfg, run)
    assert not (run / "wandb").exists()
    rows, _, wb_dir = wandb_history(tmp_path / "wandb-default")
    assert sorted(r["step"] for r in rows if "step" in r) == [1, 2, 3]
    assert wb_dir.parent.parent == tmp_path / "wandb-default"


class _FakeWandb:
    """Stands for the wandb module: records what `init` was given."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def init(self, **kwargs: Any) -> Any:
        self.kwargs = kwargs
        return self

    def define_metric(self, *args: Any, **kwargs: Any) -> None:
        pass


def test_the_config_wins_over_wandb_environment_variables_and_fills_none_of_its_own(tmp_path, monkeypatch):
    from tenx.train.callbacks import wandb_sink

    fake = _FakeWandb()
    monkeypatch.setattr(wandb_sink, "import_wandb", lambda: fake)

    def view(run: str) -> Any:  # what the sink reads of the trainer: the step and the run directory
        return type("View", (), {"step": 0, "rundir": RunDir(tmp_path / run)})()

    env = {"WANDB_PROJECT": "env-project", "WANDB_ENTITY": "env-team", "WANDB_MODE": "offline"}
    for name, value in {**env, "WANDB_DIR": str(tmp_path / "env-dir")}.items():
        monkeypatch.setenv(name, value)
    sink = wandb_sink.WandbSink(project="")
    sink.on_train_start(view("run"))
    assert fake.kwargs["project"] == "env-project" and fake.kwargs["dir"] == str(tmp_path / "env-dir")
    assert fake.kwargs["mode"] is None and fake.kwargs["entity"] is None  # W&B reads its variables itself
    sink = wandb_sink.WandbSink(project="cfg", entity="team", mode="online", directory=str(tmp_path / "d"))
    sink.on_train_start(view("run2"))
    assert (fake.kwargs["project"], fake.kwargs["entity"], fake.kwargs["mode"]) == ("cfg", "team", "online")
    assert fake.kwargs["dir"] == str(tmp_path / "d")
    for name in (*env, "WANDB_DIR"):
        monkeypatch.delenv(name)
    sink = wandb_sink.WandbSink(project="")
    sink.on_train_start(view("run3"))
    assert fake.kwargs["project"] == "tenx" and fake.kwargs["dir"] == str(tmp_path / "run3")
