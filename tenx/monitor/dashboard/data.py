"""A run directory as the dashboard's JSON view, read again and again while the run trains.

`RunView(run_dir).read()` returns one dict of plain JSON (no NaN: a non-finite value is `null`):

    name, path, exists       the label on every chart (the shortest unique tail of the path) and where
    total_steps, finished    from run.json and the goodput ledger's `end` record
    steps, series            every logged step and, aligned with it, loss, lr, grad_norm, tokens_per_s,
                             mfu, step_time_s and pred_dev (runs of more than `max_points` logged steps
                             are thinned to every k-th step, the last one kept)
    val                      validation losses: {"step": [...], "loss": [...]}
    prediction               the predicted curve and band: from prediction.json, else from the pred_loss,
                             pred_lower and pred_upper of metrics.jsonl; null when there is neither
    heatmaps                 per-layer statistics `stats/NAME/LAYER` (LAYER a block index, embed, norm
                             or head): {NAME: {"layers": [...], "step": [...], "z": [[per step] per layer]}}
    lines                    the other statistics, `stats/GROUP[/SERIES]`: {GROUP: {SERIES: {step, value}}}
    events                   events.jsonl: {step, time, kind, fields}; an event written without a step is
                             placed at the step the ledger had reached at its time (`estimated`: true)
    goodput                  tenx.monitor.goodput.compute_goodput's report, without its per-process rows
    last                     the newest step's loss, validation loss, deviation and final-loss figures
    updated                  when metrics, events or ledger last changed (unix seconds)
    files                    the run's viewable files that exist (config, provenance, eval report, plots)
    errors                   what could not be read, each a sentence (a malformed prediction.json, ...)

metrics.jsonl is read from where the last read stopped, complete lines only: a line still being written is
left for the next read, and a file replaced since (a resume or a rollback rewrites it) is read again from
its start. The small files are parsed again only when their size or modification time changed.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tenx.errors import TenxError
from tenx.monitor.events import read_events
from tenx.monitor.goodput import compute_goodput, read_ledger
from tenx.monitor.prediction_file import read_prediction
from tenx.rundir import RunDir
from tenx.utils.io import JsonlTail

SERIES = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "pred_dev")
"""The per-step figures of metrics.jsonl drawn as lines (pred_dev only once the run is watched)."""

LAST = ("step", "loss", "val_loss", "pred_dev", "pred_final", "pred_final_self", "tokens_per_s", "mfu")
LAYER = re.compile(r"^(\d+|embed|norm|head)$")
"""A per-layer statistic's last component: a block index, or the embedding, final norm or output head."""

LINE_GROUPS = ("loss_source", "step_time_s")
"""Statistics families drawn as lines even though they have several series (sources, ranks)."""

MAX_POINTS = 20_000
MAX_EVENTS = 5_000


def _finite(value: Any) -> Any:
    """`value` with every non-finite float (and the strings events.jsonl writes for them) as None."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _number(value: Any) -> float | None:
    """A finite number as float, anything else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _layer_key(layer: str) -> tuple[int, int]:
    """Layers in model order: embed, blocks 0, 1, ..., the final norm, head."""
    if layer.isdigit():
        return (1, int(layer))
    return ({"embed": 0, "norm": 2, "head": 3}.get(layer, 4), 0)


def unique_names(paths: Sequence[str | Path]) -> list[str]:
    """A label per run: the directory's name, with as many parent folders as it takes to tell runs apart."""
    parts = [Path(os.path.abspath(p)).parts for p in paths]
    names = []
    for i, p in enumerate(parts):
        depth = 1
        while depth < len(p) and any(q != p and q[-depth:] == p[-depth:] for q in parts):
            depth += 1
        name = "/".join(p[-depth:])
        names.append(name if parts.count(p) == 1 else f"{name} ({i + 1})")
    return names


class _Cached:
    """A value computed from a file, computed again only when the file's size or modification time changed."""

    def __init__(self, path: Path, load: Callable[[Path], Any], missing: Any) -> None:
        self.path, self.load, self.missing = path, load, missing
        self._signature: tuple[int, int, int] | None = None
        self._value: Any = missing

    def get(self) -> Any:
        try:
            st = os.stat(self.path)
        except OSError:
            self._signature, self._value = None, self.missing
            return self.missing
        signature = (st.st_ino, st.st_size, st.st_mtime_ns)
        if signature != self._signature:
            self._value = self.load(self.path)
            self._signature = signature
        return self._value


def _read_provenance(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}  # being written, or not JSON: the page does without the total step count
    return obj if isinstance(obj, dict) else {}


def _read_prediction(path: Path) -> dict[str, Any]:
    try:
        p = read_prediction(path)
    except TenxError as e:
        return {"error": str(e)}
    return {
        "source": path.name,
        "step": p.step,
        "loss": p.loss,
        "lower": p.lower,
        "upper": p.upper,
        "level": p.level,
        "quantity": p.quantity,
        "window": p.window,
    }


def _goodput(path: Path) -> dict[str, Any]:
    report = compute_goodput(path.parent)
    return {k: v for k, v in report.items() if k not in ("attempts", "exits")}


def _thin(n: int, max_points: int) -> list[int]:
    """Indices of at most about `max_points` of `n` records, evenly spaced, the last one included."""
    if n <= max_points:
        return list(range(n))
    stride = math.ceil(n / max_points)
    keep = list(range(0, n, stride))
    if keep[-1] != n - 1:
        keep.append(n - 1)
    return keep


def _statistics(records: list[dict[str, Any]], max_points: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `stats/...` keys of the records as heatmaps (per-layer families) and lines (the others)."""
    families: dict[str, dict[str, dict[int, float | None]]] = {}  # name -> sub-key -> step -> value
    singles: dict[str, dict[int, float | None]] = {}
    for r in records:
        step = r["step"]
        for key, value in r.items():
            if not key.startswith("stats/"):
                continue
            parts = key.split("/", 2)
            if len(parts) == 2:
                singles.setdefault(parts[1], {})[step] = _number(value)
            else:
                families.setdefault(parts[1], {}).setdefault(parts[2], {})[step] = _number(value)
    heatmaps: dict[str, Any] = {}
    lines: dict[str, Any] = {}
    for name, values in singles.items():
        lines.setdefault(name, {})[name] = values
    for name, members in families.items():
        if name not in LINE_GROUPS and all(LAYER.match(layer) for layer in members):
            layers = sorted(members, key=_layer_key)
            steps = sorted({s for member in members.values() for s in member})
            steps = [steps[i] for i in _thin(len(steps), max_points)]
            z = [[members[layer].get(s) for s in steps] for layer in layers]
            heatmaps[name] = {"layers": layers, "step": steps, "z": z}
        else:
            group = lines.setdefault(name, {})
            for member, values in members.items():
                group[member] = values
    for group in lines.values():
        for member, values in list(group.items()):
            steps = sorted(values)
            steps = [steps[i] for i in _thin(len(steps), max_points)]
            group[member] = {"step": steps, "value": [values[s] for s in steps]}
    return heatmaps, lines


class RunView:
    """One run directory, read into the dashboard's view on each `read()` (not thread-safe: one reader)."""

    def __init__(self, run_dir: str | Path, name: str | None = None, max_points: int = MAX_POINTS) -> None:
        self.run = RunDir(run_dir)
        self.name = name or self.run.root.name
        self.max_points = max_points
        self._metrics = JsonlTail(self.run.metrics)
        self._events = _Cached(self.run.events, lambda p: read_events(p.parent), [])
        self._ledger = _Cached(self.run.ledger, lambda p: read_ledger(p.parent), [])
        self._goodput = _Cached(self.run.ledger, _goodput, None)
        self._provenance = _Cached(self.run.provenance, _read_provenance, {})
        self._prediction = _Cached(self.run.prediction, _read_prediction, None)

    def files(self) -> list[str]:
        """The run's files worth a link that exist now, relative to the run directory."""
        run = self.run
        candidates = [run.config, run.provenance, run.eval_report, run.loss_curve, run.prediction_png]
        candidates.append(run.extrapolation_png)
        found = []
        for path in candidates:
            try:
                if path.is_file():
                    found.append(path.relative_to(run.root).as_posix())
            except OSError:
                continue
        return found

    def read(self) -> dict[str, Any]:
        """The view of the run as it is on disk now."""
        errors: list[str] = []
        exists = self.run.root.is_dir()
        records = [r for r in self._metrics.read() if isinstance(r.get("step"), int)]
        view: dict[str, Any] = {
            "name": self.name,
            "path": str(self.run.root),
            "exists": exists,
            "records": len(records),
        }
        if not exists:
            errors.append(f"{self.run.root} does not exist yet: the page shows the run once it starts")
        if self._metrics.error is not None:
            errors.append(f"steps not drawn past a damaged line: {self._metrics.error}")
        provenance = self._provenance.get()
        total = provenance.get("total_steps")
        view["total_steps"] = total if isinstance(total, int) else None
        keep = _thin(len(records), self.max_points)
        view["steps"] = [records[i]["step"] for i in keep]
        view["series"] = {
            key: [_number(records[i].get(key)) for i in keep]
            for key in SERIES
            if any(key in r for r in records)
        }
        validated = [r for r in records if "val_loss" in r]
        view["val"] = {
            "step": [r["step"] for r in validated],
            "loss": [_number(r["val_loss"]) for r in validated],
        }
        view["prediction"] = self._prediction_view(records, errors)
        view["heatmaps"], view["lines"] = _statistics(records, self.max_points)
        view["events"] = self._event_view()
        goodput = self._goodput.get()
        view["goodput"] = goodput if goodput and goodput.get("records") else None
        view["finished"] = bool(goodput and goodput.get("finished"))
        last: dict[str, Any] = {}
        for r in records:
            last.update({k: r[k] for k in LAST if k in r})
        view["last"] = last
        view["files"] = self.files()
        view["updated"] = self._updated()
        view["errors"] = errors
        return _finite(view)

    def _updated(self) -> float | None:
        """When the run last wrote a step, an event or a ledger record (unix seconds)."""
        times = []
        for path in (self.run.metrics, self.run.events, self.run.ledger):
            try:
                times.append(path.stat().st_mtime)
            except OSError:
                continue
        return max(times) if times else None

    def _prediction_view(self, records: list[dict[str, Any]], errors: list[str]) -> dict[str, Any] | None:
        predicted = self._prediction.get()
        if predicted is not None and "error" in predicted:
            errors.append(f"prediction not drawn: {predicted['error']}")
        elif predicted is not None:
            return predicted
        watched = [
            r for r in records if all(_number(r.get(k)) is not None for k in ("pred_lower", "pred_upper"))
        ]
        if not watched:
            return None
        return {
            "source": self.run.metrics.name,
            "step": [r["step"] for r in watched],
            "loss": [_number(r.get("pred_loss")) for r in watched],
            "lower": [r["pred_lower"] for r in watched],
            "upper": [r["pred_upper"] for r in watched],
            "level": None,
            "quantity": None,
            "window": None,
        }

    def _event_view(self) -> list[dict[str, Any]]:
        events = self._events.get()[-MAX_EVENTS:]
        ledger: list[tuple[float, int]] | None = None
        out = []
        for event in events:
            step, estimated = event.get("step"), False
            if not isinstance(step, int) or isinstance(step, bool):
                if ledger is None:  # (time, step) of every step record, in time order
                    ledger = sorted(
                        (float(r["time"]), r["step"]) for r in self._ledger.get() if r["kind"] == "step"
                    )
                t = _number(event.get("time"))
                i = bisect.bisect_right(ledger, (t, math.inf)) if t is not None else 0
                step, estimated = (ledger[i - 1][1] if i else 0), True
            fields = {k: v for k, v in event.items() if k not in ("time", "kind", "step")}
            out.append(
                {
                    "step": step,
                    "time": _number(event.get("time")),
                    "kind": str(event.get("kind")),
                    "fields": fields,
                    "estimated": estimated,
                }
            )
        return out
