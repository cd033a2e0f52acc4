"""Reading a run's metrics (metrics.jsonl: one JSON line per step). The callbacks that write them are
in tenx/train/callbacks/metrics.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (a torn last line from a crash is ignored)."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                break
    return records
