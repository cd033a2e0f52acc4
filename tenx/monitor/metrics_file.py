"""Reading a run's metrics (metrics.jsonl: one JSON line per step). The callbacks that write them are
in tenx/train/callbacks/metrics.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tenx.utils.io import read_jsonl


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (a torn last line from a crash is ignored, a damaged line is a
    DataError naming it)."""
    return read_jsonl(path)
