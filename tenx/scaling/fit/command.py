"""The `tenx fit` command: its arguments (`add_fit_parser`, registered by tenx/cli.py) and `cmd_fit`."""

from __future__ import annotations

import argparse
from typing import Any

from tenx.scaling.fit.laws import LAWS
from tenx.scaling.fit.report import format_report, run_fit


def cmd_fit(args: argparse.Namespace) -> None:
    """`tenx fit`: fit, print the summary, write the JSON and PNG."""
    report = run_fit(
        args.input,
        law=args.law,
        target=args.target,
        out_dir=args.out,
        json_out=args.json,
        bootstrap=args.bootstrap,
        seed=args.seed,
        plot=not args.no_plot,
        huber_delta=args.huber_delta,
        tie_exponents=args.tie_exponents,
        min_tokens_per_param=args.min_tokens_per_param,
        max_residual=args.max_residual,
        params_column=args.params_column,
        tokens_column=args.tokens_column,
        loss_column=args.loss_column,
        flops_column=args.flops_column,
        unique_column=args.unique_column,
        filters=args.filter,
        holdout=args.holdout,
    )
    print(format_report(report))


def add_fit_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `tenx fit` on the CLI's subparsers."""
    fp = subparsers.add_parser(
        "fit", help="fit a scaling law to finished runs and extrapolate, with bootstrap intervals"
    )
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
    fp.add_argument("--json", help="report JSON path (default OUT/INPUT_fit_LAW.json)")
    fp.add_argument("--out", help="directory of the plot (default: next to the input)")
    fp.add_argument("--no-plot", action="store_true", help="skip the PNG")
    fp.add_argument(
        "--bootstrap", type=int, default=200, help="bootstrap resamples (default 200; 0: no intervals)"
    )
    fp.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    fp.add_argument(
        "--huber-delta", type=float, default=1e-3, help="Huber threshold on log-loss residuals (1e-3)"
    )
    fp.add_argument(
        "--tie-exponents", action="store_true", help="chinchilla with one exponent for N and D (Gadre et al.)"
    )
    fp.add_argument(
        "--min-tokens-per-param",
        type=float,
        default=0.0,
        help="leave out runs with fewer training tokens per parameter (default 0: keep all)",
    )
    fp.add_argument(
        "--max-residual",
        type=float,
        default=0.05,
        help="leave out runs this far off the fit to the others, in log loss (default 0.05; 0: keep all)",
    )
    fp.set_defaults(func=cmd_fit)
    return fp
