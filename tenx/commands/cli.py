"""The commands that start runs: `tenx train` (in this process, or supervised: restarted after failures;
an ensemble's members one after another, tenx/train/members.py), `tenx ensemble` (finished runs listed as
one ensemble) and `tenx quickstart` (prepare, train and evaluate on the standard library; tenx/quickstart.py).

The supervisor's flags (`--max-restarts`, `--backoff`, `--launcher`, ...) are generated from the fields of
SupervisorConfig, the `[supervisor]` section (tenx/launch/supervise.py). `tenx train ... --emit slurm`
writes the run's Slurm job instead of training (tenx/launch/slurm.py). An entry point like
tenx/commands/worker.py, this module sits in the top layer: a run it trains is watched by tenx.scaling's
self-extrapolation.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path
from typing import Any

from tenx.config import add_config_arguments, config_from_args
from tenx.errors import ConfigError, TenxError
from tenx.utils.cli import add_set, at_least, subcommand

SUPERVISOR_FLAGS = (
    "max_restarts",
    "same_failure_limit",
    "backoff_s",
    "heartbeat_timeout_s",
    "launcher",
    "node_env",
)
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
    init = None
    if args.init_from:  # the model is the directory's: its config here, its weights before step 1
        from tenx.export.hf_import import init_from_hf

        if args.emit:
            raise TenxError("--init-from: not with --emit slurm yet; train with --init-from on the cluster")
        init, model_sets = init_from_hf(args.init_from, cfg)
        cfg = load_run_config(config_path, [*overrides, *model_sets])
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / config_path.stem
    emit_only = [f for f, given in _emit_flags_given(args).items() if given]
    if emit_only and not args.emit:
        raise TenxError(
            f"{', '.join(emit_only)}: only with --emit slurm (they describe the Slurm job it writes)"
        )
    if cfg.model.ensemble > 1 and (args.emit or args.supervise):
        raise TenxError(
            f"{'--emit slurm' if args.emit else '--supervise'} with model.ensemble={cfg.model.ensemble}: "
            "not for an ensemble yet; train it without, and continue it with --resume auto"
        )
    if args.emit:
        path = emit_train_job(args, cfg, config_path, run_dir, overrides)
        print(
            f"wrote {path}: submit it with `sbatch {shlex.quote(str(path))}`; the job trains {run_dir} (its log: "
            "slurm-JOBID.out)"
        )
        return
    if args.supervise:
        from tenx.launch.supervise import SupervisorConfig, child_environment, format_supervision, supervise

        child_args = ["train", "--config", str(config_path), "--run-dir", str(run_dir)]
        for item in overrides:
            child_args += ["--set", item]
        child_args += ["--init-from", args.init_from] if args.init_from else []
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

    extra = [*watch_callbacks(cfg), *([init] if init else [])]
    trainer, metrics = train(cfg, run_dir, resume=args.resume, extra_callbacks=extra)
    if trainer.rank != 0:  # under torchrun the summary is the run's, printed once
        return
    if "members" in metrics:  # an ensemble (tenx/train/members.py): each member's summary, then the whole's
        for i, member in enumerate(metrics["members"]):
            fields = {k: member.get(k) for k in ("step", "tokens", "loss", "val_loss")} if member else {}
            print(json.dumps({"member": i, **(fields or {"finished": "before this resume"})}))
        status = shlex.join(["tenx", "status", str(RunDir(run_dir).member(0))])
        evaluate = shlex.join(["tenx", "eval", str(run_dir)])
        print(f"ensemble: {metrics['ensemble']}  (evaluate: {evaluate}; a member: {status})")
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
    status = shlex.join(["tenx", "status", str(run_dir)])
    print(f"run directory: {run_dir}  (metrics: {RunDir(run_dir).metrics}, status: {status})")


def _emit_flags_given(args: argparse.Namespace) -> dict[str, bool]:
    from tenx.launch.slurm import RDZV_PORT

    return {
        "--nodes": args.nodes != 1,
        "--nproc-per-node": args.nproc_per_node != 8,
        "--gpus-per-node": args.gpus_per_node is not None,
        "--partition": args.partition is not None,
        "--time": args.time is not None,
        "--rdzv-port": args.rdzv_port != RDZV_PORT,
        "--script": args.script is not None,
        "--force": args.force,
    }


def emit_train_job(
    args: argparse.Namespace, cfg: Any, config_path: Path, run_dir: Path, overrides: list[str]
) -> Path:
    """`tenx train ... --emit slurm`: write the sbatch script that trains this run on `--nodes` nodes
    (tenx/launch/slurm.py); returns its path (default RUN_DIR.sbatch)."""
    from tenx.launch.slurm import SlurmJob, job_script, write_job_script
    from tenx.launch.supervise import SupervisorConfig
    from tenx.train.config import accumulation_steps
    from tenx.utils.io import check_output_file

    if args.launcher:
        raise TenxError("--launcher with --emit slurm: the job script starts torchrun itself; leave it out")
    if args.node_env:
        raise TenxError("--node-env with --emit slurm: the job script sets it itself; leave it out")
    if args.resume not in (None, "auto"):
        raise TenxError(
            f"--resume {args.resume} with --emit slurm: the job always resumes with --resume auto"
        )
    job = SlurmJob(
        run_dir.absolute().name,
        run_dir,
        args.nodes,
        args.nproc_per_node,
        args.gpus_per_node,
        args.partition,
        args.time,
        args.rdzv_port,
        flags={"log_dir": "--run-dir", "name": "--run-dir"},
    )
    job.validate()
    # the supervisor in the job takes these flags: what a local run refuses is refused here, not written
    try:
        config_from_args(SupervisorConfig, args, SUPERVISOR_FLAGS).validate()
    except ConfigError as e:
        field_name = str(e).split(":", 1)[0].removeprefix("supervisor.")
        flag = SUPERVISOR_FLAG_NAMES.get(field_name, "--" + field_name.replace("_", "-"))
        raise ConfigError(f"{flag} ({e}) with --emit slurm: the job's supervisor would refuse it") from None
    if cfg.train.global_batch is not None and cfg.parallel.replicas.mode == "off":  # groups: known at start
        try:
            accumulation_steps(cfg.train, job.nodes * job.nproc_per_node)
        except TenxError as e:
            raise TenxError(f"--nodes {job.nodes} x --nproc-per-node {job.nproc_per_node}: {e}") from None
    script = check_output_file(args.script or f"{run_dir}.sbatch", force=args.force, flag="--script")
    train_args = ["--config", str(config_path), "--run-dir", str(run_dir)]
    for item in overrides:
        train_args += ["--set", item]
    defaults = SupervisorConfig()
    supervisor_args: list[str] = []
    for name in SUPERVISOR_FLAGS[:4]:
        if getattr(args, name) != getattr(defaults, name):
            flag = SUPERVISOR_FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
            supervisor_args += [flag, str(getattr(args, name))]
    text = job_script(job, train_args, supervisor_args)  # checks every #SBATCH value before writing
    run_dir.mkdir(parents=True, exist_ok=True)  # Slurm writes the job's log there
    return write_job_script(script, text)


def _train_arguments(tp: argparse.ArgumentParser) -> None:
    from tenx.launch.supervise import SupervisorConfig

    tp.add_argument(
        "--config", required=True, help="a .toml path or a shipped config name (configs/NAME.toml)"
    )
    add_set(tp, "override (repeatable)")
    tp.add_argument("--run-dir", help="run directory (default runs/CONFIG_NAME)")
    tp.add_argument("--resume", help="'auto' (newest checkpoint that verifies) or a checkpoint directory")
    tp.add_argument(
        "--init-from",
        metavar="HF_DIR",
        help="start from a local transformers model directory (GPT-2, Llama, Qwen3): its config sets the "
        "model section, its weights the model at step 0 (docs/interop.md#import)",
    )
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
    _emit_arguments(tp)


def _emit_arguments(tp: argparse.ArgumentParser) -> None:
    from tenx.launch.slurm import RDZV_PORT

    slurm = tp.add_argument_group(
        "--emit slurm: write a Slurm job that trains this run (docs/distributed.md)"
    )
    slurm.add_argument(
        "--emit",
        choices=["slurm"],
        help="write an sbatch script (supervised torchrun on every node, requeued with --resume auto after "
        "a SIGTERM); train nothing",
    )
    slurm.add_argument(
        "--nodes", type=at_least(int, 1, 100_000), default=1, help="with --emit: nodes of the job"
    )
    slurm.add_argument(
        "--nproc-per-node", type=at_least(int, 1, 1024), default=8, help="with --emit: ranks (GPUs) per node"
    )
    slurm.add_argument(
        "--gpus-per-node",
        type=at_least(int, 0, 1024),
        default=None,
        help="with --emit: GPUs per node (default --nproc-per-node; 0: none)",
    )
    slurm.add_argument("--partition", help="with --emit: the Slurm partition (default: the cluster's)")
    slurm.add_argument(
        "--time", help="with --emit: the job's time limit, e.g. 1-00:00:00 (default: the partition's)"
    )
    slurm.add_argument(
        "--rdzv-port",
        type=at_least(int, 1, 65535),
        default=RDZV_PORT,
        help="with --emit: the rendezvous port on the first node",
    )
    slurm.add_argument("-o", "--script", help="with --emit: the script to write (default RUN_DIR.sbatch)")
    slurm.add_argument("--force", action="store_true", help="with --emit: replace an existing --script")


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


def cmd_ensemble(args: argparse.Namespace) -> None:
    """List finished runs as one ensemble: write OUT/ensemble.json (tenx.checkpoint.models)."""
    from tenx.checkpoint.models import assemble_ensemble

    path = assemble_ensemble(args.runs, args.out)
    print(f"wrote {path}: an ensemble of {len(args.runs)} runs; evaluate it with `tenx eval {args.out}`")


def _ensemble_arguments(ep: argparse.ArgumentParser) -> None:
    ep.add_argument(
        "runs", nargs="+", metavar="RUN", help="finished run directories (or checkpoint directories)"
    )
    ep.add_argument(
        "--out", required=True, help="the ensemble's directory: writes OUT/ensemble.json, never replaces one"
    )


def register(subparsers: Any) -> None:
    """Register `tenx train`, `tenx ensemble` and `tenx quickstart` on the CLI's subparsers."""
    subcommand(subparsers, "train", "train a model from a TOML config", cmd_train, _train_arguments)
    about = "list finished runs as one ensemble (the average of their probabilities)"
    subcommand(subparsers, "ensemble", about, cmd_ensemble, _ensemble_arguments)
    about = "prepare the stdlib corpus, train, evaluate against xz"
    subcommand(subparsers, "quickstart", about, cmd_quickstart, _quickstart_arguments)
