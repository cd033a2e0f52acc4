"""The prepare pipeline: read a source, clean, deduplicate, split by document, tokenize, decontaminate, write
shards + manifest + the train split's n-gram index."""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash

from tenx.config import check_bounds, field
from tenx.data.manifest import (
    FORMAT,
    MANIFEST_NAME,
    SPLITS,
    read_manifest,
    verify_split,
)
from tenx.data.ngrams import (
    DEFAULT_CONTAMINATION_THRESHOLD,
    default_n,
    load_index,
    remove_stale_indexes,
)
from tenx.data.prepare.dedup import group_splits, groups_from_signatures
from tenx.data.prepare.engine import merge_scan, merge_tokenize, run_stage
from tenx.data.prepare.outdir import check_prepare_out, listed_files, remove_stale_files
from tenx.data.prepare.partitioned import Partitions, decontaminate_partitions, fill, write_index
from tenx.data.prepare.sources import effective_patterns, source_provenance
from tenx.data.prepare.stream import (
    ShardWriter,
    TokenReader,
    Work,
    kept_documents,
    scan,
    signatures,
    texts,
    tokenize,
)
from tenx.data.tokenizer import MIN_BPE_VOCAB, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe
from tenx.errors import ConfigError, DataError
from tenx.utils.cpus import usable_cpu_count
from tenx.utils.io import atomic_write_json, fsync_dir
from tenx.utils.scripts import sbatch_value, slurm_time

TOKENIZERS = ("bpe", "bytes")
TOKENIZER_SAMPLE_MB = 256.0
"""Default tokenizer sample: more than the standard library (31 MB), so small corpora use every document."""
MIN_SPLIT_FOR_WARNING = 4
"""Decontamination warns when it moves most of a val or held-out split at least this large."""


@dataclass
class PrepareConfig:
    """Options of `tenx data prepare`."""

    source: str = field(help="DIR | FILE.txt | FILE.jsonl | FILE.parquet | hf:NAME[:SPLIT] | stdlib")
    out: str = field(help="output data directory (created if needed): manifest.json, shards, tokenizer.json")
    tokenizer: Literal["bpe", "bytes"] = field(
        "bpe",
        help="'bpe': byte-level BPE trained on the train split; 'bytes': raw UTF-8 bytes, vocabulary 257",
    )
    tokenizer_from: str = field("", help="a Hugging Face model directory whose tokenizer.json to use instead")
    vocab_size: int = field(8192, help="BPE vocabulary size, end-of-document token included (bytes: unused)")
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
    ngram_index: int | None = field(
        None,
        ge=0,
        le=1024,
        help="write ngrams-N.npy, the hashed N-token n-grams of the train split (decontamination); 0: none; "
        "default: 13 for BPE, 50 for bytes (about the same text: tenx.data.ngrams.BYTES_N)",
    )
    contamination_threshold: float = field(
        DEFAULT_CONTAMINATION_THRESHOLD,
        ge=0,
        le=1,
        help="val and held-out documents sharing more than this fraction of their ngram_index-grams with "
        "the train split are moved into it, until none is left; 1 (or ngram_index 0) turns this off",
    )
    tokenizer_sample_mb: float = field(
        TOKENIZER_SAMPLE_MB,
        gt=0,
        help="BPE: train the tokenizer on the train split, or on a seeded sample of about this many MB of its "
        "documents when it is larger",
    )
    workers: int | None = field(
        None,
        ge=1,
        le=1024,
        help="worker processes that clean, hash and tokenize (default: the CPUs this process may use)",
    )
    resume: bool = field(
        False, help="continue an interrupted prepare of the same source and settings where it stopped"
    )
    engine: Literal["local", "datatrove", "datatrove-slurm"] = field(
        "local",
        help="who runs the scan and tokenize passes: 'local' worker processes, or datatrove tasks on this "
        "machine or as Slurm job arrays (docs/data.md); the output is the same",
    )
    tasks: int | None = field(None, ge=1, help="datatrove engines: tasks per pass (default: workers)")
    slurm_partition: str = field("", help="datatrove-slurm: the partition the tasks run on")
    slurm_time: str = field("24:00:00", help="datatrove-slurm: time limit of a task")

    @property
    def ngram_n(self) -> int:
        """The decontamination n-gram length in use: ngram_index, or the tokenizer's default (0: none)."""
        return default_n(self.tokenizer) if self.ngram_index is None else self.ngram_index

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
        if self.ngram_index is not None and not _is_int(self.ngram_index):
            raise ConfigError(
                f"ngram_index must be null or an integer (0: no index), got {self.ngram_index!r}"
            )
        check_bounds(self)
        if self.engine == "datatrove-slurm" and not self.slurm_partition:
            raise ConfigError(
                "engine 'datatrove-slurm' needs slurm_partition (--slurm-partition), the tasks' partition"
            )
        if self.slurm_partition:  # written into sbatch scripts (datatrove's, or --emit slurm's)
            sbatch_value(self.slurm_partition, "--slurm-partition")
        slurm_time(self.slurm_time, "--slurm-time")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def assign_split(doc_id: str, seed: int, val_ratio: float, heldout_ratio: float) -> str:
    """Split of a document, from a hash of its id alone (so it never depends on order or offsets)."""
    u = xxhash.xxh64_intdigest(f"{seed}:{doc_id}".encode()) / 2**64
    if u < heldout_ratio:
        return "heldout"
    if u < heldout_ratio + val_ratio:
        return "val"
    return "train"


def prepare(cfg: PrepareConfig, progress: bool = True) -> dict[str, Any]:
    """Turn `cfg.source` into verified token shards under `cfg.out` and return the manifest written there.

    Streaming and resumable (tenx/data/prepare/stream.py): the source is read three times, never held in memory;
    n-grams are counted in hash partitions on disk (tenx/data/prepare/partitioned.py)."""
    cfg.validate()
    out = Path(cfg.out)
    check_prepare_out(out)
    source_entry = _source_entry(cfg)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = {"source": source_entry, "split": _split_settings(cfg), "prepare": _prepare_settings(cfg)}
    work = Work(out, fingerprint, cfg.resume)
    try:
        return _prepare(cfg, out, work, source_entry, progress)
    except DataError:  # the source cannot be prepared: nothing to resume, and nothing of ours is left behind
        work.clear()
        if created and not any(out.iterdir()):
            out.rmdir()
        raise


def _prepare(
    cfg: PrepareConfig, out: Path, work: Work, source_entry: dict[str, Any], progress: bool
) -> dict[str, Any]:
    workers = cfg.workers or usable_cpu_count()
    laps: dict[str, float] = {}
    lap = _stopwatch(laps)
    if cfg.engine != "local" and not work.state.get("scan", {}).get("final"):
        merge_scan(cfg, work, run_stage("scan", cfg, work))
    stats = scan(cfg, work, workers, progress)
    lap("scan")
    rows, ids = kept_documents(work)
    if not len(rows):
        raise DataError(
            f"{cfg.source!r} gave no usable documents ({stats['documents_seen']} read, "
            f"{stats['empty_skipped']} empty, {stats['binary_skipped']} binary); check the source and its patterns"
        )
    groups: list[list[int]] = []
    if cfg.near_dup_threshold:
        sigs = signatures(work, len(rows))
        valid = np.concatenate([sigs[i : i + 65536].any(axis=1) for i in range(0, len(rows), 65536)])
        groups = groups_from_signatures(sigs, valid, cfg.near_dup_threshold)
    lap("near-duplicates")
    split_names, dedup = group_splits(
        ids, lambda doc_id: assign_split(doc_id, cfg.seed, cfg.val_ratio, cfg.heldout_ratio), groups
    )
    members = {
        name: sorted((i for i, s in enumerate(split_names) if s == name), key=ids.__getitem__)
        for name in SPLITS
    }
    if not members["train"]:
        raise DataError(
            f"no documents of {cfg.source!r} landed in the train split ({stats['documents_kept']} kept after "
            "cleaning); add documents or lower val_ratio/heldout_ratio"
        )
    if cfg.tokenizer_from:  # before anything of an earlier preparation is removed
        _check_imported_tokenizer(cfg, rows, ids)
    previous = listed_files(out)  # only files an earlier manifest listed may be removed as stale
    # Drop any previous manifest first: shards are rewritten in place, and no manifest may point at them meanwhile.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    fsync_dir(out)

    tokenizer, tokenizer_entry = _build_tokenizer(cfg, work, rows, ids, members["train"], progress)
    lap("tokenizer")
    dtype = "uint16" if tokenizer.vocab_size <= 65535 else "uint32"
    if cfg.engine != "local" and not work.state.get("tokenize", {}).get("final"):
        tasks = run_stage("tokenize", cfg, work, (tokenizer_entry, dtype))
        merge_tokenize(work, tasks, len(rows), dtype)
    offsets = tokenize(cfg, work, rows, tokenizer_entry, dtype, workers, progress)
    lap("tokenize")
    reader = TokenReader(work, offsets, dtype)
    try:
        added: list[np.ndarray] = []
        if cfg.ngram_n:
            dedup.moved_for_contamination, added, partitions = _move_contaminated(
                cfg, work, members, ids, reader, tokenizer.eot_id, int(offsets["length"].sum())
            )
        lap("decontamination")
        splits = {
            name: _write_split(out, name, members[name], ids, rows, reader, cfg.shard_tokens)
            for name in SPLITS
        }
    finally:
        reader.close()
    manifest = {
        "format": FORMAT,
        "source": source_entry,
        "tokenizer": tokenizer_entry,
        "dtype": dtype,
        "split": _split_settings(cfg),
        "prepare": _prepare_settings(cfg),
        "stats": stats,
        "dedup": asdict(dedup),
        "splits": splits,
    }
    atomic_write_json(out / MANIFEST_NAME, manifest)
    remove_stale_files(out, manifest, previous)
    remove_stale_indexes(out)
    if cfg.ngram_n:
        shards = [shard["xxhash"] for shard in splits["train"]["shards"]]
        write_index(out, partitions, added, cfg.ngram_n, tokenizer.eot_id, shards)
    lap("shards and index")
    work.clear()
    if progress:
        print("passes (s): " + ", ".join(f"{k} {v:.1f}" for k, v in laps.items()), file=sys.stderr)
    return manifest


def _stopwatch(laps: dict[str, float]) -> Any:
    """lap(name): the seconds since the previous lap, recorded under name."""
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        laps[name], last[0] = now - last[0], now

    return lap


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
        if cfg.ngram_n:
            load_index(cfg.out, cfg.ngram_n)
    except DataError:
        return False
    return True


def format_prepare_summary(manifest: dict[str, Any], data_dir: str | Path | None = None) -> str:
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
        "ngram_index": cfg.ngram_n,
        "contamination_threshold": cfg.contamination_threshold if cfg.ngram_n else None,
        # recorded only when it differs from the default, so that earlier manifests stay valid
        **(
            {"tokenizer_sample_mb": cfg.tokenizer_sample_mb}
            if cfg.tokenizer == "bpe" and cfg.tokenizer_sample_mb != TOKENIZER_SAMPLE_MB
            else {}
        ),
    }


def _check_imported_tokenizer(cfg: PrepareConfig, rows: np.ndarray, ids: list[str]) -> None:
    """Refuse a `--tokenizer-from` tokenizer that does not give back the corpus's text (a normalizer that
    lowercases, say), checked on documents spread over the corpus (tenx.data.tokenizer.check_round_trip)."""
    from tenx.data.tokenizer import check_round_trip, load_hf_tokenizer, round_trip_sample

    chosen = sorted(round_trip_sample(rows["num_bytes"].tolist()), key=lambda i: int(rows["seq"][i]))
    names = [ids[i] for i in chosen]  # zip stops at the last one: the source is read no further
    sample = zip(names, texts(cfg, rows["seq"][chosen], False), itertools.repeat(None))
    check_round_trip(load_hf_tokenizer(cfg.tokenizer_from), sample, f"--tokenizer-from {cfg.tokenizer_from}")


def _build_tokenizer(
    cfg: PrepareConfig, work: Work, rows: np.ndarray, ids: list[str], train: list[int], progress: bool
) -> tuple[Tokenizer, dict[str, Any]]:
    """Bytes, a model directory's (tokenizer_from), or a BPE trained on the train split (on a seeded sample of
    about tokenizer_sample_mb of it when larger), saved in OUT, and its manifest entry (a trained one is kept)."""
    if cfg.tokenizer == "bytes" or cfg.tokenizer_from:  # an imported one is taken as it is, like bytes
        from tenx.data.tokenizer import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(cfg.tokenizer_from) if cfg.tokenizer_from else ByteTokenizer()
        return tokenizer, tokenizer.save(Path(cfg.out))
    entry = work.state.get("tokenizer")
    if entry is not None:
        try:
            return load_tokenizer(cfg.out, entry), entry
        except DataError:
            pass  # trained again below
    sizes = rows["num_bytes"][train]
    budget, total = cfg.tokenizer_sample_mb * 1e6, float(sizes.sum())
    if total > budget:
        chosen = [
            i
            for i in train
            if xxhash.xxh64_intdigest(f"{cfg.seed}:sample:{ids[i]}".encode()) < budget / total * 2**64
        ]
    else:
        chosen = train
    wanted = np.sort(rows["seq"][chosen])
    if progress:
        mb = float(rows["num_bytes"][chosen].sum()) / 1e6
        print(
            f"training BPE tokenizer (vocab_size {cfg.vocab_size}) on {len(chosen):,} documents ({mb:.1f} MB)",
            file=sys.stderr,
        )
    tokenizer = train_bpe(texts(cfg, wanted, progress), cfg.vocab_size)
    entry = tokenizer.save(Path(cfg.out))
    work.commit("tokenizer", entry)
    return tokenizer, entry


def _move_contaminated(
    cfg: PrepareConfig,
    work: Work,
    members: dict[str, list[int]],
    ids: list[str],
    reader: TokenReader,
    eot_id: int,
    total_tokens: int,
) -> tuple[dict[str, Any], list[np.ndarray], Partitions]:
    """Move the val and held-out documents that decontamination names into train (tenx.data.ngrams.
    decontaminate_partitions, counted in hash partitions); the manifest's record, the moved documents' hashes and the
    partitions (the train index is written from them).

    The tokenizer, trained on the train split before the move, is kept: retraining it would change the
    token ids and so the very n-grams just measured, and the moved documents, unseen by it, are encoded
    like any other text it did not see; they only add training data."""
    held = members["val"] + members["heldout"]
    partitions = Partitions(work.path("ngrams"), total_tokens)
    documents = itertools.chain(
        (("train", reader(i)) for i in members["train"]), (("held", reader(i)) for i in held)
    )
    windows = fill(partitions, documents, cfg.ngram_n, eot_id, len(held))
    result, added = decontaminate_partitions(partitions, windows, cfg.contamination_threshold)
    moving = {held[i] for i in result.moved}
    moved = sorted(ids[i] for i in moving)
    record: dict[str, Any] = {
        "n": cfg.ngram_n,
        "threshold": cfg.contamination_threshold,
        "count": len(moved),
    }
    for name in ("val", "heldout"):
        record[f"from_{name}"] = sum(i in moving for i in members[name])
        if record[f"from_{name}"] * 2 > len(members[name]) >= MIN_SPLIT_FOR_WARNING:
            print(
                f"warning: decontamination moved {record[f'from_{name}']} of {len(members[name])} {name} "
                f"documents into train for sharing > {cfg.contamination_threshold:g} of their "
                f"{cfg.ngram_n}-token n-grams with it: n-grams this short match ordinary boilerplate for "
                f"tokenizer {cfg.tokenizer!r}; prepare again with a longer --ngram-index (default: "
                f"{default_n(cfg.tokenizer)}) unless the {name} split really is mostly copies",
                file=sys.stderr,
            )
        members["train"] += [i for i in members[name] if i in moving]
        members[name] = [i for i in members[name] if i not in moving]
    members["train"].sort(key=ids.__getitem__)
    if not result.converged:
        print(
            f"warning: decontamination stopped after {result.rounds} passes while still moving documents; "
            f"val or held-out may keep some above {cfg.contamination_threshold:g}",
            file=sys.stderr,
        )
    record = {**record, "documents": moved[:50], "rounds": result.rounds, "converged": result.converged}
    return record, added, partitions


def _write_split(
    out: Path,
    split: str,
    members: list[int],
    ids: list[str],
    rows: np.ndarray,
    reader: TokenReader,
    shard_tokens: int,
) -> dict[str, Any]:
    writer = ShardWriter(out, split, shard_tokens)
    for i in members:
        writer.add(reader(i))
    writer.flush()
    return {
        "num_documents": len(members),
        "bytes": int(rows["num_bytes"][members].sum()) if members else 0,
        "tokens": sum(shard["tokens"] for shard in writer.shards),
        "documents": [ids[i] for i in members],
        "shards": writer.shards,
    }
