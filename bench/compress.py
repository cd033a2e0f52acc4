"""The model as a file compressor: `tenx compress` against xz, zstd and brotli on a run's held-out documents.

Each held-out document is compressed on its own, file by file, by each compressor: tenx (range coding with
the run's model, tenx/compress/codec.py), xz -9e (liblzma preset 9 | EXTREME, .xz container), zstd -19 and
brotli quality 11. A document's bytes are rebuilt from the prepared held-out split: its tokens up to the
end-of-document token, decoded by the run's tokenizer and encoded as UTF-8 (the cleaned text the model was
evaluated on; their total is checked against the split's byte count). Bits per byte is 8 x the compressed
files' total size, headers included, over the documents' total size. Every round trip is verified, tenx's
by decompressing with the model (as slow as compressing: the decoder runs the model once per token).
Speed is input KB (1000 bytes) per second of coding, model loading excluded; decompression is also timed
for every file at once (`decompress_many`, the baseline: one file at a time). Printed: a line per file,
the totals, and one JSON line last.

With `--float32-baseline`, each file is also coded in format 1 (float32 kernels, the speed the portable
format is measured against). With `--adapt`, each file is also coded by `tenx compress --adapt` (the output layer learning as it
codes; its round trip verified too), against plain tenx as the baseline. `--files` codes the named files
(every file under a directory) instead of the held-out documents.

    python bench/compress.py [--run runs/quickstart] [--max-files N] [--threads 1] [--device cpu]
                             [--adapt] [--float32-baseline] [--files PATH ...]
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
import time
from pathlib import Path
from typing import Any

import brotli
import numpy as np
import zstandard

from tenx import rundir
from tenx.compress.codec import CodecModel, compress_bytes, decompress_bytes, decompress_many, load_codec
from tenx.compress.container import CodecAdaptation
from tenx.data.loader import TokenStream
from tenx.data.manifest import read_manifest

BASELINES = {
    "xz": (
        lambda d: lzma.compress(d, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME),
        lzma.decompress,
    ),
    "zstd": (
        lambda d: zstandard.ZstdCompressor(level=19).compress(d),
        lambda b: zstandard.ZstdDecompressor().decompress(b),
    ),
    "brotli": (lambda d: brotli.compress(d, quality=11), brotli.decompress),
}


def find_run(path: Path) -> Path | None:
    """The run directory at `path`, or inside a `tenx quickstart` output (its `run/`); None if neither."""
    for candidate in (path, path / "run"):
        if rundir.RunDir(candidate).checkpoints.is_dir():
            return candidate
    return None


def heldout_documents(codec: CodecModel) -> list[tuple[str, bytes]]:
    """(name, bytes) of each held-out document, rebuilt from the prepared split (see the docstring)."""
    data_dir = codec.data_dir
    stream = TokenStream(data_dir, "heldout", verify=True)
    tokens = stream.read(0, len(stream)) if len(stream) else np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(tokens == codec.tokenizer.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    docs = [codec.tokenizer.decode(tokens[s:e]).encode("utf-8") for s, e in zip(starts, ends)]
    split = read_manifest(data_dir)["splits"]["heldout"]
    if sum(map(len, docs)) != split["bytes"]:
        sys.exit(
            f"held-out documents rebuild to {sum(map(len, docs))} bytes, the manifest says {split['bytes']}"
        )
    names = split.get("documents") or []
    if len(names) != len(docs):
        names = [f"document {i}" for i in range(len(docs))]
    return list(zip(names, docs))


def named_files(paths: list[str]) -> list[tuple[str, bytes]]:
    """(name, bytes) of each named file, and of every regular file under each named directory (sorted)."""
    found: list[Path] = []
    for path in map(Path, paths):
        found += sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [(str(p), p.read_bytes()) for p in found]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", default="runs/quickstart", help="run directory or quickstart output")
    parser.add_argument("--max-files", type=int, default=None, help="only the first N held-out documents")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while coding (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--adapt", action="store_true", help="also code each file with --adapt")
    parser.add_argument(
        "--float32-baseline",
        action="store_true",
        help="also time format 1 (float32 kernels, decodable only where they run) on each file: the speed "
        "baseline of the portable codec",
    )
    parser.add_argument("--files", nargs="+", help="code these files (directories: every file under them)")
    args = parser.parse_args()
    run = find_run(Path(args.run))
    if run is None:
        sys.exit(f"no run at {args.run}: make one with `tenx quickstart` (about 10 minutes on a CPU)")
    codec = load_codec(run, args.device)
    docs = (named_files(args.files) if args.files else heldout_documents(codec))[: args.max_files]
    print(
        f"{run}: checkpoint {codec.checkpoint.name}, tokenizer {codec.tokenizer.kind}, {len(docs)} documents"
    )
    sizes: dict[str, int] = {"tenx": 0, **({"adapt": 0} if args.adapt else {}), **dict.fromkeys(BASELINES, 0)}
    seconds = {"compress": 0.0, "decompress": 0.0, "adapt": 0.0, "float32": 0.0, "float32_decompress": 0.0}
    roundtrip_ok = True
    blobs = []
    for name, doc in docs:
        started = time.perf_counter()
        blob = compress_bytes(codec, doc, threads=args.threads)
        coded = time.perf_counter()
        back = decompress_bytes(codec, blob)
        blobs.append(blob)
        seconds["compress"] += coded - started
        seconds["decompress"] += time.perf_counter() - coded
        roundtrip_ok &= back == doc
        row = {"tenx": len(blob)}
        if args.float32_baseline:
            started = time.perf_counter()
            old = compress_bytes(codec, doc, threads=args.threads, version=1)
            coded = time.perf_counter()
            roundtrip_ok &= decompress_bytes(codec, old) == doc
            seconds["float32"] += coded - started
            seconds["float32_decompress"] += time.perf_counter() - coded
        if args.adapt:
            started = time.perf_counter()
            adaptive = compress_bytes(codec, doc, threads=args.threads, adapt=CodecAdaptation())
            seconds["adapt"] += time.perf_counter() - started
            roundtrip_ok &= decompress_bytes(codec, adaptive) == doc
            row["adapt"] = len(adaptive)
        for tool, (pack, unpack) in BASELINES.items():
            packed = pack(doc)
            roundtrip_ok &= unpack(packed) == doc
            row[tool] = len(packed)
        for tool, size in row.items():
            sizes[tool] += size
        bpbs = "  ".join(f"{tool} {8 * size / max(1, len(doc)):.3f}" for tool, size in row.items())
        print(f"  {name:60.60s} {len(doc):9,d} B  {bpbs}", flush=True)
    started = time.perf_counter()
    together = decompress_many(codec, blobs)
    seconds["together"] = time.perf_counter() - started
    roundtrip_ok &= together == [doc for _, doc in docs]
    total = sum(len(d) for _, d in docs)
    bpb = {tool: 8 * size / total if total else None for tool, size in sizes.items()}
    result: dict[str, Any] = {f"{tool}_bpb": value for tool, value in bpb.items()}
    result.update(
        ratio_vs_xz=bpb["tenx"] / bpb["xz"] if total else None,
        kb_per_s=total / 1000 / seconds["compress"] if seconds["compress"] else None,
        decompress_kb_per_s=total / 1000 / seconds["decompress"] if seconds["decompress"] else None,
        decompress_together_kb_per_s=total / 1000 / seconds["together"] if seconds["together"] else None,
        adapt_vs_plain=bpb["adapt"] / bpb["tenx"] if args.adapt and total else None,
        float32_kb_per_s=total / 1000 / seconds["float32"] if seconds["float32"] else None,
        float32_decompress_kb_per_s=total / 1000 / seconds["float32_decompress"]
        if seconds["float32_decompress"]
        else None,
        adapt_kb_per_s=total / 1000 / seconds["adapt"] if seconds["adapt"] else None,
        roundtrip_ok=roundtrip_ok,
        files=len(docs),
        bytes=total,
        run=str(run),
        checkpoint=str(codec.checkpoint),
        tokenizer=codec.tokenizer.kind,
        threads=args.threads,
        device=args.device,
        eval_bpb=_eval_bpb(run),
    )
    print(
        f"total {total:,} bytes in {len(docs)} files: "
        + ", ".join(f"{tool} {value:.3f}" for tool, value in bpb.items() if value is not None)
        + " bits per byte"
    )
    if total:
        print(
            f"tenx / xz = {result['ratio_vs_xz']:.3f} (below 1: tenx files are smaller); compress "
            f"{result['kb_per_s']:.1f} KB/s, decompress {result['decompress_kb_per_s']:.1f} KB/s; "
            f"round trips {'all exact' if roundtrip_ok else 'FAILED'}"
        )
        print(
            f"decompressing every file together (decompress_many: small files share model steps): "
            f"{result['decompress_together_kb_per_s']:.1f} KB/s, "
            f"{result['decompress_together_kb_per_s'] / result['decompress_kb_per_s']:.2f}x one file at a time"
        )
        if args.float32_baseline:
            print(
                f"speed against the float32 kernels of format 1 (same files, same process): compress "
                f"{result['kb_per_s'] / result['float32_kb_per_s']:.2f}x ({result['float32_kb_per_s']:.1f} "
                f"KB/s), decompress {result['decompress_kb_per_s'] / result['float32_decompress_kb_per_s']:.2f}x "
                f"({result['float32_decompress_kb_per_s']:.1f} KB/s)"
            )
        if args.adapt:
            print(
                f"tenx --adapt / tenx = {result['adapt_vs_plain']:.3f} (the plain codec is the baseline); "
                f"compress --adapt {result['adapt_kb_per_s']:.1f} KB/s"
            )
    print(json.dumps(result))
    if not roundtrip_ok:
        sys.exit(1)


def _eval_bpb(run: Path) -> float | None:
    """The held-out bits per byte `tenx eval` recorded for the run (the whole split as one stream), if any."""
    try:
        return json.loads(rundir.RunDir(run).eval_report.read_text())["overall"]["bits_per_byte"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


if __name__ == "__main__":
    main()
