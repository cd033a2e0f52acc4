"""`tenx eval`: bits per byte of a trained model on prepared splits and on arbitrary text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tenx import rundir
from tenx.checkpoint.models import load_model
from tenx.data.codebase import DEFAULT_MAX_FILE_BYTES, read_codebase
from tenx.data.manifest import read_manifest
from tenx.data.prepare.clean import CleaningStats, clean_text
from tenx.data.prepare.sources import iter_documents
from tenx.data.tokenizer import load_tokenizer
from tenx.errors import DataError, TenxError
from tenx.eval.adaptive import AdaptConfig, adaptive_report
from tenx.eval.bpb import Scoring, combine, eval_split, eval_texts
from tenx.eval.documents import check_texts
from tenx.hardware import resolve_precision
from tenx.utils.io import atomic_write_json

PREPARED_SPLITS = ("train", "val", "heldout")


def read_texts(spec: str) -> list[str]:
    """The cleaned texts of any source `tenx data prepare` accepts (a file, a directory, ...)."""
    stats = CleaningStats()
    texts = [cleaned[0] for raw in iter_documents(spec) if (cleaned := clean_text(raw.data, stats))]
    if not texts:
        raise DataError(f"{spec}: no text documents to evaluate")
    return texts


def evaluate(
    target: str | Path,
    datasets: list[str] | None = None,
    out: str | Path | None = None,
    batch_size: int = 8,
    device: str = "auto",
    *,
    stride: int | None = None,
    precision: str = "auto",
    decontaminate: bool = False,
    breakdown: bool = False,
    ngram: int | None = None,
    threshold: float | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    adapt: AdaptConfig | None = None,
) -> dict[str, Any]:
    """Evaluate a run or checkpoint on each dataset (a prepared split name, a directory, a source of text).

    `stride` defaults to seq_len (non-overlapping windows); a smaller one gives each scored token at least
    seq_len - stride tokens of context at seq_len / stride times the compute;
    `precision` is resolved as in training ('auto': bf16 autocast where the hardware has fast bf16).
    `decontaminate`: also report, per dataset, the documents sharing `ngram`-token n-grams (default: the n
    the data was prepared with, tenx.data.ngrams.data_n: 13 BPE tokens, 50 bytes) with the training
    split beyond `threshold` (default tenx.data.ngrams.DEFAULT_CONTAMINATION_THRESHOLD) and score the clean part apart;
    `breakdown`: per-directory and per-file-type figures (tenx/eval/documents.py).
    A directory is a codebase (tenx.data.codebase.read_codebase): every text file under it, `.gitignore`
    files respected, filtered by the `include`/`exclude` globs and `max_file_bytes` (0: no limit), scored
    with figures per language and per directory and the counts of the files it skipped, always.
    `adapt`: also the adaptive (prequential) figure of each dataset, the model learning as it reads
    (tenx/eval/adaptive.py), beside the static one and xz's.
    Writes eval.json (default: in the run directory, else the checkpoint directory) and returns it.
    """
    for name in datasets or []:
        if name not in PREPARED_SPLITS and not _is_text_source(name):
            raise TenxError(
                f"--split {name!r} is neither a prepared split ({', '.join(PREPARED_SPLITS)}) nor an existing "
                "file or directory of text (or hf:NAME, stdlib)"
            )
    if (include or exclude or max_file_bytes != DEFAULT_MAX_FILE_BYTES) and not any(
        _is_codebase(name) for name in datasets or []
    ):
        raise TenxError(
            "--include, --exclude and --max-file-bytes choose the files of a directory: "
            "give one with --split DIR"
        )
    if max_file_bytes < 0:
        raise TenxError(f"--max-file-bytes must be >= 0 (0: no limit), got {max_file_bytes}")
    loaded = load_model(target, device)
    seq_len = loaded.model.cfg.seq_len
    if stride is not None and stride < 1:
        raise TenxError(f"--stride must be >= 1, got {stride}")
    stride = min(stride or seq_len, seq_len)
    amp_dtype = resolve_precision(precision, next(loaded.model.parameters()).device)
    scoring = Scoring(batch_size, stride, amp_dtype)
    data_dir = loaded.data_dir
    manifest = read_manifest(data_dir)
    tokenizer = load_tokenizer(data_dir, manifest["tokenizer"])
    if ngram is None:
        from tenx.data.ngrams import data_n

        ngram = data_n(manifest)
    model_vocab = loaded.model.cfg.vocab_size or 0
    if tokenizer.vocab_size > model_vocab:
        raise DataError(
            f"{data_dir}: its tokenizer has {tokenizer.vocab_size} tokens but the model of {loaded.checkpoint} "
            f"has {model_vocab}: this is not the data the run was trained on (check data.dir in its config.toml)"
        )
    results: dict[str, dict[str, Any]] = {}
    for name in datasets or ["heldout"]:
        if decontaminate or breakdown or adapt is not None or _is_codebase(name):
            results[name] = _by_document(
                loaded.model,
                name,
                data_dir,
                tokenizer,
                scoring,
                decontaminate,
                breakdown,
                ngram,
                threshold,
                {"include": include or (), "exclude": exclude or (), "max_file_bytes": max_file_bytes},
                adapt,
            )
        elif name in PREPARED_SPLITS:
            results[name] = eval_split(
                loaded.model, data_dir, name, batch_size, stride=stride, amp_dtype=amp_dtype
            )
        else:
            texts = read_texts(name)
            check_texts(tokenizer, [f"document {i}" for i in range(len(texts))], texts, None, name)
            results[name] = eval_texts(
                loaded.model, texts, tokenizer, batch_size, stride=stride, amp_dtype=amp_dtype
            )
    report = {
        "checkpoint": str(loaded.checkpoint),
        "step": loaded.meta["step"],
        "tokens_trained": loaded.meta["tokens"],
        "data_dir": str(data_dir),
        "tokenizer": manifest["tokenizer"],
        "seq_len": seq_len,
        "stride": stride,
        "precision": str(amp_dtype).replace("torch.", ""),
        "datasets": results,
        "overall": combine(results),
    }
    out_path = Path(out) if out else rundir.RunDir(loaded.run_dir or loaded.checkpoint).eval_report
    try:
        atomic_write_json(out_path, report)
        report["path"] = str(out_path)
    except OSError as e:  # the results are kept (returned and printed); only the file is missing
        report["path"] = None
        report["write_error"] = f"could not write {out_path}: {e.strerror or e}"
    return report


def _by_document(
    model: Any,
    name: str,
    data_dir: Path,
    tokenizer: Any,
    scoring: Scoring,
    decontaminate: bool,
    breakdown: bool,
    ngram: int,
    threshold: float | None,
    files: dict[str, Any],
    adapt: AdaptConfig | None = None,
) -> dict[str, Any]:
    """A dataset scored document by document: contamination, the clean part, breakdowns; a directory (a
    codebase read with the `files` choices of read_codebase) always with its breakdowns and file counts."""
    from tenx.eval.documents import (
        codebase_documents,
        contamination_report,
        document_nll,
        score_documents,
        source_documents,
        split_documents,
    )

    codebase = None
    if name in PREPARED_SPLITS:
        docs = split_documents(data_dir, name)
    elif _is_codebase(name):
        codebase = read_codebase(Path(name).expanduser(), **files)
        docs = codebase_documents(codebase, tokenizer)
    else:
        docs = source_documents(name, tokenizer)
    report = None
    if decontaminate:
        from tenx.data.ngrams import DEFAULT_CONTAMINATION_THRESHOLD

        report = contamination_report(
            data_dir, docs, ngram, DEFAULT_CONTAMINATION_THRESHOLD if threshold is None else threshold
        )
    nll = document_nll(model, docs, tokenizer.eot_id, scoring)
    result = score_documents(
        docs,
        nll,
        contaminated=report.pop("_flags") if report else None,
        breakdown=breakdown or codebase is not None,
        languages=codebase is not None,
    )
    if codebase is not None:
        result["files"] = codebase.summary()
    if report:
        result["contamination"] = report
    if adapt is not None:
        adaptive = adaptive_report(model, docs, tokenizer.token_bytes(), tokenizer.eot_id, adapt)
        adaptive.pop("files")  # the bytes themselves stay out of eval.json
        result["adaptive"] = adaptive
    return result


def _is_codebase(spec: str) -> bool:
    """Whether the dataset `spec` is a directory read as a codebase (not a prepared split, not stdlib)."""
    return spec not in PREPARED_SPLITS and spec != "stdlib" and Path(spec).expanduser().is_dir()


def _is_text_source(spec: str) -> bool:
    """Whether `spec` names something read_texts can read (a path, hf:NAME, stdlib)."""
    return spec.startswith("hf:") or spec == "stdlib" or Path(spec).expanduser().exists()
