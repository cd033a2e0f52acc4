"""One candidate change of a derisking study: its name, the overrides that make it and, in data mode, what
kind of change it is beyond overrides (an ensemble, a distilled student, a tuned sweep, a planted win)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tenx.config import field
from tenx.errors import ConfigError

MAX_ENSEMBLE = 16
"""The most members a study's ensemble change may have (each member is a whole run at every scale)."""
MAX_SWEEP = 12
"""The most candidates a change's sweep (or its baseline's) may have (each is a whole change's runs)."""


@dataclass
class ChangeConfig:
    """One candidate change: a name and the config overrides that make it (data mode: or another kind)."""

    name: str = field("", help="short name, used in run names and the report")
    set: list[str] = field(default_factory=list, help="overrides, e.g. ['model.pos=rope']")
    ensemble: int = field(
        1,
        ge=1,
        le=MAX_ENSEMBLE,
        help="mode 'data': an ensemble of this many members of the change's config (seeds 0, 1, ...), "
        "scored by the average of their probabilities and priced at this many times the compute",
    )
    distill_from: str = field(
        "",
        help="mode 'data': the name of an ensemble change of this study whose ensemble at each scale is the "
        "teacher (train.distill_from; `set` may give train.distill_weight); its compute counts in the price",
    )
    sweep: list[str] = field(
        default_factory=list,
        help="mode 'data': a grid the change is tuned over, 'section.key=v1,v2,...' each; per scale the "
        "candidate with the lowest validation loss is the change",
    )
    baseline_sweep: list[str] = field(
        default_factory=list,
        help="mode 'data': the grid the baseline is tuned over, the same way, for this change's anchor "
        "(tuned against tuned); default: the untuned baseline",
    )
    seeds: list[int] = field(
        default_factory=list,
        help="mode 'data': the seeds this change trains at each budget, smallest first (default: the "
        "study's `seeds` at the smallest budget, 1 at the others); an ensemble scores this many ensembles",
    )
    planted: float = field(
        0.0,
        ge=0,
        help="mode 'data': a planted win of this factor (> 1): the baseline given this many times the unique "
        "tokens at the same epochs, a change worth exactly that much data by construction",
    )

    def validate(self) -> None:
        """Names must be usable in file names; a change must change something."""
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise ConfigError(f"change.name: {self.name!r} must be letters, digits, '-' or '_'")
        if self.planted and self.planted <= 1:
            raise ConfigError(
                f"change {self.name!r}: planted = {self.planted:g}; a planted win is a factor > 1"
            )
        kinds = [k for k, on in (("ensemble", self.ensemble > 1), ("distill_from", bool(self.distill_from)),
                                 ("planted", bool(self.planted))) if on]  # fmt: skip
        if len(kinds) > 1:
            raise ConfigError(
                f"change {self.name!r}: {' and '.join(kinds)} are different kinds of change; give one"
            )
        if not (self.set or kinds or self.sweep):
            raise ConfigError(f"change {self.name!r}: 'set' is empty; give at least one section.key=value")
        for item in self.set:
            if "=" not in item or "." not in item.split("=", 1)[0]:
                raise ConfigError(f"change {self.name!r}: {item!r} is not section.key=value")
        for which in ("sweep", "baseline_sweep"):
            n = len(sweep_candidates(getattr(self, which), f"change {self.name!r}: {which}"))
            if n > MAX_SWEEP:
                raise ConfigError(f"change {self.name!r}: {which} has {n} candidates, more than {MAX_SWEEP}")

    @property
    def beyond_overrides(self) -> bool:
        """A kind of change other than overrides (an ensemble, a student, a sweep, a planted win), which the
        data mode plans and reads its own way (tenx.scaling.derisk.data_changes); `seeds` alone is not."""
        return any(k != "seeds" for k in self.data_only)

    @property
    def data_only(self) -> list[str]:
        """The data-mode fields this change sets (a compute-mode study refuses them)."""
        return [k for k, on in (("ensemble", self.ensemble > 1), ("distill_from", bool(self.distill_from)),
                                ("sweep", bool(self.sweep)), ("baseline_sweep", bool(self.baseline_sweep)),
                                ("planted", bool(self.planted)), ("seeds", bool(self.seeds))) if on]  # fmt: skip


def sweep_candidates(grid: list[str], where: str = "sweep") -> list[list[str]]:
    """'section.key=v1,v2' entries -> every combination as a list of overrides ([[]] for no grid), in the
    order given (the first key varies slowest). Errors name `where` and the entry."""
    axes: list[list[str]] = []
    for entry in grid:
        key, sep, values = entry.partition("=")
        key = key.strip()
        items = [v.strip() for v in split_top_level(values) if v.strip()]
        if not sep or "." not in key or not items:
            raise ConfigError(f"{where}: {entry!r} is not section.key=value1,value2,...")
        axes.append([f"{key}={v}" for v in items])
    return [list(c) for c in itertools.product(*axes)]


def split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and quotes (values may be TOML lists or strings)."""
    parts, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    return [*parts, cur]
