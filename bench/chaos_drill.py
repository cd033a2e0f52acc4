"""Chaos drill: a supervised run under seeded random SIGKILLs and a corrupted checkpoint must end with the
same model, bit for bit, as the same run without faults; it prints the goodput ledger.

Baseline: the same config trained once without faults, in the same way (a `python -m tenx train` child).
The drill run is `tenx train --supervise` with `sigkill@p=P` (the seed is chosen so that at least
--min-kills kills land in the run) and one `corrupt-checkpoint`, placed just after a checkpoint that a
later kill would resume from, so the restart must fall back to the checkpoint before it.

    python bench/chaos_drill.py [--steps 300] [--every 20] [--memory-every 1] [--p 0.02] [--out runs/chaos_drill]

With `--memory-every 0` only the disk tier exists and each SIGKILL costs on average half a disk interval of
recomputation; with the in-memory tier (default: a snapshot every step to tmpfs) a kill costs about a step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from tenx.checkpoint.interval import expected_goodput
from tenx.checkpoint.models import load_model
from tenx.data.prepare.pipeline import PrepareConfig, is_prepared, prepare
from tenx.data.prepare.sources import copy_stdlib_packages
from tenx.monitor.events import read_events
from tenx.monitor.goodput import compute_goodput, format_goodput
from tenx.train.callbacks.faults import parse_fault
from tenx.utils.cpus import choose_threads

PACKAGES = ("json", "email", "http", "xml")

MODEL = [
    "model.family='gpt2'",
    "model.depth=2",
    "model.d_model=128",
    "model.head_dim=32",
    "model.seq_len=128",
    "train.micro_batch=16",
    "train.precision='fp32'",
    "train.eval_every=0",
    "log.progress=false",
    "log.tensorboard=false",
]


def prepare_data(out: Path) -> Path:
    """A few standard-library packages, byte-tokenized: prepared in seconds, real code."""
    data, corpus = out / "data", out / "corpus"
    copy_stdlib_packages(PACKAGES, corpus)
    cfg = PrepareConfig(source=str(corpus), out=str(data), tokenizer="bytes")
    if not is_prepared(cfg):
        prepare(cfg, progress=False)
    return data


def plan_faults(
    steps: int, every: int, p: float, min_kills: int, first_seed: int
) -> tuple[int, list[int], list[str]]:
    """A seed giving >= min_kills kills, the kill steps, and the fault specs (kills + one corrupt checkpoint).

    The newest checkpoint is damaged at the start of a kill's step, just before the kill, so the restart
    finds it damaged and must fall back to the one before it (in both tiers' case: memory, then disk).
    """
    kill = parse_fault(f"sigkill@p={p}")
    for seed in range(first_seed, first_seed + 10_000):
        kills = [s for s in range(1, steps + 1) if kill.fires_at(s, seed, 1)]  # index 1: listed second
        target = next((k for k in kills if k > 2 * every), None)
        if len(kills) >= min_kills and target is not None:
            return seed, kills, [f"corrupt-checkpoint@step={target}", f"sigkill@p={p}"]
    raise SystemExit("no seed gives enough kills; raise --p")


def run_tenx(args: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-m", "tenx", *args], stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=20, help="checkpoint interval in steps")
    ap.add_argument("--p", type=float, default=0.02, help="probability of a SIGKILL at each step")
    ap.add_argument("--min-kills", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="first fault seed tried")
    ap.add_argument(
        "--memory-every",
        type=int,
        default=1,
        help="steps between snapshots to the in-memory tier (checkpoint.memory_every; 0: disk tier only)",
    )
    ap.add_argument("--out", default="runs/chaos_drill")
    ap.add_argument(
        "--threads",
        type=int,
        help="torch threads of both runs (default: chosen once at the start from this machine's load)",
    )
    args = ap.parse_args()

    out = Path(args.out)
    data = prepare_data(out)
    common = ["train", "--config", "tiny", "--set", f"data.dir='{data}'"]
    common += [x for item in MODEL for x in ("--set", item)]
    common += ["--set", f"train.steps={args.steps}", "--set", f"checkpoint.every={args.every}"]
    common += ["--set", f"checkpoint.memory_every={args.memory_every}"]
    # the count orders float reductions: both runs train on one count, chosen once here (a resume inside the
    # drill takes its checkpoint's count back in any case), so the comparison is bit for bit by construction
    threads = args.threads or choose_threads(quiet=True)
    common += ["--set", f"train.threads={threads}"]
    seed, kills, faults = plan_faults(args.steps, args.every, args.p, args.min_kills, args.seed)
    print(
        f"drill: {args.steps} steps, checkpoint every {args.every}; fault seed {seed}: SIGKILL at steps {kills}"
    )
    print(f"drill: faults {faults}")

    baseline, drill = out / "baseline", out / "drill"
    for d in (baseline, drill):
        shutil.rmtree(d, ignore_errors=True)
    base_s = run_tenx([*common, "--run-dir", str(baseline)], out / "baseline.log")
    fault_args = [x for f in faults for x in ("--fault", f)]
    drill_s = run_tenx(
        [
            *common,
            "--run-dir",
            str(drill),
            "--supervise",
            "--backoff",
            "0",
            *fault_args,
            "--fault-seed",
            str(seed),
        ],
        out / "drill.log",
    )

    a = load_model(baseline, "cpu").model.state_dict()
    b = load_model(drill, "cpu").model.state_dict()
    identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = compute_goodput(drill)
    events = read_events(drill)
    fired = [e for e in events if e["kind"] == "fault"]
    kills_fired = sum(e["fault_kind"] == "sigkill" for e in fired)
    corrupt = [e for e in fired if e["fault_kind"] == "corrupt-checkpoint"]

    print(f"baseline: {base_s:.1f} s wall; drill: {drill_s:.1f} s wall (supervisor included)")
    print(format_goodput(report))
    restarts = report["restarts"]
    step_s = report["productive_s"] / max(1, report["steps"])
    bound = expected_goodput(args.every * step_s, 0.0, report["wall_s"] / max(1, restarts), 0.0)
    print(
        f"kills fired: {kills_fired}; corrupt checkpoint: {corrupt[0]['damaged'] if corrupt else None}; "
        f"restarts: {restarts}; mean recovery per restart: {report['mean_recovery_s']:.2f} s"
    )
    if not args.memory_every:
        print(
            f"first-order bound from recomputation alone (half an interval per kill): goodput <= {bound:.3f}"
        )
    print(f"final model bitwise identical to the baseline: {identical}")
    summary = {
        "steps": args.steps,
        "every": args.every,
        "memory_every": args.memory_every,
        "p": args.p,
        "threads": threads,
        "seed": seed,
        "kills": kills_fired,
        "restarts": restarts,
        "identical": identical,
        "goodput": report["goodput"],
        "mean_recovery_s": report["mean_recovery_s"],
        "baseline_wall_s": base_s,
        "drill_wall_s": drill_s,
        "ledger": report,
    }
    (out / "drill.json").write_text(json.dumps(summary, indent=2, default=str))
    goal = report["goodput"] >= 0.90
    print(f"goal goodput >= 0.90: {'met' if goal else 'NOT met'} ({report['goodput']:.3f})")
    figures = {k: v for k, v in summary.items() if k != "ledger"}
    print(
        json.dumps(
            {"bench": "chaos_drill", "baseline": "the same run without faults", **figures}, default=str
        )
    )
    if not identical or kills_fired < args.min_kills or not report["finished"]:
        raise SystemExit("drill FAILED")


if __name__ == "__main__":
    main()
