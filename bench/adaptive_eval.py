"""Adaptive (prequential) evaluation against the static figure and the general-purpose compressors.

For each dataset (a codebase the model never saw, by default the installed `hypothesis` package's sources,
and the run's held-out split) it prints bits per byte of: the model as it is (static), the model that keeps
learning as it reads (tenx.eval.adaptive: each chunk scored, then AdamW steps on it), xz -9e over the
concatenated files and file by file, zstd -19 and brotli -q11 (concatenated), all on the same bytes (the
documents' cleaned UTF-8, in sorted path order). The baseline named by the ratios is xz -9e.

    python bench/adaptive_eval.py --run runs/quickstart [--codebase DIR] [--lr 1e-4] [--steps 1]
        [--params all|norms|head|last] [--max-bytes N] [--sweep]

`--sweep` tries a small grid of learning rates and parameter sets on the codebase and reports each.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tenx.checkpoint.models import load_model  # noqa: E402
from tenx.data.codebase import read_codebase  # noqa: E402
from tenx.data.manifest import read_manifest  # noqa: E402
from tenx.data.tokenizer import load_tokenizer  # noqa: E402
from tenx.eval.adaptive import AdaptConfig, adaptive_report  # noqa: E402
from tenx.eval.documents import codebase_documents, split_documents  # noqa: E402


def figures_of(model, docs, table: list[bytes], eot: int, cfg: AdaptConfig) -> dict[str, float]:
    """tenx.eval.adaptive's report (static, adaptive, xz both ways) plus zstd -19 and brotli -q11."""
    import brotli
    import zstandard

    report = adaptive_report(model, docs, table, eot, cfg)
    data = b"".join(report.pop("files"))
    bits = 8.0 / len(data)
    return {
        "static": report["static_bits_per_byte"],
        "adaptive": report["adaptive_bits_per_byte"],
        "seconds": report["seconds"],
        "bytes": report["bytes"],
        "xz_concat": report["xz_bits_per_byte"],
        "xz_files": report["xz_per_file_bits_per_byte"],
        "zstd": len(zstandard.ZstdCompressor(level=19).compress(data)) * bits,
        "brotli": len(brotli.compress(data, quality=11)) * bits,
    }


def main() -> None:
    import hypothesis

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="runs/quickstart")
    p.add_argument("--codebase", default=str(Path(hypothesis.__file__).parent))
    p.add_argument("--lr", type=float, default=AdaptConfig.lr)
    p.add_argument("--steps", type=int, default=AdaptConfig.steps)
    p.add_argument("--params", default=AdaptConfig.params)
    p.add_argument("--max-bytes", type=int, default=0, help="use only the first files up to this many bytes")
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    loaded = load_model(args.run, "cpu")
    tokenizer = load_tokenizer(loaded.data_dir, read_manifest(loaded.data_dir)["tokenizer"])
    table = tokenizer.token_bytes()
    eot = tokenizer.eot_id
    datasets = {
        "codebase": codebase_documents(read_codebase(args.codebase, include=["**/*.py"]), tokenizer),
        "heldout": split_documents(loaded.data_dir, "heldout"),
    }
    if args.max_bytes:
        for name, docs in datasets.items():
            total, kept = 0, []
            for d in docs:
                if total + d.num_bytes > args.max_bytes and kept:
                    break
                kept.append(d)
                total += d.num_bytes
            datasets[name] = kept
    base = AdaptConfig(lr=args.lr, steps=args.steps, params=args.params)
    results: dict[str, dict] = {}
    for name, docs in datasets.items():
        if not docs:
            print(f"{name}: no documents", flush=True)
            continue
        figures = figures_of(loaded.model, docs, table, eot, base)
        figures["files"] = len(docs)
        figures["adaptive_over_xz_files"] = figures["adaptive"] / figures["xz_files"]
        figures["adaptive_over_xz_concat"] = figures["adaptive"] / figures["xz_concat"]
        results[name] = figures
        print(
            f"{name}: {len(docs)} files, {figures['bytes']:,} bytes: static {figures['static']:.3f}, adaptive "
            f"{figures['adaptive']:.3f} bits/byte ({figures['seconds']:.0f} s); xz -9e {figures['xz_concat']:.3f} "
            f"concatenated, {figures['xz_files']:.3f} file by file; zstd -19 {figures['zstd']:.3f}; brotli "
            f"{figures['brotli']:.3f}",
            flush=True,
        )
    sweep = []
    if args.sweep:
        docs = datasets["codebase"]
        for params in ("all", "last", "norms"):
            for lr in (3e-5, 1e-4, 3e-4, 1e-3):
                cfg = AdaptConfig(lr=lr, steps=args.steps, params=params)
                got = figures_of(loaded.model, docs, table, eot, cfg)
                sweep.append(
                    {"params": params, "lr": lr, "adaptive": got["adaptive"], "seconds": got["seconds"]}
                )
                print(f"  sweep {params:5s} lr {lr:.0e}: adaptive {got['adaptive']:.3f}", flush=True)
    print(
        json.dumps(
            {
                "bench": "adaptive_eval",
                "run": args.run,
                "baseline": "xz -9e",
                "adapt": {"lr": base.lr, "steps": base.steps, "params": base.params},
                "datasets": results,
                "sweep": sweep,
            }
        )
    )


if __name__ == "__main__":
    main()
