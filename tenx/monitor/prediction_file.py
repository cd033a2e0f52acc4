"""prediction.json: a run's predicted loss curve, step by step with a band, the file a run is watched against.

`tenx predict` writes it (from a ladder's curves, or from the first part of a run's own curve); the monitor
reads it. The format is versioned: readers refuse a newer major version with a message that says so, and a
file that is not a tenx prediction, or one whose arrays disagree, names the file and the field.

    {
      "format": "tenx.prediction",
      "version": 1,
      "quantity": "train_loss",          # what is predicted: the training loss in nats/token,
                                         # smoothed over `window` steps
      "window": 25,
      "level": 0.95,                     # the band's coverage
      "source": {...},                   # where it came from: kind ("ladder" or "self"), paths, law
      "target": {...},                   # the run predicted: steps, tokens_per_step, params, schedule
      "curve": {"step": [...], "tokens": [...], "loss": [...], "lower": [...], "upper": [...]},
      "final": {"step": S, "loss": L, "lower": lo, "upper": hi}
    }

Steps are optimizer steps counted from 1, as in metrics.jsonl.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenx.errors import TenxError
from tenx.utils.io import atomic_write_json

FORMAT = "tenx.prediction"
VERSION = 1
CURVE_FIELDS = ("step", "tokens", "loss", "lower", "upper")


@dataclass
class Prediction:
    """A predicted loss curve with its band (every array has one entry per predicted step)."""

    step: list[int]
    tokens: list[int]
    loss: list[float]
    lower: list[float]
    upper: list[float]
    level: float = 0.95
    window: int = 1
    quantity: str = "train_loss"
    source: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_curve("prediction", {name: getattr(self, name) for name in CURVE_FIELDS})
        if not 0 < self.level < 1:
            raise TenxError(f"prediction: level must be in (0, 1), got {self.level}")

    @property
    def final(self) -> dict[str, float]:
        return {
            "step": self.step[-1],
            "loss": self.loss[-1],
            "lower": self.lower[-1],
            "upper": self.upper[-1],
        }

    def at(self, step: int) -> dict[str, float] | None:
        """The prediction at `step`, linearly interpolated between predicted steps; None outside them."""
        if not self.step or step < self.step[0] or step > self.step[-1]:
            return None
        i = bisect.bisect_left(self.step, step)
        if self.step[i] == step:
            return {"loss": self.loss[i], "lower": self.lower[i], "upper": self.upper[i]}
        s0, s1 = self.step[i - 1], self.step[i]
        w = (step - s0) / (s1 - s0)
        return {
            name: (1 - w) * getattr(self, name)[i - 1] + w * getattr(self, name)[i]
            for name in ("loss", "lower", "upper")
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "quantity": self.quantity,
            "window": self.window,
            "level": self.level,
            "source": self.source,
            "target": self.target,
            "curve": {name: list(getattr(self, name)) for name in CURVE_FIELDS},
            "final": self.final,
        }


def write_prediction(path: str | Path, prediction: Prediction) -> Path:
    """Write prediction.json atomically (readers see the old file or the whole new one)."""
    path = Path(path)
    atomic_write_json(path, prediction.to_json())
    return path


def read_prediction(path: str | Path) -> Prediction:
    """Read and check a prediction.json; any problem is a TenxError naming the file and the field."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TenxError(f"{path}: no such prediction file; write one with `tenx predict`") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TenxError(f"{path}: not a readable JSON prediction ({e})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise TenxError(f"{path}: not a tenx prediction (field 'format' is not {FORMAT!r})")
    version = obj.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise TenxError(f"{path}: field 'version' must be an integer, got {version!r}")
    if version > VERSION:
        raise TenxError(
            f"{path}: prediction format version {version} is newer than this tenx reads ({VERSION}); "
            "upgrade tenx"
        )
    curve = obj.get("curve")
    if not isinstance(curve, dict):
        raise TenxError(f"{path}: field 'curve' must be an object with {', '.join(CURVE_FIELDS)}")
    _check_curve(str(path), curve)
    for name, kind in (("source", dict), ("target", dict), ("quantity", str)):
        if name in obj and not isinstance(obj[name], kind):
            raise TenxError(f"{path}: field {name!r} must be a JSON {kind.__name__}")
    level, window = obj.get("level", 0.95), obj.get("window", 1)
    if not _number(level) or not 0 < level < 1:
        raise TenxError(f"{path}: field 'level' must be a number in (0, 1), got {level!r}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise TenxError(f"{path}: field 'window' must be an integer >= 1, got {window!r}")
    return Prediction(
        step=[int(s) for s in curve["step"]],
        tokens=[int(t) for t in curve["tokens"]],
        loss=[float(x) for x in curve["loss"]],
        lower=[float(x) for x in curve["lower"]],
        upper=[float(x) for x in curve["upper"]],
        level=float(level),
        window=window,
        quantity=obj.get("quantity", "train_loss"),
        source=obj.get("source", {}),
        target=obj.get("target", {}),
    )


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_curve(where: str, curve: dict[str, Any]) -> None:
    """Every array present, equally long, finite; steps strictly increasing; lower <= loss <= upper."""
    lengths = set()
    for name in CURVE_FIELDS:
        values = curve.get(name)
        if not isinstance(values, list):
            raise TenxError(f"{where}: field 'curve.{name}' must be a list")
        for i, v in enumerate(values):
            integer = name in ("step", "tokens")
            if not _number(v) or (integer and (float(v) != int(v) or v < 0)):
                kind = "a non-negative integer" if integer else "a finite number"
                raise TenxError(f"{where}: field 'curve.{name}[{i}]' must be {kind}, got {v!r}")
        lengths.add(len(values))
    if len(lengths) != 1:
        raise TenxError(f"{where}: the arrays of field 'curve' differ in length ({sorted(lengths)})")
    if not curve["step"]:
        raise TenxError(f"{where}: field 'curve' holds no steps")
    steps = curve["step"]
    for i in range(1, len(steps)):
        if steps[i] <= steps[i - 1]:
            raise TenxError(
                f"{where}: field 'curve.step' must increase (index {i}: {steps[i]} after {steps[i - 1]})"
            )
    for i, (lo, x, hi) in enumerate(zip(curve["lower"], curve["loss"], curve["upper"])):
        if not lo <= x <= hi:
            raise TenxError(
                f"{where}: at index {i} (step {steps[i]}) lower <= loss <= upper fails ({lo}, {x}, {hi})"
            )
