"""The `tenx` command: the packages' subcommands, and `main`, where errors print one clear line and exit 2.

Each package registers its own subcommands, flags and handlers (`register(subparsers)` in its cli.py,
through tenx.utils.cli.subcommand); this module only lists them. Flags that mirror a config dataclass
(`tenx data prepare`, `train`'s supervisor flags, `ladder`, `derisk`, `fit`, `lighthouse`) are generated
from its fields (tenx.config.add_config_arguments), so their defaults, help and choices are written once.
"""

from __future__ import annotations

import argparse
import os
import sys

from tenx.commands import cli as commands_cli
from tenx.compress import cli as compress_cli
from tenx.data import cli as data_cli
from tenx.errors import TenxError
from tenx.eval import cli as eval_cli
from tenx.export import cli as export_cli
from tenx.monitor import cli as monitor_cli
from tenx.monitor.dashboard import cli as dashboard_cli
from tenx.parallel import cli as parallel_cli
from tenx.plan import cli as plan_cli
from tenx.scaling import cli as scaling_cli
from tenx.scaling import curves_cli
from tenx.triage import cli as triage_cli
from tenx.utils.cli import Parser
from tenx.utils.storage import STORAGE_ERRNOS, storage_error

REGISTRATIONS = (
    data_cli.register,  # data prepare, data index
    commands_cli.register,  # train (--supervise: tenx/launch/supervise.py), ensemble, quickstart
    monitor_cli.register,  # status
    dashboard_cli.register,  # dashboard, report
    triage_cli.register,  # incidents, replay, triage
    parallel_cli.register,  # lighthouse (replica groups across clusters)
    scaling_cli.register,  # ladder, derisk, fit, predict
    curves_cli.register,  # curves convert, curves check (curve tables from any trainer's logs)
    eval_cli.register,  # eval, sample
    export_cli.register,  # export (Hugging Face transformers)
    compress_cli.register,  # compress, decompress
    plan_cli.register,  # plan, plan shapes, plan failures, plan choose
)
"""Each package's `register(subparsers)`, in the order `tenx --help` lists their subcommands."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (each one's flags are added when it is first used)."""
    parser = Parser(prog="tenx", description="Pre-train GPT-style language models, end to end.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for register in REGISTRATIONS:
        register(subparsers)
    return parser


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at /dev/null, so the flush at exit does not hit the closed pipe again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file: nothing is flushed to a descriptor at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tenx` command.

    A reader that closes stdout early (`tenx status RUN_DIR | head -1`) ends the command quietly with exit
    status 141, what a Unix tool killed by SIGPIPE reports (128 + 13): the reader took what it wanted, and
    `set -o pipefail` still sees that the output was cut short."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    try:
        args.func(args)
        sys.stdout.flush()  # a closed pipe fails here, not in the flush at exit (where it cannot be caught)
    except BrokenPipeError:
        _stdout_to_devnull()
        return 141
    except TenxError as e:
        print(f"tenx: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full, read-only or forbidden file system: the user's to fix, not a bug
        found = storage_error(e)
        if found is None or found.errno is None:
            raise
        print(
            f"tenx: error: {STORAGE_ERRNOS[found.errno]} ({found.filename or 'a file'}): free space or "
            "choose a writable "
            "directory, then run the command again",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("tenx: interrupted", file=sys.stderr)
        return 130
    return 0


def entry() -> None:
    """The `tenx` console script and `python -m tenx`: `main`, then exit with its status.

    A process that trained in a torch.distributed process group (a torchrun worker) ends without
    interpreter teardown, where gloo's threads sometimes aborted a finished run (`end_process`)."""
    code = main()
    distributed = sys.modules.get("tenx.parallel.distributed")  # never imported: no group joined
    if distributed is not None:
        distributed.end_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
