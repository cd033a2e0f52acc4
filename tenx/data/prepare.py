"""The prepare pipeline: read a source, clean, deduplicate, split by document, tokenize, decontaminate, write
shards + manifest + the train split's n-gram index."""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash
from tqdm import tqdm

from tenx.config import check_bounds, field
from tenx.data.dedup import near_duplicate_splits
from tenx.data.manifest import (
    FORMAT,
    INDEX_DTYPE,
    MANIFEST_NAME,
    SPLITS,
    TOKEN_DTYPES,
    read_manifest,
    verify_split,
)
from tenx.data.ngrams import (
    DEFAULT_CONTAMINATION_THRESHOLD,
    INDEX_FILE,
    build_index,
    decontaminate,
    load_index,
    remove_stale_indexes,
)
from tenx.data.sources import effective_patterns, iter_documents, source_provenance
from tenx.data.tokenizer import BPE_FILE, MIN_BPE_VOCAB, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe
from tenx.errors import ConfigError, DataError
from tenx.utils.io import atomic_write_bytes, atomic_write_json, bytes_xxhash, fsync_dir

TOKENIZERS = ("bpe", "bytes")
BINARY_SNIFF_BYTES = 8192
"""A NUL byte within this many leading bytes marks a document as binary."""

_BATCH_DOCUMENTS = 512
_BATCH_BYTES = 8 << 20
_SHARD_NAME = re.compile(r"^(train|val|heldout)_\d{5}\.(bin|idx)$")


@dataclass
class PrepareConfig:
    """Options of `tenx data prepare`."""

    source: str = field(help="DIR | FILE.txt | FILE.jsonl | FILE.parquet | hf:NAME[:SPLIT] | stdlib")
    out: str = field(help="output data directory (created if needed): manifest.json, shards, tokenizer.json")
    tokenizer: Literal["bpe", "bytes"] = field(
        "bpe",
        help="'bpe': byte-level BPE trained on the train split; 'bytes': raw UTF-8 bytes, vocabulary 257",
    )
    vocab_size: int = field(
        8192, help="BPE vocabulary size including the end-of-document token (ignored for bytes)"
    )
    val_ratio: float = field(0.02, help="expected fraction of documents in the validation split")
    heldout_ratio: float = field(
        0.05,
        help="expected fraction of documents in the held-out split (never seen by training or tokenizer)",
    )
    seed: int = field(
        0, help="salt of the document-hash split; changing it reshuffles which documents land in which split"
    )
    patterns: list[str] | None = field(
        None, help="glob for directory and stdlib sources, e.g. '**/*.py'; default: the source's own"
    )
    text_field: str = field("text", help="JSONL field holding the text")
    id_field: str | None = field(None, help="JSONL field holding a stable document id (default: FILE:LINE)")
    column: str = field("text", help="parquet / hf column holding the text")
    shard_tokens: int = field(
        1 << 26, help="maximum tokens per shard file (shards are cut at a document boundary)"
    )
    max_documents: int | None = field(None, help="stop reading the source after this many documents")
    near_dup_threshold: float = field(
        0.8,
        ge=0,
        le=1,
        help="near-duplicates (word-shingle Jaccard >= this, MinHash estimate) are kept but put in one "
        "split, their smallest id's; 0 turns the check off",
    )
    near_dup_shingle: int = field(5, ge=1, le=64, help="words per shingle of the near-duplicate check")
    ngram_index: int = field(
        13,
        ge=0,
        le=1024,
        help="write ngrams-N.npy, the hashed N-token n-grams of the train split (decontamination); 0: none",
    )
    contamination_threshold: float = field(
        DEFAULT_CONTAMINATION_THRESHOLD,
        ge=0,
        le=1,
        help="val and held-out documents sharing more than this fraction of their ngram_index-grams with "
        "the train split are moved into it, until none is left; 1 (or ngram_index 0) turns this off",
    )

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field and what it accepts."""
        for name in ("source", "out", "text_field", "column"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
        if self.tokenizer not in TOKENIZERS:
            raise ConfigError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {self.tokenizer!r}")
        if not _is_int(self.vocab_size) or not MIN_BPE_VOCAB <= self.vocab_size <= 2**32 - 1:
            raise ConfigError(
                f"vocab_size must be an integer in [{MIN_BPE_VOCAB}, 2**32-1], got {self.vocab_size!r}"
            )
        for name in ("val_ratio", "heldout_ratio"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
                raise ConfigError(f"{name} must be a number in [0, 1), got {value!r}")
        if self.val_ratio + self.heldout_ratio >= 1.0:
            raise ConfigError(
                f"val_ratio + heldout_ratio must be < 1 to leave documents for training, "
                f"got {self.val_ratio} + {self.heldout_ratio}"
            )
        if not _is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.patterns is not None and (
            not isinstance(self.patterns, list)
            or not self.patterns
            or not all(isinstance(p, str) and p for p in self.patterns)
        ):
            raise ConfigError(
                f"patterns must be null or a non-empty list of glob strings, got {self.patterns!r}"
            )
        if self.id_field is not None and (not isinstance(self.id_field, str) or not self.id_field):
            raise ConfigError(f"id_field must be null or a non-empty string, got {self.id_field!r}")
        if not _is_int(self.shard_tokens) or self.shard_tokens < 1:
            raise ConfigError(f"shard_tokens must be a positive integer, got {self.shard_tokens!r}")
        if self.max_documents is not None and (not _is_int(self.max_documents) or self.max_documents < 1):
            raise ConfigError(f"max_documents must be null or a positive integer, got {self.max_documents!r}")
        for name, kind in (
            ("near_dup_threshold", "a number"),
            ("near_dup_shingle", "an integer"),
            ("contamination_threshold", "a number"),
        ):
            value = getattr(self, name)
            if not _is_int(value) and not (kind == "a number" and isinstance(value, float)):
                raise ConfigError(f"{name} must be {kind}, got {value!r}")
        if not _is_int(self.ngram_index):
            raise ConfigError(f"ngram_index must be an integer (0: no index), got {self.ngram_index!r}")
        check_bounds(self)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class CleaningStats:
    """Counts of what cleaning did to the source's documents."""

    documents_seen: int = 0
    decoded_with_replacement: int = 0
    empty_skipped: int = 0
    binary_skipped: int = 0
    duplicates_removed: int = 0
    documents_kept: int = 0


@dataclass
class _Document:
    id: str
    text: str
    num_bytes: int
    tokens: np.ndarray | None = None
    """Token ids ending with the end-of-document id, once tokenized."""


def assign_split(doc_id: str, seed: int, val_ratio: float, heldout_ratio: float) -> str:
    """Split of a document, from a hash of its id alone (so it never depends on order or offsets)."""
    u = xxhash.xxh64_intdigest(f"{seed}:{doc_id}".encode()) / 2**64
    if u < heldout_ratio:
        return "heldout"
    if u < heldout_ratio + val_ratio:
        return "val"
    return "train"


def clean_text(data: bytes | str, stats: CleaningStats) -> tuple[str, bytes] | None:
    """Cleaned text and its UTF-8 bytes, or None (counted in `stats`) when the document is skipped."""
    if isinstance(data, bytes):
        if b"\x00" in data[:BINARY_SNIFF_BYTES]:
            stats.binary_skipped += 1
            return None
        try:
            text = data.decode("utf-8")
            encoded = data
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="replace")
            encoded = text.encode("utf-8")
            stats.decoded_with_replacement += 1
    else:
        try:
            text, encoded = data, data.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates (e.g. from a JSON "\ud800" escape) are not UTF-8; make them U+FFFD like bad bytes.
            text = data.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
            encoded = text.encode("utf-8")
            stats.decoded_with_replacement += 1
        if b"\x00" in encoded[:BINARY_SNIFF_BYTES]:
            stats.binary_skipped += 1
            return None
    if not text.strip():
        stats.empty_skipped += 1
        return None
    return text, encoded


def prepare(cfg: PrepareConfig, progress: bool = True) -> dict[str, Any]:
    """Turn `cfg.source` into verified token shards under `cfg.out` and return the manifest written there."""
    cfg.validate()
    out = Path(cfg.out)
    _check_out_dir(out)
    source_entry = _source_entry(cfg)
    documents, stats = _read_documents(cfg, progress)
    if not documents:
        raise DataError(
            f"{cfg.source!r} gave no usable documents ({stats.documents_seen} read, "
            f"{stats.empty_skipped} empty, {stats.binary_skipped} binary); check the source and its patterns"
        )
    splits_of, dedup = near_duplicate_splits(
        [(d.id, d.text) for d in documents],
        lambda doc_id: assign_split(doc_id, cfg.seed, cfg.val_ratio, cfg.heldout_ratio),
        cfg.near_dup_threshold,
        cfg.near_dup_shingle,
        progress,
    )
    by_split: dict[str, list[_Document]] = {name: [] for name in SPLITS}
    for doc, split in zip(documents, splits_of):
        by_split[split].append(doc)
    if not by_split["train"]:
        raise DataError(
            f"no documents of {cfg.source!r} landed in the train split ({stats.documents_kept} kept after cleaning); "
            "add documents or lower val_ratio/heldout_ratio"
        )
    for docs in by_split.values():
        docs.sort(key=lambda d: d.id)

    out.mkdir(parents=True, exist_ok=True)
    previous = _listed_files(out)  # only files an earlier manifest listed may be removed as stale
    # Drop any previous manifest first: shards are rewritten in place, and no manifest may point at them meanwhile.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    fsync_dir(out)

    tokenizer = _build_tokenizer(cfg, [d.text for d in by_split["train"]], progress)
    tokenizer_entry = tokenizer.save(out)
    dtype = "uint16" if tokenizer.vocab_size <= 65535 else "uint32"
    total_bytes = sum(d.num_bytes for d in documents)
    with tqdm(
        total=total_bytes, desc="tokenizing", unit="B", unit_scale=True, disable=not progress, file=sys.stderr
    ) as bar:
        for name in SPLITS:
            _tokenize(by_split[name], tokenizer, TOKEN_DTYPES[dtype], bar)
    if cfg.ngram_index:
        dedup.moved_for_contamination = _move_contaminated(cfg, by_split, tokenizer.eot_id)
    splits = {name: _write_split(out, name, by_split[name], cfg.shard_tokens) for name in SPLITS}
    manifest = {
        "format": FORMAT,
        "source": source_entry,
        "tokenizer": tokenizer_entry,
        "dtype": dtype,
        "split": _split_settings(cfg),
        "prepare": _prepare_settings(cfg),
        "stats": asdict(stats),
        "dedup": asdict(dedup),
        "splits": splits,
    }
    atomic_write_json(out / MANIFEST_NAME, manifest)
    _remove_stale_files(out, manifest, previous)
    remove_stale_indexes(out)
    if cfg.ngram_index:
        build_index(out, cfg.ngram_index)
    return manifest


def is_prepared(cfg: PrepareConfig) -> bool:
    """True when `cfg.out` holds an intact preparation made from the same source and settings as `cfg`."""
    cfg.validate()
    try:
        manifest = read_manifest(cfg.out)
        expected = {
            "source": _source_entry(cfg),
            "split": _split_settings(cfg),
            "prepare": _prepare_settings(cfg),
        }
        if any(manifest.get(key) != value for key, value in expected.items()):
            return False
        load_tokenizer(cfg.out, manifest["tokenizer"])
        for split in SPLITS:
            verify_split(cfg.out, manifest, split)
        if cfg.ngram_index:
            load_index(cfg.out, cfg.ngram_index)
    except DataError:
        return False
    return True


def format_summary(manifest: dict[str, Any], data_dir: str | Path | None = None) -> str:
    """One-screen summary of a preparation: per-split sizes, cleaning counts, tokenizer and output directory."""
    header = f"{'split':<10}{'documents':>12}{'bytes':>16}{'tokens':>16}{'bytes/token':>13}"
    lines = [f"prepared {manifest['source']['spec']!r}", header, "-" * len(header)]
    rows = [(name, manifest["splits"][name]) for name in SPLITS]
    totals = {key: sum(entry[key] for _, entry in rows) for key in ("num_documents", "bytes", "tokens")}
    for name, entry in [*rows, ("total", totals)]:
        ratio = f"{entry['bytes'] / entry['tokens']:.2f}" if entry["tokens"] else "-"
        lines.append(
            f"{name:<10}{entry['num_documents']:>12,}{entry['bytes']:>16,}{entry['tokens']:>16,}{ratio:>13}"
        )
    stats = manifest["stats"]
    lines.append(
        f"cleaning: {stats['documents_seen']:,} seen, {stats['documents_kept']:,} kept; skipped "
        f"{stats['empty_skipped']:,} empty, {stats['binary_skipped']:,} binary, "
        f"{stats['duplicates_removed']:,} duplicates; {stats['decoded_with_replacement']:,} decoded with U+FFFD"
    )
    if "dedup" in manifest:
        near = manifest["dedup"]
        lines.append(
            f"dedup: {stats['duplicates_removed']:,} exact duplicates removed; "
            f"{near['near_duplicate_groups']:,} near-duplicate groups ({near['near_duplicate_documents']:,} "
            f"documents) kept, each in one split; {near['moved_to_group_split']:,} moved to the group's split"
        )
        moved = near.get("moved_for_contamination")
        if moved is not None:
            lines.append(
                f"decontamination: {moved['count']:,} moved into train ({moved['from_heldout']:,} held-out, "
                f"{moved['from_val']:,} val) for sharing > {moved['threshold']:g} of their {moved['n']}-grams "
                f"with it; {moved['rounds']} passes"
                + ("" if moved["converged"] else ", stopped before none was left above the threshold")
            )
    tok = manifest["tokenizer"]
    lines.append(
        f"tokenizer: {tok['kind']}, vocab_size {tok['vocab_size']:,}, eot_id {tok['eot_id']}, "
        f"shards {manifest['dtype']}"
    )
    if data_dir is not None:
        lines.append(f"output: {data_dir}")
    return "\n".join(lines)


def _source_entry(cfg: PrepareConfig) -> dict[str, Any]:
    return {
        "spec": cfg.source,
        "patterns": effective_patterns(cfg.source, cfg.patterns),
        "text_field": cfg.text_field,
        "id_field": cfg.id_field,
        "column": cfg.column,
        **source_provenance(cfg.source),
    }


def _split_settings(cfg: PrepareConfig) -> dict[str, Any]:
    return {"seed": cfg.seed, "val_ratio": cfg.val_ratio, "heldout_ratio": cfg.heldout_ratio}


def _prepare_settings(cfg: PrepareConfig) -> dict[str, Any]:
    # The requested settings that shape the output but are not visible elsewhere in the manifest
    # (a BPE trained on a small corpus may end up with fewer ids than requested).
    return {
        "tokenizer": cfg.tokenizer,
        "vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else None,
        "shard_tokens": cfg.shard_tokens,
        "max_documents": cfg.max_documents,
        "near_dup_threshold": cfg.near_dup_threshold,
        "near_dup_shingle": cfg.near_dup_shingle if cfg.near_dup_threshold else None,
        "ngram_index": cfg.ngram_index,
        "contamination_threshold": cfg.contamination_threshold if cfg.ngram_index else None,
    }


def _read_documents(cfg: PrepareConfig, progress: bool) -> tuple[list[_Document], CleaningStats]:
    stats = CleaningStats()
    documents: list[_Document] = []
    seen_ids: set[str] = set()
    seen_texts: set[int] = set()
    raw_documents = iter_documents(
        cfg.source, patterns=cfg.patterns, text_field=cfg.text_field, id_field=cfg.id_field, column=cfg.column
    )
    capped = itertools.islice(raw_documents, cfg.max_documents)
    for raw in tqdm(capped, desc="reading", unit="doc", disable=not progress, file=sys.stderr):
        stats.documents_seen += 1
        if raw.id in seen_ids:
            raise DataError(
                f"{cfg.source}: two documents share the id {raw.id!r}; document ids must be unique"
            )
        seen_ids.add(raw.id)
        cleaned = clean_text(raw.data, stats)
        if cleaned is None:
            continue
        text, encoded = cleaned
        digest = xxhash.xxh3_128_intdigest(encoded)
        if digest in seen_texts:
            stats.duplicates_removed += 1
            continue
        seen_texts.add(digest)
        documents.append(_Document(id=raw.id, text=text, num_bytes=len(encoded)))
    stats.documents_kept = len(documents)
    return documents, stats


def _build_tokenizer(cfg: PrepareConfig, train_texts: list[str], progress: bool) -> Tokenizer:
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    if progress:
        print(
            f"training BPE tokenizer (vocab_size {cfg.vocab_size}) on {len(train_texts):,} documents",
            file=sys.stderr,
        )
    return train_bpe(train_texts, cfg.vocab_size)


def _batches(docs: list[_Document]) -> Iterator[list[_Document]]:
    batch: list[_Document] = []
    batch_bytes = 0
    for doc in docs:
        batch.append(doc)
        batch_bytes += doc.num_bytes
        if len(batch) >= _BATCH_DOCUMENTS or batch_bytes >= _BATCH_BYTES:
            yield batch
            batch, batch_bytes = [], 0
    if batch:
        yield batch


class _ShardWriter:
    """Accumulates document token arrays and writes `{split}_{i:05d}.bin/.idx` pairs cut at document boundaries."""

    def __init__(self, out: Path, split: str, shard_tokens: int) -> None:
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._pieces: list[np.ndarray] = []
        self._starts: list[int] = []
        self._tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        if self._tokens and self._tokens + len(tokens) > self.shard_tokens:
            self.flush()
        self._starts.append(self._tokens)
        self._pieces.append(tokens)
        self._tokens += len(tokens)

    def flush(self) -> None:
        if not self._pieces:
            return
        stem = f"{self.split}_{len(self.shards):05d}"
        data = np.concatenate(self._pieces).tobytes()
        index = np.asarray(self._starts, dtype=INDEX_DTYPE).tobytes()
        atomic_write_bytes(self.out / f"{stem}.bin", data)
        atomic_write_bytes(self.out / f"{stem}.idx", index)
        self.shards.append(
            {
                "file": f"{stem}.bin",
                "index_file": f"{stem}.idx",
                "tokens": self._tokens,
                "documents": len(self._starts),
                "xxhash": bytes_xxhash(data),
                "index_xxhash": bytes_xxhash(index),
            }
        )
        self._pieces, self._starts, self._tokens = [], [], 0


def _tokenize(docs: list[_Document], tokenizer: Tokenizer, dtype: np.dtype, bar: tqdm) -> None:
    for batch in _batches(docs):
        for doc, ids in zip(batch, tokenizer.encode_batch([d.text for d in batch])):
            doc.tokens = np.empty(len(ids) + 1, dtype=dtype)
            doc.tokens[:-1] = ids
            doc.tokens[-1] = tokenizer.eot_id
        bar.update(sum(d.num_bytes for d in batch))


def _move_contaminated(
    cfg: PrepareConfig, by_split: dict[str, list[_Document]], eot_id: int
) -> dict[str, Any]:
    """Move the val and held-out documents that `decontaminate` names into train; the manifest's record.

    The tokenizer, trained on the train split before the move, is kept: retraining it would change the
    token ids and so the very n-grams just measured, and the moved documents, unseen by it, are encoded
    like any other text it did not see; they only add training data."""
    held = [doc for name in ("val", "heldout") for doc in by_split[name]]
    result = decontaminate(
        [_tokens(d) for d in by_split["train"]],
        [_tokens(d) for d in held],
        cfg.ngram_index,
        eot_id,
        cfg.contamination_threshold,
    )
    moved = sorted(held[i].id for i in result.moved)
    moving = set(moved)
    record: dict[str, Any] = {
        "n": cfg.ngram_index,
        "threshold": cfg.contamination_threshold,
        "count": len(moved),
    }
    for name in ("val", "heldout"):
        record[f"from_{name}"] = sum(d.id in moving for d in by_split[name])
        by_split["train"] += [d for d in by_split[name] if d.id in moving]
        by_split[name] = [d for d in by_split[name] if d.id not in moving]
    by_split["train"].sort(key=lambda d: d.id)
    if not result.converged:
        print(
            f"warning: decontamination stopped after {result.rounds} passes while still moving documents; "
            f"val or held-out may keep some above {cfg.contamination_threshold:g}",
            file=sys.stderr,
        )
    return {**record, "documents": moved[:50], "rounds": result.rounds, "converged": result.converged}


def _tokens(doc: _Document) -> np.ndarray:
    if doc.tokens is None:
        raise AssertionError(f"document {doc.id!r} was not tokenized")
    return doc.tokens


def _write_split(out: Path, split: str, docs: list[_Document], shard_tokens: int) -> dict[str, Any]:
    writer = _ShardWriter(out, split, shard_tokens)
    for doc in docs:
        writer.add(_tokens(doc))
    writer.flush()
    return {
        "num_documents": len(docs),
        "bytes": sum(d.num_bytes for d in docs),
        "tokens": sum(shard["tokens"] for shard in writer.shards),
        "documents": [d.id for d in docs],
        "shards": writer.shards,
    }


def _manifest_files(manifest: Any) -> set[str]:
    """The file names a data manifest lists (tokenizer, shards, indexes); empty for anything malformed."""
    try:
        names = {manifest["tokenizer"]["file"]}
        for entry in manifest["splits"].values():
            for shard in entry["shards"]:
                names.update((shard["file"], shard["index_file"]))
    except (KeyError, TypeError, AttributeError):
        return set()
    return {n for n in names if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")}


def _listed_files(out: Path) -> set[str]:
    """The files the manifest already in `out` lists (none when there is no readable manifest)."""
    try:
        return _manifest_files(json.loads((out / MANIFEST_NAME).read_text()))
    except (OSError, ValueError):
        return set()


def _check_out_dir(out: Path) -> None:
    """Refuse an output that is a file, or a non-empty directory that is not a tenx data directory."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a directory; give a directory (it is created if needed)")
    if not out.is_dir():
        return
    foreign = sorted(
        p.name
        for p in out.iterdir()
        if not (
            p.name == MANIFEST_NAME
            or p.name == BPE_FILE
            or _SHARD_NAME.match(p.name)
            or INDEX_FILE.match(p.name)
            or p.name.startswith(".")
        )
    )
    if foreign:
        raise DataError(
            f"--out {out} holds files tenx did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); choose a new or empty directory, nothing was changed"
        )


def _remove_stale_files(out: Path, manifest: dict[str, Any], previous: set[str]) -> None:
    # A re-prepare into the same directory may leave shards (or a tokenizer.json) the new manifest no longer
    # names. Only files the previous manifest listed are removed: never one tenx did not write.
    for name in sorted(previous - _manifest_files(manifest)):
        path = out / name
        if path.is_file() and (_SHARD_NAME.match(name) or name == BPE_FILE):
            path.unlink()
