"""Overhead of the statistics inside the model (monitor.stats_every) on the quickstart config, same process.

The baseline is the same training with `monitor.stats_every=0`. Runs alternate, baseline first in even
rounds and second in odd ones, so drift of the machine's speed falls on both alike. Each run trains
configs/quickstart.toml from scratch (checkpoints off); after `--skip` warm-up steps, `--timed` steps
are timed, which hold exactly `timed / stats_every` stats steps, the default interval's share; one more
step ends the run untimed (it validates, as the last step of every run does). A short run with
statistics every few steps comes first, untimed, so that kernels a process builds once are built. A
step's time is one whole turn of the loop (every callback included), from one `on_step_start` to the
next. Printed: each run's mean step time, the ratio with / without, and the cost of one stats step
measured inside the runs with statistics (its time over the median of the 20 steps around it), from
which the ratio at the interval follows with far less noise than the direct comparison has: another
process that takes a core for a few seconds moves one run's mean by percents. The load average before
and after is printed to show whether the machine was quiet.

    python bench/monitor_overhead.py [--data DIR] [--rounds 3] [--skip 20] [--timed 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tenx.data.prepare.pipeline import PrepareConfig, is_prepared, prepare
from tenx.hardware import cpu_name
from tenx.monitor.config import MonitorConfig
from tenx.train.config import CONFIG_DIR, load_run_config
from tenx.train.hooks import Callback
from tenx.train.run import train

DEFAULT_EVERY = MonitorConfig().stats_every


class LoopClock(Callback):
    """The wall time of each turn of the training loop, callbacks included."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.end = 0.0

    def on_step_start(self, trainer: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: Any) -> None:
        self.end = time.perf_counter()

    def step_times(self) -> list[float]:
        marks = [*self.starts, self.end]
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def ensure_data(data: Path) -> Path:
    """The quickstart's corpus: the standard library, BPE 4096 (prepared when missing)."""
    cfg = PrepareConfig(source="stdlib", out=str(data), tokenizer="bpe", vocab_size=4096)
    if not is_prepared(cfg):
        print(f"preparing the stdlib corpus into {data} ...", file=sys.stderr)
        prepare(cfg)
    return data


def run_once(data: Path, steps: int, every: int, workdir: Path) -> list[float]:
    """Train the quickstart config for `steps` with stats every `every` steps; each step's loop time."""
    cfg = load_run_config(
        CONFIG_DIR / "quickstart.toml",
        [
            f'data.dir="{data}"',
            f"train.steps={steps}",
            "train.eval_every=0",
            "checkpoint.every=0",
            "checkpoint.at_end=false",
            "log.progress=false",
            f"monitor.stats_every={every}",
        ],
    )
    clock = LoopClock()
    train(cfg, tempfile.mkdtemp(dir=workdir), extra_callbacks=[clock])
    return clock.step_times()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="runs/quickstart/data", help="the quickstart's prepared data")
    ap.add_argument("--rounds", type=int, default=3, help="pairs of runs (without, with statistics)")
    ap.add_argument("--skip", type=int, default=20, help="warm-up steps of each run left out of the timing")
    ap.add_argument("--timed", type=int, default=100, help="steps of each run that are timed, after --skip")
    ap.add_argument("--every", type=int, default=DEFAULT_EVERY, help="monitor.stats_every of the runs with")
    args = ap.parse_args()
    if args.timed % args.every:
        ap.error("--timed must be a multiple of --every")
    steps = args.skip + args.timed + 1
    data = ensure_data(Path(args.data))
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"configs/quickstart.toml, {steps} steps a run, steps {args.skip + 1}-{args.skip + args.timed} timed; "
        f"stats every {args.every} steps against a baseline without; {args.rounds} rounds"
    )
    first = args.skip  # steps are numbered from 1: the timed ones are first+1 .. first+timed
    stats_steps = [s for s in range(first + 1, first + args.timed + 1) if s % args.every == 0]
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    without: list[float] = []
    with_stats: list[float] = []
    stats_costs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tenx-monitor-overhead-") as tmp:
        run_once(data, 11, 5, Path(tmp))  # warm-up
        for rnd in range(args.rounds):
            order = [0, args.every] if rnd % 2 == 0 else [args.every, 0]
            for every in order:
                times = run_once(data, steps, every, Path(tmp))[first : first + args.timed]
                mean = sum(times) / len(times)
                label = "with stats" if every else "baseline (stats off)"
                (with_stats if every else without).append(mean)
                line = f"round {rnd + 1}: {label:22} mean step {1000 * mean:7.2f} ms"
                if every:
                    costs = []
                    for step in stats_steps:
                        i = step - first - 1
                        around = [
                            t for j, t in enumerate(times[max(0, i - 10) : i + 11], max(0, i - 10)) if j != i
                        ]
                        costs.append(times[i] - statistics.median(around))
                    stats_costs.append(sum(costs) / len(costs))
                    line += f" | a stats step costs {1000 * stats_costs[-1]:7.1f} ms more than the steps around it"
                print(line, flush=True)
    ratio = sum(with_stats) / sum(without)
    pair_ratios = [w / b for w, b in zip(with_stats, without, strict=True)]
    step = sum(without) / len(without)
    cost = statistics.median(stats_costs)
    derived = 1 + cost / (args.every * step)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"\n{'':28} {'mean step ms':>12}")
    print(f"{'baseline (stats off)':28} {1000 * step:12.2f}")
    print(f"{'stats every ' + str(args.every):28} {1000 * sum(with_stats) / len(with_stats):12.2f}")
    print(
        f"direct ratio with / without: {ratio:.4f} (per round: {', '.join(f'{r:.4f}' for r in pair_ratios)})"
    )
    print(
        f"one stats step costs {1000 * cost:.1f} ms more than a step ({cost / step:.2f} steps); "
        f"at one in {args.every} steps: ratio {derived:.4f}"
    )
    print(
        json.dumps(
            {
                "bench": "monitor_overhead",
                "baseline": "stats_every=0",
                "overhead_ratio": ratio,
                "overhead_ratio_from_stats_step": derived,
                "round_ratios": pair_ratios,
                "stats_step_extra_ms": 1000 * cost,
                "step_ms": 1000 * step,
                "stats_every": args.every,
                "cpu": cpu_name(),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
