"""`tenx quickstart`: the whole loop on the embedded default corpus, the Python standard library.

prepare stdlib (BPE 4096) -> train configs/quickstart.toml on this machine -> bits per byte on the
held-out documents beside xz -9e on exactly the same bytes. Re-running reuses prepared data and a
finished run; an interrupted run resumes from its newest verified checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tenx import checkpoint as ckpt
from tenx import rundir
from tenx.data.manifest import read_manifest, split_documents_text
from tenx.data.prepare import PrepareConfig, format_summary, is_prepared, prepare
from tenx.data.tokenizer import load_tokenizer
from tenx.eval.compression import xz_bits_per_byte, xz_bits_per_byte_per_document
from tenx.eval.run import evaluate
from tenx.monitor.plots import plot_loss_curve
from tenx.train.config import load_run_config, resolve_config_path
from tenx.train.run import train
from tenx.utils.io import atomic_write_json


def quickstart(
    out: str | Path = "runs/quickstart",
    steps: int | None = None,
    *,
    source: str = "stdlib",
    tokenizer: str = "bpe",
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Run the quickstart into `out`; returns (and writes) summary.json.

    `source`, `tokenizer` and config `overrides` exist for tests and experiments; the defaults are the
    README's main job.
    """
    t0 = time.perf_counter()
    out = Path(out)
    data_dir, run_dir = out / "data", out / "run"

    prep = PrepareConfig(source=source, out=str(data_dir), tokenizer=tokenizer, vocab_size=4096)
    if is_prepared(prep):
        print(f"[1/4] reusing prepared data in {data_dir}")
    else:
        print(f"[1/4] preparing the corpus '{source}' (tokenizer, shards, manifest)")
        print(format_summary(prepare(prep), data_dir))

    settings = [f'data.dir="{data_dir}"', *(overrides or [])] + ([f"train.steps={steps}"] if steps else [])
    cfg = load_run_config(resolve_config_path("quickstart"), settings)
    existing = ckpt.list_checkpoints(run_dir / rundir.CHECKPOINTS)
    latest, _ = ckpt.latest_verified(run_dir / rundir.CHECKPOINTS)
    if latest is not None and ckpt.read_checkpoint_meta(latest)["step"] >= (cfg.train.steps or 0):
        print(f"[2/4] reusing finished run in {run_dir}")
    else:
        print(f"[2/4] training configs/quickstart.toml into {run_dir}")
        train(cfg, run_dir, resume="auto" if existing else None)

    print("[3/4] evaluating on the held-out split")
    report = evaluate(run_dir, ["heldout"])
    heldout = report["datasets"]["heldout"]

    print("[4/4] compressing the same held-out bytes with xz -9e")
    manifest = read_manifest(data_dir)
    tok = load_tokenizer(data_dir, manifest["tokenizer"])
    documents = [text.encode("utf-8") for text in split_documents_text(data_dir, manifest, "heldout", tok)]
    xz_bpb = xz_bits_per_byte(b"".join(documents))
    xz_doc_bpb = xz_bits_per_byte_per_document(documents)
    curve = plot_loss_curve(run_dir / rundir.METRICS, out / rundir.LOSS_CURVE, f"tenx quickstart ({source})")

    summary = {
        "heldout_bits_per_byte": heldout["bits_per_byte"],
        "xz_bits_per_byte": xz_bpb,
        "xz_per_document_bits_per_byte": xz_doc_bpb,
        "heldout_loss_nats_per_token": heldout["loss"],
        "heldout_bytes": heldout["bytes"],
        "heldout_documents": manifest["splits"]["heldout"]["num_documents"],
        "beats_xz": heldout["bits_per_byte"] < xz_bpb,
        "wall_seconds": time.perf_counter() - t0,
        "run_dir": str(run_dir),
        "metrics": str(run_dir / rundir.METRICS),
        "loss_curve": str(curve),
        "eval": report["path"],
        "data_dir": str(data_dir),
    }
    atomic_write_json(out / "summary.json", summary)
    print(
        f"\nheld-out bits per byte: tenx {summary['heldout_bits_per_byte']:.4f} | xz -9e {xz_bpb:.4f} over the "
        f"concatenated files, {xz_doc_bpb:.4f} file by file\n"
        f"({heldout['bytes']:,} bytes in {summary['heldout_documents']} documents never trained on)\n"
        f"run directory: {run_dir}\nmetrics: {summary['metrics']}\nloss curve: {curve}\n"
        f"summary: {out / 'summary.json'}  ({summary['wall_seconds']:.0f} s)"
    )
    return summary
