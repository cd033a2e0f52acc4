"""Reading a run's metrics (metrics.jsonl: one JSON line per step). The callbacks that write them are
in tenx/train/callbacks/metrics.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tenx.monitor.events import require_file
from tenx.utils.io import read_jsonl


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
    lines = path.read_bytes().split(b"\n")
    records: list[dict[str, Any]] = []
    skipped = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:  # NaN is allowed: a skipped step's loss is written as NaN
            record = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError:
            if i == len(lines) - 1:  # the last piece has no newline: the write a crash cut short
                continue
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            records.append(record)
        else:
            skipped += 1
    return records, skipped
