"""`tenx eval` and `tenx sample`: their flags and what they run; eval's printout and the comparison of
several runs on the same data."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from tenx.data.codebase import CODEBASE_SKIP_REASONS, DEFAULT_MAX_FILE_BYTES
from tenx.errors import TenxError
from tenx.utils.cli import above, at_least, subcommand
from tenx.utils.cpus import add_threads_argument


def _line(name: str, r: dict[str, Any]) -> str:
    if not r.get("tokens"):
        return f"{name:>12}: empty"
    return (
        f"{name:>12}: {r['bits_per_byte']:.4f} bits/byte | loss {r['loss']:.4f} nats/token | "
        f"ppl {r['perplexity']:.2f} | {r['tokens']:,} tokens | {r['bytes']:,} bytes"
    )


def format_eval(report: dict[str, Any]) -> str:
    """One run's figures: each dataset, its contamination and clean part, its breakdowns."""
    lines = []
    for name, r in report["datasets"].items():
        lines.append(_line(name, r))
        a = r.get("adaptive")
        if a:
            lines.append(
                f"{'':>12}  adaptive (learning as it reads, {a['settings']['params']} parameters, lr "
                f"{a['settings']['lr']:g}, {a['settings']['steps']} step(s) a chunk): "
                f"{a['adaptive_bits_per_byte']:.4f} bits/byte against {a['static_bits_per_byte']:.4f} static; "
                f"xz -9e {a['xz_bits_per_byte']:.4f} concatenated, {a['xz_per_file_bits_per_byte']:.4f} file by "
                f"file ({a['seconds']:.0f} s)"
            )
        c = r.get("contamination")
        if c:
            lines.append(
                f"{'':>12}  contamination ({c['n']}-gram, threshold {c['threshold']:g}): "
                f"{c['contaminated_documents']} of {c['documents']} documents "
                f"({100 * c['contaminated_fraction']:.1f}%), {c['contaminated_bytes']:,} bytes "
                f"({100 * c['contaminated_bytes_fraction']:.1f}%); {100 * c['shared_ngram_fraction']:.2f}% of "
                "all n-grams occur in training"
            )
            clean = r["clean"]
            if clean.get("tokens"):
                lines.append(
                    f"{'':>12}  clean part: {clean['bits_per_byte']:.4f} bits/byte over {clean['documents']} "
                    f"documents, {clean['bytes']:,} bytes"
                )
        files = r.get("files")
        if files:
            skipped = ", ".join(f"{n} {CODEBASE_SKIP_REASONS[k]}" for k, n in files["skipped"].items())
            replaced = files["decoded_with_replacement"]
            lines.append(
                f"{'':>12}  files: {files['scored']} scored"
                + (f" ({replaced} not valid UTF-8, bad bytes replaced)" if replaced else "")
                + f"; skipped: {skipped or 'none'}"
            )
        for key, title in (
            ("by_language", "language"),
            ("by_directory", "directory"),
            ("by_file_type", "file type"),
        ):
            if r.get(key) and not (key == "by_file_type" and files):  # the languages say it for a directory
                lines.append(f"{'':>12}  by {title}:")
                for group, g in r[key].items():
                    bpb = f"{g['bits_per_byte']:.4f}" if g.get("bits_per_byte") is not None else "-"
                    lines.append(
                        f"{'':>14}{group:<28} {bpb:>8} bits/byte  {g['documents']:>5} docs  {g['bytes']:>10,} bytes"
                    )
    return "\n".join(lines)


def format_comparison(reports: dict[str, dict[str, Any]]) -> str:
    """Runs side by side on the same datasets (bits per byte; the clean part's where decontaminated)."""
    names = list(next(iter(reports.values()))["datasets"])
    header = f"{'run':<32}" + "".join(f"{n[-24:]:>26}" for n in names)
    lines = [header, "-" * len(header)]
    for run, report in reports.items():
        cells = []
        for n in names:
            r = report["datasets"][n]
            value = (r.get("clean") or r).get("bits_per_byte")
            cells.append(f"{value:>26.4f}" if value is not None else f"{'-':>26}")
        lines.append(f"{run[-32:]:<32}" + "".join(cells))
    best = {
        n: min(
            reports,
            key=lambda k: (
                (reports[k]["datasets"][n].get("clean") or reports[k]["datasets"][n]).get("bits_per_byte")
                or float("inf")
            ),
        )
        for n in names
    }
    lines.append(
        "lowest bits per byte (clean part where decontaminated): "
        + "; ".join(f"{n}: {b}" for n, b in best.items())
    )
    return "\n".join(lines)


def cmd_eval(args: argparse.Namespace) -> None:
    """Evaluate each run on each dataset; print each, then a comparison when there are several runs."""
    from tenx.eval.adaptive import AdaptConfig
    from tenx.eval.evaluate import evaluate
    from tenx.utils.cpus import set_torch_threads

    if args.out is not None and len(args.targets) > 1:
        raise TenxError("--out names one eval.json: give it with one run (each run keeps its own eval.json)")
    if args.out is not None:
        from tenx.utils.io import check_output_file

        check_output_file(args.out, force=args.force, flag="--out")
    set_torch_threads(args.threads)
    reports = {}
    for target in args.targets:
        report = evaluate(
            target,
            args.split,
            args.out,
            args.batch_size,
            args.device,
            stride=args.stride,
            precision=args.precision,
            decontaminate=args.decontaminate,
            breakdown=args.breakdown,
            ngram=args.ngram,
            threshold=args.threshold,
            include=args.include,
            exclude=args.exclude,
            max_file_bytes=args.max_file_bytes,
            adapt=AdaptConfig(args.adapt_lr, args.adapt_steps, params=args.adapt_params)
            if args.adapt
            else None,
        )
        if len(args.targets) > 1:
            print(f"{target}:")
        print(format_eval(report))
        if report.get("write_error"):
            raise TenxError(
                f"{report['write_error']}; the results above were computed but not saved (use --out)"
            )
        print(f"wrote {report['path']}")
        reports[str(target)] = report
    if len(reports) > 1:
        print()
        print(format_comparison(reports))


def _fraction(text: str) -> float:
    """An argparse `type=` for a fraction: a number in [0, 1] (nan, inf and anything else: exit status 2)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:  # False for nan
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {text!r}")
    return value


def _dataset(text: str) -> str:
    """An argparse `type=` for --split: a non-empty name or path (an empty one would be the current
    directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a split or a file or directory of text, got {text!r}")
    try:
        os.stat(os.path.expanduser(text))
    except (FileNotFoundError, NotADirectoryError):  # a split's name, hf:NAME, or a path said missing later
        pass
    except (OSError, ValueError) as e:  # a name too long for the file system, an embedded NUL byte
        why = getattr(e, "strerror", None) or e
        raise argparse.ArgumentTypeError(f"{text!r} cannot be used as a path ({why})") from None
    return text


_fraction.__name__ = "a fraction in [0, 1]"
_dataset.__name__ = "a split name or path"


def _add_device(p: argparse.ArgumentParser) -> None:
    """`--device`, the device eval and sample load the model on (load_model resolves it)."""
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N")


def _eval_arguments(ep: argparse.ArgumentParser) -> None:
    ep.add_argument(
        "targets", nargs="+", metavar="TARGET", help="run or checkpoint directories (several: a comparison)"
    )
    ep.add_argument(
        "--split",
        action="append",
        type=_dataset,
        help="heldout | val | train | PATH (repeatable; default heldout)",
    )
    ep.add_argument(
        "--out",
        help="where to write eval.json (default: the run directory's eval.json, rewritten each time)",
    )
    ep.add_argument("--force", action="store_true", help="let --out replace an existing file")
    ep.add_argument("--batch-size", type=at_least(int, 1), default=8, help="sequences per forward pass")
    _add_device(ep)
    ep.add_argument(
        "--stride",
        type=at_least(int, 1),
        default=None,
        help="tokens each scoring window moves (default seq_len: no overlap; smaller gives more context)",
    )
    ep.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="auto: bf16 where this device runs it fast (measured on CPUs), else fp32",
    )
    ep.add_argument(
        "--decontaminate",
        action="store_true",
        help="report the documents that share n-grams with the training split and score the clean part apart",
    )
    ep.add_argument(
        "--ngram",
        type=at_least(int, 1),
        default=None,
        help="n-gram length of --decontaminate, in tokens (default: the data's, as prepared: 13 for BPE, "
        "50 for bytes)",
    )
    ep.add_argument(
        "--threshold",
        type=_fraction,
        default=None,
        help="a document is contaminated when more than this fraction of its n-grams occur in training "
        "(default 0.5: tenx.data.ngrams.DEFAULT_CONTAMINATION_THRESHOLD; see docs/eval.md)",
    )
    ep.add_argument(
        "--adapt",
        action="store_true",
        help="also the adaptive (prequential) figure: each chunk scored, then the model trains on it "
        "(tenx/eval/adaptive.py; a copy adapts, the run is untouched)",
    )
    ep.add_argument(
        "--adapt-lr", type=above(float, 0, 1), default=3e-4, help="with --adapt: AdamW learning rate"
    )
    ep.add_argument(
        "--adapt-steps", type=at_least(int, 1, 100), default=1, help="with --adapt: optimizer steps per chunk"
    )
    ep.add_argument(
        "--adapt-params",
        choices=("all", "norms", "head", "last"),
        default="all",
        help="with --adapt: what adapts (last: the last block, final norm and output layer)",
    )
    ep.add_argument(
        "--breakdown",
        action="store_true",
        help="figures per directory and per file type (always on for a directory --split)",
    )
    ep.add_argument(
        "--include",
        action="append",
        metavar="GLOB",
        help="a directory --split scores only the files matching one of these globs (repeatable; '**' "
        "spans directories; a glob without '/' matches a file name at any depth)",
    )
    ep.add_argument(
        "--exclude",
        action="append",
        metavar="GLOB",
        help="a directory --split leaves out the files and directories matching one of these (repeatable)",
    )
    ep.add_argument(
        "--max-file-bytes",
        type=at_least(int, 0),
        default=DEFAULT_MAX_FILE_BYTES,
        help=f"a directory --split skips larger files (default {DEFAULT_MAX_FILE_BYTES:,}; 0: no limit)",
    )
    add_threads_argument(ep)


def cmd_sample(args: argparse.Namespace) -> None:
    """Print a continuation of the prompt by a run's model."""
    from tenx.checkpoint.models import load_model
    from tenx.data.tokenizer import load_tokenizer
    from tenx.eval.sample import check_sampling, generate
    from tenx.utils.cpus import set_torch_threads

    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.seed)  # before the model is loaded
    set_torch_threads(args.threads)
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


def _sample_arguments(sp: argparse.ArgumentParser) -> None:
    from tenx.eval.sample import MAX_NEW_TOKENS

    sp.add_argument("target", help="run directory or checkpoint directory")
    sp.add_argument("--prompt", default="", help="text to continue")
    sp.add_argument(
        "--max-new-tokens",
        type=at_least(int, 0),
        default=200,
        help=f"tokens to generate, 0 to {MAX_NEW_TOKENS:,} (default 200)",
    )
    sp.add_argument(
        "--temperature",
        type=at_least(float, 0),
        default=0.8,
        help="sampling temperature, a finite number >= 0; 0 is greedy (default 0.8)",
    )
    sp.add_argument(
        "--top-k", type=at_least(int, 0), default=50, help="sample among the k likeliest tokens (0: all)"
    )
    sp.add_argument(
        "--seed",
        type=at_least(int, 0),
        default=0,
        help="sampling seed, >= 0 (the same seed gives the same text)",
    )
    _add_device(sp)
    add_threads_argument(sp)


def register(subparsers: Any) -> None:
    """Register `tenx eval` and `tenx sample` on the CLI's subparsers."""
    subcommand(subparsers, "eval", "bits per byte on held-out data", cmd_eval, _eval_arguments)
    subcommand(subparsers, "sample", "print a continuation of a prompt", cmd_sample, _sample_arguments)
