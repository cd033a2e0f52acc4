"""RunDir: the one place that names every file and folder of a run directory.

```
RUN_DIR/
  config.toml          the resolved config (written at start)
  run.json             provenance: version, git commit, hardware, parameter and FLOP counts
  run_id               this directory's identity (the in-memory tier loads only its own snapshots)
  metrics.jsonl        one JSON line per step
  events.jsonl         what happened besides steps (resume, rollback, faults, heals, crashes, ...)
  prequential.json     the training stream's prequential code length (bits per byte), beside xz
  steps.jsonl          each step's exact loss and gradient norm, digest and data positions (tenx replay)
  incidents.db         the incident store (SQLite): every anomaly, and what triage found (tenx triage)
  incidents/N/         incident N's evidence: the minimal reproduction of a faulty op
    repro.py           the script that runs it (exit status 1 while the op still misbehaves)
    repro.json         the op and its non-tensor arguments
    inputs.safetensors its tensor inputs: the smallest slice that still triggers it
  ledger.jsonl         goodput ledger: time spent productively and otherwise
  data_skips.json      data skipped after rollbacks (a resume from an older checkpoint skips it too)
  eval.json            the last `tenx eval` report
  loss_curve.png       the loss curve (quickstart, ladder runs)
  prediction.json      the predicted loss curve the run is watched against (tenx predict; monitor.prediction)
  prediction.png       its plot
  extrapolation/       prediction.json and .png of `tenx predict --run` (the run from its own curve)
  stacks-pidN.txt      thread stacks dumped by `kill -USR1 N` (removed when empty)
  hang-stepS-pidN.txt  thread stacks the watchdog dumped when step S did not complete in time
  writer.lock          held by the one process writing the run (tenx.utils.lock): who, since when
  tensorboard/         TensorBoard scalars
  wandb/               the W&B run (log.wandb; log.wandb_dir puts it elsewhere)
  wandb.json           the W&B run id and the events sent to it (a resume continues that run)
  checkpoints/         step_XXXXXXXX/ checkpoints (tenx.checkpoint)
  ensemble.json        an ensemble's members (model.ensemble = K, or `tenx ensemble` of finished runs)
  members/K/           member K of an ensemble trained here: a run directory of its own
```

Other modules ask a RunDir for a path; none spells these names (tests/test_layers.py checks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.toml"
PROVENANCE = "run.json"
RUN_ID = "run_id"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
STEPS = "steps.jsonl"
PREQUENTIAL = "prequential.json"
INCIDENTS_DB = "incidents.db"
INCIDENTS = "incidents"
REPRO_SCRIPT = "repro.py"
REPRO_META = "repro.json"
REPRO_INPUTS = "inputs.safetensors"
LEDGER = "ledger.jsonl"
DATA_SKIPS = "data_skips.json"
EVAL = "eval.json"
LOSS_CURVE = "loss_curve.png"
PREDICTION = "prediction.json"
PREDICTION_PNG = "prediction.png"
EXTRAPOLATION = "extrapolation"
TENSORBOARD = "tensorboard"
WANDB = "wandb"
WANDB_STATE = "wandb.json"
CHECKPOINTS = "checkpoints"
STACKS = "stacks-pid"
HANG = "hang-step"
WRITER_LOCK = "writer.lock"
ENSEMBLE = "ensemble.json"
MEMBERS = "members"
STEP_DIR = re.compile(r"^step_(\d{8})$")
"""A published checkpoint's directory name."""
STEP_GLOB = "step_" + "[0-9]" * 8
"""STEP_DIR as a glob (with a prefix and a suffix, it finds the leftovers of an interrupted save)."""


def written_by_tenx(name: str) -> bool:
    """Whether an entry named `name` at the top of a run directory is one tenx writes: a name above, the
    incident store's SQLite side files, a stack dump, or the temporary of an atomic write of one of them
    (`.NAME.*`, and the write probe `.tenx-write-check.*`)."""
    ours = {
        CONFIG, PROVENANCE, RUN_ID, METRICS, EVENTS, STEPS, PREQUENTIAL, INCIDENTS_DB, INCIDENTS, LEDGER,
        DATA_SKIPS, EVAL, LOSS_CURVE, PREDICTION, PREDICTION_PNG, EXTRAPOLATION, TENSORBOARD, WANDB,
        WANDB_STATE, CHECKPOINTS, WRITER_LOCK, ENSEMBLE, MEMBERS,
    }  # fmt: skip
    if name in ours or name.startswith((STACKS, f"{INCIDENTS_DB}-", ".tenx-write-check.")):
        return True
    return name.startswith(".") and any(name.startswith(f".{own}.") for own in ours)


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of `step`."""
    return f"step_{step:08d}"


def step_of(path: str | Path) -> int | None:
    """The step of a checkpoint directory `path` (named like step_00000020), None for any other name."""
    match = STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class RunDir:
    """A run directory and the paths of everything in it."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def provenance(self) -> Path:
        return self.root / PROVENANCE

    @property
    def run_id(self) -> Path:
        return self.root / RUN_ID

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def prequential(self) -> Path:
        return self.root / PREQUENTIAL

    @property
    def steps(self) -> Path:
        return self.root / STEPS

    @property
    def incidents_db(self) -> Path:
        return self.root / INCIDENTS_DB

    def incident_dir(self, incident_id: int) -> Path:
        """Where the evidence of incident `incident_id` is kept (its minimal reproduction)."""
        return self.root / INCIDENTS / str(int(incident_id))

    @property
    def ledger(self) -> Path:
        return self.root / LEDGER

    @property
    def data_skips(self) -> Path:
        return self.root / DATA_SKIPS

    @property
    def eval_report(self) -> Path:
        return self.root / EVAL

    @property
    def loss_curve(self) -> Path:
        return self.root / LOSS_CURVE

    @property
    def prediction(self) -> Path:
        return self.root / PREDICTION

    @property
    def prediction_png(self) -> Path:
        return self.root / PREDICTION_PNG

    @property
    def extrapolation(self) -> Path:
        return self.root / EXTRAPOLATION

    @property
    def extrapolation_png(self) -> Path:
        """The plot of `tenx predict --run` (the run's prediction from its own curve)."""
        return self.extrapolation / PREDICTION_PNG

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def wandb_state(self) -> Path:
        return self.root / WANDB_STATE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        """The directory of the checkpoint of `step` (whether or not it exists)."""
        return self.checkpoints / step_dir_name(step)

    @property
    def writer_lock(self) -> Path:
        """The lock the one process writing the run holds (tenx.utils.lock.exclusive_writer)."""
        return self.root / WRITER_LOCK

    @property
    def ensemble(self) -> Path:
        """An ensemble's manifest: its members' run directories (tenx.checkpoint.models.load_model)."""
        return self.root / ENSEMBLE

    def member(self, k: int) -> Path:
        """The run directory of member `k` of an ensemble trained in this one."""
        return self.root / MEMBERS / str(int(k))

    def stacks(self, pid: int) -> Path:
        """Where `kill -USR1 PID` dumps the thread stacks of process `pid`."""
        return self.root / f"{STACKS}{pid}.txt"

    def hang_report(self, step: int, pid: int) -> Path:
        """Where the watchdog of process `pid` dumps its thread stacks when `step` did not complete in time."""
        return self.root / f"{HANG}{step}-pid{pid}.txt"
