"""`tenx curves convert` and `tenx curves check`: curve tables from other trainers' logs, and their check.

A curve table (tenx/scaling/curve/curve_table.py) holds anyone's loss curves, one row per logged point;
`convert` writes one from a tenx run or ladder, a TensorBoard log or a W&B CSV export
(tenx/scaling/curve/convert.py), `check` reads tables as the curve laws will and says what they hold.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tenx.utils.cli import Command, above, command_group
from tenx.utils.text import counted

SIZE_FLAGS = ("params", "tokens_per_step")
"""What a TensorBoard log or a W&B export does not record: given as flags, never guessed."""


def cmd_curves_convert(args: argparse.Namespace) -> None:
    """Convert one source into a curve table; print how many runs and rows went where."""
    from tenx.errors import ConfigError
    from tenx.scaling.curve import convert
    from tenx.scaling.curve.curve_table import table_format, write_curve_table

    out = Path(args.out)
    table_format(out)  # a wrong suffix is refused before the source is read
    if out.exists() and not args.force:
        raise ConfigError(f"--out: {out} exists; pass --force to replace it")
    given = {flag: getattr(args, flag) for flag in SIZE_FLAGS if getattr(args, flag) is not None}
    if args.from_run or args.from_ladder:
        source = "--from-run" if args.from_run else "--from-ladder"
        log_only = (
            ("--params", args.params),
            ("--tokens-per-step", args.tokens_per_step),
            ("--loss-tag", args.loss_tag),
            ("--lr-tag", args.lr_tag),
            ("--step-column", args.step_column),
        )
        unused = [flag for flag, value in log_only if value is not None]
        if unused:
            raise ConfigError(
                f"{', '.join(unused)}: a tenx run records its own size, tokens per step and metric names; "
                f"drop them with {source}"
            )
        split = args.split or "both"
        if args.from_run:
            rows = convert.rows_from_run(args.from_run, split, args.run)
        else:
            if args.run is not None:
                raise ConfigError(
                    "--run: a ladder's runs are named by their folders; drop --run with --from-ladder"
                )
            rows = convert.rows_from_ladder(args.from_ladder, split)
    else:
        flag = "--tensorboard" if args.tensorboard else "--wandb-csv"
        missing = [f"--{k.replace('_', '-')}" for k in SIZE_FLAGS if k not in given]
        if missing:
            raise ConfigError(
                f"{' and '.join(missing)}: required with {flag} (the model's parameter count and the tokens "
                "per optimizer step: a log does not record them)"
            )
        split = args.split or "val"
        if split == "both":
            raise ConfigError(
                f"--split both: with {flag}, convert one split at a time (val or train) into its own table"
            )
        options: dict[str, Any] = dict(given, split=split, run=args.run)
        if args.tensorboard:
            if args.step_column is not None:
                raise ConfigError("--step-column: only for --wandb-csv (TensorBoard logs carry their steps)")
            rows = convert.rows_from_tensorboard(
                args.tensorboard, loss_tag=args.loss_tag, lr_tag=args.lr_tag, **options
            )
        else:
            rows = convert.rows_from_wandb_csv(
                args.wandb_csv,
                loss_column=args.loss_tag,
                lr_column=args.lr_tag,
                step_column=args.step_column,
                **options,
            )
    write_curve_table(out, rows)
    runs = {r["run"] for r in rows}
    splits = sorted({r["split"] for r in rows})
    print(f"wrote {counted(len(runs), 'run')}, {counted(len(rows), 'row')} ({', '.join(splits)}) to {out}")


def cmd_curves_check(args: argparse.Namespace) -> None:
    """Read curve tables as the curve laws will; print what each split holds."""
    from tenx.scaling.curve.curve_table import read_curve_tables

    table = read_curve_tables(args.tables)
    print(f"{table.path}: {counted(len({r.run for r in table.runs}), 'run')}, {counted(table.rows, 'row')}")
    for split in sorted({r.split for r in table.runs}):
        runs = [r for r in table.runs if r.split == split]
        rows = sum(len(r.steps) for r in runs)
        to_predict = sum(int((~r.observed).sum()) for r in runs)
        sizes = sorted(r.params for r in runs)
        print(
            f"  {split}: {counted(len(runs), 'run')}, {counted(rows, 'row')} ({to_predict:,} to predict), "
            f"params {sizes[0]:,.0f}-{sizes[-1]:,.0f}, steps up to {max(r.last_step for r in runs):,}"
        )
        if args.runs:
            for r in runs:
                print(
                    f"    {r.run}: params {r.params:,.0f}, {counted(len(r.steps), 'row')} "
                    f"({int((~r.observed).sum())} to predict), steps {r.steps[0]}-{r.last_step}, "
                    f"peak lr {r.lr.max():.4g}"
                )


def _convert_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_argument_group("source (exactly one)").add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--from-run",
        metavar="DIR",
        help="a tenx run directory: size, tokens per step and schedule from its own files",
    )
    source.add_argument(
        "--from-ladder",
        metavar="DIR",
        help="a tenx ladder directory: every run under DIR/runs/, named by its folder",
    )
    source.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="a TensorBoard log directory: each folder in it holding event files is one run, named by its "
        "path (needs --params and --tokens-per-step)",
    )
    source.add_argument(
        "--wandb-csv",
        metavar="FILE",
        help="a CSV exported from a W&B chart or run history: one run, or one per 'RUN - METRIC' column "
        "(needs --params and --tokens-per-step)",
    )
    p.add_argument(
        "--params",
        type=above(float, 0),
        metavar="N",
        help="the model's parameter count (--tensorboard, --wandb-csv: the log does not record it)",
    )
    p.add_argument(
        "--tokens-per-step",
        type=above(float, 0),
        metavar="N",
        help="tokens per optimizer step, batch x sequence length (--tensorboard, --wandb-csv)",
    )
    p.add_argument(
        "--loss-tag",
        "--loss-column",
        dest="loss_tag",
        metavar="NAME",
        help="the loss's TensorBoard tag or W&B metric (default: the first of the usual names present: "
        "val/loss, val_loss, eval/loss, ... for --split val; train/loss, loss, train_loss, ... for train)",
    )
    p.add_argument(
        "--lr-tag",
        "--lr-column",
        dest="lr_tag",
        metavar="NAME",
        help="the learning rate's tag or metric (default: the first present of lr, train/lr, learning_rate, "
        "train/learning_rate, lr-AdamW, optimizer/lr, ...); interpolated linearly at the loss's steps",
    )
    p.add_argument(
        "--step-column",
        metavar="NAME",
        help="--wandb-csv: the step column (default: the first of Step, _step, trainer/global_step, ...)",
    )
    p.add_argument(
        "--split",
        choices=["both", "val", "train"],
        help="which loss: val (the validation loss) or train (the training loss); default: both, as far as "
        "a tenx run logged them; val for a TensorBoard log or a W&B export",
    )
    p.add_argument(
        "--run",
        metavar="NAME",
        help="the run's name (default: its folder or file name); with several runs in a log, a prefix: NAME/RUN",
    )
    p.add_argument(
        "--out", required=True, metavar="FILE", help="the curve table to write: FILE.jsonl or FILE.csv"
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def _check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tables", nargs="+", metavar="TABLE", help="curve tables (.jsonl or .csv), read as one")
    p.add_argument("--runs", action="store_true", help="also list each run")


def register(subparsers: Any) -> None:
    """Register `tenx curves` and its subcommands (`convert`, `check`) on the CLI's subparsers."""
    convert = "write a curve table from a tenx run or ladder, a TensorBoard log or a W&B CSV export"
    check = "read curve tables as the curve laws will and print their runs and rows per split"
    commands: list[Command] = [
        ("convert", convert, cmd_curves_convert, _convert_arguments),
        ("check", check, cmd_curves_check, _check_arguments),
    ]
    command_group(subparsers, "curves", "loss-curve tables from any trainer's logs", commands)
