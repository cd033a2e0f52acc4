"""`tenx plan`: co-design a run before it starts (memory, time, communication, shapes, failures).

`tenx plan --config CFG --cluster CLUSTER` estimates a run (tenx/plan/estimate.py, calibrate.py); its
subcommands' flags and handlers are here too, their work in the module each names: `shapes`
(tenx/plan/shapes.py), `failures` (tenx/plan/failsim.py), `choose` (tenx/plan/allocate.py), each imported
only when its command runs."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from typing import Any

from tenx.utils.cli import Command, above, add_set, add_subcommands, at_least, subcommand
from tenx.utils.text import counted

MAX_MEASURE_STEPS = 1000
"""The most `--measure --steps`: a calibration needs a handful, and a billion would train for days."""


def register(subparsers: Any) -> None:
    """Register `tenx plan` and its subcommands on the CLI's subparsers."""
    about = "co-design a run: memory, time, communication, GEMM shapes, failures at scale"
    subcommand(subparsers, "plan", about, cmd_plan, _plan_arguments)


def _add_vocab(p: argparse.ArgumentParser) -> None:
    """`--vocab`, the vocabulary every plan command reads through plan_vocab."""
    from tenx.plan.estimate import MAX_VOCAB

    p.add_argument(
        "--vocab",
        type=at_least(int, 1, MAX_VOCAB),
        help="vocabulary size (default: model.vocab_size, else the prepared data's manifest, else GPT-2's "
        "50257, said to be assumed)",
    )


def _add_json(p: argparse.ArgumentParser, help: str, **options: Any) -> None:
    """`--json` and the `--force` that lets it replace an existing file (check_output_file refuses it)."""
    p.add_argument("--json", help=help, **options)
    p.add_argument("--force", action="store_true", help="--json: replace an existing file")


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
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
    _add_vocab(parser)
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
    _add_json(parser, "also write the plan as JSON here (a new file, unless --force)")
    shapes = "measure the run's GEMM shapes and nearby faster ones"
    failures = "failures at scale: MTBF, checkpoint interval, goodput"
    choose = "rank (N, D, parallelism) for a compute budget by predicted loss"
    commands: list[Command] = [
        ("shapes", shapes, cmd_shapes, _shapes_arguments),
        ("failures", failures, cmd_failures, _failures_arguments),
        ("choose", choose, cmd_choose, _choose_arguments),
    ]
    add_subcommands(parser, "plan_command", commands, required=False)


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


def cmd_shapes(args: argparse.Namespace) -> int:
    """Benchmark the run's GEMM shapes and nearby candidates; print the report, optionally write JSON."""
    import torch

    from tenx.hardware import cpu_has_fast_bf16, pick_device, resolve_precision
    from tenx.plan.estimate import plan_vocab
    from tenx.plan.shapes import benchmark_shapes, format_shapes
    from tenx.train.config import load_run_config, resolve_config_path
    from tenx.utils.io import atomic_write_text, check_output_file

    config = resolve_config_path(args.config)
    out = None
    if args.json is not None:
        out = check_output_file(args.json, force=args.force, flag="--json", inputs=(config,))
    run = load_run_config(config, args.set)
    vocab = plan_vocab(run, args.vocab)
    print(vocab.describe())
    device = pick_device(args.device, "--device")
    dtype = resolve_precision(args.dtype or run.train.precision, device)
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_fast_bf16():
        print("note: this CPU has no native bf16 matmuls; bf16 times are ~100x fp32's (use --dtype fp32)")
    threads = args.threads or run.train.threads
    if threads:
        torch.set_num_threads(threads)
    result = benchmark_shapes(
        run.model,
        run.train.micro_batch,
        device,
        dtype,
        args.repeat,
        vocab=vocab.size,
        max_tokens=args.max_tokens,
    )
    result.update(
        config=args.config, vocab=vocab.size, vocab_source=vocab.source, vocab_assumed=vocab.assumed
    )
    print(format_shapes(result))
    if out is not None:
        atomic_write_text(out, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _shapes_arguments(p: argparse.ArgumentParser) -> None:
    from tenx.plan.shapes import CPU_MAX_TOKENS

    p.add_argument("--config", required=True, help="run config: a .toml path or a shipped name")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="override a config field")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype", choices=["fp32", "bf16"], default=None, help="matmul dtype (default: the run's precision)"
    )
    _add_vocab(p)
    p.add_argument(
        "--repeat",
        type=at_least(int, 2, 1000),
        default=5,
        help="timing rounds (interleaved across shapes), at most 1000",
    )
    p.add_argument(
        "--max-tokens",
        type=at_least(int, 1),
        default=None,
        help=f"rows per GEMM (default: the whole micro-batch on a GPU, {CPU_MAX_TOKENS} on a CPU)",
    )
    p.add_argument(
        "--threads",
        type=at_least(int, 1, 4096),
        default=None,
        help="torch CPU threads, at most 4096 (default: the config's train.threads, else torch's own choice)",
    )
    _add_json(p, "also write the report as JSON (a new file, unless --force)", metavar="FILE")


def _gpu_counts(text: str) -> list[float]:
    """`--gpus`: comma-separated positive, finite accelerator counts."""
    from tenx.plan.failure_limits import MAX_COUNTS, MAX_GPUS

    counts = []
    for item in (x.strip() for x in text.split(",")):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0 < value <= MAX_GPUS):
            raise argparse.ArgumentTypeError(
                f"each count must be a number > 0 and at most {MAX_GPUS:.0e}, got {item!r} in {text!r}"
            )
        counts.append(value)
    if len(counts) > MAX_COUNTS:
        raise argparse.ArgumentTypeError(f"at most {MAX_COUNTS} counts, got {len(counts)}")
    return counts


def _groups(text: str) -> int | None:
    """`--groups`: auto (None) or a number of groups >= 1."""
    return None if text == "auto" else at_least(int, 1)(text)


def _failures_arguments(p: argparse.ArgumentParser) -> None:
    from tenx.plan.failure_limits import MAX_COUNTS, MAX_DAYS, MAX_GPUS, MAX_REPLICAS, MAX_SIM_EVENTS

    p.add_argument(
        "--cluster",
        help="a cluster file or a shipped one whose [failures] rates to use (default: Llama 3's)",
    )
    p.add_argument(
        "--gpus",
        type=_gpu_counts,
        default="1e3,1e4,1e5,1e6,1e7",
        help=f"comma-separated accelerator counts, each at most {MAX_GPUS:.0e}, at most {MAX_COUNTS} of them",
    )
    span = "at most the simulated span, --days x 86400 s: a longer one makes every goodput zero"
    p.add_argument(
        "--save-cost-s",
        type=above(float, 0),
        default=60.0,
        help=f"seconds a checkpoint save stalls the job ({span})",
    )
    p.add_argument(
        "--restart-s",
        type=at_least(float, 0),
        default=600.0,
        help=f"seconds to restart (or heal a group; {span})",
    )
    p.add_argument(
        "--detect-s",
        type=at_least(float, 0),
        default=0.0,
        help=f"seconds from a failure to its detection ({span})",
    )
    p.add_argument(
        "--groups",
        type=_groups,
        default="auto",
        help="semi-synchronous replica groups: auto or N (at most the smallest --gpus count: a group holds one)",
    )
    p.add_argument(
        "--min-group-gpus", type=at_least(int, 1), default=1024, help="auto: accelerators a group must hold"
    )
    p.add_argument(
        "--sync-s",
        type=above(float, 0),
        default=600.0,
        help=f"seconds between semi-synchronous syncs, > 0 (0 would be a sync that never ends; {span})",
    )
    p.add_argument(
        "--days",
        type=above(float, 0, MAX_DAYS),
        default=30.0,
        help=f"simulated days per replica, at most {MAX_DAYS:g} (100 years); a table simulates at most "
        f"{MAX_SIM_EVENTS:,} failures (a few seconds): more is refused naming the largest --days",
    )
    p.add_argument(
        "--replicas",
        type=at_least(int, 2, MAX_REPLICAS),
        default=8,
        help=f"independent simulations (for the 95%% CI), at most {MAX_REPLICAS}",
    )
    p.add_argument("--no-sim", action="store_true", help="closed forms only")
    _add_json(p, "write one row per accelerator count here (a new file, unless --force)")
    p.add_argument("--seed", type=at_least(int, 0), default=0, help="seed of the simulation")


def cmd_failures(args: argparse.Namespace) -> None:
    """`tenx plan failures`: the table, the 50% crossing, and the groups that keep 90%."""
    from tenx.plan.estimate import cluster_file, load_cluster
    from tenx.plan.failsim import (
        failure_table,
        format_table,
        job_mtbf_s,
        short_duration,
        sync_below_half_gpus,
    )
    from tenx.plan.failure_rates import FailureRates
    from tenx.utils.io import atomic_write_text, check_output_file

    out = None
    if args.json is not None:
        inputs = (cluster_file(args.cluster),) if args.cluster else ()
        out = check_output_file(args.json, force=args.force, flag="--json", inputs=inputs)
    # argparse runs `type` on a string default too, but not on a value set in Python (tests, callers)
    gpus = _gpu_counts(args.gpus) if isinstance(args.gpus, str) else args.gpus
    groups = _groups(args.groups) if isinstance(args.groups, str) else args.groups
    cluster = load_cluster(args.cluster) if args.cluster else None
    failures = cluster.failures if cluster else FailureRates()
    rows = failure_table(
        gpus,
        args.save_cost_s,
        args.restart_s,
        args.detect_s,
        groups,
        args.min_group_gpus,
        args.sync_s,
        not args.no_sim,
        args.days,
        args.replicas,
        args.seed,
        failures,
    )
    where = f"cluster {cluster.name}" if cluster else "no --cluster: the default"
    print(
        f"rates ({where}): {failures.describe()}, linear in GPUs; δ={args.save_cost_s:g}s "
        f"R={args.restart_s:g}s D={args.detect_s:g}s sync every {args.sync_s:g}s"
    )
    if cluster:
        print(
            f"cluster {cluster.name}: {cluster.accelerators:,} accelerators, one interruption every "
            f"{short_duration(job_mtbf_s(cluster.accelerators, failures))} on average"
        )
    print(format_table(rows))
    half = sync_below_half_gpus(args.save_cost_s, args.restart_s, args.detect_s, failures)
    if math.isnan(half):
        print("synchronous goodput does not cross 50% between 1e-9 and 1e18 accelerators at these rates")
    else:
        print(f"synchronous goodput falls below 50% at about {half:,.0f} accelerators")
    for r in rows:
        if r.groups_for_90 is not None:
            print(f"  {r.gpus:.0e} GPUs: >= {r.groups_for_90} groups keep semi-synchronous goodput >= 90%")
    if out is not None:
        keys = ("gpus", "mtbf_s", "checkpoint_interval_s", "goodput_sync", "goodput_semi_sync", "groups")
        rows_out = [
            {**{k: asdict(r)[k] for k in keys}, **{k: v for k, v in asdict(r).items() if k not in keys}}
            for r in rows
        ]
        atomic_write_text(out, json.dumps(rows_out, indent=2) + "\n")
        print(f"wrote {args.json}")


def _choose_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the base run config (its family, sequence, batch)")
    add_set(p, "config override")
    p.add_argument("--cluster", required=True, help="a cluster file or a shipped one (configs/clusters/)")
    p.add_argument("--fit", required=True, help="a `tenx fit` report (JSON) of an L(N, D) law")
    p.add_argument(
        "--budget", required=True, type=above(float, 0), help="training compute, FLOPs (e.g. 1e21)"
    )
    p.add_argument(
        "--days", type=above(float, 0), help="wall-clock limit: D is cut to what fits in it (default: none)"
    )
    _add_vocab(p)
    p.add_argument(
        "--unique-tokens",
        type=above(float, 0),
        help="limit on unique training tokens U (repeated for D/U epochs): rank by a data-constrained "
        "--fit's L(N, D, U), with each loss's interval (default: no limit)",
    )
    p.add_argument("--top", type=at_least(int, 1), default=12, help="rows to print")
    _add_json(p, "also write every choice as JSON here (a new file, unless --force)")


def cmd_choose(args: argparse.Namespace) -> None:
    """`tenx plan choose`: the choices for the budget, best first (and every one as JSON with --json)."""
    from tenx.plan.allocate import choose, format_choices, load_fit, load_fit_warnings
    from tenx.plan.estimate import cluster_file, load_cluster, plan_vocab
    from tenx.train.config import load_run_config, resolve_config_path
    from tenx.utils.io import atomic_write_json, check_output_file

    config = resolve_config_path(args.config)
    out = None
    if args.json is not None:
        inputs = (config, cluster_file(args.cluster), args.fit)
        out = check_output_file(args.json, force=args.force, flag="--json", inputs=inputs)
    run = load_run_config(config, args.set)
    vocab = plan_vocab(run, args.vocab)
    result = choose(
        run,
        load_cluster(args.cluster),
        load_fit(args.fit),
        args.budget,
        vocab=vocab.size,
        days=args.days,
        unique_tokens=args.unique_tokens,
    )
    result.update(vocab=vocab.size, vocab_source=vocab.source, vocab_assumed=vocab.assumed)
    result["fit_warnings"] = load_fit_warnings(args.fit)
    print(vocab.describe())
    for warning in result["fit_warnings"]:
        print(f"WARNING: the fit in {args.fit}: {warning}")
    print(format_choices(result, args.top))
    if out is not None:
        atomic_write_json(out, result)
        print(f"wrote {args.json}")
