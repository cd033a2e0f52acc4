"""Near-duplicate documents, kept but placed in one split: MinHash + LSH over word shingles.

Exact duplicates (same cleaned bytes) are removed while reading; near-duplicates are distinct documents
(a file copied to another folder with a changed header line, whitespace edits, a vendored copy with a
version bump) and are kept, but a group of them must never straddle the train/held-out boundary, or the
held-out split measures memorisation. So every member of a group takes the split of its representative,
the member with the smallest id.

Method: a document's shingles are its overlapping runs of `shingle` words (`\\w+`, so whitespace and
punctuation edits do not count; a document of fewer words is one shingle); a 128-permutation MinHash of
the shingle set goes into a `datasketch.MinHashLSH` at the Jaccard threshold; each candidate pair the LSH
returns (its bands are chosen for recall: lsh_bands) is kept when the MinHash estimate of its Jaccard
similarity is at least the threshold, and groups are the connected components of the kept pairs
(union-find), so near-copies of near-copies join one group.

Defaults: 5-word shingles, Jaccard >= 0.8. On the CPython 3.11 standard library (1,743 documents after
exact deduplication, 31.5 MB) this takes 2.2 s on one core and finds 15 groups of 40 documents (codec
tables, `*_str.py` twins of test modules), moving 1 document; every pair at true Jaccard >= 0.8 among the
candidates of a looser 0.3 search is grouped. Templated siblings below 0.8 (codec modules differing in
their names, 0.55-0.69) are not grouped: prepare then moves every val or held-out document sharing more
than half of its 13-grams with train into train (tenx.data.ngrams.decontaminate; 9 on the stdlib).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from datasketch import MinHash
from tqdm import tqdm

from tenx.data.ngrams import sorted_unique

NUM_PERM = 128
"""MinHash permutations: the Jaccard estimate has a standard error of about 0.035 near 0.8."""
MINHASH_SEED = 1
_WORD = re.compile(r"\w+")
_CHUNK = 4096
"""Shingles per MinHash update (each update builds a chunk x NUM_PERM array)."""
_SHINGLE_MULTIPLIER = np.uint64(0x100000001B3)
LSH_RECALL = 0.99
"""Smallest chance that a pair exactly at the threshold becomes an LSH candidate (see lsh_bands)."""


@dataclass
class DedupStats:
    """What near-duplicate grouping found, and what decontamination moved: the manifest's `dedup` entry."""

    near_duplicate_groups: int = 0
    near_duplicate_documents: int = 0
    moved_to_group_split: int = 0
    largest_group: int = 0
    moved_for_contamination: dict[str, Any] | None = None
    """Val and held-out documents moved into train for sharing too many n-grams with it (n, threshold,
    count, from_val, from_heldout, the first 50 ids, passes, converged); None when that step is off."""


def shingle_hashes(text: str, shingle: int) -> np.ndarray:
    """Sorted unique uint64 hashes of the runs of `shingle` consecutive words of `text` (empty: no words)."""
    words = _WORD.findall(text)
    if not words:
        return np.empty(0, dtype=np.uint64)
    word_hashes = np.fromiter(
        (xxhash.xxh3_64_intdigest(w.encode("utf-8", "surrogatepass")) for w in words),
        dtype=np.uint64,
        count=len(words),
    )
    width = min(shingle, len(words))
    count = len(words) - width + 1
    hashes = np.zeros(count, dtype=np.uint64)
    for k in range(width):
        hashes = (hashes * _SHINGLE_MULTIPLIER) ^ word_hashes[k : k + count]
    return sorted_unique(hashes)


def lsh_bands(threshold: float) -> tuple[int, int]:
    """(bands, rows per band) of the LSH: the most rows (fewest false candidates) that still make a pair at
    `threshold` a candidate with probability >= LSH_RECALL; 0.8 gives 21 x 6 (0.998 at 0.8, 0.28 at 0.5).

    datasketch's own choice balances misses against false candidates (9 x 13 at 0.8 finds a pair at 0.8 only
    40% of the time); here a miss lets a group straddle splits, while a false candidate costs one comparison.
    """
    for rows in range(NUM_PERM // 2, 0, -1):  # datasketch needs two bands or more
        bands = NUM_PERM // rows
        if 1.0 - (1.0 - threshold**rows) ** bands >= LSH_RECALL:
            return bands, rows
    return NUM_PERM, 1


def permutations() -> Any:
    """The MinHash permutations every signature uses (datasketch's, seeded)."""
    return MinHash(num_perm=NUM_PERM, seed=MINHASH_SEED, scheme="affine64").permutations


def signature(text: str, shingle: int, perms: Any) -> np.ndarray | None:
    """The NUM_PERM-value MinHash signature of the shingle set of `text`, None when it has no words."""
    shingles = shingle_hashes(text, shingle)
    if not len(shingles):
        return None
    minhash = MinHash(
        num_perm=NUM_PERM, seed=MINHASH_SEED, hashfunc=int, scheme="affine64", permutations=perms
    )
    for start in range(0, len(shingles), _CHUNK):
        minhash.update_batch(shingles[start : start + _CHUNK].tolist())
    return minhash.hashvalues.astype(np.uint64)


def find_near_duplicates(
    texts: Sequence[str], threshold: float, shingle: int = 5, progress: bool = False
) -> list[list[int]]:
    """Groups (two or more indices into `texts`, ascending; groups ordered by first index) of documents whose
    shingle sets have an estimated Jaccard similarity >= `threshold`, closed under chaining."""
    perms = permutations()
    signatures = np.zeros((len(texts), NUM_PERM), dtype=np.uint64)
    valid = np.zeros(len(texts), dtype=bool)
    for i, text in enumerate(
        tqdm(texts, desc="near-duplicates", unit="doc", disable=not progress, file=sys.stderr)
    ):
        sig = signature(text, shingle, perms)
        if sig is not None:
            signatures[i], valid[i] = sig, True
    return groups_from_signatures(signatures, valid, threshold)


def groups_from_signatures(signatures: Any, valid: np.ndarray, threshold: float) -> list[list[int]]:
    """Near-duplicate groups from MinHash signatures (rows of an array or a memory map; `valid`: rows of
    documents that have words): the LSH of `lsh_bands` makes pairs sharing a band candidates (as
    datasketch's MinHashLSH does: a band matches when its values are equal), a candidate pair is kept when
    its signatures agree on at least `threshold` of their values, and groups are the connected components
    (union-find). Memory: one uint64 key per row and band at a time, plus the rows a candidate bucket reads."""
    rows = len(valid)
    bands, width = lsh_bands(threshold)
    parent = np.arange(rows)

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = int(parent[i])
        return i

    index = np.flatnonzero(valid)
    for band in range(bands):
        keys = np.empty(len(index), dtype=np.uint64)
        for start in range(0, len(index), 1 << 16):  # rows read from a memory map in slices
            block = np.asarray(
                signatures[index[start : start + (1 << 16)], band * width : (band + 1) * width]
            )
            keys[start : start + len(block)] = _band_keys(block)
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        cuts = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
        for members in np.split(order, cuts):
            if len(members) < 2:
                continue
            rows_of = np.sort(index[members])
            sigs = np.asarray(signatures[rows_of])
            for a in range(len(rows_of)):
                same = (sigs[a + 1 :] == sigs[a]).mean(axis=1) >= threshold
                for b in np.flatnonzero(same) + a + 1:
                    parent[root(int(rows_of[b]))] = root(int(rows_of[a]))
    groups: dict[int, list[int]] = {}
    for i in range(rows):
        groups.setdefault(root(i), []).append(i)
    return sorted((g for g in groups.values() if len(g) > 1), key=lambda g: g[0])


def _band_keys(block: np.ndarray) -> np.ndarray:
    """One uint64 per row of a band's values (equal values give equal keys; a chance collision only costs a
    comparison, since every candidate pair is checked on its whole signature)."""
    from tenx.data.ngrams import fmix64

    keys = np.full(len(block), np.uint64(block.shape[1]), dtype=np.uint64)
    for column in range(block.shape[1]):
        keys = fmix64(keys ^ block[:, column])
    return keys


def near_duplicate_splits(
    documents: Sequence[tuple[str, str]],
    split_of: Callable[[str], str],
    threshold: float,
    shingle: int = 5,
    progress: bool = False,
) -> tuple[list[str], DedupStats]:
    """The split of each (id, text) document, `split_of` its id or, in a near-duplicate group, of the
    group's smallest id, and the counts; a threshold of 0 turns grouping off."""
    ids = [doc_id for doc_id, _ in documents]
    groups = (
        find_near_duplicates([text for _, text in documents], threshold, shingle, progress)
        if threshold
        else []
    )
    return group_splits(ids, split_of, groups)


def group_splits(
    ids: Sequence[str], split_of: Callable[[str], str], groups: list[list[int]]
) -> tuple[list[str], DedupStats]:
    """The split of each document: `split_of` its id, or in a near-duplicate group (indices into `ids`),
    that of the group's smallest id; and the counts."""
    splits = [split_of(doc_id) for doc_id in ids]
    stats = DedupStats(near_duplicate_groups=len(groups))
    for group in groups:
        split = splits[min(group, key=lambda i: ids[i])]
        stats.near_duplicate_documents += len(group)
        stats.largest_group = max(stats.largest_group, len(group))
        for i in group:
            stats.moved_to_group_split += splits[i] != split
            splits[i] = split
    return splits, stats
