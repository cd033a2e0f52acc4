"""The commands that start runs: `tenx train` (in this process, or supervised: restarted after failures)
and `tenx quickstart` (prepare, train and evaluate on the standard library; tenx/quickstart.py).

The supervisor's flags (`--max-restarts`, `--backoff`, `--launcher`, ...) are generated from the fields of
SupervisorConfig, the `[supervisor]` section (tenx/launch/supervise.py). An entry point like
tenx/launch/worker.py, this module sits in the top layer: a run it trains is watched by tenx.scaling's
self-extrapolation.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from tenx.config import add_config_arguments, config_from_args
from tenx.errors import TenxError
from tenx.utils.cli import add_set, subcommand

SUPERVISOR_FLAGS = ("max_restarts", "same_failure_limit", "backoff_s", "heartbeat_timeout_s", "launcher")
"""The SupervisorConfig fields `tenx train` takes as flags."""
SUPERVISOR_FLAG_NAMES = {"backoff_s": "--backoff", "heartbeat_timeout_s": "--heartbeat-timeout"}
"""Supervisor flags not named after their field."""


def cmd_train(args: argparse.Namespace) -> None:
    """Train (or supervise the training of) a run; print its summary and goodput."""
    from tenx.monitor.goodput import compute_goodput, format_goodput
    from tenx.rundir import RunDir
    from tenx.train.config import load_run_config, resolve_config_path

    config_path = resolve_config_path(args.config)
    overrides = [*args.set, *([f"faults.inject={json.dumps(args.fault)}"] if args.fault else [])]
    overrides += [f"monitor.prediction={json.dumps(args.predict)}"] if args.predict else []
    if args.fault_seed is not None:
        overrides.append(f"faults.seed={args.fault_seed}")
    cfg = load_run_config(config_path, overrides)  # checked here, before any child starts
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / config_path.stem
    if args.supervise:
        from tenx.launch.supervise import SupervisorConfig, child_environment, format_supervision, supervise

        child_args = ["train", "--config", str(config_path), "--run-dir", str(run_dir)]
        for item in overrides:
            child_args += ["--set", item]
        options = config_from_args(SupervisorConfig, args, SUPERVISOR_FLAGS)
        report = supervise(child_args, run_dir, options, resume=args.resume, env=child_environment())
        print(format_supervision(report))
        print(format_goodput(compute_goodput(run_dir)))
        if not report.finished:
            raise TenxError(f"supervised run in {run_dir} did not finish: {report.gave_up}")
        return
    from tenx.launch.supervise import SUPERVISED_ENV
    from tenx.scaling.self_extrapolation import summary_fields, watch_callbacks
    from tenx.train.run import train

    trainer, metrics = train(cfg, run_dir, resume=args.resume, extra_callbacks=watch_callbacks(cfg))
    if trainer.rank != 0:  # under torchrun the summary is the run's, printed once
        return
    if metrics:
        print(
            json.dumps(
                {k: metrics.get(k) for k in ("step", "tokens", "loss", "val_loss")} | summary_fields(run_dir)
            )
        )
    else:
        print(f"already trained to step {trainer.step} of {trainer.total_steps}; nothing to do")
    if os.environ.get(SUPERVISED_ENV) != "1":  # a supervisor prints the whole run's, once, when it ends
        print(format_goodput(compute_goodput(run_dir)))
    print(f"run directory: {run_dir}  (metrics: {RunDir(run_dir).metrics}, status: tenx status {run_dir})")


def _train_arguments(tp: argparse.ArgumentParser) -> None:
    from tenx.launch.supervise import SupervisorConfig

    tp.add_argument(
        "--config", required=True, help="a .toml path or a shipped config name (configs/NAME.toml)"
    )
    add_set(tp, "override (repeatable)")
    tp.add_argument("--run-dir", help="run directory (default runs/CONFIG_NAME)")
    tp.add_argument("--resume", help="'auto' (newest checkpoint that verifies) or a checkpoint directory")
    tp.add_argument(
        "--supervise",
        action="store_true",
        help="run training as a child process and restart it (--resume auto) after a crash, hang or kill",
    )
    add_config_arguments(tp, SupervisorConfig, SUPERVISOR_FLAGS[:4], flags=SUPERVISOR_FLAG_NAMES)
    tp.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND@step=N|KIND@p=P",
        help="inject a fault (repeatable): crash, sigkill, hang, nan, spike, corrupt-checkpoint, "
        "corrupt-shard, slow, bitflip, op-bug; see docs/fault-tolerance.md",
    )
    tp.add_argument("--fault-seed", type=int, default=None, help="seed of random (p=P) faults")
    tp.add_argument(
        "--predict", metavar="PREDICTION_JSON", help="watch the run against it (monitor.prediction)"
    )
    add_config_arguments(tp, SupervisorConfig, SUPERVISOR_FLAGS[4:])


def cmd_quickstart(args: argparse.Namespace) -> None:
    """Prepare the standard library, train within the time budget, evaluate against xz."""
    from tenx.monitor.goodput import process_start_time
    from tenx.quickstart import quickstart

    quickstart(args.out, steps=args.steps, minutes=args.minutes, started=process_start_time())


def _quickstart_arguments(qp: argparse.ArgumentParser) -> None:
    qp.add_argument("--out", default="runs/quickstart", help="output directory")
    qp.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="wall-time budget of the whole command: the step count follows the training speed observed",
    )
    qp.add_argument(
        "--steps", type=int, default=None, help="train exactly this many steps instead of fitting the budget"
    )


def register(subparsers: Any) -> None:
    """Register `tenx train` and `tenx quickstart` on the CLI's subparsers."""
    subcommand(subparsers, "train", "train a model from a TOML config", cmd_train, _train_arguments)
    about = "prepare the stdlib corpus, train, evaluate against xz"
    subcommand(subparsers, "quickstart", about, cmd_quickstart, _quickstart_arguments)
