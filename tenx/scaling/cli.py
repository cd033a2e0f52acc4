"""The scaling subcommands (`tenx ladder`, `tenx derisk`, `tenx fit`, `tenx predict`): flags and handlers.

Flags that mirror a config dataclass (LadderConfig, DeriskConfig, FitConfig) are generated from its fields
(tenx.config.add_config_arguments), so their defaults, help and choices are written once, in the dataclass.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from tenx.config import add_config_arguments, config_from_args
from tenx.utils.cli import add_set, at_least, subcommand
from tenx.utils.cpus import add_threads_argument, threads_override

LADDER_FLAGS: tuple[str, ...] = (
    "grid",
    "tokens_per_param",
    "min_tokens_per_param",
    "max_tokens_per_param",
    "sizes",
    "min_depth",
)
LADDER_FLAGS += ("max_depth", "unique_tokens", "seeds", "noise_seeds", "eval_bytes", "prepare_source")
LADDER_FLAGS += ("evals_per_run", "prepare_tokenizer", "workers")
"""The LadderConfig fields `tenx ladder` takes as flags (--budgets is parsed from text: parse_budgets)."""
FIT_FLAGS = ("bootstrap", "seed", "huber_delta", "tie_exponents", "excess_params", "joint")
"""The FitConfig fields `tenx fit` takes as flags."""


def cmd_ladder(args: argparse.Namespace) -> None:
    """Plan and run a ladder (or print its plan, or write its cluster scripts)."""
    from tenx.scaling.ladder.runner import LadderConfig, load_base, parse_budgets, run_ladder
    from tenx.utils.cpus import set_torch_threads

    set_torch_threads(args.threads)  # the dry run's timing probe; each run sets train.threads again
    lc = config_from_args(LadderConfig, args, LADDER_FLAGS)
    if args.budgets:
        lc.budgets = parse_budgets(args.budgets)
    argv = list(args.argv)
    if "--emit" in argv:  # the same command without --emit collects the results after the cluster runs
        i = argv.index("--emit")
        del argv[i : i + 2]
    argv = [a for a in argv if not a.startswith("--emit=")]
    run_ladder(
        load_base(args.config, args.set + threads_override(args.threads)),
        lc,
        args.out,
        dry_run=args.dry_run,
        emit=args.emit,
        nproc=args.nproc,
        nodes=args.nodes,
        collect=shlex.join(["tenx", *argv]),
    )


def _ladder_arguments(lp: argparse.ArgumentParser) -> None:
    from tenx.scaling.ladder.rungs import LadderConfig

    lp.add_argument("--config", default="ladder", help="base config (.toml path or shipped name)")
    add_set(lp, "override the base config")
    lp.add_argument(
        "--budgets", help="training FLOP budgets, e.g. 1e13,3e13,1e14 (default: a 10x CPU ladder)"
    )
    add_config_arguments(lp, LadderConfig, LADDER_FLAGS)
    lp.add_argument("--out", required=True, help="ladder directory (runs/, results.jsonl, plan.json)")
    lp.add_argument("--dry-run", action="store_true", help="print the plan and estimated time; train nothing")
    lp.add_argument(
        "--emit", choices=["torchrun", "slurm"], help="write cluster launch scripts; train nothing"
    )
    lp.add_argument(
        "--nproc", type=at_least(int, 1, 1024), default=8, help="with --emit: processes (GPUs) per node"
    )
    lp.add_argument("--nodes", type=at_least(int, 1, 100_000), default=1, help="with --emit: nodes per run")
    add_threads_argument(lp)


def cmd_derisk(args: argparse.Namespace) -> None:
    """Run a derisking study (or print its stack and runs)."""
    from tenx.scaling.derisk.compute_multiplier import derisk_from_args, run_derisk
    from tenx.scaling.derisk.data_multiplier import run_data_derisk
    from tenx.scaling.ladder.runner import parse_budgets
    from tenx.utils.cpus import set_torch_threads

    set_torch_threads(args.threads)
    dc = derisk_from_args(
        args.config,
        args.base,
        args.change,
        parse_budgets(args.budgets) if args.budgets else None,
        args.seeds,
        args.target,
        args.set + threads_override(args.threads),
        mode=args.mode,
        unique_tokens=args.unique_tokens,
        compare_unique_tokens=args.compare_unique_tokens,
        token_fractions=args.token_fractions,
        law_seeds=args.law_seeds,
    )
    if args.workers is not None:
        dc.ladder.workers = args.workers
    (run_data_derisk if dc.mode == "data" else run_derisk)(dc, args.out, dry_run=args.dry_run)


def _derisk_arguments(rp: argparse.ArgumentParser) -> None:
    from tenx.scaling.derisk.compute_multiplier import DeriskConfig

    rp.add_argument(
        "--config",
        help="a derisk TOML file (e.g. configs/derisk/gpt2_to_llama.toml); the flags below override its values",
    )
    add_config_arguments(rp, DeriskConfig, ["base"], overrides=True)
    add_set(rp, "override the base config")
    rp.add_argument(
        "--change",
        action="append",
        default=[],
        metavar="NAME:SECTION.KEY=VALUE[,...]",
        help="a change (repeatable, stacked in the given order); replaces the file's changes",
    )
    rp.add_argument("--budgets", help="training FLOP budgets, e.g. 1e12,4e12,1.6e13")
    add_config_arguments(rp, DeriskConfig, ["seeds", "target"], overrides=True)
    add_config_arguments(
        rp,
        DeriskConfig,
        ["mode", "unique_tokens", "compare_unique_tokens", "token_fractions", "law_seeds"],
        overrides=True,
    )
    defaults = DeriskConfig()
    for action in rp._actions:  # flags that override the file: say the value used when neither gives one
        if action.dest in ("base", "budgets", "seeds") and "default" not in (action.help or ""):
            value = getattr(defaults, action.dest)
            shown = ",".join(f"{b:g}" for b in value) if action.dest == "budgets" else value
            action.help = f"{action.help} (default: the --config file's, else {shown})"
    rp.add_argument(
        "--out", required=True, help="output directory (ladder/, report.md, report.png, derisk.json)"
    )
    rp.add_argument("--dry-run", action="store_true", help="print the stack and its runs; train nothing")
    rp.add_argument(
        "--workers",
        type=at_least(int, 1, 64),
        help="runs trained at once (ladder.workers; default: the --config file's, else 1)",
    )
    add_threads_argument(rp)


def cmd_fit(args: argparse.Namespace) -> None:
    """`tenx fit`: fit, print the summary, write the JSON and PNG."""
    from tenx.scaling.fit import format_fit, run_fit

    report = run_fit(
        args.input,
        law=args.law,
        target=args.target,
        out_dir=args.out,
        json_out=args.json,
        plot=not args.no_plot,
        **{name: getattr(args, name) for name in FIT_FLAGS},
        min_tokens_per_param=args.min_tokens_per_param,
        max_residual=args.max_residual,
        params_column=args.params_column,
        tokens_column=args.tokens_column,
        loss_column=args.loss_column,
        flops_column=args.flops_column,
        unique_column=args.unique_column,
        filters=args.filter,
        holdout=args.holdout,
        force=args.force,
    )
    print(format_fit(report))


def _fit_arguments(fp: argparse.ArgumentParser) -> None:
    from tenx.scaling.fit import LAWS, FitConfig

    fp.add_argument("input", help="LADDER_DIR (its results.jsonl), a .csv or a .jsonl with one row per run")
    fp.add_argument(
        "--law", choices=LAWS, default="chinchilla", help="L(N,D), L(C) or L(N,D,U) (default chinchilla)"
    )
    fp.add_argument(
        "--target", help="extrapolate to N=PARAMS,D=TOKENS (U=UNIQUE for data-constrained) or to C=FLOPS"
    )
    fp.add_argument("--params-column", default="params", help="parameter count column (default params)")
    fp.add_argument("--tokens-column", default="tokens", help="training tokens column (default tokens)")
    fp.add_argument(
        "--loss-column", default="heldout_loss", help="loss column, nats/token (default heldout_loss)"
    )
    fp.add_argument(
        "--flops-column",
        default="flops",
        help="training FLOPs column; C = 6ND when a row lacks it (default flops)",
    )
    fp.add_argument(
        "--unique-column", default="unique_tokens", help="unique tokens column (data-constrained)"
    )
    fp.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="COLUMN=VALUE",
        help="keep only matching rows (repeatable)",
    )
    fp.add_argument(
        "--holdout",
        metavar="EXPR",
        help="rows to predict instead of fit, e.g. 'params>=1e9' or 'params>=1e9 & tokens<1e11'",
    )
    fp.add_argument("--json", help="report JSON path (default OUT/INPUT_fit_LAW.json, rewritten each time)")
    fp.add_argument(
        "--force", action="store_true", help="let --json replace an existing file (never the run table)"
    )
    fp.add_argument("--out", help="directory of the plot (default: next to the input)")
    fp.add_argument("--no-plot", action="store_true", help="skip the PNG")
    add_config_arguments(fp, FitConfig, FIT_FLAGS, show_defaults=True)
    fp.add_argument(
        "--min-tokens-per-param",
        type=at_least(float, 0),
        default=0.0,
        help="leave out runs with fewer training tokens per parameter (default 0: keep all)",
    )
    fp.add_argument(
        "--max-residual",
        type=at_least(float, 0),
        default=0.05,
        help="leave out runs this far off the fit to the others, in log loss (default 0.05; 0: keep all)",
    )


def cmd_predict(args: argparse.Namespace) -> None:
    """`tenx predict`: a run's whole predicted loss curve, from a ladder, its own start or a curve table."""
    from tenx.errors import ConfigError
    from tenx.scaling.predict import run_predict

    if args.target is not None:
        from tenx.scaling.predict_curves import run_predict_table

        if args.ladder or args.run or args.config or args.set:
            raise ConfigError(
                "tenx predict --target: give --curves FIT and --out DIR, not --from/--run/--config"
            )
        if args.curves is None or args.out is None:
            raise ConfigError(
                "tenx predict --target TARGET: also give --curves FIT (the runs to fit) and --out DIR"
            )
        kept = {"law": args.law} if args.law else {}
        result = run_predict_table(
            args.curves,
            args.target,
            args.out,
            bootstrap=args.bootstrap,
            split=args.split,
            force=args.force,
            **kept,
        )
        print(result["text"])
        return
    if args.split is not None:
        raise ConfigError("--split: only with --curves FIT --target TARGET")
    print(
        run_predict(
            ladder_dir=args.ladder,
            config=args.config,
            overrides=args.set,
            run_dir=args.run,
            curves=args.curves,
            law=args.law,
            world_size=args.world_size,
            bootstrap=args.bootstrap,
            out=args.out,
            quantity=args.quantity,
            force=args.force,
        )["text"]
    )


def _predict_arguments(pp: argparse.ArgumentParser) -> None:
    from tenx.scaling.curve import DEFAULT_LAW, EXTRAPOLATION_LAW, LAWS
    from tenx.scaling.predict import QUANTITIES

    pp.add_argument(
        "--from", dest="ladder", metavar="LADDER_DIR", help="a ladder's directory (tenx ladder --out)"
    )
    pp.add_argument("--config", help="the run to predict: a config path or a shipped name (with --from)")
    add_set(pp, "override the config (repeatable)")
    pp.add_argument("--run", metavar="RUN_DIR", help="extrapolate this run from its curve so far instead")
    pp.add_argument(
        "--curves",
        metavar="FIT",
        help="a curve table (.jsonl/.csv, docs/prediction.md) of runs to fit: with --target, predict its "
        "runs; with --run or --from, a prior on the law's shape",
    )
    pp.add_argument(
        "--target",
        metavar="TARGET",
        help="a curve table of the runs to predict (every row past warmup; rows with a loss are compared)",
    )
    pp.add_argument(
        "--split",
        choices=["val", "train"],
        help="with --target: the loss to fit (default: the one every run has)",
    )
    pp.add_argument(
        "--law",
        choices=sorted(LAWS),
        help=f"the curve law (default: {DEFAULT_LAW} from a ladder, {EXTRAPOLATION_LAW} for --run)",
    )
    pp.add_argument(
        "--quantity",
        choices=["auto", *QUANTITIES],
        help="the metrics column to predict: loss (training) or val_loss (default: from a ladder, val_loss "
        "when every run logged it, see ladder.evals_per_run; for --run, loss)",
    )
    pp.add_argument(
        "--world-size", type=int, default=1, help="ranks the config will run on (its batch is per rank)"
    )
    pp.add_argument("--bootstrap", type=int, default=30, help="bootstrap resamples for the band (0: none)")
    pp.add_argument(
        "-o",
        "--out",
        help="output directory (default: RUN_DIR/extrapolation, or LADDER_DIR/predictions/CONFIG; never a "
        "run directory's own prediction.json)",
    )
    pp.add_argument(
        "--force",
        action="store_true",
        help="with -o: replace a prediction.json or prediction.png already there",
    )


def register(subparsers: Any) -> None:
    """Register `tenx ladder`, `tenx derisk`, `tenx fit` and `tenx predict` on the CLI's subparsers."""
    about = "plan and run a scaling ladder from FLOP budgets"
    subcommand(subparsers, "ladder", about, cmd_ladder, _ladder_arguments)
    about = "add changes one at a time; check each gain persists across budgets"
    subcommand(subparsers, "derisk", about, cmd_derisk, _derisk_arguments)
    about = "fit a scaling law to finished runs and extrapolate, with bootstrap intervals"
    subcommand(subparsers, "fit", about, cmd_fit, _fit_arguments)
    about = "predict a run's whole loss curve with a band: from a ladder, or from the run's own start"
    subcommand(subparsers, "predict", about, cmd_predict, _predict_arguments)
