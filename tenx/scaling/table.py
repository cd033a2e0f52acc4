"""Run tables for scaling fits: one row per finished run, read from CSV, JSONL or a ladder directory.

Filters pick the rows to use (`dataset=c4`); a holdout expression (`params>=1e9`) keeps some of them aside
so a fit on the rest can be checked against them. Both are parsed here by a small grammar, never `eval`.
"""

from __future__ import annotations

import csv
import math
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tenx.errors import ConfigError, DataError
from tenx.utils.io import jsonl_records, regular_input_file

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
    "=": operator.eq,
}
_COMPARISON = re.compile(r"^\s*([A-Za-z_][\w.\-]*)\s*(>=|<=|==|!=|>|<|=)\s*(\S.*?)\s*$")
_AND = re.compile(r"\s*&&?\s*|\s+and\s+")


def _as_number(value: Any) -> float | None:
    """`value` as a float when it is a number or a string that parses as one, else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        return None


def _matches(row_value: Any, op: str, value: str) -> bool:
    """One comparison; numeric when both sides parse as numbers, else string (equality only)."""
    left, right = _as_number(row_value), _as_number(value)
    if left is not None and right is not None:
        return _OPS[op](left, right)
    if op in ("=", "==", "!="):
        return _OPS[op](str(row_value), value)
    return False


@dataclass(frozen=True)
class Comparison:
    """`column op value`, as parsed from a filter or holdout expression."""

    column: str
    op: str
    value: str

    def __call__(self, row: dict[str, Any]) -> bool:
        return self.column in row and _matches(row[self.column], self.op, self.value)


def parse_holdout(expr: str) -> list[Comparison]:
    """'params>=1e9 & tokens<1e10' -> comparisons that must all hold; ConfigError on anything else."""
    parts = _AND.split(expr.strip()) if expr.strip() else []
    if not parts:
        raise ConfigError(
            "--holdout: empty expression; write e.g. 'params>=1e9' or 'params>=1e9 & tokens<1e11'"
        )
    comparisons = []
    for part in parts:
        m = _COMPARISON.match(part)
        if not m:
            raise ConfigError(
                f"--holdout {expr!r}: cannot parse {part!r}; each comparison is COLUMN OP VALUE with OP one of "
                ">=, <=, ==, !=, >, <, joined by '&' or ' and ' (e.g. 'params>=1e9 & tokens<1e11')"
            )
        column, op, value = m.groups()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if any(c in value for c in "<>=&|()"):
            raise ConfigError(f"--holdout {expr!r}: unexpected operator in the value {value!r} of {part!r}")
        if op in (">=", "<=", ">", "<") and _as_number(value) is None:
            raise ConfigError(f"--holdout {expr!r}: {op} needs a number, got {value!r}")
        comparisons.append(Comparison(column, op, value))
    return comparisons


def parse_filter(spec: str) -> Comparison:
    """'COLUMN=VALUE' -> an equality comparison; ConfigError otherwise."""
    column, sep, value = spec.partition("=")
    column = column.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][\w.\-]*", column):
        raise ConfigError(f"--filter {spec!r}: expected COLUMN=VALUE, e.g. dataset=c4_original")
    return Comparison(column, "==", value.strip())


@dataclass
class Points:
    """The numeric columns of some rows; NaN where an optional column is absent."""

    N: np.ndarray
    D: np.ndarray
    L: np.ndarray
    C: np.ndarray
    U: np.ndarray
    budget: np.ndarray

    def __len__(self) -> int:
        return len(self.L)

    def take(self, index: np.ndarray) -> Points:
        """The points at `index` (a boolean mask or integer indices)."""
        return Points(*(getattr(self, k)[index] for k in ("N", "D", "L", "C", "U", "budget")))


@dataclass
class Table:
    """A run table: the rows kept by the filters, split into rows to fit and rows held out."""

    path: str
    rows: list[dict[str, Any]]
    fit_rows: list[dict[str, Any]]
    holdout_rows: list[dict[str, Any]]
    fit: Points
    holdout: Points
    columns: dict[str, str] = field(default_factory=dict)
    holdout_expr: str | None = None

    def with_fit_rows(self, keep: np.ndarray) -> Table:
        """A table fitting only the fit rows where `keep` is true (the holdout rows stay as they are)."""
        keep = np.asarray(keep, dtype=bool)
        return Table(
            path=self.path,
            rows=self.rows,
            fit_rows=[r for r, k in zip(self.fit_rows, keep) if k],
            holdout_rows=self.holdout_rows,
            fit=self.fit.take(keep),
            holdout=self.holdout,
            columns=self.columns,
            holdout_expr=self.holdout_expr,
        )


def _read_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs of a CSV or JSONL file."""
    if not path.exists():
        raise DataError(
            f"{path}: no such file; give a .csv, a .jsonl or a ladder directory with results.jsonl"
        )
    regular_input_file(path, "run table")
    rows: list[tuple[int, dict[str, Any]]] = []
    if path.suffix.lower() == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames:
                raise DataError(f"{path}: empty CSV; the first line must name the columns")
            for row in reader:
                rows.append((reader.line_num, dict(row)))
        return rows
    if path.suffix.lower() not in (".jsonl", ".json"):
        raise DataError(f"{path}: unknown format {path.suffix!r}; give a .csv or .jsonl file")
    return list(jsonl_records(path))


def _positive(path: Path, line: int, row: dict[str, Any], column: str) -> float:
    """The row's value in `column` as a positive finite float; DataError naming file, line and column."""
    if column not in row:
        raise DataError(
            f"{path}: line {line}: column {column!r} is missing; add it or choose another column "
            f"(columns of this row: {', '.join(sorted(row))})"
        )
    if row[column] in (None, ""):
        raise DataError(
            f"{path}: line {line}: the {column!r} cell is empty; fill it in or leave the row out "
            "(--filter keeps only matching rows)"
        )
    value = _as_number(row[column])
    if value is None or not math.isfinite(value):
        raise DataError(f"{path}: line {line}: column {column!r} is not a number: {row[column]!r}")
    if value <= 0:
        raise DataError(f"{path}: line {line}: column {column!r} must be positive, got {row[column]!r}")
    return value


def _points(
    path: Path, rows: Sequence[tuple[int, dict[str, Any]]], columns: dict[str, str], use_flops: bool
) -> Points:
    """Numeric columns of `rows`: loss always; params and tokens unless flops are given; unique optional."""
    n = len(rows)
    out = {k: np.full(n, np.nan) for k in ("N", "D", "L", "C", "U", "budget")}
    for i, (line, row) in enumerate(rows):
        out["L"][i] = _positive(path, line, row, columns["loss"])
        if not use_flops or columns["params"] in row:
            out["N"][i] = _positive(path, line, row, columns["params"])
        if not use_flops or columns["tokens"] in row:
            out["D"][i] = _positive(path, line, row, columns["tokens"])
        out["C"][i] = (
            _positive(path, line, row, columns["flops"]) if use_flops else 6 * out["N"][i] * out["D"][i]
        )
        if row.get(columns["unique"]) not in (None, ""):
            out["U"][i] = _positive(path, line, row, columns["unique"])
        if row.get("budget") not in (None, ""):
            out["budget"][i] = _positive(path, line, row, "budget")
    return Points(**out)


def read_table(
    path: str | Path,
    *,
    params_column: str = "params",
    tokens_column: str = "tokens",
    loss_column: str = "heldout_loss",
    flops_column: str = "flops",
    unique_column: str = "unique_tokens",
    filters: Iterable[str] = (),
    holdout: str | None = None,
) -> Table:
    """Read a .csv, a .jsonl or LADDER_DIR/results.jsonl; keep rows passing `filters`; set `holdout` rows aside."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.jsonl"
    numbered = _read_rows(path)
    present = set().union(*(row.keys() for _, row in numbered)) if numbered else set()
    for spec in filters:
        comparison = parse_filter(spec)
        if comparison.column not in present:
            raise ConfigError(
                f"--filter {spec!r}: {path} has no column {comparison.column!r} "
                f"(columns: {', '.join(sorted(present))})"
            )
        numbered = [(line, row) for line, row in numbered if comparison(row)]
    if not numbered:
        raise DataError(f"{path}: no rows left after the filters {list(filters)}; check the filter values")
    comparisons = parse_holdout(holdout) if holdout is not None else []
    for c in comparisons:
        if c.column not in present:
            raise ConfigError(
                f"--holdout {holdout!r}: {path} has no column {c.column!r} (columns: {', '.join(sorted(present))})"
            )
    columns = {
        "params": params_column,
        "tokens": tokens_column,
        "loss": loss_column,
        "flops": flops_column,
        "unique": unique_column,
    }
    # C is the flops column only when every row has it, so that all points share one definition of compute.
    use_flops = all(row.get(flops_column) not in (None, "") for _, row in numbered)
    held = [bool(comparisons) and all(c(row) for c in comparisons) for _, row in numbered]
    fit_numbered = [nr for nr, h in zip(numbered, held) if not h]
    held_numbered = [nr for nr, h in zip(numbered, held) if h]
    if not fit_numbered:
        raise DataError(f"{path}: the holdout {holdout!r} keeps every row aside; nothing is left to fit")
    return Table(
        path=str(path),
        rows=[row for _, row in numbered],
        fit_rows=[row for _, row in fit_numbered],
        holdout_rows=[row for _, row in held_numbered],
        fit=_points(path, fit_numbered, columns, use_flops),
        holdout=_points(path, held_numbered, columns, use_flops),
        columns=columns,
        holdout_expr=holdout,
    )
