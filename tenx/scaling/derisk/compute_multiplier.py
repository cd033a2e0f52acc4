"""Derisking: add changes to a known-good config one at a time and check that each gain persists with scale.

The stack is baseline, baseline + change 1, baseline + changes 1..2, ... Each config is trained at every
budget (a `ratio` ladder; every config uses the baseline's depth at a budget, so a change is compared at
equal shape). For change k and budget C its **effective compute multiplier** is

    m = C_prev(L_k) / C_k

where L_k is the change's held-out loss, C_k its training FLOPs and C_prev(L) the inverse of L(C) fitted
to the previous config of the stack (its "known-good" baseline): how much more compute the config without
the change would need to reach the same loss. m > 1 is a gain. The cumulative multiplier against the
original baseline is reported beside it.

Intervals come from the bootstrap of the baseline fit combined with seed noise: with `seeds` > 1 the
smallest budget is trained with several seeds, and the pooled standard deviation of the loss across seeds
is taken as every run's noise. Verdicts read the trend line (least squares of log10 m on log10 C) at the
smallest and largest budget:

- *grows*: the gain rises by more than `tolerance` (as a factor per decade of compute), or a change that
  does not help at the smallest budget helps at the largest;
- *fades*: the gain falls by more than `tolerance` per decade but stays above 1 at the largest budget;
- *reverses*: a gain at the smallest budget that is gone (m <= 1) at the largest (the multiplier
  extrapolated to the target budget is reported beside the verdict; a fading gain may cross 1 there);
- *persists*: anything else that helps;
- *hurts*: m <= 1 at both ends of the trend line (a fifth verdict: no gain to persist);
- *unresolved*: every budget's interval holds 1, so the runs cannot tell the change from none (more seeds
  or larger budgets would); this one is read before the others.

With `mode = "data"` a study measures each change's effective *data* multiplier at a fixed budget of unique
tokens instead (tenx/scaling/derisk/data_multiplier.py, which plans and analyses it with this module's pieces).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tenx import config as cfglib
from tenx.config import field
from tenx.errors import ConfigError, TenxError
from tenx.scaling.derisk.change import ChangeConfig, split_top_level
from tenx.scaling.derisk.study import run_study
from tenx.scaling.ladder.rungs import MAX_SEEDS, LadderConfig, PlannedRun, plan_ladder
from tenx.scaling.ladder.runner import config_key, ensure_data, format_dry_run, load_base
from tenx.utils.io import save_png

Z95 = 1.959963984540054


@dataclass
class DeriskConfig:
    """A derisking study: base config, changes in stacking order, budgets (a TOML file or flags)."""

    base: str = field(
        "ladder",
        help="base run config: a .toml path or a shipped name (in a derisk file, a path may be relative to it)",
    )
    set: list[str] = field(default_factory=list, help="overrides applied to the base config")
    budgets: list[float] = field(default_factory=lambda: [1e12, 4e12, 1.6e13], help="training FLOP budgets")
    change: list[ChangeConfig] = field(default_factory=list, help="the changes, in stacking order")
    seeds: int = field(
        2, ge=1, le=MAX_SEEDS, help="seeds at the smallest budget (noise estimate for the intervals)"
    )
    target: float | None = field(
        None,
        gt=0,
        help="budget the multipliers are extrapolated to, in FLOPs (default: 100x the largest budget)",
    )
    tolerance: float = field(
        1.25, gt=1, help="a trend steeper than this factor per decade is 'grows'/'fades'"
    )
    bootstrap: int = field(200, ge=0, le=100_000, help="bootstrap resamples of each baseline fit")
    ladder: LadderConfig = field(
        default_factory=lambda: LadderConfig(grid="ratio"), help="how runs are shaped (grid is 'ratio')"
    )
    mode: Literal["compute", "data"] = field(
        "compute",
        help="'compute': effective compute multipliers of a stack; 'data': effective data multipliers of "
        "each change alone at a fixed unique-token budget (tenx/scaling/derisk/data_multiplier.py)",
    )
    unique_tokens: list[int] = field(
        default_factory=list,
        help="mode 'data': the baseline's unique-token budgets U, trained at every budget to fit L(N, D, U)",
    )
    compare_unique_tokens: int | None = field(
        None, ge=2, help="mode 'data': the U the changes train at (default: the smallest of unique_tokens)"
    )
    law_seeds: list[int] = field(
        default_factory=list,
        help="mode 'data': seeds of the baseline's runs (the law's points) at each budget, smallest first "
        "(default: `seeds` at the smallest budget, 1 at the others); the changes keep `seeds` at the "
        "smallest, 1 elsewhere",
    )
    token_fractions: list[float] = field(
        default_factory=lambda: [0.5, 1.0],
        help="mode 'data': the baseline trains each scale on these fractions of its tokens (fresh and under "
        "each U; same batch, shorter schedule), so the law sees several token counts per size",
    )

    def validate(self) -> None:
        """Check bounds, budgets, changes and the grid; names the offending field."""
        cfglib.check_bounds(self)
        if not self.token_fractions or any(
            isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1
            for f in self.token_fractions
        ):
            raise ConfigError(
                f"token_fractions: give fractions in (0, 1] of each scale's tokens, got {self.token_fractions}"
            )
        if len(self.budgets) < 2:
            raise ConfigError("budgets: give at least 2 budgets (3 or more to see a trend)")
        for i, b in enumerate(self.budgets):
            if not (b > 0 and math.isfinite(b)):
                raise ConfigError(f"budgets[{i}]: must be a positive number of FLOPs, got {b}")
        if not self.change:
            raise ConfigError("change: give at least one change (NAME:section.key=value)")
        for c in self.change:
            c.validate()
        names = [c.name for c in self.change]
        if len(set(names)) != len(names):
            raise ConfigError(f"change: names must be distinct, got {names}")
        if self.ladder.grid != "ratio":
            raise ConfigError("ladder.grid: derisking trains one size per budget; use 'ratio'")
        if self.mode == "data":
            self._validate_data_mode()
        elif any(c.data_only for c in self.change):
            c = next(c for c in self.change if c.data_only)
            raise ConfigError(
                f"change {c.name!r}: {', '.join(c.data_only)}: only mode 'data' uses them; set mode = \"data\" "
                "or leave them out"
            )
        elif self.unique_tokens or self.compare_unique_tokens is not None or self.law_seeds:
            raise ConfigError(
                "unique_tokens, compare_unique_tokens, law_seeds: only mode 'data' uses them; set mode = "
                '"data" (--mode data) or leave them out'
            )

    def _validate_data_mode(self) -> None:
        if len(set(self.unique_tokens)) < 2:
            raise ConfigError(
                "unique_tokens: mode 'data' needs 2 or more distinct unique-token budgets, got "
                f"{self.unique_tokens}"
            )
        for i, u in enumerate(self.unique_tokens):
            if isinstance(u, bool) or not isinstance(u, int) or u < 2:
                raise ConfigError(f"unique_tokens[{i}]: must be a whole number of tokens >= 2, got {u!r}")
        if self.compare_unique_tokens is not None and self.compare_unique_tokens not in self.unique_tokens:
            raise ConfigError(
                f"compare_unique_tokens: {self.compare_unique_tokens} is not one of unique_tokens "
                f"{self.unique_tokens}; the baseline must train at the U the changes are compared at"
            )
        if self.ladder.unique_tokens is not None:
            raise ConfigError("ladder.unique_tokens: mode 'data' sets each run's cap itself; leave it out")
        for where, seeds in [("law_seeds (--law-seeds)", self.law_seeds)] + [
            (f"change {c.name!r}: seeds", c.seeds) for c in self.change
        ]:
            if seeds and (
                len(seeds) != len(self.budgets)
                or any(
                    isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SEEDS for n in seeds
                )
            ):
                raise ConfigError(
                    f"{where}: give one whole number >= 1 per budget ({len(self.budgets)}), at most {MAX_SEEDS} "
                    f"each, smallest budget first, got {seeds}"
                )

    @property
    def compare_u(self) -> int:
        """Mode 'data': the unique-token budget the changes train at."""
        return self.compare_unique_tokens or min(self.unique_tokens)


def parse_change(text: str) -> ChangeConfig:
    """'NAME:section.key=value[,section.key=value...]' -> ChangeConfig (validated)."""
    name, sep, rest = text.partition(":")
    if not sep:
        raise ConfigError(f"--change {text!r}: expected NAME:section.key=value[,...]")
    change = ChangeConfig(name=name.strip(), set=[s.strip() for s in split_top_level(rest) if s.strip()])
    change.validate()
    return change


def load_derisk(path: str | Path) -> DeriskConfig:
    """Read a derisk TOML file; a relative `base` path is taken relative to the file."""
    path = Path(path)
    cfg = cfglib.load(DeriskConfig, path)
    base = Path(cfg.base)
    if base.suffix == ".toml" and not base.is_absolute() and not base.exists():
        cfg.base = str((path.parent / base).resolve())
    return cfg


# ----- planning --------------------------------------------------------------------------------------
@dataclass
class Stage:
    """One config of the stack: 'baseline' or the name of the change it adds, and its runs."""

    name: str
    overrides: list[str]
    runs: list[PlannedRun]


def prepare_stack(
    dc: DeriskConfig, *, dry_run: bool = False
) -> tuple[LadderConfig, list[str], dict[float, int]]:
    """The study's ladder settings, the base overrides (with the prepared data) and the depth per budget."""
    dc.validate()
    lc = dataclasses.replace(dc.ladder, budgets=list(dc.budgets), seeds=1)
    overrides = list(dc.set)
    base = load_base(dc.base, overrides)
    prepared = ensure_data(base, lc, dry_run=dry_run)
    if prepared.data.dir != base.data.dir:  # every config of the stack reads the prepared cache
        overrides.append(f"data.dir={json.dumps(prepared.data.dir)}")
    if prepared.model.vocab_size != base.model.vocab_size:  # a dry run plans with the vocabulary to be
        overrides.append(f"model.vocab_size={prepared.model.vocab_size}")
    base = load_base(dc.base, overrides)
    return lc, overrides, {r.budget: r.depth for r in plan_ladder(base, lc, "baseline")}


def plan_derisk(dc: DeriskConfig, *, dry_run: bool = False) -> list[Stage]:
    """The stack's configs and their runs; every config uses the baseline's depth at each budget."""
    lc, overrides, depths = prepare_stack(dc, dry_run=dry_run)
    stages = []
    for name, extra in [("baseline", []), *[(c.name, c.set) for c in dc.change]]:
        overrides = overrides + list(extra)
        cfg = load_base(dc.base, overrides)
        runs = []
        for budget in dc.budgets:
            one = dataclasses.replace(
                lc, budgets=[budget], min_depth=depths[budget], max_depth=depths[budget]
            )
            runs += plan_ladder(cfg, one, name)
        if dc.seeds > 1:
            smallest = dataclasses.replace(
                lc,
                budgets=[min(dc.budgets)],
                seeds=dc.seeds,
                min_depth=depths[min(dc.budgets)],
                max_depth=depths[min(dc.budgets)],
            )
            seen = {config_key(r.config) for r in runs}
            runs += [r for r in plan_ladder(cfg, smallest, name) if config_key(r.config) not in seen]
        stages.append(Stage(name, overrides, runs))
    return stages


# ----- analysis --------------------------------------------------------------------------------------
def _inverse_compute(params: np.ndarray, names: list[str], loss: np.ndarray) -> np.ndarray:
    """C at which L(C) = E + A C^-alpha reaches `loss`, for parameter rows (S, P); inf where loss <= E."""
    col = {n: params[:, i] for i, n in enumerate(names)}
    gap = loss - col["E"]
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(gap > 0, (col["A"] / np.where(gap > 0, gap, 1.0)) ** (1.0 / col["alpha"]), np.inf)
    return out


def analyse(stages: list[Stage], rows: dict[str, dict[str, Any]], dc: DeriskConfig) -> dict[str, Any]:
    """Fits, multipliers with intervals, trends and verdicts from the runs' results (rows by key)."""
    from tenx.scaling.fit import fit_compute

    budgets = sorted(dc.budgets)
    per_stage: list[dict[float, list[dict[str, Any]]]] = []
    for st in stages:
        by_budget: dict[float, list[dict[str, Any]]] = {b: [] for b in budgets}
        for r in st.runs:
            by_budget[r.budget].append(rows[config_key(r.config)])
        per_stage.append(by_budget)
    # seed noise: pooled standard deviation of held-out loss over the seeds at the smallest budget
    groups = [s[budgets[0]] for s in per_stage if len(s[budgets[0]]) > 1]
    dev = [r["heldout_loss"] - np.mean([x["heldout_loss"] for x in g]) for g in groups for r in g]
    dof = sum(len(g) - 1 for g in groups)
    sigma = float(math.sqrt(sum(d * d for d in dev) / dof)) if dof else 0.0

    def points(stage: dict[float, list[dict[str, Any]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        C = np.array([np.mean([r["flops"] for r in stage[b]]) for b in budgets])
        L = np.array([np.mean([r["heldout_loss"] for r in stage[b]]) for b in budgets])
        n = np.array([len(stage[b]) for b in budgets])
        return C, L, n

    fits = []
    for i, stage in enumerate(per_stage):
        C, L, _ = points(stage)
        fits.append(fit_compute(C, L, bootstrap=dc.bootstrap, seed=i))
    rng = np.random.default_rng(0)
    target = dc.target or 100 * budgets[-1]
    logc = np.log10(np.array(budgets))
    changes = []
    for k in range(1, len(stages)):
        C, L, n = points(per_stage[k])
        entry: dict[str, Any] = {"name": stages[k].name, "overrides": stages[k].overrides, "budgets": []}
        for ref_name, ref in (("marginal", k - 1), ("cumulative", 0)):
            fit = fits[ref]
            names = list(fit.params)
            point = np.array([list(fit.params.values())])
            ok = np.all(np.isfinite(fit.samples), axis=1)
            samples = fit.samples[ok] if ok.any() else point
            m_point = _inverse_compute(np.repeat(point, len(L), 0), names, L) / C
            noise = rng.normal(0.0, 1.0, (len(samples), len(L))) * (sigma / np.sqrt(n))[None, :]
            m_samples = np.stack(
                [_inverse_compute(samples, names, L[j] + noise[:, j]) / C[j] for j in range(len(L))], axis=1
            )
            log_m = np.log10(np.clip(m_samples, 1e-300, 1e300))
            slopes = np.polyfit(logc, log_m.T, 1)[0] if len(budgets) > 1 else np.zeros(len(log_m))
            fin = np.isfinite(m_point) & (m_point > 0)
            if fin.sum() >= 2:
                slope, intercept = np.polyfit(logc[fin], np.log10(m_point[fin]), 1)
            else:
                slope, intercept = math.nan, math.nan
            entry[ref_name] = {
                "against": stages[ref].name,
                "multipliers": [float(x) for x in m_point],
                "low": [float(np.percentile(m_samples[:, j], 2.5)) for j in range(len(L))],
                "high": [float(np.percentile(m_samples[:, j], 97.5)) for j in range(len(L))],
                "slope_per_decade": float(slope),
                "slope_interval": [float(np.percentile(slopes, 2.5)), float(np.percentile(slopes, 97.5))],
                "at_target": float(10 ** (intercept + slope * math.log10(target)))
                if fin.sum() >= 2
                else math.nan,
            }
            entry[ref_name]["verdict"] = verdict(entry[ref_name], dc.tolerance)
        entry["budgets"] = [
            {"budget": b, "flops": float(C[j]), "heldout_loss": float(L[j]), "seeds": int(n[j])}
            for j, b in enumerate(budgets)
        ]
        changes.append(entry)
    return {
        "budgets": budgets,
        "target": target,
        "seed_sigma": sigma,
        "stages": [
            {
                "name": st.name,
                "overrides": st.overrides,
                "fit": fits[i].to_dict(),
                "points": [
                    {"budget": b, "flops": float(c), "heldout_loss": float(loss), "seeds": int(m)}
                    for b, c, loss, m in zip(budgets, *points(per_stage[i]))
                ],
            }
            for i, st in enumerate(stages)
        ],
        "changes": changes,
    }


def verdict(m: dict[str, Any], tolerance: float) -> str:
    """persists | grows | fades | reverses | hurts | unresolved, from the multipliers across budgets (see
    module doc).

    The trend line through the multipliers (`fitted`) is read at the smallest and largest budget, so
    one noisy budget does not decide alone. With intervals (`low`, `high`) that all hold 1, no budget tells
    the change from none: *unresolved*, whatever the point estimates say.
    """
    low, high = m.get("low"), m.get("high")
    if low and high and all(lo <= 1 <= hi for lo, hi in zip(low, high)):
        return "unresolved"
    line = m.get("fitted") or m["multipliers"]
    first, last = line[0], line[-1]
    slope = m["slope_per_decade"]
    tol = math.log10(tolerance)
    if first > 1:
        if last <= 1:
            return "reverses"
        if slope > tol:
            return "grows"
        if slope < -tol:
            return "fades"
        return "persists"
    if last > 1:
        return "grows"
    return "hurts"


# ----- report ----------------------------------------------------------------------------------------
def format_multiplier(m: float, lo: float, hi: float) -> str:
    """A multiplier and its interval as the reports print them: `1.08 [0.70, 1.96]`."""

    def f(x: float) -> str:
        if not math.isfinite(x):
            return "inf" if x > 0 else "nan"
        return f"{x:.2f}" if x < 100 else f"{x:.3g}"

    return f"{f(m)} [{f(lo)}, {f(hi)}]"


def format_derisk(result: dict[str, Any]) -> str:
    """The Markdown report: losses by budget, multipliers with intervals, trends and verdicts."""
    budgets = result["budgets"]
    head = " | ".join(f"C = {b:.2g}" for b in budgets)
    lines = [
        "# Derisking report",
        "",
        "Held-out loss (nats/token) of each config of the stack (each row adds one change to the row above):",
        "",
        f"| config | {head} |",
        "|---" * (len(budgets) + 1) + "|",
    ]
    for st in result["stages"]:
        cells = " | ".join(
            f"{p['heldout_loss']:.4f}" + (f" ({p['seeds']} seeds)" if p["seeds"] > 1 else "")
            for p in st["points"]
        )
        lines.append(f"| {st['name']} | {cells} |")
    lines += [
        "",
        "Effective compute multiplier of each change against the config before it (marginal) and against "
        "the baseline (cumulative), with 95% intervals; > 1 is a gain. Trend: the factor by which the "
        f"multiplier changes per decade of compute. Extrapolated to C = {result['target']:.2g}.",
        "",
        f"| change | against | {head} | trend per decade | at target | verdict |",
        "|---" * (len(budgets) + 5) + "|",
    ]
    for ch in result["changes"]:
        for ref in ("marginal", "cumulative"):
            m = ch[ref]
            cells = " | ".join(
                format_multiplier(x, lo, hi) for x, lo, hi in zip(m["multipliers"], m["low"], m["high"])
            )
            lo, hi = m["slope_interval"]
            trend = f"{10 ** m['slope_per_decade']:.2f}x [{10**lo:.2f}, {10**hi:.2f}]"
            lines.append(
                f"| {ch['name'] if ref == 'marginal' else ''} | {m['against']} | {cells} | {trend} | "
                f"{m['at_target']:.2f} | **{m['verdict']}** |"
            )
    lines += [
        "",
        f"Seed noise (pooled std of held-out loss at the smallest budget): {result['seed_sigma']:.4f} nats/token.",
        "Fits per config: L(C) = E + A*C^-alpha (a pure power law with fewer than 4 budgets); see derisk.json.",
    ]
    return "\n".join(lines) + "\n"


def _label_axes(ax: Any, ylabel: str, title: str) -> None:
    """Log training FLOPs on x, the labels and title, a grid and the legend."""
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def plot_report(result: dict[str, Any], out_png: str | Path) -> Path:
    """Left: held-out loss against compute for each config with its fit; right: multipliers by budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tenx.scaling.fit import FitResult

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    budgets = np.array(result["budgets"])
    grid = np.geomspace(budgets[0] / 1.5, result["target"], 100)
    for st in result["stages"]:
        C = [p["flops"] for p in st["points"]]
        L = [p["heldout_loss"] for p in st["points"]]
        (line,) = ax1.plot(C, L, "o", label=st["name"])
        f = st["fit"]
        fit = FitResult(f["law"], f["form"], f["params"], {}, np.zeros((0, len(f["params"]))), 0, 0.0)
        ax1.plot(grid, fit.predict(C=grid), "-", color=line.get_color(), lw=0.8, alpha=0.7)
    _label_axes(ax1, "held-out loss (nats/token)", "configs of the stack, with L(C) fits")
    for ch in result["changes"]:
        m = ch["marginal"]
        y = np.array(m["multipliers"])
        err = np.array([y - np.array(m["low"]), np.array(m["high"]) - y])
        bar = ax2.errorbar(budgets, y, yerr=np.clip(err, 0, None), fmt="o", capsize=3, label=ch["name"])
        if math.isfinite(m["slope_per_decade"]) and math.isfinite(m["at_target"]):
            xs = np.array([budgets[0], result["target"]])
            ys = m["at_target"] * (xs / result["target"]) ** m["slope_per_decade"]
            ax2.plot(xs, ys, "--", color=bar[0].get_color(), lw=0.8)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_yscale("log")
    _label_axes(
        ax2, "effective compute multiplier (marginal)", "gain of each change, extrapolated to the target"
    )
    return save_png(fig, out_png)


# ----- the whole study -------------------------------------------------------------------------------
def run_derisk(dc: DeriskConfig, out: str | Path, *, dry_run: bool = False) -> dict[str, Any]:
    """Train every config of the stack at every budget (reusing runs already in OUT), analyse, report."""
    out = Path(out)
    if dc.mode == "data":
        raise ConfigError("mode: 'data' studies run with tenx.scaling.derisk.data_multiplier.run_data_derisk")
    stages = plan_derisk(dc, dry_run=dry_run)
    if dry_run:
        for st in stages:
            print(f"{st.name}: {' '.join(st.overrides) or '(base config)'}")
        print(format_dry_run([r for st in stages for r in st.runs], dc.ladder))
        return {}
    runs = [r for st in stages for r in st.runs]
    return run_study(
        dc,
        out,
        runs,
        describe=lambda row: f"held-out {row['heldout_loss']:.4f} nats/token",
        analyse=lambda rows: analyse(stages, {row["key"]: row for row in rows.values()}, dc),
        report=format_derisk,
        plot=plot_report,
    )


def derisk_from_args(
    config: str | None,
    base: str | None,
    changes: list[str],
    budgets: list[float] | None,
    seeds: int | None,
    target: float | None,
    sets: list[str],
    **data_mode: Any,
) -> DeriskConfig:
    """A DeriskConfig from a file and/or flags (flags win; --change flags replace the file's changes).

    `data_mode`: mode, unique_tokens, compare_unique_tokens, token_fractions, law_seeds (None or empty: the
    file's)."""
    dc = load_derisk(config) if config else DeriskConfig()
    if base:
        dc.base = base
    if sets:
        dc.set = [*dc.set, *sets]
    if changes:
        dc.change = [parse_change(c) for c in changes]
    if budgets:
        dc.budgets = budgets
    if seeds is not None:
        dc.seeds = seeds
    if target is not None:
        dc.target = target
    for name, value in data_mode.items():
        if name not in ("mode", "unique_tokens", "compare_unique_tokens", "token_fractions", "law_seeds"):
            raise TypeError(f"derisk_from_args() got an unexpected keyword argument {name!r}")
        if value is not None and value != []:
            setattr(dc, name, value)
    try:
        cfglib.validate_tree(dc)
    except ConfigError as e:
        raise ConfigError(f"{config or 'derisk'}: {e}") from None
    return dc


def read_result(out: str | Path) -> dict[str, Any]:
    """derisk.json of a finished study."""
    path = Path(out) / "derisk.json"
    if not path.exists():
        raise TenxError(f"{path} does not exist; run `tenx derisk ... --out {shlex.quote(str(out))}` first")
    return json.loads(path.read_text())
