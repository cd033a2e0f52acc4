"""`tenx data prepare` and `tenx data index`: their flags and what they run.

The flags of `tenx data prepare` are generated from PrepareConfig's fields (tenx.config.add_config_arguments),
so their defaults, help and choices are written once, in the dataclass; `--emit slurm` writes the same flags
back into the job it emits (`prepare_argv`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tenx.config import add_config_arguments, config_from_args
from tenx.utils.cli import Command, command_group

PREPARE_FLAGS: tuple[str, ...] = (
    "source",
    "out",
    "tokenizer",
    "tokenizer_from",
    "vocab_size",
    "val_ratio",
    "heldout_ratio",
    "seed",
    "patterns",
    "text_field",
    "column",
    "shard_tokens",
    "max_documents",
)
PREPARE_FLAGS += ("near_dup_threshold", "near_dup_shingle", "ngram_index", "contamination_threshold")
PREPARE_FLAGS += (
    "tokenizer_sample_mb",
    "workers",
    "resume",
    "engine",
    "tasks",
    "slurm_partition",
    "slurm_time",
)
"""The PrepareConfig fields `tenx data prepare` takes as flags."""
PREPARE_FLAG_NAMES = {"patterns": "--pattern"}
"""Flags of `tenx data prepare` not named after their field."""


def cmd_data_prepare(args: argparse.Namespace) -> None:
    """Prepare the corpus (or write the Slurm job that prepares it); print the summary."""
    from tenx.data.prepare.pipeline import PrepareConfig, format_prepare_summary, prepare

    cfg = config_from_args(PrepareConfig, args, PREPARE_FLAGS)
    if cfg.tokenizer_from:  # refused before the corpus is read, not after
        from tenx.data.tokenizer import load_hf_tokenizer

        load_hf_tokenizer(cfg.tokenizer_from)
    if args.emit:
        from tenx.data.prepare.engine import emit_slurm

        print(f"wrote {emit_slurm(cfg, prepare_argv(cfg))}: sbatch it")
        return
    manifest = prepare(cfg, progress=not args.quiet)
    print(format_prepare_summary(manifest, args.out))


def prepare_argv(cfg: Any) -> list[str]:
    """The `tenx data prepare` flags that give `cfg` (its source and out, and what differs from defaults)."""
    from tenx.data.prepare.pipeline import PrepareConfig

    defaults, argv = PrepareConfig(source=cfg.source, out=cfg.out), []
    for name in PREPARE_FLAGS:
        value = getattr(cfg, name)
        if name not in ("source", "out") and value == getattr(defaults, name):
            continue
        flag = PREPARE_FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [x for item in (value if isinstance(value, list) else [value]) for x in (flag, str(item))]
    return argv


def cmd_data_index(args: argparse.Namespace) -> None:
    """`tenx data index DATA_DIR [--n N]`: build the n-gram index of a prepared directory's train split and
    print what it holds (default n: the one the directory was prepared with, else its tokenizer's,
    `data_n`)."""
    from tenx.data.manifest import read_manifest
    from tenx.data.ngrams import build_index, data_n, index_paths

    n = args.n if args.n is not None else data_n(read_manifest(args.data_dir))
    path = build_index(args.data_dir, n)
    count = json.loads(index_paths(args.data_dir, n)[1].read_text())["count"]
    print(f"{path}: {count:,} distinct {n}-grams of the train split")


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    from tenx.data.prepare.pipeline import PrepareConfig

    add_config_arguments(p, PrepareConfig, PREPARE_FLAGS, flags=PREPARE_FLAG_NAMES)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--emit", choices=["slurm"], help="write OUT.sbatch, a Slurm job driving the datatrove-slurm engine"
    )


def _index_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data_dir", help="a prepared data directory")
    p.add_argument(
        "--n",
        type=int,
        default=None,
        help="n-gram length in tokens (default: the one the directory was prepared with; else 13 for BPE, "
        "50 for bytes)",
    )


def register(subparsers: Any) -> None:
    """Register `tenx data` and its subcommands (`prepare`, `index`) on the CLI's subparsers."""
    prepare = "corpus -> tokenizer -> shards + manifest, split by document"
    index = "hashed n-grams of the train split, for decontamination"
    commands: list[Command] = [
        ("prepare", prepare, cmd_data_prepare, _prepare_arguments),
        ("index", index, cmd_data_index, _index_arguments),
    ]
    command_group(subparsers, "data", "prepare corpora", commands)
