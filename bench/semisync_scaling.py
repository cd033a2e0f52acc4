"""Semi-synchronous training across compute budgets: does DiLoCo's loss gap to sync close with scale?

Every mode trains the same model at every budget with 2 replica groups of 1 process each (one thread each,
a lighthouse in this process), the same global batch and the same tokens, on the standard-library corpus
(byte tokens). A budget is a model shape (DEPTHxWIDTH) trained on --tokens-per-param tokens per
non-embedding parameter, so the budgets span model size and tokens together; C = training FLOPs per token
(tenx.model.flops) x tokens. Modes: `sync` (gradients averaged across the groups every step), DiLoCo at two
values of H, streaming DiLoCo (2 fragments) at the larger H, and DiLoCo with low-precision pseudo-gradients
(`parallel.replicas.pseudo_grad_dtype` bf16, int8, int4, with error feedback).

Scored: group 0's final model on the whole held-out split (fp32). The analysis is `tenx derisk`'s
(tenx.scaling.derisk.compute_multiplier.analyse) with sync as the baseline: L_sync(C) is fitted (tenx.scaling.fit), and a
mode's effective compute multiplier at budget C is C_sync(L_mode) / C (< 1: the mode needs more compute
than sync for its loss), with a 95% interval from the fit's bootstrap and the seed noise measured at the
smallest budget (--seeds), and its trend per decade of compute. Bytes: `replica_bytes_sent` of group 0 per
training token (bytes ratio: sync's over the mode's). Low precision: held-out loss against fp32 DiLoCo at
the same H, run for run (same seed, so same initialisation and data order). Group loss: at the middle
budget, group 1 of `sync` and of DiLoCo (larger H) is SIGKILLed half-way (in the middle of an outer
interval) and group 0 trains on alone (min_groups 1, a 1 s heartbeat timeout); its held-out loss against
the undisturbed run, and its longest stall (a step's excess over the median step).

    python bench/semisync_scaling.py [--out runs/semisync_scaling] [--quick]
    python bench/semisync_scaling.py --shapes 1x64,2x64,2x96,2x128 --group-loss-budget 1   # + a 4th budget

The defaults (3 budgets, 7 modes, 25 runs) took 21.5 minutes on 2 CPU cores that other jobs shared; the
4th budget (2x128, 7 more runs) about 30 more; --quick (a few steps per run) checks the plumbing in about
5. Resumable: finished runs are kept in OUT/results.json (keyed by run, with the settings that made them
and ReplicaConfig's defaults) and reused; a run whose settings changed, or --rerun NAME,..., trains again
in a fresh directory, and a run that fails (a start-up race of the groups, now and then) is tried once
more. Ends with one JSON line: budgets, multiplier (and its interval), trend_per_decade, parity_flops,
gap_at_largest per mode, bytes_ratio, loss_after_group_loss, low_precision.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diloco_vs_sync import free_port, heldout_loss, prepare_data  # noqa: E402

from tenx.model.config import ModelConfig  # noqa: E402
from tenx.model.flops import count_params, flops_per_token  # noqa: E402
from tenx.parallel.lighthouse import start_lighthouse  # noqa: E402
from tenx.parallel.replicas import ReplicaConfig  # noqa: E402
from tenx.scaling.derisk.compute_multiplier import (  # noqa: E402
    DeriskConfig,
    Stage,
    _label_axes,
    analyse,
    format_multiplier,
)
from tenx.scaling.ladder.runner import config_key  # noqa: E402
from tenx.utils.io import atomic_write_json  # noqa: E402

SEQ_LEN = 128
VOCAB = 257  # the byte tokenizer's


@dataclass(frozen=True)
class Mode:
    """One way of synchronising the groups: a name and the parallel.replicas overrides that make it."""

    name: str
    replicas: str  # parallel.replicas.mode
    sync_every: int = 1
    sets: tuple[str, ...] = ()

    def overrides(self, outer: list[str]) -> list[str]:
        sets = [f"parallel.replicas.mode={self.replicas}", *self.sets]
        if self.replicas != "sync":
            sets += [f"parallel.replicas.sync_every={self.sync_every}", *outer]
        return sets


def build_modes(h_small: int, h_large: int, low_precision: list[str]) -> list[Mode]:
    """sync, DiLoCo at both H, streaming DiLoCo and low-precision DiLoCo at the larger H."""
    modes = [
        Mode("sync", "sync"),
        Mode(f"diloco-h{h_small}", "diloco", h_small),
        Mode(f"diloco-h{h_large}", "diloco", h_large),
        Mode(f"streaming-h{h_large}", "streaming-diloco", h_large, ("parallel.replicas.fragments=2",)),
    ]
    modes += [
        Mode(
            f"diloco-h{h_large}-{dtype}", "diloco", h_large, (f"parallel.replicas.pseudo_grad_dtype={dtype}",)
        )
        for dtype in low_precision
    ]
    return modes


@dataclass(frozen=True)
class Budget:
    """A model shape and the steps that train it on tokens_per_param tokens per non-embedding parameter."""

    depth: int
    d_model: int
    steps: int
    tokens_per_step: int

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(
            family="gpt2", depth=self.depth, d_model=self.d_model, head_dim=32, seq_len=SEQ_LEN
        ).resolved(VOCAB)

    @property
    def params(self) -> int:
        return count_params(self.model).non_embedding

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def flops(self) -> float:
        return float(flops_per_token(self.model) * self.tokens)


def plan_budgets(shapes: str, tokens_per_param: float, tokens_per_step: int, multiple: int) -> list[Budget]:
    """One budget per DEPTHxWIDTH shape; steps rounded to a multiple of `multiple` (every H divides it)."""
    budgets = []
    for shape in shapes.split(","):
        depth, width = (int(x) for x in shape.lower().split("x"))
        n = Budget(depth, width, 1, tokens_per_step).params
        steps = max(multiple, multiple * round(tokens_per_param * n / tokens_per_step / multiple))
        budgets.append(Budget(depth, width, steps, tokens_per_step))
    return sorted(budgets, key=lambda b: b.flops)


class RunFailed(RuntimeError):
    """A group exited with an error, or the run took too long."""


# ----- one run -----------------------------------------------------------------------------------------
def _metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return rows


def _last_step(run_dir: Path) -> int:
    rows = [r for r in _metrics(run_dir / "metrics.jsonl") if "loss" in r]
    return int(rows[-1]["step"]) if rows else 0


def train_pair(
    run_dir: Path, budget: Budget, mode: Mode, sets: list[str], *, kill_at: int = 0, timeout: float = 900
) -> dict[str, Any]:
    """Train 2 groups with `sets`; with kill_at > 0, SIGKILL group 1 at that step and let group 0 finish
    alone. Returns group 0's figures (held-out loss of its final model, bytes, wall time)."""
    os.environ.setdefault("RUST_LOG", "warn")
    if run_dir.exists():  # a fresh run each time: never resume an old one
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    lighthouse = {"min_groups": 2, "join_timeout_ms": 30_000, "quorum_tick_ms": 5}
    if kill_at:  # the survivor must be allowed to go on alone, and to notice the death within a second
        lighthouse.update(min_groups=1, heartbeat_timeout_ms=1000)
        sets = [*sets, "parallel.replicas.min_groups=1", "parallel.replicas.timeout_s=10"]
    server, address = start_lighthouse(f"127.0.0.1:{free_port()}", **lighthouse)
    sets = [*sets, f"parallel.replicas.lighthouse={address}"]
    procs = []
    t0 = time.perf_counter()
    try:
        overrides = [x for item in sets for x in ("--set", item)]
        for group in (0, 1):
            group_dir = str(run_dir / f"group{group}")
            cmd = [
                sys.executable,
                "-m",
                "tenx",
                "train",
                "--config",
                "tiny",
                "--run-dir",
                group_dir,
                *overrides,
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TENX_REPLICA_GROUP": str(group)}
            with open(run_dir / f"group{group}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        killed_at, deadline = None, time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [g for g, rc in enumerate(codes) if rc not in (None, 0) and not (g == 1 and killed_at)]
            if failed:  # fail fast: the other group would wait for its peer until a timeout
                raise RunFailed(f"{run_dir}: group {failed[0]} failed; see {run_dir}/group{failed[0]}.log")
            if all(rc is not None for rc in codes):
                break
            if time.monotonic() > deadline:
                raise RunFailed(f"{run_dir}: not finished after {timeout:.0f} s")
            if kill_at and killed_at is None and _last_step(run_dir / "group1") >= kill_at:
                procs[1].send_signal(signal.SIGKILL)  # no pause: it may land inside a cross-group all-reduce
                procs[1].wait()
                killed_at = _last_step(run_dir / "group0")
            time.sleep(0.2)
    finally:  # on an error, the other group would wait for its peer until a timeout: stop both at once
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        server.shutdown()
    wall = time.perf_counter() - t0
    rows = _metrics(run_dir / "group0" / "metrics.jsonl")
    steps = [r for r in rows if "replica_wait_s" in r]
    last = [r for r in rows if "val_loss" in r][-1]
    # a step's time: sync's quorum and all-reduces are inside step_time_s, DiLoCo's outer step is not
    times = [r["step_time_s"] + (r["replica_wait_s"] if mode.replicas != "sync" else 0.0) for r in steps]
    out = {
        "heldout_loss": heldout_loss(run_dir / "group0"),
        "val_loss": last["val_loss"],
        "bytes_sent": last["replica_bytes_sent"],
        "tokens": last["tokens"],
        "flops": budget.flops,
        "bytes_per_token": last["replica_bytes_sent"] / last["tokens"],
        "outer_steps": last.get("replica_outer_steps", 0.0),
        "wall_s": wall,
        "longest_stall_s": max(times) - float(np.median(times)) if times else 0.0,
    }
    outer = re.search(r"outer SGD lr (\S+), Nesterov momentum (\S+)", (run_dir / "group0.log").read_text())
    if outer:  # what DiLoCo's 'auto' outer lr and momentum resolved to
        out["outer_lr"], out["outer_momentum"] = float(outer[1]), float(outer[2])
    if kill_at:
        out["killed_at_step"] = killed_at
    return out


# ----- analysis (pure: unit-tested in tests/test_semisync_bench.py) --------------------------------------
@dataclass
class _RowKey:
    """The config part derisk.analyse keys a run's row by (tenx.scaling.ladder.runner.config_key)."""

    model: dict[str, Any]
    data: dict[str, Any]
    optim: dict[str, Any]
    train: dict[str, Any]


@dataclass
class _Run:
    """What derisk.analyse reads of a planned run: its budget and its config."""

    budget: float
    config: _RowKey


def analyse_modes(
    runs: dict[str, dict[str, Any]], modes: list[str], budgets: list[float], bootstrap: int = 200
) -> dict[str, Any]:
    """Multipliers against the first mode (sync) with intervals and trends: `tenx derisk`'s analysis.

    `runs`: name -> row with `mode`, `budget` (a value of `budgets`), `flops`, `heldout_loss`; several rows
    of one mode and budget (seeds) are averaged and measure the noise. Adds, per mode, the loss gap at the
    largest budget and the compute at which the trend line of the multiplier reaches 1 (parity), with the
    interval of the trend's slope (the line pivoting on its centroid).
    """
    rows, stages = {}, []
    for mode in modes:
        stage_runs = []
        for name, row in runs.items():
            if row["mode"] == mode:
                run = _Run(row["budget"], _RowKey({}, {}, {}, {"run": name}))
                rows[config_key(run.config)] = row
                stage_runs.append(run)
        stages.append(Stage(mode, [], stage_runs))
    dc = DeriskConfig(budgets=list(budgets), bootstrap=bootstrap)
    with np.errstate(invalid="ignore"):  # infinite multipliers (a loss below the fit's floor) are kept
        result = analyse(stages, rows, dc)
    logc = np.log10(np.array(result["budgets"]))
    sync_loss = result["stages"][0]["points"][-1]["heldout_loss"]
    summary = {}
    for change in result["changes"]:
        m = change["cumulative"]
        loss = change["budgets"][-1]["heldout_loss"]
        entry = {
            "multiplier": m["multipliers"],
            "low": m["low"],
            "high": m["high"],
            "trend_per_decade": 10 ** m["slope_per_decade"],
            "trend_interval": [10**s for s in m["slope_interval"]],
            "gap_at_largest": (loss - sync_loss) / sync_loss,
            "heldout_loss": [b["heldout_loss"] for b in change["budgets"]],
            "verdict": m["verdict"],
        }
        entry.update(parity(logc, np.log10(np.array(m["multipliers"])), m["slope_interval"]))
        summary[change["name"]] = entry
    return {"derisk": result, "modes": summary}


def parity(logc: np.ndarray, log_m: np.ndarray, slope_interval: list[float]) -> dict[str, Any]:
    """Compute C* (FLOPs) where the least-squares line of log10 m on log10 C crosses m = 1 while rising (the
    mode at least matches sync from C* on), and its range over the slope's interval, the line pivoting on
    its centroid. None: the line does not rise (no parity ahead); an interval's upper end None: never."""
    ok = np.isfinite(log_m)
    if ok.sum() < 2:
        return {"parity_flops": None, "parity_interval": [None, None]}
    slope = float(np.polyfit(logc[ok], log_m[ok], 1)[0])
    x0, y0 = float(logc[ok].mean()), float(log_m[ok].mean())

    def crossing(s: float) -> float:
        return float(10 ** (x0 - y0 / s)) if s > 0 else math.inf

    ends = sorted(crossing(s) for s in slope_interval)
    return {
        "parity_flops": crossing(slope) if slope > 0 else None,
        "parity_interval": [e if math.isfinite(e) else None for e in ends],
    }


def bytes_ratios(bytes_per_token: dict[str, float], reference: str = "sync") -> dict[str, float]:
    """Reference bytes per token over each mode's (how many times fewer bytes the mode sends)."""
    ref = bytes_per_token[reference]
    return {m: (ref / b if b > 0 else math.inf) for m, b in bytes_per_token.items()}


# ----- report -------------------------------------------------------------------------------------------
def format_tables(summary: dict[str, Any], budgets: list[Budget], sync_loss: list[float]) -> str:
    """Held-out loss and multiplier per mode and budget; then trend, gap, bytes and group loss per mode."""
    head = " | ".join(f"{b.depth}x{b.d_model} {b.params / 1e6:.2f}M, C={b.flops:.2g}" for b in budgets)
    lines = [
        f"| mode | {head} |",
        "|---" * (len(budgets) + 1) + "|",
        "| sync | " + " | ".join(f"{x:.4f}" for x in sync_loss) + " |",
    ]
    for mode, s in summary["modes"].items():
        cells = [
            f"{loss:.4f} (x{format_multiplier(m, lo, hi)})"
            for loss, m, lo, hi in zip(s["heldout_loss"], s["multiplier"], s["low"], s["high"])
        ]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| mode | trend per decade | parity at C | gap at largest | bytes/token | bytes ratio | "
        "loss after group loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in ["sync", *summary["modes"]]:
        s = summary["modes"].get(mode)
        gl = summary["group_loss"].get(mode)
        lost = (
            f"{gl['heldout_loss']:.4f} ({100 * gl['loss_change']:+.2f}%, stall {gl['longest_stall_s']:.1f} s)"
            if gl
            else "-"
        )
        if s is None:
            trend = parity_text = gap = "-"
        else:
            lo, hi = s["trend_interval"]
            trend = f"{s['trend_per_decade']:.2f}x [{lo:.2f}, {hi:.2f}]"
            p, (lo, hi) = s["parity_flops"], s["parity_interval"]
            parity_text = "none ahead" if p is None else f"{p:.2g}"
            parity_text += " [" + ", ".join("never" if e is None else f"{e:.2g}" for e in (lo, hi)) + "]"
            gap = f"{100 * s['gap_at_largest']:+.2f}%"
        lines.append(
            f"| {mode} | {trend} | {parity_text} | {gap} | {summary['bytes_per_token'][mode]:.1f} | "
            f"{summary['bytes_ratio'][mode]:.1f}x | {lost} |"
        )
    return "\n".join(lines)


def plot(summary: dict[str, Any], out_png: Path) -> Path:
    """Left: held-out loss against compute per mode, with sync's fit; right: multipliers against sync."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    from tenx.scaling.fit import FitResult

    result = summary["derisk"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=120)
    budgets = np.array(result["budgets"])
    for st in result["stages"]:
        C = [p["flops"] for p in st["points"]]
        ax1.plot(C, [p["heldout_loss"] for p in st["points"]], "o-", lw=1, ms=4, label=st["name"])
    f = result["stages"][0]["fit"]
    fit = FitResult(f["law"], f["form"], f["params"], {}, np.zeros((0, len(f["params"]))), 0, 0.0)
    grid = np.geomspace(budgets[0] / 1.3, budgets[-1] * 1.3, 50)
    ax1.plot(grid, fit.predict(C=grid), "k:", lw=1, label="sync fit")
    _label_axes(ax1, "held-out loss (nats/token)", "held-out loss of group 0's final model")
    for i, (mode, s) in enumerate(summary["modes"].items()):
        x = budgets * (1 + 0.03 * (i - len(summary["modes"]) / 2))  # spread the error bars apart
        y = np.array(s["multiplier"])
        err = np.clip([y - np.array(s["low"]), np.array(s["high"]) - y], 0, None)
        ax2.errorbar(x, y, yerr=err, fmt="o-", lw=1, ms=4, capsize=3, label=mode, color=f"C{i + 1}")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_yscale("log")
    _label_axes(ax2, "effective compute multiplier vs sync", "C_sync(L_mode) / C (< 1: needs more compute)")
    for ax in (ax1, ax2):  # label decades only; plain numbers on the multiplier's log axis
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax2.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax2.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


# ----- the study ----------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x64,2x64,2x96", help="model shape DEPTHxWIDTH of each budget")
    p.add_argument(
        "--tokens-per-param", type=float, default=16, help="training tokens per non-embedding param"
    )
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per group per step (128 bytes each)")
    p.add_argument("--h", default="20,40", help="the two DiLoCo H (inner steps per outer step)")
    p.add_argument(
        "--low-precision", default="bf16,int8,int4", help="pseudo-gradient dtypes tried at the larger H"
    )
    p.add_argument("--outer-lr", type=float, default=None, help="DiLoCo outer lr (default: ReplicaConfig's)")
    p.add_argument(
        "--outer-momentum", type=float, default=None, help="outer momentum (default: ReplicaConfig's)"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW lr at width 128 (x (128/width)^0.5)")
    p.add_argument(
        "--seeds", type=int, default=2, help="seeds of sync and DiLoCo (larger H) at the smallest budget"
    )
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples of the sync fit")
    p.add_argument(
        "--group-loss-budget",
        type=int,
        default=None,
        help="budget index of the group-loss runs (default: middle)",
    )
    p.add_argument("--no-group-loss", action="store_true", help="skip the group-loss runs")
    p.add_argument("--quick", action="store_true", help="a few steps per run: check the plumbing")
    p.add_argument("--rerun", default="", help="comma-separated run names to train again")
    p.add_argument("--out", type=Path, default=Path("runs/semisync_scaling"))
    args = p.parse_args()
    if args.quick:
        args.shapes, args.tokens_per_param, args.h, args.micro_batch = "1x32,1x64,2x64", 0.5, "5,10", 4
        args.seeds, args.bootstrap = 2, 20
        if args.out == p.get_default("out"):
            args.out = Path("runs/semisync_scaling_quick")
    h_small, h_large = (int(x) for x in args.h.split(","))
    modes = build_modes(h_small, h_large, [x for x in args.low_precision.split(",") if x])
    multiple = math.lcm(h_small, h_large, 2)
    budgets = plan_budgets(args.shapes, args.tokens_per_param, 2 * args.micro_batch * SEQ_LEN, multiple)
    outer = []
    if args.outer_lr is not None:
        outer.append(f"parallel.replicas.outer_lr={args.outer_lr}")
    if args.outer_momentum is not None:
        outer.append(f"parallel.replicas.outer_momentum={args.outer_momentum}")
    defaults = ReplicaConfig()
    replica_defaults = json.loads(json.dumps(dataclasses.asdict(defaults)))
    print(
        f"outer lr {args.outer_lr if args.outer_lr is not None else defaults.outer_lr}, momentum "
        f"{args.outer_momentum if args.outer_momentum is not None else defaults.outer_momentum}; budgets: "
        + ", ".join(
            f"{b.depth}x{b.d_model} ({b.params} params, {b.steps} steps, {b.tokens / 1e6:.2f}M tokens, "
            f"C={b.flops:.3g})"
            for b in budgets
        ),
        flush=True,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args.out)
    results_path = args.out / "results.json"
    results: dict[str, Any] = json.loads(results_path.read_text())["runs"] if results_path.exists() else {}
    rerun = set(filter(None, args.rerun.split(",")))

    def base_sets(b: Budget, seed: int) -> list[str]:
        lr = args.lr * (128 / b.d_model) ** 0.5
        return [
            f'data.dir="{data}"',
            "model.family='gpt2'",
            f"model.depth={b.depth}",
            f"model.d_model={b.d_model}",
            "model.head_dim=32",
            f"model.seq_len={SEQ_LEN}",
            f"train.micro_batch={args.micro_batch}",
            f"train.steps={b.steps}",
            f"train.seed={seed}",
            "train.precision='fp32'",
            "train.threads=1",
            f"train.eval_every={b.steps}",
            "train.eval_batches=16",
            f"optim.lr={lr:.3g}",
            f"optim.warmup_steps={max(5, b.steps // 50)}",
            f"checkpoint.every={b.steps}",
            "log.progress=false",
            "log.tensorboard=false",
            "parallel.replicas.groups=2",
            "parallel.replicas.min_groups=2",
        ]

    # name, mode, budget index, seed, kill step
    plan = [(f"{m.name}@{i}", m, i, 0, 0) for i in range(len(budgets)) for m in modes]
    seeded = {"sync", f"diloco-h{h_large}"}
    plan += [(f"{m.name}@0#{s}", m, 0, s, 0) for s in range(1, args.seeds) for m in modes if m.name in seeded]
    mid = len(budgets) // 2 if args.group_loss_budget is None else args.group_loss_budget
    if not args.no_group_loss:
        kill_at = budgets[mid].steps // 2 + h_large // 2  # half-way, in the middle of an outer interval
        plan += [(f"{m.name}@{mid}!kill", m, mid, 0, kill_at) for m in modes if m.name in seeded]
    t_study = time.perf_counter()
    for k, (name, mode, i, seed, kill_at) in enumerate(plan, 1):
        sets = base_sets(budgets[i], seed) + mode.overrides(outer)
        # the data path may move with OUT; a changed ReplicaConfig default (e.g. the outer rule) trains again
        spec = {"sets": sets[1:], "kill_at": kill_at, "replica_defaults": replica_defaults}
        old = results.get(name)
        if old is not None and old["spec"] == spec and name not in rerun:
            continue
        run_dir = args.out / "runs" / name.replace("@", "-").replace("#", "-s").replace("!", "-")
        for attempt in (1, 2):  # a start-up race of the groups fails a run now and then: once more
            try:
                row = train_pair(run_dir, budgets[i], mode, sets, kill_at=kill_at)
                break
            except RunFailed as e:
                print(f"[{k}/{len(plan)}] {name}: attempt {attempt} failed: {e}", flush=True)
                if attempt == 2:
                    raise SystemExit(1) from None
                kept = run_dir.with_name(run_dir.name + "-failed")  # its logs, for whoever looks
                shutil.rmtree(kept, ignore_errors=True)
                run_dir.rename(kept)
        results[name] = {"mode": mode.name, "budget_index": i, "seed": seed, "spec": spec, **row}
        atomic_write_json(results_path, {"runs": results})
        print(
            f"[{k}/{len(plan)}] {name}: held-out {row['heldout_loss']:.4f}  val {row['val_loss']:.4f}  "
            f"{row['bytes_per_token']:.1f} B/token  wall {row['wall_s']:.0f} s"
            + (
                f"  outer lr {row['outer_lr']:g} momentum {row['outer_momentum']:g}"
                if "outer_lr" in row
                else ""
            ),
            flush=True,
        )
    study_s = time.perf_counter() - t_study
    runs_s = sum(
        results[name]["wall_s"] for name, *_ in plan
    )  # their training wall time, reused runs included

    names = [m.name for m in modes]
    flops = [b.flops for b in budgets]
    clean = {
        n: {**r, "budget": flops[r["budget_index"]]}
        for n, r in results.items()
        if "!kill" not in n and r["mode"] in names and r["budget_index"] < len(budgets)
    }
    summary = analyse_modes(clean, names, flops, args.bootstrap)
    largest = len(budgets) - 1
    summary["bytes_per_token"] = {m: results[f"{m}@{largest}"]["bytes_per_token"] for m in names}
    summary["bytes_ratio"] = bytes_ratios(summary["bytes_per_token"])
    summary["group_loss"] = {}
    for name, r in results.items():
        if name.endswith(f"@{mid}!kill") and r["mode"] in names:
            ref = results[name.split("!")[0]]
            summary["group_loss"][r["mode"]] = {
                "heldout_loss": r["heldout_loss"],
                "undisturbed": ref["heldout_loss"],
                "loss_change": (r["heldout_loss"] - ref["heldout_loss"]) / ref["heldout_loss"],
                "wall_s": r["wall_s"],
                "wall_change_s": r["wall_s"] - ref["wall_s"],
                "longest_stall_s": r["longest_stall_s"],
                "killed_at_step": r.get("killed_at_step"),
                "flops": flops[mid],
            }
    fp32 = f"diloco-h{h_large}"  # low precision against it, run for run (same seed: same init and data)
    low = {
        m: {
            "loss_change": [
                results[f"{m}@{i}"]["heldout_loss"] / results[f"{fp32}@{i}"]["heldout_loss"] - 1
                for i in range(len(budgets))
            ],
            "bytes_ratio": summary["bytes_per_token"][fp32] / summary["bytes_per_token"][m],
        }
        for m in names
        if m.startswith(f"{fp32}-")
    }
    sync_loss = summary["derisk"]["stages"][0]["points"]
    print()
    print(format_tables(summary, budgets, [pt["heldout_loss"] for pt in sync_loss]))
    if low:
        print(f"\nlow-precision pseudo-gradients against {fp32} (fp32), same seed, held-out loss by budget:")
        for m, v in low.items():
            changes = ", ".join(f"{100 * x:+.2f}%" for x in v["loss_change"])
            print(f"  {m}: {changes}; {v['bytes_ratio']:.1f}x fewer bytes")
    png = plot(summary, args.out / "semisync_scaling.png")
    print(
        f"\nplot: {png}  numbers: {results_path}  seed noise {summary['derisk']['seed_sigma']:.4f} nats/token"
    )
    atomic_write_json(
        args.out / "summary.json", {**summary, "low_precision": low, "study_s": study_s, "runs_s": runs_s}
    )
    line = {
        "bench": "semisync_scaling",
        "budgets": flops,
        "multiplier": {m: s["multiplier"] for m, s in summary["modes"].items()},
        "multiplier_interval": {m: list(zip(s["low"], s["high"])) for m, s in summary["modes"].items()},
        "trend_per_decade": {m: s["trend_per_decade"] for m, s in summary["modes"].items()},
        "parity_flops": {m: s["parity_flops"] for m, s in summary["modes"].items()},
        "gap_at_largest": {m: s["gap_at_largest"] for m, s in summary["modes"].items()},
        "bytes_ratio": summary["bytes_ratio"],
        "loss_after_group_loss": {m: g["heldout_loss"] for m, g in summary["group_loss"].items()},
        "low_precision": low,
        "wall_s": study_s,
        "runs_wall_s": runs_s,
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
