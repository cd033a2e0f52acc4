"""Decontamination and the train n-gram index of a corpus larger than memory: hash-partitioned on disk.

Every n-gram hash (tenx.data.ngrams: windows inside one document) goes to one of P partition files by its
top log2(P) bits, P chosen so that a partition holds about PARTITION_HASHES hashes. Train hashes are made
sorted and unique one partition at a time; since a partition is a range of hash values, the partitions in
order are the sorted unique index (`ngrams-N.npy`, written piece by piece, byte-identical to
`build_index`). Val and held-out windows are kept with their document's number; decontaminate's rounds
(tenx.data.ngrams.decontaminate: move every candidate sharing more than the threshold of its windows with
train, then check the rest against train plus what moved) count, per partition, the windows found in train
once, and in each later round only the windows not found there against the moved documents'. Results are
the same as the in-memory functions'; memory is one partition at a time.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tenx.data.ngrams import (
    HASH_VERSION,
    MAX_DECONTAMINATION_ROUNDS,
    Decontamination,
    _batched_document_hashes,
    _in_sorted,
    index_paths,
    sorted_unique,
)
from tenx.utils.io import AtomicOutput, atomic_write_json

PARTITION_HASHES = 1 << 24
"""Hashes per partition aimed at (128 MiB of uint64): the memory of the partitioned steps."""
HELD = np.dtype([("hash", "<u8"), ("doc", "<u4")])


class Partitions:
    """Partition files of train hashes and of candidates' (hash, document) pairs under `root`."""

    def __init__(self, root: Path, expected_hashes: int) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.bits = max(0, math.ceil(math.log2(max(1, expected_hashes) / PARTITION_HASHES)))
        self.count = 1 << self.bits

    def of(self, hashes: np.ndarray) -> np.ndarray:
        return (
            (hashes >> np.uint64(64 - self.bits)).astype(np.int64)
            if self.bits
            else np.zeros(len(hashes), np.int64)
        )

    def _append(self, kind: str, values: np.ndarray, parts: np.ndarray) -> None:
        order = np.argsort(parts, kind="stable")
        values, parts = values[order], parts[order]
        cuts = np.flatnonzero(parts[1:] != parts[:-1]) + 1
        for piece in np.split(np.arange(len(values)), cuts):
            if len(piece):
                with open(self.root / f"{kind}-{int(parts[piece[0]]):05d}.bin", "ab") as f:
                    f.write(values[piece].tobytes())

    def add_train(self, hashes: np.ndarray) -> None:
        self._append("train", hashes, self.of(hashes))

    def add_held(self, hashes: np.ndarray, doc: np.ndarray) -> None:
        pairs = np.empty(len(hashes), dtype=HELD)
        pairs["hash"], pairs["doc"] = hashes, doc
        self._append("held", pairs, self.of(hashes))

    def load(self, kind: str, p: int, dtype: Any) -> np.ndarray:
        path = self.root / f"{kind}-{p:05d}.bin"
        return np.fromfile(path, dtype=dtype) if path.exists() else np.empty(0, dtype=dtype)

    def finish_train(self) -> None:
        """Each train partition sorted and unique, in place."""
        for p in range(self.count):
            path = self.root / f"train-{p:05d}.bin"
            if path.exists():
                sorted_unique(np.fromfile(path, dtype=np.uint64)).tofile(path)


def fill(
    partitions: Partitions,
    documents: Iterator[tuple[str, np.ndarray]],
    n: int,
    eot_id: int,
    candidates: int,
) -> np.ndarray:
    """Hash (kind, tokens) documents in order ('train', or 'held' for the candidates, numbered in order)
    into the partitions; the number of windows of each candidate."""
    windows = np.zeros(candidates, dtype=np.int64)
    held_seen = 0
    batch: list[tuple[str, np.ndarray]] = []

    def flush() -> None:
        nonlocal held_seen
        hashes = _batched_document_hashes([t for _, t in batch], n, eot_id)
        lists = [h for chunk in hashes for h in chunk]
        train = [h for (kind, _), h in zip(batch, lists) if kind == "train"]
        if train:
            partitions.add_train(np.concatenate(train))
        held = [
            (held_seen + k, h)
            for k, h in enumerate(h for (kind, _), h in zip(batch, lists) if kind == "held")
        ]
        for doc, h in held:
            windows[doc] = len(h)
        if held:
            partitions.add_held(
                np.concatenate([h for _, h in held]),
                np.concatenate([np.full(len(h), doc, dtype=np.uint32) for doc, h in held]),
            )
        held_seen += len(held)
        batch.clear()

    size = 0
    for kind, tokens in documents:
        batch.append((kind, tokens))
        size += len(tokens)
        if size >= 1 << 22:
            flush()
            size = 0
    if batch:
        flush()
    partitions.finish_train()
    return windows


def decontaminate_partitions(
    partitions: Partitions,
    windows: np.ndarray,
    threshold: float,
    max_rounds: int = MAX_DECONTAMINATION_ROUNDS,
) -> tuple[Decontamination, list[np.ndarray]]:
    """decontaminate's rounds over the partitions; also each partition's sorted hashes of moved documents."""
    found = np.zeros(len(windows), dtype=np.int64)
    for p in range(partitions.count):  # windows found in train: fixed across rounds
        train, held = partitions.load("train", p, np.uint64), partitions.load("held", p, HELD)
        hit = _in_sorted(train, held["hash"])
        found += np.bincount(held["doc"][hit].astype(np.int64), minlength=len(windows))
        held[~hit].tofile(partitions.root / f"rest-{p:05d}.bin")
    left = np.flatnonzero(windows > 0)  # no n-grams: never contaminated
    moved: list[int] = []
    added = [np.empty(0, dtype=np.uint64) for _ in range(partitions.count)]
    for rounds in range(1, max_rounds + 1):
        shared = found.copy()
        if rounds > 1:
            for p in range(partitions.count):
                rest = partitions.load("rest", p, HELD)
                hit = _in_sorted(added[p], rest["hash"])
                shared += np.bincount(rest["doc"][hit].astype(np.int64), minlength=len(windows))
        over = left[shared[left] / windows[left] > threshold]
        if not len(over):
            return Decontamination(sorted(moved), rounds, True), added
        moved += over.tolist()
        left = np.setdiff1d(left, over)
        moving = np.zeros(len(windows), dtype=bool)
        moving[over] = True
        for p in range(partitions.count):
            held = partitions.load("held", p, HELD)
            added[p] = sorted_unique(np.concatenate([added[p], held["hash"][moving[held["doc"]]]]))
    return Decontamination(sorted(moved), max_rounds, False), added


def write_index(
    data_dir: Path, partitions: Partitions, added: list[np.ndarray], n: int, eot_id: int, shards: list[str]
) -> Path:
    """ngrams-N.npy of train (train partitions plus the moved documents' hashes) and its sidecar, written
    piece by piece; the same bytes as tenx.data.ngrams.build_index."""
    count = 0
    for p in range(partitions.count):
        final = sorted_unique(np.concatenate([partitions.load("train", p, np.uint64), added[p]]))
        final.tofile(partitions.root / f"index-{p:05d}.bin")
        count += len(final)
    header = io.BytesIO()
    descr = np.lib.format.dtype_to_descr(np.dtype(np.uint64))
    np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": (count,)})
    path, sidecar = index_paths(data_dir, n)
    digest = xxhash.xxh3_64()
    with AtomicOutput(path) as f:
        for piece in [header.getvalue()] + [
            partitions.root / f"index-{p:05d}.bin" for p in range(partitions.count)
        ]:
            data = piece if isinstance(piece, bytes) else piece.read_bytes()
            f.write(data)
            digest.update(data)
    atomic_write_json(
        sidecar,
        {
            "n": n,
            "split": "train",
            "count": count,
            "hash": HASH_VERSION,
            "eot_id": eot_id,
            "xxhash": digest.hexdigest(),
            "shards": shards,
        },
    )
    return path
