"""The streaming passes of `tenx data prepare`: bounded memory, every core, resumable.

The source is read three times, in its own deterministic order, and never held in memory:

1. **scan**: worker processes clean each document and compute its exact digest and MinHash signature; the
   main process drops exact duplicates (the first in read order stays) and appends one fixed-size row per
   kept document (read position, bytes, digest) to `rows.bin`, its id to `ids.txt` and its signature to
   `signatures.bin`, all in the work directory `OUT/.prepare-work/`.
2. **sample** (BPE only): the tokenizer is trained on the train split's documents, or, when they exceed
   `tokenizer_sample_mb`, on a seeded sample of them (a document is in it when a hash of seed and id falls
   below budget / train bytes: about the budget, the same documents for any order or worker count).
3. **tokenize**: worker processes clean and encode each kept document; the main process appends its tokens
   to `tokens.bin` in read order and its (offset, length) to `offsets.bin`.

Every result comes back in submission order (`ordered_map`), and every decision is made by the main
process in read order, so the output does not depend on the number of workers. Memory: a bounded window
of batches in flight, plus per kept document its id, digest, row and offsets (the dedup index; about 100
bytes and the id), and one LSH band key per document at a time when grouping near-duplicates.

Resume: after each chunk of batches the main process flushes and fsyncs its files and then records, in
`state.json` (atomically), how far it got: the read position and the committed length of every file. A
resumed pass truncates each file to its committed length, skips the source up to that position and goes
on; a killed pass loses at most one chunk of work. `state.json` also holds a fingerprint of the settings
that shape the output, and a resume with other settings starts over.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from tqdm import tqdm

from tenx.data.manifest import INDEX_DTYPE
from tenx.data.prepare.pool import ordered_map
from tenx.errors import DataError
from tenx.utils.io import AtomicOutput, atomic_write_bytes, atomic_write_json, bytes_xxhash
from tenx.utils.text import first_line

WORK_DIR = ".prepare-work"
ROW = np.dtype([("seq", "<u8"), ("num_bytes", "<u8"), ("digest", "V16")])
OFFSET = np.dtype([("start", "<u8"), ("length", "<u8")])
BATCH_DOCUMENTS = 512
BATCH_BYTES = 4 << 20
COMMIT_BATCHES = 16
"""Batches between two commits of a pass (at most this much work is redone after a kill)."""


class Work:
    """The work directory of one preparation: its files and `state.json`."""

    def __init__(self, out: Path, fingerprint: dict[str, Any], resume: bool) -> None:
        self.dir = out / WORK_DIR
        self.state_path = self.dir / "state.json"
        if self.dir.exists() and (
            self.dir.is_symlink() or not self.dir.is_dir() or not self.state_path.is_file()
        ):
            if self.dir.is_symlink() or not self.dir.is_dir() or any(self.dir.iterdir()):
                raise DataError(
                    f"{self.dir} exists but is not a tenx work directory (no state.json); move it away, "
                    "nothing was changed"
                )
        state: dict[str, Any] = {}
        if resume:
            try:
                state = json.loads(self.state_path.read_text())
            except (OSError, ValueError):
                state = {}
            if state.get("fingerprint") != fingerprint:
                if state:
                    print(
                        "--resume: the interrupted preparation had other settings; starting over",
                        file=sys.stderr,
                    )
                state = {}
        if not state:
            self.clear()
            self.dir.mkdir(parents=True, exist_ok=True)
            state = {"fingerprint": fingerprint}
        self.state = state
        self.resumed = resume and len(state) > 1

    def path(self, name: str) -> Path:
        return self.dir / name

    def commit(self, key: str, value: Any) -> None:
        """Record `value` under `key` in state.json, atomically, after the files it describes are synced."""
        self.state[key] = value
        atomic_write_json(self.state_path, self.state)

    def clear(self) -> None:
        """Delete the work directory (tenx's own files only: it lives inside the output directory)."""
        if self.dir.is_dir() and not self.dir.is_symlink():
            shutil.rmtree(self.dir)


class _Appender:
    """A file appended to and committed by length: reopened, it is cut back to its committed length."""

    def __init__(self, path: Path, committed: int) -> None:
        self.path = path
        mode = "r+b" if path.exists() else "w+b"
        self.f = open(path, mode)  # noqa: SIM115 - closed by close()
        self.f.truncate(committed)
        self.f.seek(committed)
        self.length = committed

    def write(self, data: bytes) -> None:
        self.f.write(data)
        self.length += len(data)

    def sync(self) -> int:
        self.f.flush()
        os.fsync(self.f.fileno())
        return self.length

    def close(self) -> None:
        self.f.close()


def _batches(docs: Iterable[tuple[int, Any, Any]]) -> Iterator[list[tuple[int, Any, Any]]]:
    batch: list[tuple[int, Any, Any]] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[2])
        if len(batch) >= BATCH_DOCUMENTS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# ----- scan -------------------------------------------------------------------------------------------------
_SCAN: dict[str, Any] = {}


def _scan_init(shingle: int, near_dups: bool) -> None:
    from tenx.data.prepare.dedup import permutations

    _SCAN.update(shingle=shingle, perms=permutations() if near_dups else None)


def _scan_batch(batch: list[tuple[int, str, Any]]) -> list[tuple[str, Any, Any, Any]]:
    """Per document: (outcome, digest, num_bytes, signature), outcome 'kept' or a CleaningStats counter."""
    from tenx.data.prepare.clean import CleaningStats, clean_text
    from tenx.data.prepare.dedup import signature

    out = []
    for _, _, data in batch:
        stats = CleaningStats()
        cleaned = clean_text(data, stats)
        if cleaned is None:
            reason = "binary_skipped" if stats.binary_skipped else "empty_skipped"
            out.append((reason, None, 0, None))
            continue
        text, encoded = cleaned
        sig = signature(text, _SCAN["shingle"], _SCAN["perms"]) if _SCAN["perms"] is not None else None
        flag = "kept-replaced" if stats.decoded_with_replacement else "kept"
        out.append((flag, xxhash.xxh3_128_digest(encoded), len(encoded), sig))
    return out


def _source(
    cfg: Any, start: int, seen_ids: set[str] | None = None, select: Callable[[int], bool] | None = None
) -> Iterator[tuple[int, str, Any]]:
    """(read position, id, raw data) of the source's documents from `start` (ids before it go to seen_ids);
    with `select`, a rejected position may come with empty data (see iter_documents)."""
    import itertools

    from tenx.data.prepare.sources import iter_documents

    raw = iter_documents(
        cfg.source,
        patterns=cfg.patterns,
        text_field=cfg.text_field,
        id_field=cfg.id_field,
        column=cfg.column,
        select=select,
    )
    for seq, doc in enumerate(itertools.islice(raw, cfg.max_documents)):
        if seq < start:
            if seen_ids is not None:
                seen_ids.add(doc.id)
            continue
        yield seq, doc.id, doc.data


class Scanner:
    """The main process's side of the scan: every document's outcome in read order goes through `take`,
    which counts it, refuses a repeated id, drops an exact duplicate and appends a kept document's row, id
    and signature; `commit` records how far it got. The same for local workers and for engine tasks."""

    def __init__(self, cfg: Any, work: Work) -> None:
        from tenx.data.prepare.clean import CleaningStats
        from tenx.data.prepare.dedup import NUM_PERM

        self.cfg, self.work = cfg, work
        self.done = work.state.get(
            "scan", {"seq": 0, "rows": 0, "ids": 0, "signatures": 0, "stats": {}, "final": False}
        )
        self.stats = CleaningStats(**self.done["stats"])
        self.rows = _Appender(work.path("rows.bin"), self.done["rows"])
        self.ids = _Appender(work.path("ids.txt"), self.done["ids"])
        self.sigs = _Appender(work.path("signatures.bin"), self.done["signatures"])
        self.seen_ids: set[str] = set()
        self.digests = (
            {bytes(r["digest"]) for r in np.fromfile(work.path("rows.bin"), dtype=ROW)}
            if self.done["rows"]
            else set()
        )
        self.near = bool(cfg.near_dup_threshold)
        self._empty = np.zeros(NUM_PERM, dtype=np.uint64).tobytes()

    def take(
        self, seq: int, doc_id: str, outcome: str, digest: bytes | None, num_bytes: int, sig: Any
    ) -> None:
        stats = self.stats
        stats.documents_seen += 1
        if doc_id in self.seen_ids:
            raise DataError(
                f"{self.cfg.source}: two documents share the id {doc_id!r}; document ids must be unique"
            )
        self.seen_ids.add(doc_id)
        if not outcome.startswith("kept"):
            setattr(stats, outcome, getattr(stats, outcome) + 1)
            return
        stats.decoded_with_replacement += outcome == "kept-replaced"
        if digest in self.digests:
            stats.duplicates_removed += 1
            return
        self.digests.add(digest)
        stats.documents_kept += 1
        self.rows.write(np.array([(seq, num_bytes, digest)], dtype=ROW).tobytes())
        self.ids.write(json.dumps(doc_id).encode() + b"\n")
        if self.near:
            self.sigs.write(sig.tobytes() if sig is not None else self._empty)

    def commit(self, seq: int | None, final: bool) -> None:
        record = {
            "seq": seq if seq is not None else self.done["seq"],
            "rows": self.rows.sync(),
            "ids": self.ids.sync(),
            "signatures": self.sigs.sync(),
            "stats": asdict(self.stats),
            "final": final,
        }
        self.work.commit("scan", record)

    def close(self) -> None:
        for f in (self.rows, self.ids, self.sigs):
            f.close()


def scan(cfg: Any, work: Work, workers: int, progress: bool) -> dict[str, Any]:
    """Pass 1 (resumable): the kept documents' rows, ids and signatures; returns the cleaning stats."""
    done = work.state.get("scan")
    if done is not None and done["final"]:
        return done["stats"]
    scanner = Scanner(cfg, work)
    batches = _batches(_source(cfg, scanner.done["seq"], scanner.seen_ids))
    pending: list[list[tuple[int, str, Any]]] = []

    def tracked() -> Iterator[list[tuple[int, str, Any]]]:
        for batch in batches:
            pending.append(batch)
            yield batch

    count = 0
    bar = tqdm(desc="scanning", unit="doc", disable=not progress, file=sys.stderr)
    init = (cfg.near_dup_shingle, scanner.near)
    try:
        for results in ordered_map(_scan_batch, tracked(), workers, _scan_init, init):
            batch = pending.pop(0)
            for (seq, doc_id, _), result in zip(batch, results, strict=True):
                scanner.take(seq, doc_id, *result)
            bar.update(len(batch))
            count += 1
            if count % COMMIT_BATCHES == 0:
                scanner.commit(batch[-1][0] + 1, final=False)
        scanner.commit(None, final=True)
    finally:
        bar.close()
        scanner.close()
    return asdict(scanner.stats)


def kept_documents(work: Work) -> tuple[np.ndarray, list[str]]:
    """The rows and ids of the kept documents, in read order (after `scan`)."""
    rows = np.fromfile(work.path("rows.bin"), dtype=ROW)
    with open(work.path("ids.txt"), "rb") as f:  # JSON strings, not objects: checked against rows.bin below
        ids = [json.loads(line) for line in f]
    if len(ids) != len(rows):
        raise DataError(
            f"{work.dir}: {len(rows)} rows but {len(ids)} ids; delete the directory and prepare again"
        )
    return rows, ids


def signatures(work: Work, count: int) -> np.ndarray:
    """The kept documents' MinHash signatures, memory-mapped (an all-zero row: no words)."""
    from tenx.data.prepare.dedup import NUM_PERM

    if count == 0:
        return np.zeros((0, NUM_PERM), dtype=np.uint64)
    return np.memmap(work.path("signatures.bin"), dtype=np.uint64, mode="r", shape=(count, NUM_PERM))


# ----- texts for the tokenizer, and tokenization -------------------------------------------------------------
def _clean(data: Any) -> str:
    from tenx.data.prepare.clean import CleaningStats, clean_text

    cleaned = clean_text(data, CleaningStats())
    assert cleaned is not None, "a kept document no longer cleans: the source changed during prepare"
    return cleaned[0]


def texts(cfg: Any, wanted: np.ndarray, progress: bool) -> Iterator[str]:
    """The cleaned texts of the documents at the read positions `wanted` (sorted), in read order."""
    want = set(wanted.tolist())
    bar = tqdm(total=len(want), desc="tokenizer sample", unit="doc", disable=not progress, file=sys.stderr)
    for seq, _, data in _source(cfg, 0):
        if seq in want:
            bar.update(1)
            yield _clean(data)
    bar.close()


_TOKENIZE: dict[str, Any] = {}


def _tokenize_init(data_dir: str, entry: dict[str, Any], dtype: str) -> None:
    from tenx.data.tokenizer import load_tokenizer

    _TOKENIZE.update(tokenizer=load_tokenizer(data_dir, entry), dtype=np.dtype(dtype))


def _tokenize_batch(batch: list[tuple[int, str, Any]]) -> list[bytes]:
    tokenizer, dtype = _TOKENIZE["tokenizer"], _TOKENIZE["dtype"]
    out = []
    texts = [_clean(data) for _, _, data in batch]
    try:
        encoded = tokenizer.encode_batch(texts)
    except BaseException as e:  # noqa: BLE001 - a panic inside `tokenizers` (PanicException) is no Exception
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise DataError(_encode_failure(tokenizer, batch, e)) from None
    for ids in encoded:
        tokens = np.empty(len(ids) + 1, dtype=dtype)
        tokens[:-1] = ids
        tokens[-1] = tokenizer.eot_id
        out.append(tokens.tobytes())
    return out


def _encode_failure(tokenizer: Any, batch: list[tuple[int, str, Any]], error: BaseException) -> str:
    """The message for a batch the tokenizer failed to encode: the documents, the error, and the tokenizer's
    regular expressions (Oniguruma's retry limit, reached on a pattern that backtracks, is the usual cause)."""
    from tenx.data.tokenizer_regex import tokenizer_regexes

    to_json = getattr(tokenizer, "to_json", None)
    patterns = [p for _, p in tokenizer_regexes(to_json())] if to_json else []
    first = batch[0][1] if batch else "?"
    for _, doc_id, data in batch:  # name the document it fails on
        try:
            tokenizer.encode(_clean(data))
        except BaseException as e:  # noqa: BLE001 - as in _tokenize_batch
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            first, error = doc_id, e
            break
    named = (
        f"; its regex {patterns[0][:200]!r} may backtrack on them"
        if len(patterns) == 1
        else (f"; its regexes {[p[:100] for p in patterns]!r} may backtrack on them" if patterns else "")
    )
    return (
        f"the tokenizer failed on document {first!r} ({first_line(error)}){named}; "
        "use a tokenizer whose pre-tokenizer patterns repeat only single characters and classes"
    )


def tokenize(
    cfg: Any, work: Work, rows: np.ndarray, entry: dict[str, Any], dtype: str, workers: int, progress: bool
) -> np.ndarray:
    """Pass 3 (resumable): every kept document's tokens (ending with the end-of-document id) appended to
    tokens.bin in read order; returns their (start, length) in tokens."""
    done = work.state.get("tokenize", {"seq": 0, "tokens": 0, "offsets": 0, "final": False})
    itemsize = np.dtype(dtype).itemsize
    if not done["final"]:
        tokens = _Appender(work.path("tokens.bin"), done["tokens"])
        offsets = _Appender(work.path("offsets.bin"), done["offsets"])
        kept = set(rows["seq"].tolist())
        total = int(rows["num_bytes"].sum())
        bar = tqdm(
            total=total, desc="tokenizing", unit="B", unit_scale=True, disable=not progress, file=sys.stderr
        )
        pending: list[list[tuple[int, str, Any]]] = []

        def tracked() -> Iterator[list[tuple[int, str, Any]]]:
            for batch in _batches(d for d in _source(cfg, done["seq"]) if d[0] in kept):
                pending.append(batch)
                yield batch

        count = 0
        try:
            initargs = (str(Path(cfg.out)), entry, dtype)
            for encoded in ordered_map(_tokenize_batch, tracked(), workers, _tokenize_init, initargs):
                batch = pending.pop(0)
                for data in encoded:
                    start = tokens.length // itemsize
                    tokens.write(data)
                    offsets.write(np.array([(start, len(data) // itemsize)], dtype=OFFSET).tobytes())
                bar.update(sum(len(d[2]) for d in batch))
                count += 1
                if count % COMMIT_BATCHES == 0:
                    work.commit(
                        "tokenize",
                        {
                            "seq": batch[-1][0] + 1,
                            "tokens": tokens.sync(),
                            "offsets": offsets.sync(),
                            "final": False,
                        },
                    )
            work.commit(
                "tokenize", {"seq": None, "tokens": tokens.sync(), "offsets": offsets.sync(), "final": True}
            )
        finally:
            bar.close()
            tokens.close()
            offsets.close()
    result = np.fromfile(work.path("offsets.bin"), dtype=OFFSET)
    if len(result) != len(rows):
        raise DataError(
            f"{work.dir}: {len(result)} tokenized documents of {len(rows)}; prepare again without --resume"
        )
    return result


class TokenReader:
    """Reads one document's tokens from tokens.bin (explicit reads: no memory map grows the resident set)."""

    def __init__(self, work: Work, offsets: np.ndarray, dtype: str) -> None:
        self.f = open(work.path("tokens.bin"), "rb")  # noqa: SIM115 - closed by close()
        self.offsets, self.dtype = offsets, np.dtype(dtype)

    def __call__(self, i: int) -> np.ndarray:
        start, length = self.offsets[i]
        self.f.seek(int(start) * self.dtype.itemsize)
        return np.fromfile(self.f, dtype=self.dtype, count=int(length))

    def close(self) -> None:
        self.f.close()


class ShardWriter:
    """Writes `{split}_{i:05d}.bin/.idx` pairs cut at document boundaries, streaming each shard into an
    AtomicOutput that is published once complete (a shard is never read half-written)."""

    def __init__(self, out: Path, split: str, shard_tokens: int) -> None:
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._output: AtomicOutput | None = None
        self._starts: list[int] = []
        self._tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        if self._tokens and self._tokens + len(tokens) > self.shard_tokens:
            self.flush()
        if self._output is None:
            self._output = AtomicOutput(self.out / f"{self.split}_{len(self.shards):05d}.bin")
            self._digest = xxhash.xxh3_64()
        data = tokens.tobytes()
        self._output.file.write(data)
        self._digest.update(data)
        self._starts.append(self._tokens)
        self._tokens += len(tokens)

    def flush(self) -> None:
        if self._output is None:
            return
        stem = f"{self.split}_{len(self.shards):05d}"
        index = np.asarray(self._starts, dtype=INDEX_DTYPE).tobytes()
        atomic_write_bytes(self.out / f"{stem}.idx", index)
        self._output.publish()
        self._output = None
        self.shards.append(
            {
                "file": f"{stem}.bin",
                "index_file": f"{stem}.idx",
                "tokens": self._tokens,
                "documents": len(self._starts),
                "xxhash": self._digest.hexdigest(),
                "index_xxhash": bytes_xxhash(index),
            }
        )
        self._starts, self._tokens = [], 0
