"""`tenx export`: write a run's model and tokenizer as a Hugging Face transformers model."""

from __future__ import annotations

import argparse
from typing import Any

from tenx.utils.cli import at_least, subcommand


def cmd_export(args: argparse.Namespace) -> None:
    """Export the run's checkpoint; print what was written."""
    from tenx.export.hf import export_hf, format_export_summary, quiet_library_logs

    with quiet_library_logs():
        summary = export_hf(args.target, args.out, checkpoint=args.checkpoint, member=args.member)
    print(format_export_summary(summary))


def _export_arguments(xp: argparse.ArgumentParser) -> None:
    xp.add_argument("target", help="run directory (its newest verified checkpoint) or checkpoint directory")
    xp.add_argument("--format", choices=["hf"], default="hf", help="hf: a transformers model directory")
    xp.add_argument(
        "-o",
        "--out",
        required=True,
        help="output directory: new, empty, or a previous tenx export to replace",
    )
    xp.add_argument(
        "--checkpoint",
        help="export this checkpoint (a path, or a step_XXXXXXXX name in the run's checkpoints)",
    )
    xp.add_argument(
        "--member",
        type=at_least(int, 0, 63),
        metavar="K",
        help="export member K of an ensemble (an ensemble's run directory is refused without one)",
    )


def register(subparsers: Any) -> None:
    """Register `tenx export` on the CLI's subparsers."""
    about = "write a run's model and tokenizer as a Hugging Face transformers model"
    subcommand(subparsers, "export", about, cmd_export, _export_arguments)
