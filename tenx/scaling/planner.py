"""Planning a ladder: from a base config and FLOP budgets to the runs, their shapes and hyperparameters.

Model shapes come from one knob, `model.depth` (width, heads and MLP derive from it with the foundation's
multiples of 64). For each depth the planner knows the exact parameter count N and training FLOPs per token
F (tenx.model.flops), so a run at budget C trains D = C / F tokens.

Grids:
- `isoflop`: at each budget, `sizes` depths centred on the one whose tokens per parameter D/N is closest
  (in log) to `tokens_per_param`; every run at a budget spends the same FLOPs (Chinchilla approach 2).
- `ratio`: one run per budget, the depth closest to `tokens_per_param`.

Hyperparameters by size (the rule is the same at every scale, so a ladder extrapolates):
- peak learning rate = optim.lr x (d_ref / d_model) ** lr_width_exponent, d_ref = the base config's width
  (the base lr is the one tuned at the base size; 0.5 is the 1/sqrt(width) rule of nanochat and others);
- batch: the base config's sequences per step, halved until the run has at least `min_steps` steps;
- warmup: `warmup_tokens_per_param` x N tokens (OLMo's ladder warms up over N tokens), at most
  `max_warmup_fraction` of the run; the base schedule (cosine by default) spans each run's own length.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from tenx import config as cfglib
from tenx.config import field
from tenx.errors import ConfigError
from tenx.model.config import ModelConfig
from tenx.model.flops import count_params, flops_per_token
from tenx.train.config import RunConfig

DEFAULT_BUDGETS = [1e12, 2.3e12, 5.5e12, 1.3e13, 3e13]  # 30x; about 20 minutes on 2 CPU cores


@dataclass
class LadderConfig:
    """How a ladder turns budgets into runs (the `[ladder]` section of a derisk file, or `tenx ladder` flags)."""

    budgets: list[float] = field(
        default_factory=lambda: list(DEFAULT_BUDGETS), help="training FLOP budgets, one rung each"
    )
    grid: Literal["isoflop", "ratio"] = field(
        "isoflop", help="'isoflop': several sizes per budget; 'ratio': one size per budget"
    )
    tokens_per_param: float = field(
        20.0, gt=0, help="the ratio D/N the grid centres on (Chinchilla: about 20)"
    )
    sizes: int = field(3, ge=1, help="isoflop: model sizes (depths) per budget")
    min_depth: int = field(1, ge=1, help="smallest model.depth the planner may use")
    max_depth: int = field(32, ge=1, help="largest model.depth the planner may use")
    unique_tokens: int | None = field(
        None, ge=2, help="cap on distinct training tokens (data.max_unique_tokens); runs past it repeat data"
    )
    seeds: int = field(1, ge=1, help="seeds of every run (train.seed, train.seed+1, ...)")
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
    prepare_source: str | None = field(
        "stdlib", help="if data.dir is not prepared yet, prepare it from this source first (none: error)"
    )
    prepare_tokenizer: Literal["bytes", "bpe"] = field("bytes", help="tokenizer used when preparing")

    def validate(self) -> None:
        """Check bounds, the budgets and the depth range; names the offending field."""
        cfglib.check_bounds(self, "ladder")
        if not self.budgets:
            raise ConfigError("ladder.budgets: give at least one FLOP budget")
        for i, b in enumerate(self.budgets):
            if not (b > 0 and math.isfinite(b)):
                raise ConfigError(f"ladder.budgets[{i}]: must be a positive number of FLOPs, got {b}")
        if self.max_depth < self.min_depth:
            raise ConfigError(f"ladder.max_depth: {self.max_depth} is below min_depth {self.min_depth}")


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
    seq_len = base.model.seq_len
    runs: list[PlannedRun] = []
    for budget in lc.budgets:
        # log distance of each depth's tokens-per-parameter from the target ratio at this budget
        dist = {d: abs(math.log(budget / fpt[d] / counts[d].total / lc.tokens_per_param)) for d in shapes}
        best = min(dist, key=lambda d: dist[d])
        if lc.grid == "ratio":
            depths = [best]
        else:
            k = min(lc.sizes, len(shapes))
            lo = max(lc.min_depth, min(best - (k - 1) // 2, lc.max_depth - k + 1))
            depths = list(range(lo, lo + k))
        for depth in depths:
            for s in range(lc.seeds):
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
                        seq_len,
                        ref_width,
                        base.train.seed + s,
                    )
                )
    return runs


def _plan_run(
    base: RunConfig,
    lc: LadderConfig,
    tag: str,
    budget: float,
    depth: int,
    model: ModelConfig,
    count: Any,
    fpt: int,
    seq_len: int,
    ref_width: int,
    seed: int,
) -> PlannedRun:
    tokens_wanted = budget / fpt
    sequences = _base_sequences(base)
    micro = base.train.micro_batch
    while sequences > 1 and tokens_wanted / (sequences * seq_len) < lc.min_steps:
        sequences //= 2
    steps = max(1, round(tokens_wanted / (sequences * seq_len)))
    if tokens_wanted / (sequences * seq_len) < lc.min_steps / 2:
        raise ConfigError(
            f"ladder.budgets: {budget:.3g} FLOPs buys depth {depth} only {tokens_wanted:.0f} tokens "
            f"(< {lc.min_steps // 2} steps of one sequence); raise the budget or lower ladder.min_depth/"
            "ladder.sizes"
        )
    micro = min(micro, sequences)
    while sequences % micro:
        micro -= 1
    tokens = steps * sequences * seq_len
    assert model.d_model is not None
    lr = base.optim.lr * (ref_width / model.d_model) ** lc.lr_width_exponent
    warmup = math.ceil(lc.warmup_tokens_per_param * count.total / (sequences * seq_len))
    warmup = max(1, min(warmup, int(lc.max_warmup_fraction * steps)))
    name = f"{tag}-C{_format_budget(budget)}-d{depth}" + (f"-s{seed}" if lc.seeds > 1 else "")
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
            eval_every=0,
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


def format_plan(plan: list[PlannedRun], seconds: dict[str, float] | None = None) -> str:
    """A table of the plan: shape, parameters, tokens, FLOPs, batch, lr and (optionally) time."""
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
            line += f" {_fmt_s(seconds[r.name]):>9}"
        lines.append(line)
    total_flops = sum(r.flops for r in plan)
    tail = f"{len(plan)} runs, {total_flops:.2e} FLOPs"
    if seconds is not None:
        tail += f", about {_fmt_s(sum(seconds.values()))} on this machine (measured step times)"
    lines.append(tail)
    return "\n".join(lines)


def _fmt_s(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"
