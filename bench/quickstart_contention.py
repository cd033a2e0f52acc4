"""`tenx quickstart` keeps its wall-clock budget, and beats xz, beside a competing program (issues 28, 46).

Two runs of `tenx quickstart --minutes M`, one after the other, each in a subprocess with its own output
directory and an empty peak-FLOP/s cache (as on a machine that never ran tenx, so the peak MFU is taken
against is measured during the run):

  alone       the baseline, nothing else started by this bench;
  contended   beside a CPU-bound competitor, a subprocess of numpy matmuls:
              --competitor whole-run (the default): one core's worth (`--hog-threads`, default 1) busy from
                the quickstart's launch until it exits, as on a laptop where something else runs throughout;
              --competitor probe: every core, started the moment the quickstart says it is measuring the
                machine's speed, stopped `--hog-s` seconds later (60; scaled by M/10 for a budget under 10
                minutes).

Both reuse one preparation of the standard library (BPE 4096, as the quickstart prepares it), made first
and untimed, copied into each run's OUT/data. Per run: `wall_s` (the command's, from launch to exit),
`bpb` (held-out bits per byte), `xz_bpb` (xz -9e on the same bytes), `max_mfu` (the highest MFU in its
metrics.jsonl), the steps the probe planned and the steps trained. Printed: the contended run against the
baseline (wall time and bits per byte, as ratios), each against its budget and against xz, then one JSON
line. The checks: both end within 5% of the budget, neither shows an MFU above 1, both beat xz, and the
run alone reaches at most 0.95x xz's bits per byte (`margin_0_95`).

    python bench/quickstart_contention.py [--minutes 10] [--out runs/bench/quickstart_contention]
        [--competitor whole-run|probe] [--hog-s S] [--hog-threads N] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tenx.data.prepare.pipeline import PrepareConfig, is_prepared, prepare
from tenx.monitor.metrics_file import read_metrics
from tenx.rundir import RunDir

PROBE_LINE = "measuring this machine's training speed"  # what tenx quickstart prints as its probe starts
TOLERANCE = 0.05

HOG = """
import sys, time
import numpy as np
end = time.monotonic() + float(sys.argv[1])
a = np.random.default_rng(0).random((768, 768))
while time.monotonic() < end:
    a @ a
"""


def prepared_data(out: Path, data: str | None) -> Path:
    """The standard library prepared as the quickstart prepares it (made once, reused after)."""
    if data:
        return Path(data)
    cfg = PrepareConfig(source="stdlib", out=str(out / "data"), tokenizer="bpe", vocab_size=4096)
    if not is_prepared(cfg):
        print(f"preparing the standard library into {cfg.out} (once, untimed)", flush=True)
        prepare(cfg, progress=False)
    return Path(cfg.out)


def run_quickstart(
    out: Path,
    data: Path,
    minutes: float,
    hog_s: float = 0.0,
    hog_threads: int = 0,
    whole_run: bool = False,
) -> dict[str, Any]:
    """One `tenx quickstart` into `out` (a fresh copy of `data` in out/data); with `hog_s`, the competitor
    starts when the probe does; with `whole_run`, it starts with the quickstart and runs until it exits.
    Returns the run's figures."""
    if out.exists():  # a run this bench wrote before (its summary or its copy of the data), else refused
        if any(out.iterdir()) and not ((out / "summary.json").is_file() or (out / "data").is_dir()):
            raise SystemExit(f"{out} exists and was not written by this bench; choose another --out")
        shutil.rmtree(out)
    shutil.copytree(data, out / "data")
    cache = out / "cache"  # an empty peak-FLOP/s cache: the peak is measured during this run
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(cache)}
    command = [sys.executable, "-m", "tenx", "quickstart", "--out", str(out), "--minutes", f"{minutes:g}"]
    hog: subprocess.Popen[bytes] | None = None

    def start_hog(seconds: float) -> subprocess.Popen[bytes]:
        threads = str(hog_threads or (1 if whole_run else os.cpu_count() or 1))
        hog_env = {**os.environ, "OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads}
        what = "until the quickstart exits" if whole_run else f"for {seconds:g} s"
        print(
            f"  competitor started at {time.perf_counter() - t0:.1f} s: {threads} threads of matmuls {what}"
        )
        return subprocess.Popen([sys.executable, "-c", HOG, str(seconds)], env=hog_env)

    t0 = time.perf_counter()
    hog_at = None
    if whole_run:  # busy before the quickstart starts, and after it ends (killed below)
        hog, hog_at = start_hog(4 * 60 * minutes + 600), 0.0
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            print(f"  {time.perf_counter() - t0:6.1f} s | {line}", end="", flush=True)
            if hog_s > 0 and hog is None and PROBE_LINE in line:
                hog = start_hog(hog_s)
                hog_at = time.perf_counter() - t0
        code = proc.wait()
        wall = time.perf_counter() - t0
    finally:  # the bench stopped early (Ctrl-C) leaves neither process behind
        for child in (proc, hog):
            if child is not None and child.poll() is None:
                child.kill()
            if child is not None:
                child.wait()
    if code != 0:
        raise SystemExit(f"tenx quickstart into {out} failed with exit code {code}")
    summary = json.loads((out / "summary.json").read_text())
    records = [r for r in read_metrics(RunDir(out / "run").metrics) if "mfu" in r]
    mfus = [r["mfu"] for r in records if r["mfu"] is not None]
    return {
        "wall_s": wall,
        "quickstart_wall_s": summary["wall_seconds"],
        "bpb": summary["heldout_bits_per_byte"],
        "xz_bpb": summary["xz_bits_per_byte"],
        "bpb_over_xz": summary["heldout_bits_per_byte"] / summary["xz_bits_per_byte"],
        "max_mfu": max(mfus) if mfus else None,
        "mfu_unknown_steps": len(records) - len(mfus),  # steps above the measured peak: MFU not known
        "planned_steps": summary.get("planned_steps"),
        "steps": summary["steps"],
        "depth": summary["depth"],
        "probe_tokens_per_s": summary["probe_tokens_per_s"],
        "competitor_started_s": hog_at,
    }


def verdict(run: dict[str, Any], budget_s: float) -> dict[str, bool]:
    """Whether `run` kept the acceptance's three promises."""
    return {
        "within_budget": abs(run["wall_s"] - budget_s) <= TOLERANCE * budget_s,
        "mfu_at_most_1": run["max_mfu"] is not None
        and run["max_mfu"] <= 1.0
        and not run["mfu_unknown_steps"],
        "beats_xz": run["bpb"] < run["xz_bpb"],
    }


MARGIN = 0.95
"""The run alone must reach at most this share of xz -9e's bits per byte (issue 46)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--minutes", type=float, default=10.0, help="each run's budget (tenx quickstart --minutes)"
    )
    ap.add_argument("--out", default="runs/bench/quickstart_contention", help="working directory")
    ap.add_argument(
        "--hog-s", type=float, default=None, help="competitor's seconds (default 60 x minutes/10)"
    )
    ap.add_argument(
        "--competitor",
        choices=("whole-run", "probe"),
        default="whole-run",
        help="whole-run: one core busy throughout; probe: every core from the probe for --hog-s",
    )
    ap.add_argument(
        "--hog-threads",
        type=int,
        default=0,
        help="competitor's threads (default: 1 whole-run, CPUs for probe)",
    )
    ap.add_argument("--data", default=None, help="a prepared stdlib BPE-4096 directory to reuse")
    args = ap.parse_args()
    if not args.minutes > 0:
        raise SystemExit(f"--minutes must be > 0, got {args.minutes}")
    hog_s = args.hog_s if args.hog_s is not None else 60.0 * min(1.0, args.minutes / 10)
    out = Path(args.out)
    data = prepared_data(out, args.data)
    budget_s = 60 * args.minutes
    load_before = os.getloadavg()

    print(f"baseline: tenx quickstart --minutes {args.minutes:g}, alone", flush=True)
    alone = run_quickstart(out / "alone", data, args.minutes)
    whole_run = args.competitor == "whole-run"
    if whole_run:
        print("contended: the same beside a CPU-bound competitor busy for the whole run", flush=True)
    else:
        print(f"contended: the same beside a CPU-bound competitor for {hog_s:g} s from the probe", flush=True)
    contended = run_quickstart(
        out / "contended", data, args.minutes, 0.0 if whole_run else hog_s, args.hog_threads, whole_run
    )

    checks = {name: verdict(run, budget_s) for name, run in (("alone", alone), ("contended", contended))}
    checks["alone"]["margin_0_95"] = alone["bpb"] <= MARGIN * alone["xz_bpb"]
    for name, run in (("alone", alone), ("contended", contended)):
        print(
            f"{name:>10}: {run['wall_s']:.1f} s of {budget_s:.0f} ({run['wall_s'] / budget_s - 1:+.1%}), "
            f"{run['steps']} steps (probe planned {run['planned_steps']}, {run['probe_tokens_per_s']:,.0f} "
            f"tokens/s, depth {run['depth']}), {run['bpb']:.4f} bits per byte against xz -9e "
            f"{run['xz_bpb']:.4f} ({run['bpb_over_xz']:.3f}x), max MFU {run['max_mfu']:.1%}"
        )
    ratio_wall = contended["wall_s"] / alone["wall_s"]
    ratio_bpb = contended["bpb"] / alone["bpb"]
    print(f"contended / alone: wall time {ratio_wall:.3f}x, bits per byte {ratio_bpb:.3f}x")
    print(f"load average before: {load_before[0]:.2f}, after: {os.getloadavg()[0]:.2f}")
    passed = all(all(c.values()) for c in checks.values())
    print(
        json.dumps(
            {
                "bench": "quickstart_contention",
                "minutes": args.minutes,
                "budget_s": budget_s,
                "competitor": args.competitor,
                "competitor_s": None if whole_run else hog_s,
                "alone": alone,
                "contended": contended,
                "contended_over_alone": {"wall_s": ratio_wall, "bpb": ratio_bpb},
                "checks": checks,
                "pass": passed,
            }
        )
    )


if __name__ == "__main__":
    main()
