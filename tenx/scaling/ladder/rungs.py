"""Planning a ladder: from a base config and FLOP budgets to the runs, their shapes and hyperparameters.

Model shapes come from one knob, `model.depth` (width, heads and MLP derive from it with the foundation's
multiples of 64). For each depth the planner knows the exact parameter count N and training FLOPs per token
F (tenx.model.flops), so a run at budget C trains D = C / F tokens.

Grids:
- `isoflop`: at each budget, `sizes` consecutive depths around the one whose tokens per parameter D/N is
  closest (in log) to `tokens_per_param`; every run at a budget spends the same FLOPs (Chinchilla approach
  2). Only depths that train between `min_tokens_per_param` and `max_tokens_per_param` are admissible: the
  window is shifted, then trimmed, to stay among them. With an odd `sizes` the window is centred on that
  depth, with an even one its extra depth lies on the far side of the target ratio, so that where the
  admissible depths allow it the window brackets the ratio (a depth above it and one below): the measured
  IsoFLOP minimum can then lie inside the sizes tried. `plan_checks` says, per budget, whether it does.
- `ratio`: one run per budget, the depth closest to `tokens_per_param` (the closest one can get, so the
  tokens-per-parameter range does not apply; tenx derisk plans its stacks on this grid).

Seeds: every run trains with `seeds` seeds; in the isoflop grid the runs of the smallest budget train with
`noise_seeds` seeds (train.seed, train.seed+1, ...), so the ladder measures its own seed noise where it
counts most against the differences between runs (the shortest runs, with the fewest steps to average
over) and where repeats cost least.

Hyperparameters by size (the rule is the same at every scale, so a ladder extrapolates):
- peak learning rate = optim.lr x (d_ref / d_model) ** lr_width_exponent, d_ref = the base config's width
  (the base lr is the one tuned at the base size; 0.5 is the 1/sqrt(width) rule of nanochat and others);
- batch: the base config's sequences per step, halved until the run has at least `min_steps` steps;
- warmup: `warmup_tokens_per_param` x N tokens (OLMo's ladder warms up over N tokens), at most
  `max_warmup_fraction` of the run; the base schedule (cosine by default) spans each run's own length.

After the runs, `minimum_checks` reads tenx.scaling.fit.frontier.isoflop_minima of the results: a budget
whose fitted minimum lies outside the sizes tried (or that has none) is named, with the tokens per
parameter at its minimum, the value to centre the next ladder on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from tenx import config as cfglib
from tenx.config import field
from tenx.errors import ConfigError
from tenx.model.config import ModelConfig
from tenx.model.flops import count_params, flops_per_token
from tenx.train.config import RunConfig

# configs/ladder.toml's CPU ladder: 16x in steps of 10^0.2 over depths 1-3 (94k, 0.51M, 1.45M parameters).
# Depths are coarse here: depths 1 and 2 both train 1..300 tokens per parameter only from 1.82e12 to
# 1.81e13 FLOPs and depth 3 reaches 1 at 1.47e13, so 1.7e13 trains depths 1-3 (282, 9.3, 1.2 tokens per
# parameter), the four budgets below it depths 1-2, all bracketing 20; the bottom one, where depth 2 would
# train 0.93, trains depth 1 alone (28, 3 seeds) and cannot. The top rung, 2.7e13, trains depths 2-3 (14.8
# and 1.85: depth 1 would train 448): it does not bracket 20, but every size it trains is also trained
# below it, so leaving it out (bench/predict_accuracy.py) tests a prediction of longer training at known
# sizes. A top budget bracketing with depths 2-3 needs 3.65e13.
DEFAULT_BUDGETS = [1.7e12, 2.7e12, 4.3e12, 6.8e12, 1.07e13, 1.7e13, 2.7e13]

MAX_DEPTH = 256
"""The deepest model a ladder may plan (the planner tries every depth up to --max-depth)."""

MAX_SEEDS = 1000
"""The most seeds a run or a budget may train (--seeds, --noise-seeds, derisk's --seeds and --law-seeds): each
is a whole training run, and a billion of them is a typo that planning alone would spend hours listing."""


@dataclass
class LadderConfig:
    """How a ladder turns budgets into runs (the `[ladder]` section of a derisk file, or `tenx ladder` flags)."""

    SECTION: ClassVar[str] = "ladder"
    """Where its fields sit in the config tree (errors name `ladder.FIELD`)."""

    budgets: list[float] = field(
        default_factory=lambda: list(DEFAULT_BUDGETS), help="training FLOP budgets, one rung each"
    )
    grid: Literal["isoflop", "ratio"] = field(
        "isoflop", help="'isoflop': several sizes per budget; 'ratio': one size per budget"
    )
    tokens_per_param: float = field(
        20.0, gt=0, help="the ratio D/N the grid centres on (Chinchilla: about 20)"
    )
    min_tokens_per_param: float = field(
        1.0,
        ge=0,
        help="isoflop: no run trains fewer tokens per parameter (below 1 a run sees fewer tokens than the N "
        "its warmup rule asks for: it learns little and distorts fits)",
    )
    max_tokens_per_param: float = field(
        300.0,
        gt=0,
        help="isoflop: no run trains more tokens per parameter (15x the target of 20, far past an IsoFLOP "
        "minimum; at 300 the shipped ladder's depth 1 reads its 29M training bytes once)",
    )
    sizes: int = field(3, ge=1, help="isoflop: model sizes (depths) per budget")
    min_depth: int = field(1, ge=1, le=MAX_DEPTH, help="smallest model.depth the planner may use")
    max_depth: int = field(32, ge=1, le=MAX_DEPTH, help="largest model.depth the planner may use")
    unique_tokens: int | None = field(
        None,
        ge=2,
        help="cap on distinct training tokens (data.max_unique_tokens); runs past it repeat data (default: "
        "none, no cap)",
    )
    seeds: int = field(1, ge=1, le=MAX_SEEDS, help="seeds of every run (train.seed, train.seed+1, ...)")
    noise_seeds: int = field(
        3,
        ge=1,
        le=MAX_SEEDS,
        help="isoflop: seeds of the smallest budget's runs, to measure seed noise (3: two repeats, so the "
        "pooled spread has 2 degrees of freedom per size; 1: none)",
    )
    lr_width_exponent: float = field(0.5, help="peak lr = optim.lr * (d_ref / d_model) ** this")
    min_steps: int = field(100, ge=1, help="halve the batch until a run has at least this many steps")
    warmup_tokens_per_param: float = field(1.0, help="warmup lasts this many tokens per parameter")
    max_warmup_fraction: float = field(
        0.25, gt=0, le=1, help="warmup is at most this fraction of a run's steps"
    )
    eval_bytes: int = field(
        262144,
        ge=0,
        help="bytes of whole documents (spread evenly over the split) scored per split for val and "
        "held-out loss and bits per byte; 0 scores the whole split",
    )
    evals_per_run: int = field(
        20,
        ge=0,
        help="validation losses logged per run (train.eval_every = steps / this, on train.eval_batches "
        "micro-batches): the held-out curves tenx predict fits; 0: only the final evaluation",
    )
    workers: int = field(
        1,
        ge=1,
        le=64,
        help="runs trained at once, each in its own process with train.threads / workers CPU threads (or "
        "its own GPU, cuda:i): small models barely use a second thread; a run's numbers depend on its "
        "thread count, so compare runs trained with the same workers",
    )
    prepare_source: str | None = field(
        "stdlib", help="if data.dir is not prepared yet, prepare it from this source first (none: error)"
    )
    prepare_tokenizer: Literal["bytes", "bpe"] = field("bytes", help="tokenizer used when preparing")

    def validate(self) -> None:
        """Check bounds, the budgets and the depth range; names the offending field."""
        cfglib.check_bounds(self)
        if not self.budgets:
            raise ConfigError("ladder.budgets: give at least one FLOP budget")
        for i, b in enumerate(self.budgets):
            if not (b > 0 and math.isfinite(b)):
                raise ConfigError(f"ladder.budgets[{i}]: must be a positive number of FLOPs, got {b}")
        if self.max_depth < self.min_depth:
            raise ConfigError(f"ladder.max_depth: {self.max_depth} is below min_depth {self.min_depth}")
        if not self.min_tokens_per_param <= self.tokens_per_param <= self.max_tokens_per_param:
            raise ConfigError(
                f"ladder.tokens_per_param: {self.tokens_per_param:g} is outside min_tokens_per_param.."
                f"max_tokens_per_param ({self.min_tokens_per_param:g}..{self.max_tokens_per_param:g})"
            )


@dataclass
class PlannedRun:
    """One run of a ladder: its shape, budget, hyperparameters and the overrides that make its config."""

    name: str
    tag: str
    budget: float
    seed: int
    depth: int
    d_model: int
    params: int
    non_embedding_params: int
    flops_per_token: int
    steps: int
    global_batch: int
    seq_len: int
    tokens: int
    flops: float
    lr: float
    warmup_steps: int
    unique_tokens: int | None
    config: RunConfig = dataclasses.field(repr=False)

    def record(self) -> dict[str, Any]:
        """The plan as plain data (the resolved config excluded)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        out["tokens_per_param"] = self.tokens_per_param
        return out

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params


def parse_budgets(text: str) -> list[float]:
    """'1e13,3e13' -> [1e13, 3e13]; a clear error names the bad item."""
    out = []
    for item in text.split(","):
        try:
            value = float(item.strip())
        except ValueError:
            raise ConfigError(
                f"--budgets: {item.strip()!r} is not a number (expected e.g. 1e13,3e13)"
            ) from None
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"--budgets: {item.strip()!r} must be a positive number of FLOPs")
        out.append(value)
    return out


def vocab_size_of(base: RunConfig) -> int:
    """The data's vocabulary (unpadded) from its manifest, or the config's explicit model.vocab_size."""
    from tenx.data.manifest import read_manifest

    if base.model.vocab_size is not None:
        return base.model.vocab_size
    return int(read_manifest(base.data.dir)["tokenizer"]["vocab_size"])


def shape_for_depth(base: ModelConfig, depth: int, vocab: int) -> ModelConfig:
    """The base model at `depth`, width and heads derived from depth (explicit widths are cleared)."""
    return dataclasses.replace(base, depth=depth, d_model=None, n_heads=None, d_ff=None).resolved(vocab)


def _base_sequences(base: RunConfig) -> int:
    return base.train.global_batch or base.train.micro_batch * base.train.grad_accum


def _format_budget(c: float) -> str:
    return f"{c:.2e}".replace("+", "")


def plan_ladder(base: RunConfig, lc: LadderConfig, tag: str = "base") -> list[PlannedRun]:
    """The runs of a ladder over `base` (whose data.dir must be prepared, for the vocabulary)."""
    lc.validate()
    vocab = vocab_size_of(base)
    ref_width = base.model.resolved(vocab).d_model
    assert ref_width is not None
    shapes = {d: shape_for_depth(base.model, d, vocab) for d in range(lc.min_depth, lc.max_depth + 1)}
    counts = {d: count_params(m) for d, m in shapes.items()}
    fpt = {d: flops_per_token(m) for d, m in shapes.items()}
    runs: list[PlannedRun] = []
    for budget in lc.budgets:
        ratio = {d: _batch_and_steps(base, lc, budget / fpt[d])[2] / counts[d].total for d in shapes}
        seeds = lc.seeds
        if lc.grid == "isoflop" and budget == min(lc.budgets):
            seeds = max(seeds, lc.noise_seeds)
        for depth in _window(budget, ratio, lc):
            for s in range(seeds):
                runs.append(
                    _plan_run(
                        base,
                        lc,
                        tag,
                        budget,
                        depth,
                        shapes[depth],
                        counts[depth],
                        fpt[depth],
                        ref_width,
                        base.train.seed + s,
                        seeds > 1,
                    )
                )
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(
            f"ladder.budgets: {twice[0]} is planned twice; give distinct budgets (names keep 3 digits)"
        )
    return runs


def _window(budget: float, ratio: dict[int, float], lc: LadderConfig) -> list[int]:
    """The depths of one budget, given each depth's tokens per parameter there (they fall with depth)."""
    dist = {d: abs(math.log(r / lc.tokens_per_param)) for d, r in ratio.items()}
    if lc.grid == "ratio":
        return [min(dist, key=lambda d: dist[d])]
    admissible = [d for d, r in ratio.items() if lc.min_tokens_per_param <= r <= lc.max_tokens_per_param]
    if not admissible:
        raise ConfigError(_no_admissible_depth(budget, ratio, lc))
    best = min(admissible, key=lambda d: dist[d])
    k = min(lc.sizes, len(admissible))
    # an even window puts its extra depth on the side of the target ratio that `best` misses
    lo = best - (k - 1) // 2 - (1 if k % 2 == 0 and ratio[best] < lc.tokens_per_param else 0)
    lo = max(min(admissible), min(lo, max(admissible) - k + 1))
    return list(range(lo, lo + k))


def _no_admissible_depth(budget: float, ratio: dict[int, float], lc: LadderConfig) -> str:
    """Why no depth trains between min_tokens_per_param and max_tokens_per_param at `budget`."""
    low, high = min(ratio), max(ratio)
    head = f"ladder.budgets: {budget:.3g} FLOPs"
    if ratio[low] < lc.min_tokens_per_param:
        return (
            f"{head} buys depth {low} only {ratio[low]:.2g} tokens per parameter (below "
            f"ladder.min_tokens_per_param {lc.min_tokens_per_param:g}); raise the budget or lower "
            "ladder.min_tokens_per_param or ladder.min_depth"
        )
    if ratio[high] > lc.max_tokens_per_param:
        return (
            f"{head} gives depth {high} {ratio[high]:.3g} tokens per parameter (above "
            f"ladder.max_tokens_per_param {lc.max_tokens_per_param:g}); lower the budget or raise "
            "ladder.max_tokens_per_param or ladder.max_depth"
        )
    above = max(d for d, r in ratio.items() if r > lc.max_tokens_per_param)
    return (
        f"{head} gives depth {above} {ratio[above]:.3g} tokens per parameter (above "
        f"ladder.max_tokens_per_param {lc.max_tokens_per_param:g}) and depth {above + 1} "
        f"{ratio[above + 1]:.2g} (below ladder.min_tokens_per_param {lc.min_tokens_per_param:g}); move the "
        "budget or widen that range"
    )


def _batch_and_steps(base: RunConfig, lc: LadderConfig, tokens_wanted: float) -> tuple[int, int, int]:
    """(sequences per step, steps, tokens) of a run that wants `tokens_wanted` tokens."""
    seq_len = base.model.seq_len
    sequences = _base_sequences(base)
    while sequences > 1 and tokens_wanted / (sequences * seq_len) < lc.min_steps:
        sequences //= 2
    steps = max(1, round(tokens_wanted / (sequences * seq_len)))
    return sequences, steps, steps * sequences * seq_len


def _plan_run(
    base: RunConfig,
    lc: LadderConfig,
    tag: str,
    budget: float,
    depth: int,
    model: ModelConfig,
    count: Any,
    fpt: int,
    ref_width: int,
    seed: int,
    seed_in_name: bool,
) -> PlannedRun:
    tokens_wanted = budget / fpt
    seq_len = base.model.seq_len
    sequences, steps, tokens = _batch_and_steps(base, lc, tokens_wanted)
    if tokens_wanted / (sequences * seq_len) < lc.min_steps / 2:
        raise ConfigError(
            f"ladder.budgets: {budget:.3g} FLOPs buys depth {depth} only {tokens_wanted:.0f} tokens "
            f"(< {lc.min_steps // 2} steps of one sequence); raise the budget or lower ladder.min_depth/"
            "ladder.sizes"
        )
    micro = min(base.train.micro_batch, sequences)
    while sequences % micro:
        micro -= 1
    assert model.d_model is not None
    lr = base.optim.lr * (ref_width / model.d_model) ** lc.lr_width_exponent
    warmup = math.ceil(lc.warmup_tokens_per_param * count.total / (sequences * seq_len))
    warmup = max(1, min(warmup, int(lc.max_warmup_fraction * steps)))
    name = f"{tag}-C{_format_budget(budget)}-d{depth}" + (f"-s{seed}" if seed_in_name else "")
    cfg = dataclasses.replace(
        base,
        checkpoint=dataclasses.replace(
            base.checkpoint, every=max(10, math.ceil(steps / 4)), at_end=True, keep_last=1
        ),
        log=dataclasses.replace(base.log, progress=False),
        model=dataclasses.replace(base.model, depth=depth, d_model=None, n_heads=None, d_ff=None),
        train=dataclasses.replace(
            base.train,
            steps=steps,
            tokens=None,
            global_batch=sequences,
            micro_batch=micro,
            grad_accum=1,
            seed=seed,
            eval_every=math.ceil(steps / lc.evals_per_run) if lc.evals_per_run else 0,
        ),
        optim=dataclasses.replace(base.optim, lr=float(f"{lr:.6g}"), warmup_steps=warmup),
        data=dataclasses.replace(
            base.data, max_unique_tokens=lc.unique_tokens or base.data.max_unique_tokens
        ),
    )
    cfglib.validate_tree(cfg)
    return PlannedRun(
        name=name,
        tag=tag,
        budget=budget,
        seed=seed,
        depth=depth,
        d_model=model.d_model,
        params=count.total,
        non_embedding_params=count.non_embedding,
        flops_per_token=fpt,
        steps=steps,
        global_batch=sequences,
        seq_len=seq_len,
        tokens=tokens,
        flops=float(tokens * fpt),
        lr=float(f"{lr:.6g}"),
        warmup_steps=warmup,
        unique_tokens=cfg.data.max_unique_tokens,
        config=cfg,
    )


@dataclass
class BudgetCheck:
    """What one budget's runs cover: their depths and D/N, and whether they bracket the target ratio."""

    budget: float
    depths: list[int]
    tokens_per_param: list[float]
    """D/N of each depth, in depth order."""
    seeds: int
    """Seeds of each depth (`noise_seeds` at an isoflop ladder's smallest budget)."""
    target: float
    brackets: bool
    """A depth trains at least the target D/N and one at most it, so an IsoFLOP minimum near the target
    lies inside the sizes tried."""
    why_not: str
    """Why the runs do not bracket the target ('' when they do)."""

    def record(self) -> dict[str, Any]:
        """The check as plain data."""
        return dataclasses.asdict(self)


def plan_checks(plan: list[PlannedRun], lc: LadderConfig) -> list[BudgetCheck]:
    """Per budget of `plan`: its depths, their tokens per parameter, and whether they bracket
    `lc.tokens_per_param` (and if not, which limit stops the depth that would)."""
    out = []
    for budget in dict.fromkeys(r.budget for r in plan):
        runs = {r.depth: r for r in plan if r.budget == budget}
        depths = sorted(runs)
        ratios = [runs[d].tokens_per_param for d in depths]
        target = lc.tokens_per_param
        brackets = max(ratios) >= target >= min(ratios)
        why = ""
        if not brackets and lc.grid == "ratio":
            why = "the ratio grid trains one size per budget"
        elif not brackets:
            more = min(ratios) > target
            side = depths[-1] + 1 if more else depths[0] - 1
            why = f"every size trains {'more' if more else 'fewer'} than {target:g} tokens per parameter; "
            why += _why_not_depth(runs[depths[0]].config, lc, budget, side)
        seeds = len([r for r in plan if r.budget == budget and r.depth == depths[0]])
        out.append(BudgetCheck(budget, depths, ratios, seeds, target, brackets, why))
    return out


def _why_not_depth(cfg: RunConfig, lc: LadderConfig, budget: float, depth: int) -> str:
    """Why `depth` is not among the budget's sizes (the limit that excludes it)."""
    if depth < 1:
        return "depth 1 is the smallest model"
    if depth < lc.min_depth:
        return f"depth {depth} is below ladder.min_depth {lc.min_depth}"
    if depth > lc.max_depth:
        return f"depth {depth} is above ladder.max_depth {lc.max_depth}"
    model = shape_for_depth(cfg.model, depth, vocab_size_of(cfg))
    ratio = budget / flops_per_token(model) / count_params(model).total
    if ratio < lc.min_tokens_per_param:
        return (
            f"depth {depth} would train {ratio:.2g} tokens per parameter "
            f"(< ladder.min_tokens_per_param {lc.min_tokens_per_param:g})"
        )
    if ratio > lc.max_tokens_per_param:
        return (
            f"depth {depth} would train {ratio:.3g} tokens per parameter "
            f"(> ladder.max_tokens_per_param {lc.max_tokens_per_param:g})"
        )
    return f"ladder.sizes {lc.sizes} leaves out depth {depth} ({ratio:.3g} tokens per parameter)"


def format_checks(checks: list[BudgetCheck], lc: LadderConfig) -> str:
    """The plan table's footer: per budget, the depths, their D/N and whether they bracket the target."""
    lines = [
        f"target {lc.tokens_per_param:g} tokens per parameter; isoflop sizes train "
        f"{lc.min_tokens_per_param:g}..{lc.max_tokens_per_param:g}:"
    ]
    for c in checks:
        span = f"d{c.depths[0]}" + (f"-{c.depths[-1]}" if len(c.depths) > 1 else "")
        ratios = "/".join(f"{r:.3g}" for r in c.tokens_per_param)
        seeds = f" x{c.seeds} seeds" if c.seeds > 1 else ""
        verdict = "brackets it" if c.brackets else f"does not bracket it: {c.why_not}"
        lines.append(f"  C={_format_budget(c.budget):<8} {span:<6} D/N {ratios:<18}{seeds:<10} {verdict}")
    return "\n".join(lines)


def minimum_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """After the runs: per budget, where tenx.scaling.fit.frontier.isoflop_minima puts the held-out loss
    minimum, in tokens per parameter, and whether it lies inside the sizes tried (`inside`: True, False, or
    None when there is no minimum); `message` says what to change when it does not."""
    import numpy as np

    from tenx.scaling.fit.frontier import isoflop_minima
    from tenx.scaling.table import Points

    def column(key: str) -> np.ndarray:
        return np.array([float(r[key]) for r in rows])

    points = Points(
        N=column("params"),
        D=column("tokens"),
        L=column("heldout_loss"),
        C=column("flops"),
        U=column("unique_tokens"),
        budget=column("budget"),
    )
    minima = isoflop_minima(points)
    out = []
    for b in minima["budgets"]:
        mine = [r for r in rows if r["budget"] == b["C"]]
        # D/N against log N is a line at one budget (D = C/F, F about proportional to N): read it at N_opt
        slope, intercept = np.polyfit(
            np.log([r["params"] for r in mine]), np.log([r["tokens_per_param"] for r in mine]), 1
        )
        ratio = float(math.exp(intercept + slope * math.log(b["N_opt"])))
        message = (
            f"C={_format_budget(b['C'])}: minimum at {b['N_opt']:.3g} parameters, {ratio:.3g} tokens per "
            "parameter"
        )
        if b["extrapolated"]:
            low, high = (int(f(r["params"] for r in mine)) for f in (min, max))
            message += (
                f", outside the sizes tried ({low:,}..{high:,} parameters): the parabola's guess, not a "
                "measurement; centre the next ladder nearer it (ladder.tokens_per_param) or add a size there"
            )
        out.append(
            {"budget": b["C"], "inside": not b["extrapolated"], "tokens_per_param": ratio, "message": message}
        )
    for b in minima["skipped"]:
        out.append(
            {
                "budget": b["C"],
                "inside": None,
                "tokens_per_param": None,
                "message": f"C={_format_budget(b['C'])}: no IsoFLOP minimum ({b['reason']})",
            }
        )
    return sorted(out, key=lambda m: m["budget"])


def format_ladder_plan(
    plan: list[PlannedRun],
    seconds: dict[str, float] | None = None,
    footer: str | None = None,
    workers: tuple[int, float] | None = None,
) -> str:
    """A table of the plan: shape, parameters, tokens, FLOPs, batch, lr, (optionally) time and a footer
    (`format_checks`). `workers`: (runs at a time, the wall seconds of the whole plan at that)."""
    head = (
        f"{'run':<26} {'depth':>5} {'d':>4} {'params':>9} {'non-emb':>9} {'tokens':>10} {'D/N':>6} "
        f"{'FLOPs':>9} {'steps':>6} {'batch':>5} {'lr':>8} {'warmup':>6}"
    )
    if seconds is not None:
        head += f" {'est. time':>9}"
    lines = [head, "-" * len(head)]
    for r in plan:
        line = (
            f"{r.name:<26} {r.depth:>5} {r.d_model:>4} {r.params:>9,} {r.non_embedding_params:>9,} "
            f"{r.tokens:>10,} {r.tokens_per_param:>6.1f} {r.flops:>9.2e} {r.steps:>6} {r.global_batch:>5} "
            f"{r.lr:>8.2e} {r.warmup_steps:>6}"
        )
        if seconds is not None:
            line += f" {format_seconds(seconds[r.name]):>9}"
        lines.append(line)
    total_flops = sum(r.flops for r in plan)
    tail = f"{len(plan)} runs, {total_flops:.2e} FLOPs"
    if seconds is not None:
        if workers is not None and workers[0] > 1:
            tail += (
                f", about {format_seconds(workers[1])} on this machine, {workers[0]} runs at a time "
                f"({format_seconds(sum(seconds.values()))} of runs; measured step times)"
            )
        else:
            tail += f", about {format_seconds(sum(seconds.values()))} on this machine (measured step times)"
    lines.append(tail)
    if footer:
        lines.append(footer)
    return "\n".join(lines)


def format_seconds(s: float) -> str:
    """Seconds as the ladder prints them: `42 s` below two minutes, else `3.5 min`."""
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"
