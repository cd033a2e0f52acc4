"""`tenx plan`: co-design a run before it starts (memory, time, communication, shapes, failures).

`tenx plan --config CFG --cluster CLUSTER` estimates a run; each of its subcommands is registered by the
module that implements it (`shapes`: tenx/plan/shapes.py, `failures`: tenx/plan/failsim.py, `choose`:
tenx/plan/allocate.py), imported only when `tenx plan` is used."""

from __future__ import annotations

import argparse
from typing import Any

from tenx.utils.cli import add_set, at_least, subcommand
from tenx.utils.text import counted

MAX_MEASURE_STEPS = 1000
"""The most `--measure --steps`: a calibration needs a handful, and a billion would train for days."""


def register(subparsers: Any) -> None:
    """Register `tenx plan` and its subcommands on the CLI's subparsers."""
    about = "co-design a run: memory, time, communication, GEMM shapes, failures at scale"
    subcommand(subparsers, "plan", about, cmd_plan, _plan_arguments)


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    from tenx.plan import allocate, failsim, shapes
    from tenx.plan.estimate import MAX_VOCAB

    parser.add_argument("--config", help="the run config (a .toml path or a shipped name)")
    add_set(parser, "config override")
    parser.add_argument(
        "--cluster", help="a cluster file or a shipped one (configs/clusters/: cpu, h100-node, ...)"
    )
    parser.add_argument("--strategy", choices=["ddp", "fsdp", "hsdp"], default="ddp", help="data parallelism")
    parser.add_argument(
        "--ranks",
        type=at_least(int, 1),
        help="data-parallel ranks (default: every accelerator of the cluster)",
    )
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16"], help="activation dtype (default: from train.precision)"
    )
    parser.add_argument(
        "--vocab",
        type=at_least(int, 1, MAX_VOCAB),
        help="vocabulary size (default: model.vocab_size, else the prepared data's manifest, else GPT-2's "
        "50257, said to be assumed)",
    )
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute block activations")
    parser.add_argument(
        "--replica-groups", type=at_least(int, 1), default=1, help="replica groups across clusters (torchft)"
    )
    parser.add_argument(
        "--diloco-every",
        type=at_least(int, 0),
        default=0,
        help="DiLoCo: steps between cross-cluster syncs (0: synchronous groups only)",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="train the config a few steps here (micro-batch B and 2B on one process, and --ranks processes "
        "if more than 1), compare with the prediction, fit and keep the cluster's factors",
    )
    parser.add_argument(
        "--steps",
        type=at_least(int, 1),
        default=6,
        help=f"--measure: steps per measurement, at most {MAX_MEASURE_STEPS} (two warm up, the median of the rest "
        "is the step time: a few are enough, and each case runs in full)",
    )
    parser.add_argument(
        "--no-calibration", action="store_true", help="use the cluster file's factors, not the measured ones"
    )
    parser.add_argument("--json", help="also write the plan as JSON here (a new file, unless --force)")
    parser.add_argument("--force", action="store_true", help="--json: replace an existing file")
    sub = parser.add_subparsers(dest="plan_command")
    shapes.register(sub)
    failsim.register(sub)
    allocate.register(sub)


def cmd_plan(args: argparse.Namespace) -> None:
    """`tenx plan --config CFG --cluster CLUSTER`: the estimate, printed (and written as JSON with --json)."""
    from tenx.errors import TenxError
    from tenx.hardware import device_name, pick_device
    from tenx.plan.calibrate import apply_calibration, calibration_path
    from tenx.plan.estimate import cluster_file, estimate, format_estimate, load_cluster, plan_vocab
    from tenx.train.config import load_run_config, resolve_config_path
    from tenx.utils.io import atomic_write_json, check_output_file

    if not args.config or not args.cluster:
        raise TenxError(
            "tenx plan needs --config CFG and --cluster CLUSTER (or a subcommand: shapes, failures, choose)"
        )
    out = None
    if args.json is not None:
        inputs = (resolve_config_path(args.config), cluster_file(args.cluster))
        out = check_output_file(args.json, force=args.force, flag="--json", inputs=inputs)
    if args.measure and args.steps > MAX_MEASURE_STEPS:
        raise TenxError(
            f"--steps {args.steps}: --measure takes at most {MAX_MEASURE_STEPS} steps per case (a few are enough)"
        )
    run = load_run_config(resolve_config_path(args.config), args.set)
    vocab = plan_vocab(run, args.vocab)
    print(vocab.describe())
    cluster = load_cluster(args.cluster)
    if args.ranks is not None and args.ranks > cluster.accelerators and not args.measure:
        raise TenxError(
            f"--ranks {args.ranks}: cluster {cluster.name!r} ({cluster_file(args.cluster)}) has "
            f"{counted(cluster.accelerators, 'accelerator')} ({cluster.node.accelerators} per node x "
            f"{counted(cluster.cluster.nodes, 'node')}): plan at most "
            f"{cluster.accelerators} ranks, or describe a larger cluster"
        )
    calibration = None
    if args.measure:
        calibration = _measure(args, cluster, vocab.size)
    elif not args.no_calibration:
        applied = apply_calibration(cluster, device_name(pick_device(run.train.device, "train.device")))
        if applied == "applied":
            print(
                f"factors of {cluster.name!r} measured on this machine: {calibration_path()} (--no-calibration)"
            )
        elif applied is not None:
            print(f"tenx: {applied}")
    plan = estimate(
        run,
        cluster,
        vocab=vocab.size,
        strategy=args.strategy,
        ranks=args.ranks,
        dtype=args.dtype,
        activation_checkpointing=args.activation_checkpointing,
        replica_groups=args.replica_groups,
        diloco_every=args.diloco_every,
    )
    print(format_estimate(plan, cluster))
    if out is not None:
        record = {"cluster": cluster.name, "vocab": vocab.size, "vocab_source": vocab.source}
        record = {**record, "vocab_assumed": vocab.assumed, **plan.to_dict()}
        atomic_write_json(out, {**record, "calibration": calibration} if calibration else record)
        print(f"wrote {args.json}")


def _measure(args: argparse.Namespace, cluster: Any, vocab: int) -> dict[str, Any]:
    """`--measure`: predicted against measured before and after fitting; the factors are kept."""
    from tenx.errors import ConfigError
    from tenx.plan.calibrate import calibrate, save_calibration

    if not 1 <= (args.ranks or 1) <= 8:
        raise ConfigError(f"--measure runs at most 8 ranks on this machine, got --ranks {args.ranks}")
    print(f"measuring {args.config} on this machine ({args.steps} steps per case) ...", flush=True)
    result = calibrate(
        args.config, args.set, cluster, vocab, ranks=args.ranks or 1, strategy=args.strategy, steps=args.steps
    )
    print(f"{'case':<22}{'time pred/meas':>16}{'memory pred/meas':>18}   (before -> after the fit)")
    for name in result["cases"]:
        b, a = result["before"][name], result["after"][name]
        print(
            f"{name:<22}{b['step_time_ratio']:>8.2f} -> {a['step_time_ratio']:<5.2f}"
            f"{b['memory_ratio']:>10.2f} -> {a['memory_ratio']:<5.2f}"
        )
    path = save_calibration(cluster.name, result["factors"], result["measured_on"])
    print(
        f"fitted {result['factors']}\nkept in {path} for clusters named {cluster.name!r}, "
        f"measured on {result['measured_on']}"
    )
    return result
