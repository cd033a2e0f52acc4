"""The `tenx` command: a thin layer over the Python API. Errors print one clear line and exit 2.

Every argparse parser lives here (the parser classes in tenx/cli_parsing.py). Flags that mirror a config dataclass (`tenx data prepare`, `ladder`,
`derisk`, `fit`, `lighthouse`) are generated from its fields (tenx.config.add_config_arguments), so their
defaults, help and choices are written once, in the dataclass.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from tenx.cli_parsing import Parser, add_set, command
from tenx.compress.cli import add_compress_parsers
from tenx.config import add_config_arguments, config_from_args
from tenx.errors import TenxError
from tenx.eval.cli import add_eval_parser
from tenx.monitor.dashboard.cli import add_dashboard_parser, add_report_parser
from tenx.plan.cli import add_plan_parser
from tenx.rundir import RunDir
from tenx.triage.cli import add_incidents_parser, add_replay_parser, add_triage_parser
from tenx.utils.io import STORAGE_ERRNOS, storage_error


def cmd_data_prepare(args: argparse.Namespace) -> None:
    from tenx.data.prepare.pipeline import PrepareConfig, format_prepare_summary, prepare

    cfg = config_from_args(PrepareConfig, args, PREPARE_FLAGS)
    if args.emit:
        from tenx.data.prepare.engine import emit_slurm

        print(f"wrote {emit_slurm(cfg, _prepare_argv(cfg))}: sbatch it")
        return
    manifest = prepare(cfg, progress=not args.quiet)
    print(format_prepare_summary(manifest, args.out))


def _prepare_argv(cfg: Any) -> list[str]:
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
    from tenx.data.ngrams import index_command

    index_command(args)


def cmd_train(args: argparse.Namespace) -> None:
    from tenx.monitor.goodput import compute_goodput, format_goodput
    from tenx.train.config import load_run_config, resolve_config_path

    config_path = resolve_config_path(args.config)
    overrides = [*args.set, *([f"faults.inject={json.dumps(args.fault)}"] if args.fault else [])]
    overrides += [f"monitor.prediction={json.dumps(args.predict)}"] if args.predict else []
    if args.fault_seed is not None:
        overrides.append(f"faults.seed={args.fault_seed}")
    cfg = load_run_config(config_path, overrides)  # checked here, before any child starts
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / config_path.stem
    if args.supervise:
        from tenx.launch.supervise import child_environment, format_supervision, supervise

        child_args = ["train", "--config", str(config_path), "--run-dir", str(run_dir)]
        for item in overrides:
            child_args += ["--set", item]
        report = supervise(
            child_args,
            run_dir,
            resume=args.resume,
            max_restarts=args.max_restarts,
            same_failure_limit=args.same_failure_limit,
            backoff_s=args.backoff,
            heartbeat_timeout_s=args.heartbeat_timeout,
            launcher=shlex.split(args.launcher) if args.launcher else None,
            env=child_environment(),
        )
        print(format_supervision(report))
        print(format_goodput(compute_goodput(run_dir)))
        if not report.finished:
            raise TenxError(f"supervised run in {run_dir} did not finish: {report.gave_up}")
        return
    from tenx.scaling.self_extrapolation import summary_fields, watch_callbacks
    from tenx.train.run import train

    trainer, metrics = train(cfg, run_dir, resume=args.resume, extra_callbacks=watch_callbacks(cfg))
    if trainer.rank != 0:  # under torchrun the summary is the run's, printed once
        return
    if metrics:
        print(
            json.dumps(
                {k: metrics.get(k) for k in ("step", "tokens", "loss", "val_loss")} | summary_fields(run_dir)
            )
        )
    else:
        print(f"already trained to step {trainer.step} of {trainer.total_steps}; nothing to do")
    print(format_goodput(compute_goodput(run_dir)))
    print(f"run directory: {run_dir}  (metrics: {RunDir(run_dir).metrics}, status: tenx status {run_dir})")


def cmd_status(args: argparse.Namespace) -> None:
    from tenx.monitor.goodput import format_status

    print(format_status(args.run_dir))


def cmd_sample(args: argparse.Namespace) -> None:
    from tenx.data.tokenizer import load_tokenizer
    from tenx.eval.load import load_model
    from tenx.eval.sample import check_sampling, generate

    check_sampling(args.max_new_tokens, args.temperature, args.top_k)  # before the model is loaded
    loaded = load_model(args.target, args.device)
    tokenizer = load_tokenizer(loaded.data_dir)
    prompt = tokenizer.encode(args.prompt) if args.prompt else []
    prompt = [tokenizer.eot_id] + prompt
    new = generate(
        loaded.model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        stop_id=tokenizer.eot_id,
        vocab_size=tokenizer.vocab_size,
        seed=args.seed,
    )
    print(args.prompt + tokenizer.decode(new))


def cmd_export(args: argparse.Namespace) -> None:
    from tenx.export.hf import export_hf, format_export_summary

    summary = export_hf(args.target, args.out, checkpoint=args.checkpoint)
    print(format_export_summary(summary))


def cmd_quickstart(args: argparse.Namespace) -> None:
    from tenx.quickstart import quickstart

    quickstart(args.out, steps=args.steps, minutes=args.minutes)


def cmd_ladder(args: argparse.Namespace) -> None:
    from tenx.scaling.ladder import LadderConfig, load_base, parse_budgets, run_ladder

    lc = config_from_args(LadderConfig, args, LADDER_FLAGS)
    if args.budgets:
        lc.budgets = parse_budgets(args.budgets)
    argv = list(args.argv)
    if "--emit" in argv:  # the same command without --emit collects the results after the cluster runs
        i = argv.index("--emit")
        del argv[i : i + 2]
    argv = [a for a in argv if not a.startswith("--emit=")]
    run_ladder(
        load_base(args.config, args.set),
        lc,
        args.out,
        dry_run=args.dry_run,
        emit=args.emit,
        nproc=args.nproc,
        nodes=args.nodes,
        collect=shlex.join(["tenx", *argv]),
    )


def cmd_derisk(args: argparse.Namespace) -> None:
    from tenx.scaling.derisk import derisk_from_args, run_derisk
    from tenx.scaling.ladder import parse_budgets

    dc = derisk_from_args(
        args.config,
        args.base,
        args.change,
        parse_budgets(args.budgets) if args.budgets else None,
        args.seeds,
        args.target,
        args.set,
    )
    run_derisk(dc, args.out, dry_run=args.dry_run)


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
    )
    print(format_fit(report))


def cmd_lighthouse(args: argparse.Namespace) -> None:
    """The `tenx lighthouse` command."""
    from tenx.parallel.lighthouse import run_lighthouse

    run_lighthouse(args.bind, **{name: getattr(args, name) for name in LIGHTHOUSE_FLAGS})


# ----- flags generated from config fields ------------------------------------------------------------
PREPARE_FLAGS = (
    "source",
    "out",
    "tokenizer",
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
LADDER_FLAGS = (
    "grid",
    "tokens_per_param",
    "min_tokens_per_param",
    "max_tokens_per_param",
    "sizes",
    "min_depth",
)
LADDER_FLAGS += ("max_depth", "unique_tokens", "seeds", "noise_seeds", "eval_bytes", "prepare_source")
LADDER_FLAGS += ("evals_per_run", "prepare_tokenizer")
"""The LadderConfig fields `tenx ladder` takes as flags (--budgets is parsed from text: parse_budgets)."""
FIT_FLAGS = ("bootstrap", "seed", "huber_delta", "tie_exponents")
"""The FitConfig fields `tenx fit` takes as flags."""
LIGHTHOUSE_FLAGS = ("min_groups", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms")
"""The LighthouseConfig fields `tenx lighthouse` takes as flags."""


def _prepare_arguments(dp: argparse.ArgumentParser) -> None:
    from tenx.data.prepare.pipeline import PrepareConfig

    add_config_arguments(dp, PrepareConfig, PREPARE_FLAGS, flags=PREPARE_FLAG_NAMES)
    dp.add_argument("--quiet", action="store_true", help="no progress bar")
    dp.add_argument(
        "--emit", choices=["slurm"], help="write OUT.sbatch, a Slurm job driving the datatrove-slurm engine"
    )


def _ladder_arguments(lp: argparse.ArgumentParser) -> None:
    from tenx.scaling.rungs import LadderConfig

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
    lp.add_argument("--nproc", type=int, default=8, help="with --emit: processes (GPUs) per node")
    lp.add_argument("--nodes", type=int, default=1, help="with --emit: nodes per run")


def _derisk_arguments(rp: argparse.ArgumentParser) -> None:
    from tenx.scaling.derisk import DeriskConfig

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
    rp.add_argument(
        "--out", required=True, help="output directory (ladder/, report.md, report.png, derisk.json)"
    )
    rp.add_argument("--dry-run", action="store_true", help="print the stack and its runs; train nothing")


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
    fp.add_argument("--json", help="report JSON path (default OUT/INPUT_fit_LAW.json)")
    fp.add_argument("--out", help="directory of the plot (default: next to the input)")
    fp.add_argument("--no-plot", action="store_true", help="skip the PNG")
    add_config_arguments(fp, FitConfig, FIT_FLAGS, show_defaults=True)
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


def cmd_predict(args: argparse.Namespace) -> None:
    """`tenx predict`: a run's whole predicted loss curve, from a ladder or from its own start."""
    from tenx.scaling.predict import run_predict

    print(
        run_predict(
            ladder_dir=args.ladder,
            config=args.config,
            overrides=args.set,
            run_dir=args.run,
            law=args.law,
            world_size=args.world_size,
            bootstrap=args.bootstrap,
            out=args.out,
            quantity=args.quantity,
        )["text"]
    )


def add_predict_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `tenx predict` on the CLI's subparsers."""
    about = "predict a run's whole loss curve with a band: from a ladder, or from the run's own start"
    from tenx.scaling.predict import add_arguments

    return command(subparsers, "predict", about, cmd_predict, add_arguments)


def add_fit_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `tenx fit` on the CLI's subparsers."""
    about = "fit a scaling law to finished runs and extrapolate, with bootstrap intervals"
    return command(subparsers, "fit", about, cmd_fit, _fit_arguments)


def _lighthouse_arguments(lp: argparse.ArgumentParser) -> None:
    from tenx.parallel.lighthouse import LighthouseConfig

    lp.add_argument(
        "--bind",
        required=True,
        metavar="ADDR:PORT",
        help="where to listen: 127.0.0.1:PORT for one machine, ADDR:PORT with this machine's address on "
        "the network the groups share otherwise (0.0.0.0:PORT listens on every interface; docs/security.md)",
    )
    add_config_arguments(lp, LighthouseConfig, LIGHTHOUSE_FLAGS, show_defaults=True)


def add_lighthouse_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `tenx lighthouse` on the CLI's subparsers."""
    about = "run torchft's lighthouse: the rendezvous of replica groups (parallel.replicas)"
    return command(subparsers, "lighthouse", about, cmd_lighthouse, _lighthouse_arguments)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = Parser(prog="tenx", description="Pre-train GPT-style language models, end to end.")
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="prepare corpora").add_subparsers(dest="data_command", required=True)
    about = "corpus -> tokenizer -> shards + manifest, split by document"
    command(data, "prepare", about, cmd_data_prepare, _prepare_arguments)
    ip = data.add_parser("index", help="hashed n-grams of the train split, for decontamination")
    ip.add_argument("data_dir", help="a prepared data directory")
    ip.add_argument("--n", type=int, default=13, help="n-gram length in tokens (default 13)")
    ip.set_defaults(func=cmd_data_index)

    tp = sub.add_parser("train", help="train a model from a TOML config")
    tp.add_argument(
        "--config", required=True, help="a .toml path or a shipped config name (configs/NAME.toml)"
    )
    add_set(tp, "override (repeatable)")
    tp.add_argument("--run-dir", help="run directory (default runs/CONFIG_NAME)")
    tp.add_argument("--resume", help="'auto' (newest checkpoint that verifies) or a checkpoint directory")
    tp.add_argument(
        "--supervise",
        action="store_true",
        help="run training as a child process and restart it (--resume auto) after a crash, hang or kill",
    )
    tp.add_argument(
        "--max-restarts", type=int, default=10, help="with --supervise: restarts before giving up"
    )
    tp.add_argument(
        "--same-failure-limit",
        type=int,
        default=3,
        help="with --supervise: give up when the same failure repeats this many times at the same step",
    )
    tp.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="with --supervise: seconds before restarting an attempt "
        "that made no progress (doubles each time, up to 60)",
    )
    tp.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=0.0,
        help="with --supervise: kill a child whose ledger has not grown for this many seconds (0: off; "
        "the in-process watchdog, [watchdog] timeout_s, is on by default)",
    )
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
    tp.add_argument(
        "--launcher",
        help="with --supervise: the command that runs `tenx` (default `python -m tenx`), e.g. "
        "'torchrun --nproc_per_node 2 -m tenx' to restart a whole multi-process job",
    )
    tp.set_defaults(func=cmd_train)

    stp = sub.add_parser("status", help="progress, newest verified checkpoint, goodput and events of a run")
    stp.add_argument("run_dir", help="run directory")
    stp.set_defaults(func=cmd_status)

    add_lighthouse_parser(sub)  # `tenx lighthouse --bind ADDR:PORT`: coordinates replica groups (torchft)
    add_fit_parser(sub)  # `tenx fit`: scaling-law fits with bootstrap intervals
    add_predict_parser(sub)  # `tenx predict`: a whole loss curve with a band
    add_dashboard_parser(sub)  # `tenx dashboard RUN_DIR...`: a live page of runs (tenx/monitor/dashboard/)
    add_report_parser(sub)  # `tenx report RUN_DIR... -o FILE`: the same page as one offline file
    add_incidents_parser(sub)  # `tenx incidents RUN_DIR...`: every anomaly of runs (tenx/triage/)
    add_replay_parser(sub)
    add_plan_parser(sub)  # `tenx plan --config CFG --cluster C`, `tenx plan shapes`, `tenx plan failures`
    add_triage_parser(sub)
    add_compress_parsers(sub)  # `tenx compress` / `tenx decompress` (tenx/compress/codec.py)

    add_eval_parser(sub)  # `tenx eval RUN... [--split X] [--decontaminate] [--breakdown]` (tenx/eval/cli.py)

    sp = sub.add_parser("sample", help="print a continuation of a prompt")
    sp.add_argument("target", help="run directory or checkpoint directory")
    sp.add_argument("--prompt", default="", help="text to continue")
    sp.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate, >= 0 (default 200)")
    sp.add_argument(
        "--temperature", type=float, default=0.8, help="sampling temperature, >= 0; 0 is greedy (default 0.8)"
    )
    sp.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    sp.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same text)")
    sp.add_argument(
        "--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N"
    )
    sp.set_defaults(func=cmd_sample)
    xp = sub.add_parser(
        "export", help="write a run's model and tokenizer as a Hugging Face transformers model"
    )
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
    xp.set_defaults(func=cmd_export)

    command(sub, "ladder", "plan and run a scaling ladder from FLOP budgets", cmd_ladder, _ladder_arguments)
    about = "add changes one at a time; check each gain persists across budgets"
    command(sub, "derisk", about, cmd_derisk, _derisk_arguments)

    qp = sub.add_parser("quickstart", help="prepare the stdlib corpus, train, evaluate against xz")
    qp.add_argument("--out", default="runs/quickstart", help="output directory")
    qp.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="wall-time budget: the step count is fitted to it from a measured training speed",
    )
    qp.add_argument(
        "--steps", type=int, default=None, help="train exactly this many steps instead of fitting the budget"
    )
    qp.set_defaults(func=cmd_quickstart)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tenx` command."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    try:
        args.func(args)
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


if __name__ == "__main__":
    sys.exit(main())
