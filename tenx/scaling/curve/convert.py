"""Curve tables from the logs trainers leave: a tenx run or ladder, a TensorBoard log directory, a W&B export.

Each converter returns curve-table rows (dicts of tenx.scaling.curve.curve_table.COLUMNS) for
`write_curve_table`; `tenx curves convert` is the command line over them.

- `rows_from_run(RUN_DIR)`, `rows_from_ladder(LADDER_DIR)`: a tenx run knows everything a table needs:
  run.json gives the parameter count and tokens per step, config.toml the whole schedule, metrics.jsonl the
  training loss of every step (split `train`) and the validation loss every train.eval_every steps (split
  `val`). Both splits are written when the run logged them. When the run stopped before its planned last
  step (still training, or cut short), one row at that step with an empty loss says where its schedule
  ends: the step to predict.
- `rows_from_tensorboard(LOGDIR, params=, tokens_per_step=)`: the scalars of every directory under LOGDIR
  that holds event files (one run each, named by its path below LOGDIR). Scalars written as TF2 summary
  tensors are read too.
- `rows_from_wandb_csv(FILE, params=, tokens_per_step=)`: the CSV the W&B UI exports from a chart or a run's
  history: a step column, and metric columns named `METRIC` (one run) or `RUN - METRIC` (one set per run,
  with `__MIN`/`__MAX` companions, which are left out). An empty cell is a metric not logged at that step;
  a run without the loss column (a run of another chart) is left out.

A TensorBoard log or a W&B export does not say how large the model was or how many tokens a step trained
on: the caller gives `params` and `tokens_per_step`, never a guess. The loss and learning-rate names are
found among the common ones (LOSS_NAMES, LR_NAMES; case does not matter) unless given. The learning rate
is often logged at other steps than the loss: it is interpolated linearly at each loss step, held at its
last logged value after it, and a loss logged before the first learning rate is an error (the table's
warmup would be invented). A point at step 0 (an evaluation before training) is left out: a table's
steps start at 1. Steps are taken as the source numbers them; a step logged twice (a resumed run) counts
once, the later value. Every error names the file or directory and the tag or column at fault.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tenx import rundir
from tenx.errors import ConfigError, DataError
from tenx.scaling.curve.curve_table import QUANTITY, SPLITS

LOSS_NAMES = {
    "val": (
        "val/loss",
        "val_loss",
        "eval/loss",
        "loss/val",
        "validation/loss",
        "valid/loss",
        "validation_loss",
        "eval_loss",
        "loss/validation",
        "val/lm_loss",
        "lm loss validation",
        "val/ce_loss",
    ),
    "train": (
        "train/loss",
        "loss",
        "train_loss",
        "loss/train",
        "training/loss",
        "train/lm_loss",
        "lm loss",
        "train/ce loss",
        "loss_metrics/global_avg_loss",
    ),
}
"""The loss names each split looks for when none is given, most specific first (tenx, PyTorch Lightning,
Hugging Face, Megatron, OLMo-core, torchtitan spell them so)."""
LR_NAMES = (
    "lr",
    "train/lr",
    "learning_rate",
    "train/learning_rate",
    "lr-AdamW",
    "lr-Adam",
    "lr-SGD",
    "optimizer/lr",
    "optim/lr",
    "optim/LR (group 0)",
    "learning-rate",
    "trainer/learning_rate",
    "lr/group0",
)
"""The learning-rate names looked for when none is given."""
STEP_COLUMNS = ("Step", "_step", "trainer/global_step", "global_step", "step")
"""The step columns a W&B export may have, in the order they are looked for."""
RUN_SEPARATOR = " - "
"""W&B names a chart export's columns `RUN - METRIC`."""
COMPANIONS = ("__MIN", "__MAX")
"""Suffixes of the min/max columns a W&B chart export adds beside each metric."""


def rows_from_run(run_dir: str | Path, split: str = "both", name: str | None = None) -> list[dict[str, Any]]:
    """The curve-table rows of a tenx run directory: `split` is `val`, `train` or `both` (the splits the
    run logged; at least one)."""
    from tenx.monitor.metrics_file import read_metrics
    from tenx.scaling.curve.schedule import curve_from_run

    splits = _splits(split)
    rd = rundir.RunDir(run_dir)
    if not rd.config.exists() or not rd.metrics.exists():
        raise DataError(
            f"{run_dir}: not a tenx run directory with a config and metrics (need {rd.config.name} and "
            f"{rd.metrics.name})"
        )
    records = [r for r in read_metrics(rd.metrics) if "skipped" not in r]
    logged = {"val": any("val_loss" in r for r in records), "train": any("loss" in r for r in records)}
    if split != "both":
        if not logged[split]:
            what = (
                "validation loss (val_loss; train.eval_every was 0?)" if split == "val" else "training loss"
            )
            raise DataError(f"{rd.metrics}: holds no {what}")
    elif not any(logged.values()):
        raise DataError(f"{rd.metrics}: holds no loss")
    rows: list[dict[str, Any]] = []
    for s in splits:
        if not logged[s]:
            continue
        curve = curve_from_run(run_dir, name, quantity=QUANTITY[s])
        tokens_per_step = float(curve.config["tokens_per_step"])
        seed = curve.config.get("seed")
        steps = [int(x) for x in curve.steps]
        losses: list[float | None] = [float(x) for x in curve.loss]
        if steps[-1] < curve.schedule.steps:  # where the schedule ends: the step to predict
            steps.append(curve.schedule.steps)
            losses.append(None)
        for step, loss in zip(steps, losses):
            lr = curve.schedule.lr[step - 1]
            rows.append(_row(curve.name, s, curve.params, tokens_per_step, step, lr, loss, seed))
    return rows


def rows_from_ladder(ladder_dir: str | Path, split: str = "both") -> list[dict[str, Any]]:
    """The rows of every run of a tenx ladder (LADDER/runs/NAME, or run directories straight under
    `ladder_dir`), each named by its folder; runs not started yet (no metrics) are left out."""
    root = Path(ladder_dir)
    if not root.is_dir():
        raise DataError(f"{root}: no such ladder directory")
    runs_dir = root / "runs" if (root / "runs").is_dir() else root
    runs = sorted(p for p in runs_dir.iterdir() if rundir.RunDir(p).config.exists())
    started = [p for p in runs if rundir.RunDir(p).metrics.exists()]
    if not started:
        raise DataError(
            f"{runs_dir}: holds no run directory with metrics (folders with {rundir.CONFIG} and "
            f"{rundir.METRICS})"
        )
    return [row for p in started for row in rows_from_run(p, split, p.name)]


def rows_from_tensorboard(
    logdir: str | Path,
    *,
    params: float,
    tokens_per_step: float,
    loss_tag: str | None = None,
    lr_tag: str | None = None,
    split: str = "val",
    run: str | None = None,
) -> list[dict[str, Any]]:
    """The rows of a TensorBoard log: each directory at or below `logdir` holding event files is one run,
    named by its path below `logdir` (`run` names a lone run, or prefixes the names of several)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    params, tokens_per_step = _size(params, tokens_per_step)
    split = _one_split(split)
    root = Path(logdir)
    event_dirs = _event_dirs(root)
    scalars: dict[Path, dict[str, list[tuple[int, float]]]] = {}
    for d in event_dirs:
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        scalars[d] = _scalars(acc)
    several = len(event_dirs) > 1
    rows: list[dict[str, Any]] = []
    missing: list[str] = []
    for d in event_dirs:
        tags = scalars[d]
        where = str(d)
        loss_key = _find(tags, loss_tag, LOSS_NAMES[split])
        if loss_key is None:
            if not several:
                raise DataError(_no_loss(where, "tag", loss_tag, split, tags, "loss_tag (--loss-tag)"))
            missing.append(f"{where}: {_listed(tags)}")
            continue  # another folder of the log (hparams, a side metric)
        lr_key = _find(tags, lr_tag, LR_NAMES)
        if lr_key is None:
            raise DataError(_no_lr(where, "tag", lr_tag, tags, "lr_tag (--lr-tag)"))
        rel = d.relative_to(root).as_posix() if d != root else ""
        alone = rel or (root.parent.name if root.is_file() else root.name)
        name = _run_name(run, rel if several else "", alone)
        rows += _curve_rows(
            name,
            split,
            params,
            tokens_per_step,
            _points(tags[loss_key], f"{where}: tag {loss_key!r}"),
            _points(tags[lr_key], f"{where}: tag {lr_key!r}"),
            f"{where}: tag {loss_key!r}",
            f"{where}: tag {lr_key!r}",
        )
    if not rows:
        wanted = (
            repr(loss_tag) if loss_tag is not None else f"{split} loss tag ({', '.join(LOSS_NAMES[split])})"
        )
        raise DataError(
            f"{root}: no event directory has a {wanted}; name one with loss_tag (--loss-tag). Scalar tags: "
            + "; ".join(missing)
        )
    return rows


def rows_from_wandb_csv(
    path: str | Path,
    *,
    params: float,
    tokens_per_step: float,
    loss_column: str | None = None,
    lr_column: str | None = None,
    step_column: str | None = None,
    split: str = "val",
    run: str | None = None,
) -> list[dict[str, Any]]:
    """The rows of a W&B CSV export (a chart's or a run history's): one run, or one per `RUN - METRIC`
    column set. `loss_column` and `lr_column` name a metric (`val/loss`) or a whole column; `run` names a
    lone run (default: the file's name), or prefixes the names of several."""
    params, tokens_per_step = _size(params, tokens_per_step)
    split = _one_split(split)
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such W&B export file")
    with open(p, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        if not header:
            raise DataError(f"{p}: empty file (a W&B export's first line names its columns)")
        step_at = _step_column(p, header, step_column)
        runs = _wandb_runs(header, step_at)
        found = {name: _wandb_pick(p, name, metrics, loss_column, lr_column, split) for name, metrics in runs}
        picked = {name: cols for name, cols in found.items() if cols is not None}
        if not picked:
            wanted = (
                repr(loss_column) if loss_column else f"{split} loss column ({', '.join(LOSS_NAMES[split])})"
            )
            raise DataError(
                f"{p}: line 1: no {wanted}; name one with loss_column (--loss-column). Columns: {_listed(header)}"
            )
        read = {i for cols in picked.values() for i in cols}
        points: dict[int, list[tuple[int, float]]] = {i: [] for i in read}
        for cells in reader:
            if not cells or all(not c.strip() for c in cells):
                continue
            line = reader.line_num
            if len(cells) != len(header):
                raise DataError(f"{p}: line {line}: {len(cells)} cells where the header has {len(header)}")
            raw_step = cells[step_at].strip()
            step = _cell_number(p, line, header[step_at], raw_step)
            if step is None:
                continue
            if not math.isfinite(step) or step != int(step):
                raise DataError(
                    f"{p}: line {line}: column {header[step_at]!r}: {raw_step!r} is not a whole step"
                )
            for i in read:
                value = _cell_number(p, line, header[i], cells[i])
                if value is not None:
                    if not math.isfinite(value):
                        raise DataError(
                            f"{p}: line {line}: column {header[i]!r}: {cells[i].strip()!r} at step {int(step)} "
                            "(a diverged step: cut the export before it)"
                        )
                    points[i].append((int(step), value))
    several = len(picked) > 1
    rows: list[dict[str, Any]] = []
    for name, (loss_at, lr_at) in picked.items():
        run_name = _run_name(run, name if several else "", name or p.stem)
        rows += _curve_rows(
            run_name,
            split,
            params,
            tokens_per_step,
            points[loss_at],
            points[lr_at],
            f"{p}: column {header[loss_at]!r}",
            f"{p}: column {header[lr_at]!r}",
        )
    return rows


def _splits(split: str) -> tuple[str, ...]:
    if split == "both":
        return SPLITS
    if split not in SPLITS:
        raise ConfigError(f"split: {split!r} is not one of both, {', '.join(SPLITS)}")
    return (split,)


def _one_split(split: str) -> str:
    if split not in SPLITS:
        raise ConfigError(
            f"split: {split!r} is not one of {', '.join(SPLITS)} (a log's loss name belongs to one split: "
            "convert each split into its own table)"
        )
    return split


def _size(params: float, tokens_per_step: float) -> tuple[float, float]:
    for what, value, why in (
        ("params", params, "the model's parameter count"),
        ("tokens_per_step", tokens_per_step, "tokens per optimizer step"),
    ):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ConfigError(
                f"{what}: must be a positive number ({why}; the log does not say it), got {value!r}"
            )
    return float(params), float(tokens_per_step)


def _row(
    run: str,
    split: str,
    params: float,
    tokens_per_step: float,
    step: int,
    lr: float,
    loss: float | None,
    seed: int | None = None,
) -> dict[str, Any]:
    return {
        "run": run,
        "params": _whole(params),
        "tokens_per_step": _whole(tokens_per_step),
        "step": int(step),
        "lr": float(lr),
        "loss": loss,
        "split": split,
        "unique_tokens": None,
        "seed": None if seed is None else int(seed),
    }


def _whole(x: float) -> int | float:
    """A count as an int when it is whole (a table reads `508544`, not `508544.0`)."""
    return int(x) if float(x).is_integer() else float(x)


def _run_name(run: str | None, below: str, alone: str) -> str:
    """`run` (or `alone`) for a lone run; `run/below` (or `below`) for one of several."""
    if not below:
        return run or alone
    return f"{run}/{below}" if run else below


def _curve_rows(
    name: str,
    split: str,
    params: float,
    tokens_per_step: float,
    loss: Sequence[tuple[int, float]],
    lr: Sequence[tuple[int, float]],
    loss_where: str,
    lr_where: str,
) -> list[dict[str, Any]]:
    """One run's rows: the loss points (step >= 1, the later of a step logged twice) with the learning rate
    interpolated at their steps."""
    loss_by_step = {s: v for s, v in loss if s >= 1}
    lr_by_step = dict(lr)
    if len(loss_by_step) < 2:
        raise DataError(
            f"{loss_where}: {len(loss_by_step)} logged point(s) at steps >= 1; a curve needs at least 2"
        )
    if not lr_by_step:
        raise DataError(f"{lr_where}: no logged learning rate")
    steps = np.array(sorted(loss_by_step))
    lr_steps = np.array(sorted(lr_by_step), dtype=float)
    lr_values = np.array([lr_by_step[int(s)] for s in lr_steps])
    bad = np.flatnonzero(lr_values < 0)
    if len(bad):
        raise DataError(
            f"{lr_where}: the learning rate at step {int(lr_steps[bad[0]])} is {lr_values[bad[0]]}"
        )
    if steps[0] < lr_steps[0]:
        raise DataError(
            f"{loss_where}: the loss at step {int(steps[0])} comes before the first logged learning rate "
            f"({lr_where}, step {int(lr_steps[0])}): its learning rate is unknown; drop the earlier points "
            "or log the learning rate from the start"
        )
    lr_at = np.interp(steps.astype(float), lr_steps, lr_values)
    return [
        _row(name, split, params, tokens_per_step, int(s), float(r), float(loss_by_step[int(s)]))
        for s, r in zip(steps, lr_at)
    ]


def _points(events: Iterable[tuple[int, float]], where: str) -> list[tuple[int, float]]:
    """(step, value) pairs in logged order; a non-finite value is a DataError naming its step."""
    out = []
    for step, value in events:
        if not math.isfinite(value):
            raise DataError(f"{where}: {value} at step {step} (a diverged step: cut the log before it)")
        out.append((int(step), float(value)))
    return out


def _find(names: Iterable[str], given: str | None, candidates: Sequence[str]) -> str | None:
    """`given` if present (exactly or, failing that, but for case), else the first candidate present."""
    names = list(names)
    lower = {n.lower(): n for n in reversed(names)}
    for want in [given] if given is not None else candidates:
        if want in names:
            return want
        if want.lower() in lower:
            return lower[want.lower()]
    return None


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(repr(n) for n in names) if names else "none"


def _no_loss(where: str, kind: str, given: str | None, split: str, names: Iterable[str], flag: str) -> str:
    if given is not None:
        return f"{where}: no {kind} {given!r} (its {kind}s: {_listed(names)})"
    return (
        f"{where}: no {split} loss {kind} among the usual names ({', '.join(LOSS_NAMES[split])}); its {kind}s: "
        f"{_listed(names)}; name one with {flag}"
    )


def _no_lr(where: str, kind: str, given: str | None, names: Iterable[str], flag: str) -> str:
    if given is not None:
        return f"{where}: no {kind} {given!r} (its {kind}s: {_listed(names)})"
    return (
        f"{where}: no learning-rate {kind} among the usual names ({', '.join(LR_NAMES)}); its {kind}s: "
        f"{_listed(names)}; name one with {flag} (a table needs each step's learning rate)"
    )


def _event_dirs(root: Path) -> list[Path]:
    """`root` and every directory below it holding event files, sorted; `root` may be one event file."""
    if root.is_file() and "tfevents" in root.name:
        return [root]
    if not root.is_dir():
        raise DataError(f"{root}: no such TensorBoard log directory")
    found = sorted(Path(d) for d, _, files in os.walk(root) if any("tfevents" in f for f in files))
    if not found:
        raise DataError(f"{root}: holds no TensorBoard event files (events.out.tfevents.*)")
    return found


def _scalars(acc: Any) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of an EventAccumulator: summary scalars, and TF2 scalar tensors."""
    from tensorboard.util import tensor_util

    tags = acc.Tags()
    out = {tag: [(e.step, float(e.value)) for e in acc.Scalars(tag)] for tag in tags.get("scalars", [])}
    for tag in tags.get("tensors", []):
        if tag in out or acc.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
            continue
        out[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
    return out


def _step_column(path: Path, header: list[str], given: str | None) -> int:
    at = _find(header, given, STEP_COLUMNS)
    if at is None:
        if given is not None:
            raise DataError(f"{path}: line 1: no step column {given!r} (columns: {_listed(header)})")
        raise DataError(
            f"{path}: line 1: no step column ({', '.join(STEP_COLUMNS)}); columns: {_listed(header)}; name it "
            "with step_column (--step-column)"
        )
    return header.index(at)


def _wandb_runs(header: list[str], step_at: int) -> list[tuple[str, dict[str, int]]]:
    """(run name, {metric: column}) of each run of an export: '' for the metrics without a run prefix."""
    shared: dict[str, int] = {}
    runs: dict[str, dict[str, int]] = {}
    for i, column in enumerate(header):
        if i == step_at or column.endswith(COMPANIONS) or not column:
            continue
        name, sep, metric = column.rpartition(RUN_SEPARATOR)
        if sep and name and metric:
            runs.setdefault(name, {})[metric] = i
        else:
            shared[column] = i
    if not runs:
        return [("", shared)]
    return [(name, {**shared, **metrics}) for name, metrics in runs.items()]


def _wandb_pick(
    path: Path, name: str, metrics: dict[str, int], loss: str | None, lr: str | None, split: str
) -> tuple[int, int] | None:
    """(loss column, lr column) of one run; None when it has no such loss column (a run of another chart)."""
    where = f"{path}: run {name!r}" if name else str(path)
    columns = {**metrics, **{f"{name}{RUN_SEPARATOR}{m}": i for m, i in metrics.items()}} if name else metrics
    loss_key = _find(columns, loss, LOSS_NAMES[split])
    if loss_key is None:
        return None
    lr_key = _find(columns, lr, LR_NAMES)
    if lr_key is None:
        raise DataError(_no_lr(where, "column", lr, metrics, "lr_column (--lr-column)"))
    return columns[loss_key], columns[lr_key]


def _cell_number(path: Path, line: int, column: str, raw: str) -> float | None:
    text = raw.strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise DataError(f"{path}: line {line}: column {column!r}: expected a number, got {raw!r}") from None
