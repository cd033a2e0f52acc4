"""Published training curves as curve tables: the formats of three public run sets, read as they are.

Each reader takes the folder a repository's files were copied into unchanged and returns curve-table rows
(tenx.scaling.curve.curve_table: run, params, tokens_per_step, step, lr, loss, split) and, per run, what
the run was (`RunInfo`: its schedule kind, peak learning rate, horizon, cooldown). bench/published_curves.py
measures the curve laws on them; tests/data/published-curves holds a small subset.

- `lr_scheduling` (github.com/fabian-sp/lr-scheduling, MIT; Schaipp et al. 2025 and Hägele et al. 2024):
  one JSON per run with its config and logged history (`train_lr` is the rate actually used). Files named
  `ann*` or `extend-50k*` hold only a cooldown; they are joined to the constant-rate base run of the same
  model, data and peak rate (the base's rows before the cooldown file's first row), as the repository's own
  reanalysis does. Duplicate logged steps are averaged. Validation rows take the learning rate interpolated
  from the training log.
- `multipowerlaw` (github.com/thu-yao-01-luo/MultiPowerLaw, MIT; Luo et al. 2025): `csv_{25,100,400}/NAME.csv`
  with step, lr, loss (training loss, already smoothed by the authors). The tokens per step are not in the
  files; a nominal 0.5M is used (at one batch size per run set it only rescales the laws' progress unit).
- `gemstones` (github.com/mcleish7/gemstone-scaling-laws, MIT; McLeish et al. 2025): JSON lines of
  constant-learning-rate ("hot") runs with the validation loss every 477 steps. The peak rate is not in the
  files: lr is 1 (the laws use the rate relative to its peak), with a linear warmup to the first row.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tenx.errors import DataError
from tenx.utils.io import jsonl_records

MPL_PARAMS = {"25": 25e6, "100": 100e6, "400": 400e6}
"""MultiPowerLaw's folders (csv_25 ...) and their nominal model sizes (the paper's)."""
MPL_TOKENS_PER_STEP = 0.5e6
MPL_FIT = ("cosine_24000", "constant_24000", "wsdcon_9")
"""The multi-power-law paper's fitting schedules; the other six are its test set."""


@dataclass
class RunInfo:
    """What a published run was: enough to pick a benchmark's fitting and held-out sets."""

    run: str
    params: float
    tokens_per_step: float
    schedule: str
    """constant, cosine, wsd, wsd-extension, two-stage, ... (the source's own scheduler, normalised)"""
    peak_lr: float
    steps: int
    """the run's last logged step"""
    horizon: int
    """the planned length (iterations) of the schedule"""
    cooldown: float = 0.0
    """fraction of the horizon spent decaying (WSD); 0 otherwise"""
    decay: str = ""
    """the cooldown's shape (linear, sqrt, exp) or the cosine's end (to 10%, to zero)"""
    dataset: str = ""
    source: str = ""
    """the file(s) the rows came from, relative to the folder"""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _average_duplicates(steps: Iterable[float], *columns: Iterable[float]) -> tuple[np.ndarray, ...]:
    """Sorted unique steps and each column averaged over a step's duplicates (NaN-free rows only)."""
    s = np.asarray(list(steps), dtype=float)
    cols = [np.asarray(list(c), dtype=float) for c in columns]
    keep = np.isfinite(s) & np.all([np.isfinite(c) for c in cols], axis=0) if cols else np.isfinite(s)
    s = s[keep]
    cols = [c[keep] for c in cols]
    uniq, inverse = np.unique(s, return_inverse=True)
    counts = np.bincount(inverse)
    return (uniq, *[np.bincount(inverse, weights=c) / counts for c in cols])


def _lr_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable lr-scheduling run file ({e})") from None
    if not isinstance(data, dict) or not {"config", "summary", "history"} <= set(data):
        raise DataError(f"{path}: expected a JSON object with config, summary and history")
    return data


def _streams(data: dict[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """{'train': (iter, loss, lr), 'val': (iter, loss, None)} with duplicates averaged."""
    h = data["history"]
    train = h.get("train", {})
    it, loss, lr = _average_duplicates(
        train.get("iter", []), train.get("train_loss", []), train.get("train_lr", [])
    )
    val = h.get("val", {})
    vit, vloss = _average_duplicates(val.get("iter", []), val.get("val_loss", []))
    return {"train": (it, loss, lr), "val": (vit, vloss, None)}


def _segment(name: str) -> bool:
    return name.startswith("ann") or name.startswith("extend-50k")


_SHAPE_KEYS = ("dataset", "n_layer", "n_embd", "n_head", "lr", "batch_size", "acc_steps", "world_size")


def _shape(config: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(config.get(k) for k in _SHAPE_KEYS)


def _schedule_of(name: str, config: dict[str, Any]) -> tuple[str, float, str]:
    """(schedule kind, cooldown fraction, decay shape) of an lr-scheduling run."""
    sched = str(config.get("scheduler", ""))
    fract = float(config.get("wsd_fract_decay") or 0.0)
    decay = str(config.get("decay_type") or "")
    if name.startswith("extend-50k"):
        kind = "wsd-extension-twostage" if "twostage" in sched else "wsd-extension"
        return kind, fract, decay or "linear"
    if sched.startswith("cos"):
        final = config.get("cos_final_lr")
        return ("cosine-zero" if final is not None and 0 < float(final) < 1e-5 else "cosine"), 0.0, "cosine"
    if sched.startswith("wsd") and fract > 0:
        return "wsd", fract, decay or "linear"
    return "constant", 0.0, ""


def lr_scheduling(folder: str | Path) -> tuple[list[dict[str, Any]], dict[str, RunInfo]]:
    """Rows and run descriptions of every run under lr-scheduling's `data/` folder (see the module text)."""
    root = Path(folder)
    data_dir = root / "data" if (root / "data").is_dir() else root
    files = sorted(data_dir.rglob("*.json"))
    if not files:
        raise DataError(f"{folder}: no lr-scheduling run files (*.json under data/)")
    loaded = {f: _lr_json(f) for f in files}
    shapes: dict[tuple[Any, ...], list[Path]] = defaultdict(list)
    for f, d in loaded.items():
        shapes[_shape(d["config"])].append(f)
    joined: dict[Path, tuple[dict[str, Any], str]] = {}

    def streams_of(f: Path, depth: int = 0) -> tuple[dict[str, Any], str]:
        """A file's streams, a cooldown file's joined to the run it continues (which may itself be one)."""
        if f in joined:
            return joined[f]
        config = loaded[f]["config"]
        streams = _streams(loaded[f])
        source = str(f.relative_to(data_dir))
        first = min(float(s[0][0]) for s in streams.values() if len(s[0]))
        if _segment(f.name) and first > float(config.get("warmup_steps") or 0) + 100 and depth < 4:
            others = [c for c in shapes[_shape(config)] if c != f]
            full = [(c, streams_of(c)[0]) for c in others if not _segment(c.name)]
            try:
                base = _pick_base(f, full, first)
            except DataError:  # continues another cooldown file's constant phase (a longer extension)
                base = _pick_base(
                    f, [(c, streams_of(c, depth + 1)[0]) for c in others if _segment(c.name)], first
                )
            streams = _join(joined[base][0], streams)
            source += f" + {joined[base][1]}"
        joined[f] = (streams, source)
        return joined[f]

    rows: list[dict[str, Any]] = []
    infos: dict[str, RunInfo] = {}
    for f, d in loaded.items():
        config = d["config"]
        streams, source = streams_of(f)
        tps = float(config["batch_size"]) * float(config["acc_steps"]) * float(config["world_size"])
        tps *= float(config["sequence_length"])
        params = float(d["summary"].get("parameters") or d["summary"].get("optimized_parameters"))
        kind, fract, decay = _schedule_of(f.name, config)
        name = f.stem.replace("_seed0_data_seed1337", "").replace("_llama_norm", "").replace("_llama", "")
        if f.parent != data_dir:
            name = f"{f.parent.name}/{name}"
        it, loss, lr = streams["train"]
        if lr is None or len(it) < 2:
            raise DataError(f"{f}: fewer than 2 training rows with a learning rate")
        steps = int(max(it.max(), streams["val"][0].max() if len(streams["val"][0]) else 0))
        infos[name] = RunInfo(
            run=name,
            params=params,
            tokens_per_step=tps,
            schedule=kind,
            peak_lr=float(config["lr"]),
            steps=steps,
            horizon=int(config["iterations"]),
            cooldown=fract,
            decay=decay,
            dataset=str(config.get("dataset", "")),
            source=source,
        )
        common = {"run": name, "params": params, "tokens_per_step": tps}
        for s, value, rate in zip(it, loss, lr):
            if s >= 1:
                rows.append(
                    {**common, "step": int(s), "lr": float(rate), "loss": float(value), "split": "train"}
                )
        vit, vloss, _ = streams["val"]
        vlr = np.interp(vit, it, lr, left=np.nan)
        first_train = float(it[0])
        for s, value, rate in zip(vit, vloss, vlr):
            if s < 1:
                continue
            if not np.isfinite(rate):  # before the first logged rate: the warmup, linear from 0
                rate = float(lr[0]) * s / first_train
            rows.append({**common, "step": int(s), "lr": float(rate), "loss": float(value), "split": "val"})
    return rows, infos


def _pick_base(segment: Path, candidates: list[tuple[Path, dict[str, Any]]], first: float) -> Path:
    """The run a cooldown file continues: same model, data and peak rate, logged up to the cooldown's first
    row with its rate still at the peak there (a constant run first, then a longer one)."""
    usable = []
    for c, streams in candidates:
        it, _, lr = streams["train"]
        before = it < first
        if lr is None or not before.any() or it.max() < first - 200:
            continue
        if lr[before][-1] < float(lr.max()) * (1 - 1e-6):
            continue
        usable.append((not _segment(c.name), float(it[before][0]) > 100, str(c), c))
    if not usable:
        raise DataError(f"{segment}: no constant-learning-rate run found to join its cooldown to")
    usable.sort(key=lambda u: (u[1], not u[0], u[2]))
    return usable[0][3]


def _join(base: dict[str, Any], segment: dict[str, Any]) -> dict[str, Any]:
    """Each stream: the base's rows before the segment's first row, then the segment's."""
    out = {}
    for key, (it, loss, lr) in segment.items():
        bit, bloss, blr = base[key]
        start = float(it[0]) if len(it) else math.inf
        keep = bit < start
        out[key] = (
            np.concatenate([bit[keep], it]),
            np.concatenate([bloss[keep], loss]),
            None if lr is None or blr is None else np.concatenate([blr[keep], lr]),
        )
    return out


_MPL_NAME = re.compile(r"^(cosine|constant|wsd|wsdld|wsdcon)_?(\d+)?(?:_(\d+))?$")


def multipowerlaw(folder: str | Path) -> tuple[list[dict[str, Any]], dict[str, RunInfo]]:
    """Rows and run descriptions of the MultiPowerLaw repository's csv_25/csv_100/csv_400 curves."""
    root = Path(folder)
    base = root / "loss_curve_repo" if (root / "loss_curve_repo").is_dir() else root
    rows: list[dict[str, Any]] = []
    infos: dict[str, RunInfo] = {}
    for size, params in MPL_PARAMS.items():
        sub = base / f"csv_{size}"
        if not sub.is_dir():
            continue
        for f in sorted(sub.glob("*.csv")):
            m = _MPL_NAME.match(f.stem)
            if not m:
                raise DataError(f"{f}: not a MultiPowerLaw schedule name")
            with open(f, newline="") as fh:
                table = list(csv.DictReader(fh))
            if not table or not {"step", "lr", "loss"} <= set(table[0]):
                raise DataError(f"{f}: expected the columns step, lr, loss")
            name = f"{size}M/{f.stem}"
            kind = {
                "cosine": "cosine",
                "constant": "constant",
                "wsd": "wsd",
                "wsdld": "wsd",
                "wsdcon": "two-stage",
            }
            steps = [int(float(r["step"])) for r in table]
            horizon = int(m.group(3) or m.group(2) or steps[-1]) if m.group(1) != "wsdcon" else steps[-1]
            infos[name] = RunInfo(
                run=name,
                params=params,
                tokens_per_step=MPL_TOKENS_PER_STEP,
                schedule=kind[m.group(1)],
                peak_lr=max(float(r["lr"]) for r in table),
                steps=steps[-1],
                horizon=horizon,
                cooldown=(1 - int(m.group(2)) / int(m.group(3))) if m.group(1) in ("wsd", "wsdld") else 0.0,
                decay={"wsd": "exp", "wsdld": "linear", "cosine": "cosine"}.get(m.group(1), ""),
                source=str(f.relative_to(root)),
            )
            for r, s in zip(table, steps):
                rows.append(
                    {
                        "run": name,
                        "params": params,
                        "tokens_per_step": MPL_TOKENS_PER_STEP,
                        "step": s,
                        "lr": float(r["lr"]),
                        "loss": float(r["loss"]),
                        "split": "train",
                    }
                )
    if not rows:
        raise DataError(f"{folder}: no MultiPowerLaw curves (csv_25/, csv_100/, csv_400/ of *.csv)")
    return rows, infos


def gemstones(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, RunInfo]]:
    """Rows and run descriptions of a Gemstones constant-rate JSON-lines file (wandb_df_for_fitting_hot*)."""
    p = Path(path)
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for i, r in jsonl_records(p):
        if not {"run_name", "params_active_precise", "tokens", "step", "final_loss"} <= set(r):
            raise DataError(
                f"{p}: line {i}: not a Gemstones row (run_name, params_active_precise, tokens, step, final_loss)"
            )
        by_run[str(r["run_name"])].append(r)
    rows: list[dict[str, Any]] = []
    infos: dict[str, RunInfo] = {}
    for name, runs in by_run.items():
        runs.sort(key=lambda r: r["step"])
        params = float(runs[0]["params_active_precise"])
        tps = float(runs[0]["tokens"]) / float(runs[0]["step"])
        short = name.removesuffix("_pretrain")
        infos[short] = RunInfo(
            run=short,
            params=params,
            tokens_per_step=tps,
            schedule="constant",
            peak_lr=1.0,
            steps=int(runs[-1]["step"]),
            horizon=int(runs[-1]["step"]),
            source=p.name,
        )
        for r in runs:
            rows.append(
                {
                    "run": short,
                    "params": params,
                    "tokens_per_step": tps,
                    "step": int(r["step"]),
                    "lr": 1.0,
                    "loss": float(r["final_loss"]),
                    "split": "val",
                }
            )
    return rows, infos
