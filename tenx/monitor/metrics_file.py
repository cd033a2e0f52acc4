"""Reading a run's metrics (metrics.jsonl: one JSON line per step). The callbacks that write them are
in tenx/train/callbacks/metrics.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tenx.utils.io import jsonl_records, read_jsonl, require_file


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (a torn last line from a crash is ignored, a damaged line is a
    DataError naming it, and so is a directory in the file's place)."""
    require_file(Path(path), "a metrics file")
    return read_jsonl(path)


def read_metrics_counted(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """For a reader that shows what it can (tenx status): (the records of a metrics.jsonl file whose step is
    a whole number, how many complete lines were passed over: not JSON, not a JSON object, or without a
    whole-number step). A torn last line from a crash is passed over uncounted; a directory in the file's
    place is a DataError naming it."""
    path = Path(path)
    require_file(path, "a metrics file")
    damaged: list[int] = []
    records: list[dict[str, Any]] = []
    skipped = 0
    for _, record in jsonl_records(path, passed_over=damaged):
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            records.append(record)
        else:
            skipped += 1
    return records, skipped + len(damaged)
