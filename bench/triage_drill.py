"""Triage drill: one supervised run with three hidden faults; `tenx triage --all` must find exactly three
root causes, each named.

The faults (`faults.inject`): an `op-bug` (the cross-entropy's reduction is wrong when the targets hold a
run of identical token ids: a spike, a NaN or a crash depending on the data), one `bitflip` in a
parameter (silent data corruption, seen by the consistency self-check, `parallel.consistency.alone`), and
one `corrupt-shard` (a training shard damaged on disk, skipped by `data.on_corrupt_shard = "skip"`). The
run restarts after each crash (a crash that repeats at the same step has its data skipped). Triage reads
only what the run recorded (events, step records, checkpoints, data), never the `fault` events; the drill
scores each verdict against the fault its incident kind can only come from here (a replica mismatch: the
bitflip; a corrupt shard: the damaged shard; a crash, NaN or spike: the op-bug).

Baseline: the same run's own training time (the figure to compare triage's time with).

    python bench/triage_drill.py [--steps 300] [--run 6] [--out runs/triage_drill]

Ends with one JSON line: incidents, root_causes, causes [{kind, incidents, symptoms, op, rank, shard}],
wall_s, and the timings and false verdicts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tenx.data.manifest import MANIFEST_NAME
from tenx.data.prepare.pipeline import PrepareConfig, prepare
from tenx.data.prepare.sources import copy_stdlib_packages
from tenx.rundir import RunDir
from tenx.triage.classify import format_causes, triage
from tenx.triage.incident_store import format_incidents

PACKAGES = ("json", "email", "http", "xml", "unittest", "asyncio", "logging", "importlib")
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


def prepare_data(out: Path) -> Path:
    """Eight standard-library packages, BPE 2048, in shards of 100k tokens (a fresh copy: it gets damaged)."""
    corpus, data = out / "corpus", out / "data"
    copy_stdlib_packages(PACKAGES, corpus)
    remove_ours(data, data / MANIFEST_NAME)
    cfg = PrepareConfig(
        source=str(corpus), out=str(data), tokenizer="bpe", vocab_size=2048, shard_tokens=100_000
    )
    prepare(cfg, progress=False)
    return data


def remove_ours(path: Path, marker: Path) -> None:
    """Delete a directory an earlier drill wrote (it holds `marker`); refuse anything else that is not empty."""
    if not path.exists():
        return
    if not marker.is_file() and any(path.iterdir()):
        raise SystemExit(
            f"{path} exists and was not written by this drill (no {marker.name}); choose another --out"
        )
    shutil.rmtree(path)


def expected(event: dict) -> str:
    """The verdict a correct triage gives an incident of this kind: the drill's ground truth (its three faults)."""
    kind = event["kind"]
    if kind == "replica-mismatch":
        return "hardware"
    if kind == "corrupt-shard":
        return "data"
    return "library-op"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--run", type=int, default=6, help="identical target ids in a row that trigger the op-bug")
    p.add_argument("--bitflip-step", type=int, default=40, help="a checkpoint step (checkpoint.every=20)")
    p.add_argument("--shard", type=int, default=3, help="the training shard damaged at step 1")
    p.add_argument("--out", default="runs/triage_drill")
    args = p.parse_args()
    t_start = time.perf_counter()
    out = Path(args.out)
    run_dir = out / "run"
    remove_ours(run_dir, RunDir(run_dir).config)
    data = prepare_data(out)
    faults = [
        f"op-bug@step=1,run={args.run}",
        f"bitflip@step={args.bitflip_step}",
        f"corrupt-shard@step=1,shard={args.shard}",
    ]
    settings = [
        f"data.dir={json.dumps(str(data))}",
        "data.on_corrupt_shard='skip'",
        "model.seq_len=128",
        "train.micro_batch=16",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "train.threads=2",
        "checkpoint.every=20",
        "parallel.consistency.alone=true",
        "parallel.consistency.every=10",
        "monitor.trends=false",
        "log.progress=false",
    ]
    cmd = [sys.executable, "-m", "tenx", "train", "--config", str(CONFIG), "--run-dir", str(run_dir)]
    cmd += ["--supervise", "--max-restarts", "40", "--backoff", "0"]
    for s in settings:
        cmd += ["--set", s]
    for f in faults:
        cmd += ["--fault", f]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    train_s = time.perf_counter() - t0
    print(proc.stdout[-3000:])
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"the drill's training run failed (exit {proc.returncode})")
    print(f"training (supervised, with restarts): {train_s:.1f} s")

    t0 = time.perf_counter()
    incidents, causes, seconds = triage([run_dir])
    triage_s = time.perf_counter() - t0
    print(format_incidents(incidents, [run_dir]))
    print()
    print(format_causes(incidents, causes))

    false_verdicts = [
        {
            "id": i.id,
            "kind": i.kind,
            "step": i.step,
            "verdict": i.verdict,
            "expected": expected(i.event),
        }
        for i in incidents
        if i.verdict != expected(i.event)
    ]
    per = sorted(seconds.values())
    wall_s = time.perf_counter() - t_start
    print(
        f"\ntriage: {triage_s:.1f} s for {len(incidents)} incidents "
        f"(median {per[len(per) // 2] if per else 0:.2f} s, max {max(per, default=0):.2f} s per incident); "
        f"training {train_s:.1f} s; drill {wall_s:.1f} s; false verdicts: {len(false_verdicts)}"
    )
    for f in false_verdicts:
        print(
            f"  false verdict: incident {f['id']} ({f['kind']}, step {f['step']}): {f['verdict']}, expected {f['expected']}"
        )
    symptoms = sorted({i.kind for i in incidents if expected(i.event) == "library-op"})
    print(
        json.dumps(
            {
                "incidents": len(incidents),
                "root_causes": len(causes),
                "causes": [c.summary() for c in causes],
                "op_bug_incidents": sum(expected(i.event) == "library-op" for i in incidents),
                "op_bug_symptoms": symptoms,
                "false_verdicts": len(false_verdicts),
                "triage_s": round(triage_s, 2),
                "triage_s_per_incident_median": round(per[len(per) // 2], 3) if per else None,
                "train_s": round(train_s, 2),
                "triage_vs_training": round(triage_s / train_s, 3),
                "wall_s": round(wall_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
