"""`tenx plan`: co-design a run before it starts (memory, time, communication, shapes, failures).

`tenx plan --config CFG --cluster CLUSTER` estimates a run; its subcommands each come from the module that
implements them (`shapes`: tenx/plan/shapes.py, `failures`: tenx/plan/failsim.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `tenx plan` and its subcommands on the CLI's subparsers."""
    from tenx.plan import failsim, shapes

    parser = subparsers.add_parser(
        "plan", help="co-design a run: memory, time, communication, GEMM shapes, failures at scale"
    )
    parser.add_argument("--config", help="the run config (a .toml path or a shipped name)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override"
    )
    parser.add_argument(
        "--cluster", help="a cluster file or a shipped one (configs/clusters/: cpu, h100-node, ...)"
    )
    parser.add_argument("--strategy", choices=["ddp", "fsdp", "hsdp"], default="ddp", help="data parallelism")
    parser.add_argument(
        "--ranks", type=int, help="data-parallel ranks (default: every accelerator of the cluster)"
    )
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16"], help="activation dtype (default: from train.precision)"
    )
    parser.add_argument(
        "--vocab", type=int, help="vocabulary size (default: the config's data manifest, else 50257)"
    )
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute block activations")
    parser.add_argument(
        "--replica-groups", type=int, default=1, help="replica groups across clusters (torchft)"
    )
    parser.add_argument(
        "--diloco-every", type=int, default=0, help="DiLoCo: steps between cross-cluster syncs"
    )
    parser.add_argument("--json", help="also write the plan as JSON here")
    sub = parser.add_subparsers(dest="plan_command")
    shapes.add_parser(sub)
    failsim.add_parser(sub)
    parser.set_defaults(func=cmd_plan)
    return parser


def cmd_plan(args: argparse.Namespace) -> None:
    """`tenx plan --config CFG --cluster CLUSTER`: the estimate, printed (and written as JSON with --json)."""
    from tenx.errors import TenxError
    from tenx.plan.estimate import estimate, format_plan, load_cluster
    from tenx.train.config import load_run_config, resolve_config_path
    from tenx.utils.io import atomic_write_json

    if not args.config or not args.cluster:
        raise TenxError(
            "tenx plan needs --config CFG and --cluster CLUSTER (or a subcommand: shapes, failures)"
        )
    run = load_run_config(resolve_config_path(args.config), args.set)
    vocab = args.vocab or _vocab_of(run)
    cluster = load_cluster(args.cluster)
    plan = estimate(
        run,
        cluster,
        vocab=vocab,
        strategy=args.strategy,
        ranks=args.ranks,
        dtype=args.dtype,
        activation_checkpointing=args.activation_checkpointing,
        replica_groups=args.replica_groups,
        diloco_every=args.diloco_every,
    )
    print(format_plan(plan, cluster))
    if args.json:
        atomic_write_json(Path(args.json), {"cluster": cluster.name, "vocab": vocab, **plan.to_dict()})
        print(f"wrote {args.json}")


def _vocab_of(run: Any) -> int:
    """The vocabulary of the run's prepared data, else its model.vocab_size, else GPT-2's."""
    from tenx.data.manifest import read_manifest
    from tenx.errors import DataError

    try:
        return int(read_manifest(run.data.dir)["tokenizer"]["vocab_size"])
    except (DataError, OSError, KeyError, ValueError):
        return int(run.model.vocab_size or 50257)
