"""The `tenx` command: a thin layer over the Python API. Errors print one clear line and exit 2."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from tenx.errors import TenxError


def cmd_data_prepare(args: argparse.Namespace) -> None:
    from tenx.data.prepare import PrepareConfig, format_summary, prepare

    cfg = PrepareConfig(
        source=args.source,
        out=args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_ratio=args.val_ratio,
        heldout_ratio=args.heldout_ratio,
        seed=args.seed,
        patterns=args.pattern or None,
        text_field=args.text_field,
        column=args.column,
        shard_tokens=args.shard_tokens,
        max_documents=args.max_documents,
    )
    manifest = prepare(cfg, progress=not args.quiet)
    print(format_summary(manifest, args.out))


def cmd_train(args: argparse.Namespace) -> None:
    from tenx.monitor.goodput import compute_goodput, format_goodput
    from tenx.train.config import load_run_config, resolve_config_path

    config_path = resolve_config_path(args.config)
    overrides = [*args.set, *([f"faults.inject={json.dumps(args.fault)}"] if args.fault else [])]
    if args.fault_seed is not None:
        overrides.append(f"faults.seed={args.fault_seed}")
    cfg = load_run_config(config_path, overrides)  # checked here, before any child starts
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / config_path.stem
    if args.supervise:
        from tenx.launch.supervise import child_environment, format_report, supervise

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
        print(format_report(report))
        print(format_goodput(compute_goodput(run_dir)))
        if not report.finished:
            raise TenxError(f"supervised run in {run_dir} did not finish: {report.gave_up}")
        return
    from tenx.train.run import train

    trainer, metrics = train(cfg, run_dir, resume=args.resume)
    if metrics:
        print(json.dumps({k: metrics.get(k) for k in ("step", "tokens", "loss", "val_loss")}))
    else:
        print(f"already trained to step {trainer.step} of {trainer.total_steps}; nothing to do")
    print(format_goodput(compute_goodput(run_dir)))
    print(f"run directory: {run_dir}  (metrics: {run_dir / 'metrics.jsonl'}, status: tenx status {run_dir})")


def cmd_status(args: argparse.Namespace) -> None:
    from tenx.monitor.goodput import format_status

    print(format_status(args.run_dir))


def cmd_eval(args: argparse.Namespace) -> None:
    from tenx.eval.run import evaluate

    report = evaluate(
        args.target,
        args.split,
        args.out,
        args.batch_size,
        args.device,
        stride=args.stride,
        precision=args.precision,
    )
    for name, r in report["datasets"].items():
        if not r["tokens"]:
            print(f"{name:>12}: empty")
            continue
        print(
            f"{name:>12}: {r['bits_per_byte']:.4f} bits/byte | loss {r['loss']:.4f} nats/token | "
            f"ppl {r['perplexity']:.2f} | {r['tokens']:,} tokens | {r['bytes']:,} bytes"
        )
    print(f"wrote {report['path']}")


def cmd_sample(args: argparse.Namespace) -> None:
    from tenx.data.tokenizer import load_tokenizer
    from tenx.eval.load import load_model
    from tenx.eval.sample import generate

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


def cmd_quickstart(args: argparse.Namespace) -> None:
    from tenx.quickstart import quickstart

    quickstart(args.out, steps=args.steps)


def cmd_ladder(args: argparse.Namespace) -> None:
    from tenx.scaling.ladder import LadderConfig, load_base, parse_budgets, run_ladder

    lc = LadderConfig(
        grid=args.grid,
        tokens_per_param=args.tokens_per_param,
        sizes=args.sizes,
        unique_tokens=args.unique_tokens,
        seeds=args.seeds,
        eval_bytes=args.eval_bytes,
        min_depth=args.min_depth,
        max_depth=args.max_depth,
    )
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="tenx", description="Pre-train GPT-style language models, end to end.")
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="prepare corpora").add_subparsers(dest="data_command", required=True)
    dp = data.add_parser("prepare", help="corpus -> tokenizer -> shards + manifest, split by document")
    dp.add_argument(
        "--source",
        required=True,
        help="DIR | FILE.txt | FILE.jsonl | FILE.parquet | hf:NAME[:SPLIT] | stdlib",
    )
    dp.add_argument("--out", required=True, help="output data directory")
    dp.add_argument("--tokenizer", choices=["bpe", "bytes"], default="bpe")
    dp.add_argument("--vocab-size", type=int, default=8192)
    dp.add_argument("--val-ratio", type=float, default=0.02)
    dp.add_argument("--heldout-ratio", type=float, default=0.05)
    dp.add_argument("--seed", type=int, default=0, help="salt of the document-hash split")
    dp.add_argument(
        "--pattern", action="append", help="glob for directory sources (repeatable), e.g. '**/*.py'"
    )
    dp.add_argument("--text-field", default="text", help="JSONL field holding the text")
    dp.add_argument("--column", default="text", help="parquet / hf column holding the text")
    dp.add_argument("--shard-tokens", type=int, default=1 << 26, help="maximum tokens per shard file")
    dp.add_argument("--max-documents", type=int, default=None, help="stop after this many documents")
    dp.add_argument("--quiet", action="store_true", help="no progress bar")
    dp.set_defaults(func=cmd_data_prepare)

    tp = sub.add_parser("train", help="train a model from a TOML config")
    tp.add_argument(
        "--config", required=True, help="a .toml path or a shipped config name (configs/NAME.toml)"
    )
    tp.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override (repeatable)"
    )
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
        "corrupt-shard, slow; see docs/fault-tolerance.md",
    )
    tp.add_argument("--fault-seed", type=int, default=None, help="seed of random (p=P) faults")
    tp.add_argument(
        "--launcher",
        help="with --supervise: the command that runs `tenx` (default `python -m tenx`), e.g. "
        "'torchrun --nproc_per_node 2 -m tenx' to restart a whole multi-process job",
    )
    tp.set_defaults(func=cmd_train)

    stp = sub.add_parser("status", help="progress, newest verified checkpoint, goodput and events of a run")
    stp.add_argument("run_dir", help="run directory")
    stp.set_defaults(func=cmd_status)

    from tenx.parallel.lighthouse import add_lighthouse_parser

    add_lighthouse_parser(sub)  # `tenx lighthouse --bind ADDR:PORT`: coordinates replica groups (torchft)
    from tenx.scaling.fit import add_fit_parser

    add_fit_parser(sub)  # `tenx fit`: scaling-law fits with bootstrap intervals

    ep = sub.add_parser("eval", help="bits per byte on held-out data")
    ep.add_argument("target", help="run directory or checkpoint directory")
    ep.add_argument(
        "--split", action="append", help="heldout | val | train | PATH (repeatable; default heldout)"
    )
    ep.add_argument("--out", help="where to write eval.json (default: the run directory)")
    ep.add_argument("--batch-size", type=int, default=8)
    ep.add_argument("--device", default="auto")
    ep.add_argument(
        "--stride",
        type=int,
        default=None,
        help="tokens each scoring window moves (default seq_len: no overlap; smaller gives more context)",
    )
    ep.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    ep.set_defaults(func=cmd_eval)

    sp = sub.add_parser("sample", help="print a continuation of a prompt")
    sp.add_argument("target", help="run directory or checkpoint directory")
    sp.add_argument("--prompt", default="", help="text to continue")
    sp.add_argument("--max-new-tokens", type=int, default=200)
    sp.add_argument("--temperature", type=float, default=0.8)
    sp.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--device", default="auto")
    sp.set_defaults(func=cmd_sample)

    lp = sub.add_parser("ladder", help="plan and run a scaling ladder from FLOP budgets")
    lp.add_argument("--config", default="ladder", help="base config (.toml path or shipped name)")
    lp.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override the base config"
    )
    lp.add_argument(
        "--budgets", help="training FLOP budgets, e.g. 1e13,3e13,1e14 (default: a 30x CPU ladder)"
    )
    lp.add_argument("--grid", choices=["isoflop", "ratio"], default="isoflop")
    lp.add_argument("--tokens-per-param", type=float, default=20.0, help="the D/N ratio the grid centres on")
    lp.add_argument("--sizes", type=int, default=3, help="isoflop: model sizes per budget")
    lp.add_argument("--min-depth", type=int, default=1)
    lp.add_argument("--max-depth", type=int, default=32)
    lp.add_argument(
        "--unique-tokens", type=int, default=None, help="cap distinct training tokens (repeats data)"
    )
    lp.add_argument("--seeds", type=int, default=1, help="seeds per run")
    lp.add_argument("--eval-bytes", type=int, default=262144, help="bytes scored per split (0: whole split)")
    lp.add_argument("--out", required=True, help="ladder directory (runs/, results.jsonl, plan.json)")
    lp.add_argument("--dry-run", action="store_true", help="print the plan and estimated time; train nothing")
    lp.add_argument(
        "--emit", choices=["torchrun", "slurm"], help="write cluster launch scripts; train nothing"
    )
    lp.add_argument("--nproc", type=int, default=8, help="with --emit: processes (GPUs) per node")
    lp.add_argument("--nodes", type=int, default=1, help="with --emit: nodes per run")
    lp.set_defaults(func=cmd_ladder)

    rp = sub.add_parser("derisk", help="add changes one at a time; check each gain persists across budgets")
    rp.add_argument("--config", help="a derisk TOML file (e.g. configs/derisk/gpt2_to_llama.toml)")
    rp.add_argument("--base", help="base run config (.toml or shipped name); overrides the file's")
    rp.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override the base config"
    )
    rp.add_argument(
        "--change",
        action="append",
        default=[],
        metavar="NAME:SECTION.KEY=VALUE[,...]",
        help="a change (repeatable, stacked in the given order); replaces the file's changes",
    )
    rp.add_argument("--budgets", help="training FLOP budgets, e.g. 1e12,4e12,1.6e13")
    rp.add_argument("--seeds", type=int, default=None, help="seeds at the smallest budget")
    rp.add_argument("--target", type=float, default=None, help="budget to extrapolate the multipliers to")
    rp.add_argument(
        "--out", required=True, help="output directory (ladder/, report.md, report.png, derisk.json)"
    )
    rp.add_argument("--dry-run", action="store_true", help="print the stack and its runs; train nothing")
    rp.set_defaults(func=cmd_derisk)

    qp = sub.add_parser("quickstart", help="prepare the stdlib corpus, train, evaluate against xz")
    qp.add_argument("--out", default="runs/quickstart", help="output directory")
    qp.add_argument("--steps", type=int, default=None, help="override the quickstart config's steps")
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
    except KeyboardInterrupt:
        print("tenx: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
