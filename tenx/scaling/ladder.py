"""Scaling ladders: plan runs from FLOP budgets, train them idempotently, record one results table.

A ladder turns a base config and a list of compute budgets C (training FLOPs) into runs. Model shapes come
from one knob, `model.depth` (width, heads and MLP derive from it with the foundation's multiples of 64).
For each depth the planner knows the exact parameter count N and training FLOPs per token F
(tenx.model.flops), so a run at budget C trains D = C / F tokens.

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

Runs are idempotent: a run whose row (keyed by a hash of its resolved config) is in results.jsonl is
skipped; a run with checkpoints resumes from the newest verified one; a finished run is only evaluated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tenx import config as cfglib
from tenx.config import field
from tenx.errors import ConfigError, TenxError
from tenx.model.config import ModelConfig
from tenx.model.flops import count_params, flops_per_token
from tenx.train.config import RunConfig, load_run_config
from tenx.utils.io import atomic_write_json, atomic_write_text, bytes_xxhash

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
    tokens_per_param: float = field(20.0, help="the ratio D/N the grid centres on (Chinchilla: about 20)")
    sizes: int = field(3, help="isoflop: model sizes (depths) per budget")
    min_depth: int = field(1, help="smallest model.depth the planner may use")
    max_depth: int = field(32, help="largest model.depth the planner may use")
    unique_tokens: int | None = field(
        None, help="cap on distinct training tokens (data.max_unique_tokens); runs past it repeat data"
    )
    seeds: int = field(1, help="seeds of every run (train.seed, train.seed+1, ...)")
    lr_width_exponent: float = field(0.5, help="peak lr = optim.lr * (d_ref / d_model) ** this")
    min_steps: int = field(100, help="halve the batch until a run has at least this many steps")
    warmup_tokens_per_param: float = field(1.0, help="warmup lasts this many tokens per parameter")
    max_warmup_fraction: float = field(0.25, help="warmup is at most this fraction of a run's steps")
    eval_bytes: int = field(
        262144,
        help="bytes of whole documents (spread evenly over the split) scored per split for val and "
        "held-out loss and bits per byte; 0 scores the whole split",
    )
    prepare_source: str | None = field(
        "stdlib", help="if data.dir is not prepared yet, prepare it from this source first (none: error)"
    )
    prepare_tokenizer: Literal["bytes", "bpe"] = field("bytes", help="tokenizer used when preparing")

    def validate(self) -> None:
        """Check ranges; names the offending field."""
        if not self.budgets:
            raise ConfigError("ladder.budgets: give at least one FLOP budget")
        for i, b in enumerate(self.budgets):
            if not (b > 0 and math.isfinite(b)):
                raise ConfigError(f"ladder.budgets[{i}]: must be a positive number of FLOPs, got {b}")
        if self.tokens_per_param <= 0:
            raise ConfigError(f"ladder.tokens_per_param: must be > 0, got {self.tokens_per_param}")
        for name in ("sizes", "min_depth", "max_depth", "seeds", "min_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ladder.{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_depth < self.min_depth:
            raise ConfigError(f"ladder.max_depth: {self.max_depth} is below min_depth {self.min_depth}")
        if self.unique_tokens is not None and self.unique_tokens < 2:
            raise ConfigError(f"ladder.unique_tokens: must be >= 2, got {self.unique_tokens}")
        if not 0 < self.max_warmup_fraction <= 1:
            raise ConfigError(
                f"ladder.max_warmup_fraction: must be in (0, 1], got {self.max_warmup_fraction}"
            )
        if self.eval_bytes < 0:
            raise ConfigError(f"ladder.eval_bytes: must be >= 0, got {self.eval_bytes}")


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


def _vocab_size(base: RunConfig) -> int:
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
    vocab = _vocab_size(base)
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


# ----- data ------------------------------------------------------------------------------------------
def ensure_data(base: RunConfig, lc: LadderConfig) -> None:
    """Prepare data.dir from `ladder.prepare_source` when it holds no prepared data yet."""
    from tenx.data.prepare import PrepareConfig, format_summary, prepare

    if (Path(base.data.dir) / "manifest.json").exists():
        return
    if lc.prepare_source is None:
        raise TenxError(
            f"data.dir {base.data.dir} is not prepared; run `tenx data prepare --source ... --out "
            f"{base.data.dir}` first (or set ladder.prepare_source)"
        )
    print(f"tenx: preparing {lc.prepare_source} into {base.data.dir} ({lc.prepare_tokenizer} tokenizer)")
    prep = PrepareConfig(source=lc.prepare_source, out=base.data.dir, tokenizer=lc.prepare_tokenizer)
    print(format_summary(prepare(prep, progress=False), Path(base.data.dir)))


# ----- results table ---------------------------------------------------------------------------------
def config_key(cfg: RunConfig) -> str:
    """Identity of a run: a hash of everything that changes its numbers (model, data, optim, train)."""
    tree = cfglib.to_dict(cfg)
    core = {k: tree[k] for k in ("model", "data", "optim", "train") if k in tree}
    for how in ("micro_batch", "grad_accum", "device", "threads", "compile", "tune_allocator"):
        core["train"].pop(how, None)  # how the batch is computed, not what is computed
    return bytes_xxhash(json.dumps(core, sort_keys=True).encode())


def read_results(ladder_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of LADDER_DIR/results.jsonl (empty when there is none); a bad line is a clear error."""
    path = Path(ladder_dir) / "results.jsonl"
    if not path.exists():
        return []
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise TenxError(f"{path}:{i}: not JSON ({e}); fix or delete that line and rerun") from None
    return rows


def append_result(ladder_dir: str | Path, row: dict[str, Any]) -> None:
    """Add (or replace, by key) one row of results.jsonl, written atomically."""
    rows = [r for r in read_results(ladder_dir) if r.get("key") != row["key"]] + [row]
    atomic_write_text(Path(ladder_dir) / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


# ----- evaluation ------------------------------------------------------------------------------------
def _spread_documents(texts: list[str], max_bytes: int) -> list[str]:
    """Whole documents spread evenly over the split, adding up to at least `max_bytes` (0: all)."""
    total = sum(len(t.encode("utf-8")) for t in texts)
    if max_bytes <= 0 or total <= max_bytes:
        return texts
    picked, size = [], 0
    # a golden-ratio stride order samples the whole split, not its first files (which share a package)
    for i in sorted(range(len(texts)), key=lambda i: (i * 0.6180339887) % 1.0):
        picked.append(i)
        size += len(texts[i].encode("utf-8"))
        if size >= max_bytes:
            break
    return [texts[i] for i in sorted(picked)]


def evaluate_run(run_dir: str | Path, eval_bytes: int) -> dict[str, dict[str, Any]]:
    """Loss and bits per byte of a finished run's final checkpoint on the val and held-out splits."""
    from tenx.data.manifest import read_manifest, split_documents_text
    from tenx.data.tokenizer import load_tokenizer
    from tenx.eval.bpb import eval_texts
    from tenx.eval.load import load_model
    from tenx.plan.hardware import resolve_precision

    loaded = load_model(run_dir, "auto")
    data_dir = loaded.data_dir
    manifest = read_manifest(data_dir)
    tok = load_tokenizer(data_dir, manifest["tokenizer"])
    device = next(loaded.model.parameters()).device
    amp = resolve_precision("auto", device)
    out = {}
    for split in ("val", "heldout"):
        texts = _spread_documents(list(split_documents_text(data_dir, manifest, split, tok)), eval_bytes)
        out[split] = eval_texts(loaded.model, texts, tok, batch_size=16, amp_dtype=amp)
    return out


# ----- running ---------------------------------------------------------------------------------------
def run_one(run: PlannedRun, ladder_dir: str | Path, lc: LadderConfig) -> dict[str, Any]:
    """Train (or resume, or reuse) one planned run, evaluate it and record its row in results.jsonl."""
    from tenx.monitor.plots import plot_loss_curve
    from tenx.train import checkpoint as ckpt
    from tenx.train.run import train

    ladder_dir = Path(ladder_dir)
    key = config_key(run.config)
    for row in read_results(ladder_dir):
        if row.get("key") == key:
            return {**row, "reused": True}
    run_dir = ladder_dir / "runs" / run.name
    text = cfglib.dumps_toml(run.config)
    config_path = run_dir / "config.toml"
    if config_path.exists() and config_path.read_text() != text:
        if config_key(load_run_config(config_path)) != key:
            raise TenxError(
                f"{run_dir} holds a run of a different config (the base config or the ladder settings "
                "changed); delete that directory or use another ladder directory"
            )
    t0 = time.perf_counter()
    latest, _ = ckpt.latest_verified(run_dir / "checkpoints")
    trained = latest is not None and ckpt.read_checkpoint_meta(latest)["step"] >= run.steps
    if not trained:
        resume = "auto" if ckpt.list_checkpoints(run_dir / "checkpoints") else None
        if resume is None and run_dir.exists():
            shutil.rmtree(run_dir)  # a run that crashed before its first checkpoint starts over cleanly
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(config_path, text)
        train(run.config, run_dir, resume=resume)
    train_s = time.perf_counter() - t0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss_curve.png", run.name)
    t1 = time.perf_counter()
    ev = evaluate_run(run_dir, lc.eval_bytes)
    eval_s = time.perf_counter() - t1
    train_tokens = _train_tokens(run.config)
    unique = min(run.unique_tokens or train_tokens, train_tokens)
    row = {
        "name": run.name,
        "key": key,
        **{k: v for k, v in run.record().items() if k != "name"},
        "unique_tokens": unique,
        "epochs": run.tokens / unique,
        "family": run.config.model.family,
        "train_loss": metrics[-1]["loss"],
        "val_loss": ev["val"]["loss"],
        "val_bpb": ev["val"]["bits_per_byte"],
        "heldout_loss": ev["heldout"]["loss"],
        "heldout_bpb": ev["heldout"]["bits_per_byte"],
        "eval_bytes": {k: v["bytes"] for k, v in ev.items()},
        "step_time_s": sum(m.get("step_time_s", 0.0) for m in metrics),
        "wall_s": time.perf_counter() - t0,
        "train_s": train_s,
        "eval_s": eval_s,
        "resumed_or_reused_training": trained,
        "run_dir": str(run_dir),
        "config": cfglib.to_dict(run.config),
        "time": time.time(),
    }
    append_result(ladder_dir, row)
    return row


def _train_tokens(cfg: RunConfig) -> int:
    from tenx.data.manifest import read_manifest

    return int(read_manifest(cfg.data.dir)["splits"][cfg.data.train_split]["tokens"])


def measure_tokens_per_s(cfg: RunConfig, micro_batch: int, steps: int = 3) -> float:
    """Training tokens per second of cfg's model on this machine (a few timed steps on random tokens)."""
    import torch
    import torch.nn.functional as F

    from tenx.model.transformer import Transformer
    from tenx.plan.hardware import pick_device, resolve_precision, tune_cpu_allocator
    from tenx.train.optim import build_optimizer

    device = pick_device(cfg.train.device)
    if device.type == "cpu":
        tune_cpu_allocator()
    model_cfg = cfg.model.resolved(_vocab_size(cfg))
    torch.manual_seed(0)
    model = Transformer(model_cfg).to(device)
    opt = build_optimizer(model, cfg.optim, device)
    amp = resolve_precision(cfg.train.precision, device)
    assert model_cfg.vocab_size is not None
    x = torch.randint(0, model_cfg.vocab_size, (micro_batch, model_cfg.seq_len + 1), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
            logits = model(x[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * micro_batch * model_cfg.seq_len / (time.perf_counter() - t0)


def estimate_seconds(plan: list[PlannedRun], lc: LadderConfig) -> dict[str, float]:
    """Estimated training + evaluation seconds of each run on this machine, from measured step times."""
    speed: dict[tuple[int, int], float] = {}
    out = {}
    for run in plan:
        shape = (run.depth, run.config.train.micro_batch)
        if shape not in speed:
            speed[shape] = measure_tokens_per_s(run.config, run.config.train.micro_batch)
        # forward-only evaluation is about 3x faster per token than a training step
        eval_tokens = 2 * lc.eval_bytes / _bytes_per_token(run.config) if lc.eval_bytes else 0.0
        out[run.name] = run.tokens / speed[shape] + eval_tokens / (3 * speed[shape])
    return out


def _bytes_per_token(cfg: RunConfig) -> float:
    from tenx.data.manifest import read_manifest

    split = read_manifest(cfg.data.dir)["splits"][cfg.data.train_split]
    return max(1e-9, split["bytes"] / max(1, split["tokens"]))


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


# ----- launching on a cluster ------------------------------------------------------------------------
def emit_launch(
    plan: list[PlannedRun],
    ladder_dir: str | Path,
    how: Literal["torchrun", "slurm"],
    collect: str,
    nproc: int = 8,
    nodes: int = 1,
) -> list[Path]:
    """Write each run's config and the commands that train them on a cluster; returns the scripts.

    The last command, `collect`, is this ladder's own command without --emit: it finds the finished
    runs, evaluates them and writes results.jsonl.
    """
    ladder_dir = Path(ladder_dir)
    ranks = nproc * nodes
    runs = []
    for run in plan:
        if run.global_batch % ranks:
            raise TenxError(
                f"run {run.name}: its global batch of {run.global_batch} sequences cannot be split over "
                f"{ranks} ranks; raise the base config's train.global_batch or lower --nproc/--nodes"
            )
        run_dir = ladder_dir / "runs" / run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.toml", cfglib.dumps_toml(run.config))
        micro = min(run.config.train.micro_batch, run.global_batch // ranks)
        while (run.global_batch // ranks) % micro:
            micro -= 1
        train_args = (
            f"-m tenx train --config {shlex.quote(str(run_dir / 'config.toml'))} "
            f"--run-dir {shlex.quote(str(run_dir))} --resume auto --set train.micro_batch={micro}"
        )
        runs.append((run, run_dir, train_args))
    out_dir = ladder_dir / "launch"
    out_dir.mkdir(parents=True, exist_ok=True)
    cwd = shlex.quote(str(Path.cwd()))
    if how == "torchrun":
        lines = [
            "#!/usr/bin/env bash",
            f"# {len(runs)} ladder runs, one after another on this node; rerunning resumes or skips them.",
            "set -euo pipefail",
            f"cd {cwd}",
            f'NPROC="${{NPROC_PER_NODE:-{nproc}}}"',
        ]
        lines += [f'torchrun --standalone --nproc_per_node "$NPROC" {args}' for _, _, args in runs]
        lines += ["# evaluate the finished runs and write results.jsonl", collect]
        path = out_dir / "torchrun.sh"
        atomic_write_text(path, "\n".join(lines) + "\n")
        path.chmod(0o755)
        return [path]
    scripts = []
    for run, run_dir, args in runs:
        text = "\n".join(
            [
                "#!/bin/bash",
                f"#SBATCH --job-name=tenx-{run.name}",
                f"#SBATCH --nodes={nodes}",
                "#SBATCH --ntasks-per-node=1",
                f"#SBATCH --gpus-per-node={nproc}",
                f"#SBATCH --output={run_dir}/slurm-%j.out",
                "set -euo pipefail",
                f"cd {cwd}",
                'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                f'srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node {nproc} --rdzv_id "$SLURM_JOB_ID" '
                f'--rdzv_backend c10d --rdzv_endpoint "$head:29500" {args}',
            ]
        )
        path = out_dir / f"{run.name}.sbatch"
        atomic_write_text(path, text + "\n")
        scripts.append(path)
    submit = [
        "#!/usr/bin/env bash",
        "# submits every run, then a job that collects the results once all have finished",
        "set -euo pipefail",
        f"cd {cwd}",
        "ids=()",
        *[f'ids+=("$(sbatch --parsable {shlex.quote(str(p))})")' for p in scripts],
        f'sbatch --dependency="afterok:$(IFS=:; echo "${{ids[*]}}")" --job-name=tenx-ladder-collect '
        f"--wrap {shlex.quote(collect)}",
    ]
    path = out_dir / "submit.sh"
    atomic_write_text(path, "\n".join(submit) + "\n")
    path.chmod(0o755)
    return [*scripts, path]


# ----- the whole ladder ------------------------------------------------------------------------------
def load_base(config: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """The base run config of a ladder (a path or a shipped config name) with overrides."""
    from tenx.train.config import resolve_config_path

    return load_run_config(resolve_config_path(str(config)), overrides)


def run_ladder(
    base: RunConfig,
    lc: LadderConfig,
    out: str | Path,
    *,
    tag: str = "base",
    dry_run: bool = False,
    emit: Literal["torchrun", "slurm"] | None = None,
    nproc: int = 8,
    nodes: int = 1,
    collect: str = "",
    estimate: bool = True,
) -> list[dict[str, Any]]:
    """Plan the ladder into `out` and run it (or print it, or write cluster launch scripts).

    Returns the results rows of the plan's runs (empty for a dry run or when emitting).
    """
    lc.validate()
    ensure_data(base, lc)
    plan = plan_ladder(base, lc, tag)
    out = Path(out)
    if dry_run:
        print(format_plan(plan, estimate_seconds(plan, lc) if estimate else None))
        return []
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        out / "plan.json",
        {"ladder": cfglib.to_dict(lc), "runs": [r.record() for r in plan], "time": time.time()},
    )
    if emit is not None:
        scripts = emit_launch(plan, out, emit, collect or "tenx ladder ...", nproc, nodes)
        print(format_plan(plan))
        print("launch scripts:\n  " + "\n  ".join(str(p) for p in scripts))
        return []
    print(format_plan(plan))
    rows = []
    t0 = time.perf_counter()
    for i, run in enumerate(plan, 1):
        row = run_one(run, out, lc)
        state = "reused" if row.get("reused") else f"{row['wall_s']:.0f} s"
        print(
            f"[{i}/{len(plan)}] {run.name}: held-out {row['heldout_loss']:.4f} nats/token, "
            f"{row['heldout_bpb']:.4f} bits/byte ({state})",
            flush=True,
        )
        rows.append(row)
    print(f"ladder: {len(plan)} runs in {time.perf_counter() - t0:.0f} s; results: {out / 'results.jsonl'}")
    sys.stdout.flush()
    return rows
