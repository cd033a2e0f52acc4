"""Weights & Biases sink (log.wandb): mirrors metrics.jsonl, events.jsonl and the prediction band into a W&B run.

metrics.jsonl stays the record of the run; this callback copies it out, on rank 0, after MetricsLogger has
written each step. What reaches W&B:

- every scalar of each metrics.jsonl row (numbers, booleans and strings; nested values are left out), in
  one history row whose `step` is the row's step. `step` is W&B's x-axis for every key (`define_metric`),
  not W&B's own counter: after a rollback or a resume the steps trained again are logged again, and the
  newest row of a step is the one metrics.jsonl keeps. (Logging with `step=` would drop them instead: W&B
  refuses a step below its last.)
- events.jsonl: each new event counts in its step's row as `events/KIND` (a mark on the charts), and the
  run's events go to the table `events_table` (step, time, kind, the other fields as JSON) when the run
  closes. An event with a message (off-prediction, the trend detectors) is also a W&B alert (e-mail or Slack,
  as the W&B account sets it up; an offline run records it for `wandb sync`).
- the prediction band (monitor.prediction) at every step it covers: `prediction/loss`, `prediction/lower`
  and `prediction/upper`, next to `loss` (the `pred_*` figures of metrics.jsonl compare the smoothed loss
  with the band at the window's centre; these are the band itself, step by step, for the chart).

The W&B run id and how many events were sent live in RUN_DIR/wandb.json, so a resumed run (`--resume auto`,
the supervisor's restarts) continues the same W&B run without sending an event twice; a fresh start opens a
new one. `wandb` is imported only when log.wandb is true: without it no W&B code runs and nothing reaches
the network. Offline mode (log.wandb_mode = "offline") writes the run under log.wandb_dir for `wandb sync`.
A field the config leaves empty (project, entity, mode, dir) is W&B's own environment variable's
(WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, WANDB_DIR), as in any trainer that logs to W&B.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from tenx.errors import ConfigError, DataError, TenxError
from tenx.monitor.events import read_events
from tenx.monitor.prediction_file import Prediction, read_prediction
from tenx.rundir import RunDir
from tenx.train.hooks import Callback, TrainerView
from tenx.utils.io import atomic_write_json
from tenx.utils.storage import ensure_writable

WANDB_RUN_ID = re.compile(r"[0-9a-f]{16}")
"""The W&B run ids this sink makes (and takes back from RUN_DIR/wandb.json)."""
DEFAULT_PROJECT = "tenx"
"""The W&B project when neither log.wandb_project nor WANDB_PROJECT names one."""


def import_wandb() -> Any:
    """The `wandb` module, or a ConfigError that says how to install it."""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            f"log.wandb: true needs the wandb package, which cannot be imported ({e}); install it with "
            "`pip install wandb` (or `pip install 'tenx[wandb]'`), or set log.wandb=false"
        ) from None
    return wandb


def history_row(metrics: dict[str, Any]) -> dict[str, Any]:
    """The values of a metrics.jsonl row that W&B plots or shows: numbers, booleans and strings."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}


class WandbSink(Callback):
    """Mirrors each step's metrics, the run's events and the prediction band into a W&B run (rank 0)."""

    name = "wandb_sink"
    run: RunDir
    """The trainer's run directory (from when training starts)."""

    def __init__(
        self,
        project: str,
        entity: str = "",
        name: str = "",
        mode: str = "",
        directory: str = "",
        prediction: str = "",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.wandb = import_wandb()  # here, so a missing package stops the run before its first step
        # what the config leaves empty, W&B's own environment variables decide, as in any trainer that logs
        # to W&B (WANDB_MODE=offline on a node without internet); tenx's fallbacks only where both are unset
        self.project = project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
        self.entity = entity or None  # W&B reads WANDB_ENTITY, else the login's default
        self.mode = mode or None  # W&B reads WANDB_MODE, else online
        self.run_name = name  # empty: the run directory's name
        self.directory_setting = directory or os.environ.get("WANDB_DIR") or ""  # empty: the run directory
        self.config = config or {}
        self.prediction: Prediction | None = None
        if prediction:
            try:
                self.prediction = read_prediction(prediction)
            except (OSError, TenxError) as e:
                raise ConfigError(f"monitor.prediction: {e}") from None
        self._wb_run: Any = None
        self._events_sent = 0
        self._events_size = -1  # events.jsonl's size when last read: unchanged, nothing new to send
        self._failed = False

    def on_train_start(self, trainer: TrainerView) -> None:
        self.run = trainer.rundir
        self.run_name = self.run_name or self.run.root.resolve().name
        self.directory = Path(self.directory_setting or self.run.root)
        state = self._read_state() if trainer.step > 0 else {}
        run_id = state.get("id") or uuid.uuid4().hex[:16]
        self._events_sent = int(state.get("events_sent", 0)) if state.get("id") else 0
        ensure_writable(self.directory, "log.wandb_dir")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._wb_run = self.wandb.init(
                project=self.project,
                entity=self.entity,
                name=self.run_name,
                id=run_id,
                resume="allow",
                dir=str(self.directory),
                mode=self.mode,
                config=self.config,
            )
        except Exception as e:  # noqa: BLE001 - W&B's own errors (login, network, settings) vary by version
            raise TenxError(
                f"log.wandb: W&B could not start its run in {self.directory} ({type(e).__name__}: "
                f"{str(e)[:300]}); check log.wandb_mode (offline needs no login; online needs `wandb login`), "
                "log.wandb_project, log.wandb_entity and log.wandb_dir"
            ) from e
        self._wb_run.define_metric("step")
        self._wb_run.define_metric("*", step_metric="step")
        self._write_state(run_id)

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        row = history_row(metrics)
        step = int(metrics["step"])
        if self.prediction is not None:
            band = self.prediction.at(step)
            if band is not None:
                row.update({f"prediction/{name}": value for name, value in band.items()})
        row.update(self._new_event_counts())
        self._wb_run.log(row)

    def on_error(self, trainer: TrainerView, error: BaseException) -> None:
        self._failed = True

    def close(self, trainer: TrainerView) -> None:
        if self._wb_run is None:
            return
        counts = self._new_event_counts()  # the final save's, the stop's or the crash's
        if counts:
            self._wb_run.log({"step": trainer.step, **counts})
        events = self._all_events()
        if events:  # the run's whole list (a resumed run's table holds the earlier processes' events too)
            table = self.wandb.Table(columns=["step", "time", "kind", "fields"])
            for event in events:
                fields = {k: v for k, v in event.items() if k not in ("step", "time", "kind")}
                table.add_data(event.get("step"), event["time"], event["kind"], json.dumps(fields))
            self._wb_run.log({"events_table": table, "step": trainer.step})
        if self.prediction is not None:
            final = self.prediction.final
            self._wb_run.summary.update({f"prediction/final_{k}": v for k, v in final.items() if k != "step"})
        self._wb_run.finish(exit_code=1 if self._failed else 0)
        self._wb_run = None

    def _new_event_counts(self) -> dict[str, int]:
        """`events/KIND` counts of the events appended since the last call (an alert for each with a
        message); the number sent is recorded in RUN_DIR/wandb.json."""
        try:
            size = self.run.events.stat().st_size
        except FileNotFoundError:
            return {}
        if size == self._events_size:
            return {}
        self._events_size = size
        events = self._all_events()
        new = events[self._events_sent :]
        counts: dict[str, int] = {}
        for event in new:
            counts[f"events/{event['kind']}"] = counts.get(f"events/{event['kind']}", 0) + 1
            if isinstance(event.get("message"), str):
                self._wb_run.alert(
                    title=f"tenx: {event['kind']} at step {event.get('step')}",
                    text=event["message"],
                    level=self.wandb.AlertLevel.WARN,
                )
        if new:
            self._events_sent = len(events)
            self._write_state(self._wb_run.id)
        return counts

    def _all_events(self) -> list[dict[str, Any]]:
        try:
            return read_events(self.run.root)
        except DataError:
            return []  # events.jsonl is not a file: the run's own writes say so

    def _read_state(self) -> dict[str, Any]:
        """RUN_DIR/wandb.json ({} when absent or unreadable: the resumed run then opens a new W&B run)."""
        try:
            state = json.loads(self.run.wandb_state.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(state, dict) or not WANDB_RUN_ID.fullmatch(str(state.get("id"))):
            return {}
        if not isinstance(state.get("events_sent"), int) or state["events_sent"] < 0:
            state["events_sent"] = 0
        return state

    def _write_state(self, run_id: str) -> None:
        atomic_write_json(self.run.wandb_state, {"id": run_id, "events_sent": self._events_sent})
