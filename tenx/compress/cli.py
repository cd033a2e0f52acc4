"""The compression subcommands (`tenx compress`, `tenx decompress`): their flags and what they run."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tenx.compress.container import MAX_EVERY, CodecAdaptation
from tenx.utils.cli import above, at_least, subcommand
from tenx.utils.cpus import add_threads_argument

SUFFIX = ".tenx"


def cmd_compress(args: argparse.Namespace) -> None:
    """Compress files with a run's model; print bits per byte and speed."""
    from tenx.compress.files import compress_file
    from tenx.compress.model import load_codec
    from tenx.utils.cpus import choose_threads

    _one_output(args)
    threads = choose_threads(args.threads)
    adapt = CodecAdaptation(args.adapt_lr, args.adapt_every) if args.adapt else None
    codec = load_codec(args.run_dir, args.device) if len(args.files) > 1 else args.run_dir
    for file in args.files:
        report = compress_file(
            codec,
            file,
            args.out or file + SUFFIX,
            args.force,
            threads=threads,
            device=args.device,
            adapt=adapt,
        )
        _print(report, "compressed", args.json)


def cmd_decompress(args: argparse.Namespace) -> None:
    """Decompress `.tenx` files with the run's model they were compressed with (several: together)."""
    from tenx.compress.files import decompress_file, decompress_files
    from tenx.errors import TenxError

    _one_output(args)
    outs = []
    for file in args.files:
        if args.out is None and (not file.endswith(SUFFIX) or file == SUFFIX):
            raise TenxError(f"{file} does not end in {SUFFIX}: name the output with -o FILE")
        outs.append(args.out or file[: -len(SUFFIX)])
    if len(args.files) == 1:
        report = decompress_file(
            args.run_dir, args.files[0], outs[0], args.force, args.max_bytes, args.device
        )
        _print(report, "decompressed", args.json)
        return
    pairs = list(zip(args.files, outs))
    total = decompress_files(args.run_dir, pairs, args.force, args.max_bytes, args.device)
    if args.json:
        print(json.dumps(total, indent=2))
    else:
        for report in total["files"]:
            _print(report, "decompressed", False)
        speed = "n/a" if total["kb_per_s"] is None else f"{total['kb_per_s']:.1f}"
        print(
            f"{len(total['files'])} of {len(pairs)} files decompressed together: {total['bytes']:,} bytes, "
            f"{speed} KB/s ({total['seconds']:.2f} s coding)"
        )
    if total["errors"]:
        raise TenxError("; ".join(total["errors"]))


def _one_output(args: argparse.Namespace) -> None:
    from tenx.errors import TenxError

    if args.out is not None and len(args.files) > 1:
        raise TenxError(f"-o names one output but {len(args.files)} files were given: leave -o out")


def _print(report: dict[str, Any], verb: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    bpb = "n/a (empty input)" if report["bits_per_byte"] is None else f"{report['bits_per_byte']:.3f}"
    adapt = report["adapt"]
    learned = "" if adapt is None else f", output layer learning (lr {adapt['lr']:g}, every {adapt['every']})"
    speed = "n/a" if report["kb_per_s"] is None else f"{report['kb_per_s']:.1f}"
    print(
        f"{verb} {report['src']} -> {report['dst']}: {report['bytes']:,} bytes <-> "
        f"{report['compressed_bytes']:,} compressed, {bpb} bits per byte, {speed} KB/s "
        f"({report['seconds']:.2f} s coding, {report['load_seconds']:.2f} s loading the model{learned})"
    )


def _common(p: argparse.ArgumentParser, file_help: str) -> None:
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="run directory (newest verified checkpoint), checkpoint, or an ensemble's directory (its members' "
        "mixture: format version 5)",
    )
    p.add_argument("files", metavar="FILE", nargs="+", help=file_help)
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite the output if it exists (never FILE itself; -o must name a file, not a directory)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def _compress_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, "the files to compress (any bytes), each into its own FILE.tenx")
    p.add_argument("-o", "--out", help=f"the compressed file, with one FILE (default FILE{SUFFIX})")
    add_threads_argument(
        p,
        "torch threads while coding, recorded in the file: decompression uses as many, at most its usable "
        "CPUs (default 1, the most portable: the logits differ in their last bits between thread counts; "
        "auto: the usable CPUs less those other programs keep busy)",
        default="1",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda; the file decodes on either")
    p.add_argument(
        "--adapt",
        action="store_true",
        help="the output layer learns as it codes (Adam on the tokens just coded, repeated bit for bit by "
        "the decoder): smaller files over ~100 KB, ~1.3x the time",
    )
    p.add_argument(
        "--adapt-lr",
        type=above(float, 0.0, maximum=1.0),
        default=CodecAdaptation.lr,
        help=f"with --adapt: Adam's learning rate (default {CodecAdaptation.lr:g})",
    )
    p.add_argument(
        "--adapt-every",
        type=at_least(int, 1, maximum=MAX_EVERY),
        default=CodecAdaptation.every,
        help=f"with --adapt: positions of the chunks coded side by side between updates (default "
        f"{CodecAdaptation.every})",
    )


def _decompress_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, f"the {SUFFIX} files to decompress (several: decoded together, faster for small files)")
    p.add_argument(
        "-o", "--out", help=f"the decompressed file, with one FILE (default FILE without {SUFFIX})"
    )
    p.add_argument(
        "--max-bytes",
        type=at_least(int, 0),
        default=1 << 30,
        help="refuse a file that claims a larger original (default 1 GiB: a forged header cannot make "
        "decompression allocate without bound)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda: a file decodes on any device, whatever it was compressed on (a file of "
        "tenx before its format version 2: only on the kind of device that compressed it)",
    )


def register(subparsers: Any) -> None:
    """Register `tenx compress` and `tenx decompress` on the CLI's subparsers."""
    about = "compress a file losslessly with a run's model (range coding of its next-token probabilities)"
    subcommand(subparsers, "compress", about, cmd_compress, _compress_arguments)
    about = "decompress a .tenx file with the run's model that compressed it (refuses any other model)"
    subcommand(subparsers, "decompress", about, cmd_decompress, _decompress_arguments)
