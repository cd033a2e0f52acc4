"""Data-parallel throughput: 2 torchrun processes (DDP, FSDP2) against 1 process, same global batch.

Baseline: one `tenx train` process using every core (torch's default threads). Contenders: torchrun with
2 processes, 1 OpenMP thread each, `parallel.strategy = ddp` and `fsdp`. All train the same model on the
same data with the same global batch for the same steps, one after the other. Printed per run: median
tokens/s over the steps after warm-up, the final loss, and the ratio against the baseline; the final
losses must agree (parity is checked by tests/test_parallel.py, here it is a sanity line).

On a 2-core CPU this measures what the communication and the per-process overheads cost at equal
hardware; on a GPU node (`--nproc 8`) it measures scaling.

    python bench/data_parallel.py [--data DIR] [--steps 30] [--nproc 2] [--config quickstart]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tenx.data.prepare.pipeline import PrepareConfig, is_prepared, prepare
from tenx.monitor.metrics_file import read_metrics
from tenx.rundir import RunDir


def run(label: str, launcher: list[str], args: list[str], run_dir: Path, threads: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run(
        [*launcher, *args, "--run-dir", str(run_dir)], env=env, capture_output=True, text=True, timeout=3600
    )
    if out.returncode != 0:
        sys.exit(f"{label} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    rows = read_metrics(RunDir(run_dir).metrics)
    steady = [r["tokens_per_s"] for r in rows[len(rows) // 3 :]]
    return {"label": label, "tokens_per_s": statistics.median(steady), "loss": rows[-1]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="runs/data/stdlib-bpe4096", help="prepared data (made from the stdlib)")
    p.add_argument("--config", default="quickstart")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8)
    a = p.parse_args()
    data = Path(a.data)
    prep = PrepareConfig(source="stdlib", out=str(data), tokenizer="bpe", vocab_size=4096)
    if not is_prepared(prep):
        print(f"preparing the standard-library corpus into {data} (a few minutes, once) ...")
        prepare(prep, progress=False)
    args = [
        "train",
        "--config",
        a.config,
        "--set",
        f'data.dir="{data}"',
        "--set",
        f"train.steps={a.steps}",
        "--set",
        f"train.global_batch={a.global_batch}",
        "--set",
        f"train.micro_batch={a.micro_batch}",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.eval_batches=1",
        "--set",
        "checkpoint.every=0",
        "--set",
        "checkpoint.at_end=false",
        "--set",
        "log.progress=false",
        "--set",
        "log.tensorboard=false",
        "--set",
        'train.precision="fp32"',
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = run("1 process", [sys.executable, "-m", "tenx"], args, root / "single", None)
        results = [base]
        for strategy in ("ddp", "fsdp"):
            results.append(
                run(
                    f"{a.nproc} x {strategy}",
                    [*torchrun, "-m", "tenx"],
                    [*args, "--set", f"parallel.strategy={strategy}"],
                    root / strategy,
                    1,
                )
            )
    print(f"{a.config}, {a.steps} steps, global batch {a.global_batch} sequences, fp32")
    for r in results:
        print(
            f"{r['label']:>12}: {r['tokens_per_s']:9.0f} tokens/s  ratio {r['tokens_per_s'] / base['tokens_per_s']:.2f}x"
            f"  final loss {r['loss']:.5f}"
        )
    print(
        json.dumps(
            {
                "bench": "data_parallel",
                "baseline": "1 process",
                **{
                    f"ratio_{r['label'].split()[-1]}": r["tokens_per_s"] / base["tokens_per_s"]
                    for r in results[1:]
                },
                "tokens_per_s": {r["label"]: r["tokens_per_s"] for r in results},
                "final_loss": {r["label"]: r["loss"] for r in results},
            }
        )
    )


if __name__ == "__main__":
    main()
