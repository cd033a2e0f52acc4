"""Curve tables: anyone's loss curves, one row per logged point, as JSONL or CSV.

A curve table is how loss curves from other trainers (torchtitan, Megatron, nanoGPT, a W&B or TensorBoard
export, a published paper's logs) reach tenx's curve laws. One row per logged point:

    run, params, tokens_per_step, step, lr, loss [, split, unique_tokens, seed]

- `run`: the run's name; `params`: its parameter count N; `tokens_per_step`: tokens per optimizer step;
- `step`: the optimizer step (1-based, as tenx's metrics count them), increasing within a run;
- `lr`: the learning rate in effect at that step. Between logged rows it is interpolated linearly; before
  the first row it is a linear warmup from 0 (so a table that starts after warmup still gives the laws a
  schedule);
- `loss`: nats per token, left empty (CSV) or null (JSONL) for the steps to predict;
- `split`: `val` (default) or `train`; `unique_tokens`: the distinct tokens the run's data holds (for
  repeated-data warnings); `seed`.

Every bad row is a DataError that names the file, the line and the field. A (run, split) pair is one curve;
`CurveTable.curves` turns them into `Curve`s with their whole schedule (up to the run's last row).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tenx.errors import ConfigError, DataError
from tenx.scaling.curve.schedule import MAX_STEPS, Curve, Schedule
from tenx.scaling.fit.data_law_check import MIN_TOKENS_PER_PARAM, RISE_TOLERANCE
from tenx.utils.io import atomic_write_text, jsonl_records

REQUIRED = ("run", "params", "tokens_per_step", "step", "lr", "loss")
"""Columns every curve table has (a row may leave `loss` empty: a step to predict)."""
OPTIONAL = ("split", "unique_tokens", "seed")
COLUMNS = REQUIRED + OPTIONAL
SPLITS = ("val", "train")
"""`split` values: the validation loss (default) or the training loss."""
QUANTITY = {"val": "val_loss", "train": "loss"}
"""split -> the Curve's quantity (a validation curve is not smoothed in windows of 2 or more)."""
FORMATS = ("jsonl", "csv")


def table_format(path: str | Path) -> str:
    """`jsonl` or `csv` from the file name's suffix; a ConfigError for any other."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".csv",):
        return "csv"
    raise ConfigError(f"{path}: a curve table is .jsonl or .csv (got {suffix or 'no suffix'!r})")


@dataclass
class TableRun:
    """The rows of one (run, split) of a curve table, in step order."""

    run: str
    split: str
    params: float
    tokens_per_step: float
    steps: np.ndarray
    """(R,) logged steps, increasing"""
    lr: np.ndarray
    """(R,) learning rate at each logged step"""
    loss: np.ndarray
    """(R,) loss, NaN where the row is to be predicted"""
    lines: np.ndarray
    """(R,) line of each row in the file (for messages)"""
    path: str = ""
    unique_tokens: float | None = None
    seed: int | None = None

    @property
    def observed(self) -> np.ndarray:
        """Mask of the rows with a loss."""
        return np.isfinite(self.loss)

    @property
    def last_step(self) -> int:
        return int(self.steps[-1])

    @property
    def tokens(self) -> float:
        """Tokens trained by the run's last row."""
        return self.last_step * self.tokens_per_step

    def schedule(self, last_step: int | None = None) -> Schedule:
        """Every step's learning rate from 1 to `last_step` (default the run's last row): linear between
        rows, a linear warmup from 0 before the first, and the last row's rate held after it."""
        last = self.last_step if last_step is None else int(last_step)
        s = np.arange(1, last + 1, dtype=float)
        lr = np.interp(s, self.steps.astype(float), self.lr)
        first = float(self.steps[0])
        before = s < first
        lr[before] = self.lr[0] * s[before] / first
        try:
            return Schedule(lr, np.full(last, self.tokens_per_step), f"{self.path}: run {self.run!r}")
        except ConfigError as e:
            raise DataError(f"{e} (rows: lines {self.lines[0]}-{self.lines[-1]})") from None

    def curve(self, name: str | None = None, last_step: int | None = None) -> Curve:
        """The observed rows as a Curve of the whole schedule (to `last_step`, default the last row)."""
        keep = self.observed
        config: dict[str, Any] = {"table": self.path, "tokens_per_step": self.tokens_per_step}
        if self.unique_tokens is not None:
            config["unique_tokens"] = self.unique_tokens
        if self.seed is not None:
            config["seed"] = self.seed
        schedule = self.schedule(last_step)
        return Curve(
            name or self.run,
            self.params,
            schedule,
            self.steps[keep],
            self.loss[keep],
            config,
            QUANTITY[self.split],
        )


@dataclass
class CurveTable:
    """Every run of a curve table (or of several, merged)."""

    path: str
    runs: list[TableRun] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def rows(self) -> int:
        return sum(len(r.steps) for r in self.runs)

    def pick_split(self, split: str | None = None) -> str:
        """`split`, or when None the one split every run has (`val` when every run has both)."""
        if split is not None:
            if split not in SPLITS:
                raise ConfigError(f"--split: {split!r} is not one of {', '.join(SPLITS)}")
            return split
        names = {r.run for r in self.runs}
        for s in SPLITS:
            if names == {r.run for r in self.runs if r.split == s}:
                return s
        raise ConfigError(
            f"{self.path}: some runs log only the validation loss and some only the training loss; "
            "choose one with --split val or --split train"
        )

    def select(self, split: str | None = None, runs: Sequence[str] | None = None) -> list[TableRun]:
        """The runs of one split (pick_split), optionally only those named."""
        s = self.pick_split(split)
        out = [r for r in self.runs if r.split == s]
        if runs is not None:
            wanted = list(runs)
            missing = [w for w in wanted if w not in {r.run for r in out}]
            if missing:
                raise DataError(f"{self.path}: no run named {', '.join(map(repr, missing))} ({s} split)")
            out = [r for r in out if r.run in wanted]
        if not out:
            raise DataError(f"{self.path}: no runs with {s} rows")
        return out

    def curves(self, split: str | None = None, runs: Sequence[str] | None = None) -> list[Curve]:
        """The observed part of each run of one split as a Curve (runs with no loss at all are left out)."""
        return [r.curve() for r in self.select(split, runs) if r.observed.any()]


def _bad(path: str, line: int, column: str, what: str) -> DataError:
    return DataError(f"{path}: line {line}: field {column!r}: {what}")


def _number(raw: Any, path: str, line: int, column: str) -> float | None:
    """A cell as a float; None when empty/null; DataError when it is not a number."""
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise _bad(path, line, column, f"expected a number, got {raw!r}")
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        text = raw.strip()
        if not text or text.lower() in ("null", "none"):
            return None
        try:
            return float(text)
        except ValueError:
            raise _bad(path, line, column, f"expected a number, got {raw!r}") from None
    raise _bad(path, line, column, f"expected a number, got {type(raw).__name__}")


class _Builder:
    """Collects rows run by run, checking each as it comes."""

    def __init__(self, path: str):
        self.path = path
        self.runs: dict[tuple[str, str], dict[str, Any]] = {}

    def add(self, row: dict[str, Any], line: int) -> None:
        path = self.path
        name = row.get("run")
        if name is None or (isinstance(name, str) and not name.strip()) or isinstance(name, (dict, list)):
            raise _bad(path, line, "run", "missing (every row names its run)")
        name = str(name)
        split = row.get("split")
        split = "val" if split is None or split == "" else str(split).strip()
        if split not in SPLITS:
            raise _bad(path, line, "split", f"{split!r} is not one of {', '.join(SPLITS)}")
        values: dict[str, float | None] = {}
        for column in ("params", "tokens_per_step", "step", "lr", "loss", "unique_tokens", "seed"):
            values[column] = _number(row.get(column), path, line, column)
        for column, why in (
            ("params", "the model's parameter count"),
            ("tokens_per_step", "tokens per optimizer step"),
            ("step", "the optimizer step"),
            ("lr", "the learning rate in effect at that step"),
        ):
            v = values[column]
            if v is None:
                raise _bad(path, line, column, f"missing ({why})")
            if not math.isfinite(v) or v < 0 or (v == 0 and column != "lr"):
                need = ">= 0" if column == "lr" else "> 0"
                raise _bad(path, line, column, f"{v} is not a finite number {need}")
        step = values["step"]
        assert step is not None
        if step != int(step) or step < 1:
            raise _bad(path, line, "step", f"{step:g} is not a whole step >= 1")
        if step > MAX_STEPS:
            raise _bad(path, line, "step", f"{int(step):,} is past the {MAX_STEPS:,} steps the laws evaluate")
        loss = values["loss"]
        if loss is not None and not (math.isfinite(loss) and loss > 0):
            raise _bad(
                path,
                line,
                "loss",
                f"{loss} is not a finite loss > 0 (leave the cell empty, or null, for a step to predict)",
            )
        unique = values["unique_tokens"]
        if unique is not None and not (math.isfinite(unique) and unique > 0):
            raise _bad(path, line, "unique_tokens", f"{unique} is not a finite token count > 0")
        seed = values["seed"]
        if seed is not None and (not math.isfinite(seed) or seed != int(seed)):
            raise _bad(path, line, "seed", f"{seed} is not a whole number")
        key = (name, split)
        run = self.runs.get(key)
        if run is None:
            self.runs[key] = run = {
                "first": line,
                "params": values["params"],
                "tokens_per_step": values["tokens_per_step"],
                "unique_tokens": unique,
                "seed": seed,
                "steps": [],
                "lr": [],
                "loss": [],
                "lines": [],
            }
        else:
            for column in ("params", "tokens_per_step", "unique_tokens", "seed"):
                v = unique if column == "unique_tokens" else seed if column == "seed" else values[column]
                if v != run[column]:
                    raise _bad(
                        path,
                        line,
                        column,
                        f"{v} differs from {run[column]} on line {run['first']} for run {name!r}: one run "
                        "has one value",
                    )
            if step <= run["steps"][-1]:
                raise _bad(
                    path,
                    line,
                    "step",
                    f"step {int(step)} of run {name!r} ({split}) does not come after step {run['steps'][-1]} "
                    f"on line {run['lines'][-1]}: steps must increase within a run",
                )
        run["steps"].append(int(step))
        run["lr"].append(values["lr"])
        run["loss"].append(math.nan if loss is None else loss)
        run["lines"].append(line)

    def table(self) -> CurveTable:
        out = CurveTable(self.path)
        for (name, split), r in self.runs.items():
            if len(r["steps"]) < 2:
                raise _bad(
                    self.path,
                    r["first"],
                    "run",
                    f"run {name!r} ({split}) has a single row; a curve needs at least 2 (its learning rate "
                    "and losses at two steps)",
                )
            out.runs.append(
                TableRun(
                    run=name,
                    split=split,
                    params=float(r["params"]),
                    tokens_per_step=float(r["tokens_per_step"]),
                    steps=np.array(r["steps"], dtype=np.int64),
                    lr=np.array(r["lr"], dtype=float),
                    loss=np.array(r["loss"], dtype=float),
                    lines=np.array(r["lines"], dtype=np.int64),
                    path=self.path,
                    unique_tokens=r["unique_tokens"],
                    seed=None if r["seed"] is None else int(r["seed"]),
                )
            )
        if not out.runs:
            raise DataError(f"{self.path}: no rows (a curve table has one row per logged point)")
        return out


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, newline="", encoding="utf-8-sig") as f:  # a spreadsheet may add a BOM
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise DataError(f"{path}: empty file (a curve table's first line names its columns)") from None
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise _bad(
                str(path),
                1,
                missing[0],
                f"missing from the header{''.join(f', and so is {c!r}' for c in missing[1:])} (a curve table "
                f"has the columns {', '.join(REQUIRED)}, and "
                f"optionally {', '.join(OPTIONAL)}; this one has {', '.join(header)})",
            )
        index = [(c, header.index(c)) for c in COLUMNS if c in header]
        width = len(header)
        for row in reader:
            line = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != width:
                raise DataError(f"{path}: line {line}: {len(row)} cells where the header has {width}")
            yield line, {c: row[i] for c, i in index}


def read_curve_table(path: str | Path) -> CurveTable:
    """Read and check a curve table (.jsonl or .csv); DataError naming the file, line and field."""
    p = Path(path)
    fmt = table_format(p)
    if not p.is_file():
        raise DataError(f"{p}: no such curve table file")
    builder = _Builder(str(p))
    rows = _csv_rows(p) if fmt == "csv" else jsonl_records(p)
    for line, row in rows:
        builder.add(row, line)
    return builder.table()


def read_curve_tables(paths: Iterable[str | Path]) -> CurveTable:
    """Several curve tables as one (a run name may appear in only one of them)."""
    tables = [read_curve_table(p) for p in paths]
    if not tables:
        raise ConfigError("no curve table given")
    merged = CurveTable(", ".join(t.path for t in tables))
    seen: dict[tuple[str, str], str] = {}
    for t in tables:
        for r in t.runs:
            if (r.run, r.split) in seen:
                raise DataError(f"{t.path}: run {r.run!r} ({r.split}) is also in {seen[(r.run, r.split)]}")
            seen[(r.run, r.split)] = t.path
            merged.runs.append(r)
    return merged


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def format_rows(rows: Iterable[dict[str, Any]], fmt: str) -> str:
    """Rows (dicts of COLUMNS; a NaN or None loss is a step to predict) as curve-table text."""
    rows = list(rows)
    present = [c for c in COLUMNS if c in REQUIRED or any(r.get(c) is not None for r in rows)]
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(present)
        for r in rows:
            writer.writerow([_cell(r.get(c)) for c in present])
        return buf.getvalue()
    if fmt != "jsonl":
        raise ConfigError(f"curve table format {fmt!r} is not one of {', '.join(FORMATS)}")
    lines = []
    for r in rows:
        obj = {}
        for c in present:
            v = r.get(c)
            obj[c] = None if isinstance(v, float) and math.isnan(v) else v
        lines.append(json.dumps(obj))
    return "\n".join(lines) + ("\n" if lines else "")


def table_from_rows(rows: Iterable[dict[str, Any]], source: str, first_line: int = 1) -> CurveTable:
    """Rows (dicts of COLUMNS; a NaN or None loss is a step to predict) checked exactly as a table file's
    lines are, numbered from `first_line` in messages that name `source`."""
    builder = _Builder(source)
    for i, row in enumerate(rows):
        loss = row.get("loss")
        checked = dict(row, loss=None if isinstance(loss, float) and math.isnan(loss) else loss)
        builder.add(checked, first_line + i)
    return builder.table()


def write_curve_table(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write rows as a curve table (format from the suffix), atomically, once they pass the reader's checks
    (a bad row is a DataError naming the line it would have had, and nothing is written)."""
    p = Path(path)
    fmt = table_format(p)
    rows = list(rows)
    table_from_rows(rows, str(p), first_line=2 if fmt == "csv" else 1)  # a CSV table's line 1 is its header
    atomic_write_text(p, format_rows(rows, fmt))
    return p


def rows_of(run: TableRun) -> list[dict[str, Any]]:
    """A TableRun back as rows."""
    return [
        {
            "run": run.run,
            "params": run.params,
            "tokens_per_step": run.tokens_per_step,
            "step": int(s),
            "lr": float(lr),
            "loss": float(loss),
            "split": run.split,
            "unique_tokens": run.unique_tokens,
            "seed": run.seed,
        }
        for s, lr, loss in zip(run.steps, run.lr, run.loss)
    ]


def curve_regime_warnings(runs: Sequence[TableRun], role: str = "") -> list[str]:
    """Warnings for runs in regimes the curve laws cannot describe, each naming the run: fewer than
    MIN_TOKENS_PER_PARAM tokens per parameter, data repeated (unique_tokens below the tokens trained), a
    loss that rises again by more than RISE_TOLERANCE after its lowest point (the limits the data-constrained
    law's warnings use, tenx.scaling.fit.data_law_check)."""
    out = []
    what = f"{role} run" if role else "run"
    for r in runs:
        per_param = r.tokens / r.params
        if per_param < MIN_TOKENS_PER_PARAM:
            out.append(
                f"{what} {r.run!r} trains {per_param:.2g} tokens per parameter (below {MIN_TOKENS_PER_PARAM:g}): "
                "the curve laws describe runs past the first fast fall; treat its figures as outside their range"
            )
        if r.unique_tokens is not None and r.tokens > r.unique_tokens * 1.0001:
            out.append(
                f"{what} {r.run!r} repeats its data ({r.tokens / r.unique_tokens:.3g} epochs of "
                f"{r.unique_tokens:.3g} unique tokens): the curve laws assume fresh data; repeated data is "
                "the data-constrained law's regime (tenx fit --law data-constrained)"
            )
        seen = r.observed
        steps, loss = r.steps[seen], r.loss[seen]
        if len(loss) >= 8:
            after_peak = steps >= int(r.steps[int(np.argmax(r.lr))])
            tail = loss[after_peak] if after_peak.sum() >= 8 else loss
            k = max(2, len(tail) // 20)  # mean of a few records: one noisy record is not a rise
            smooth = np.convolve(tail, np.ones(k) / k, mode="valid")
            low = int(np.argmin(smooth))
            if smooth[-1] > smooth[low] * (1 + RISE_TOLERANCE):
                step_low = int(steps[after_peak][low] if after_peak.sum() >= 8 else steps[low])
                out.append(
                    f"{what} {r.run!r}: its loss rises again after step {step_low}, by "
                    f"{100 * (smooth[-1] / smooth[low] - 1):.1f}% (overfitting repeated data, or an "
                    "instability): the curve laws describe a loss that does not rise, so its figures are "
                    "not trustworthy"
                )
    return out
