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
from datasketch import MinHash, MinHashLSH
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


def find_near_duplicates(
    texts: Sequence[str], threshold: float, shingle: int = 5, progress: bool = False
) -> list[list[int]]:
    """Groups (two or more indices into `texts`, ascending; groups ordered by first index) of documents whose
    shingle sets have an estimated Jaccard similarity >= `threshold`, closed under chaining."""
    permutations = MinHash(num_perm=NUM_PERM, seed=MINHASH_SEED, scheme="affine64").permutations
    lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM, params=lsh_bands(threshold))
    signatures = np.zeros((len(texts), NUM_PERM), dtype=np.uint64)
    parent = list(range(len(texts)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, text in enumerate(
        tqdm(texts, desc="near-duplicates", unit="doc", disable=not progress, file=sys.stderr)
    ):
        shingles = shingle_hashes(text, shingle)
        if not len(shingles):
            continue
        minhash = MinHash(
            num_perm=NUM_PERM, seed=MINHASH_SEED, hashfunc=int, scheme="affine64", permutations=permutations
        )
        for start in range(0, len(shingles), _CHUNK):
            minhash.update_batch(shingles[start : start + _CHUNK].tolist())
        signatures[i] = minhash.hashvalues
        # Querying before inserting finds each candidate pair once, from its later member.
        for j in lsh.query(minhash):
            if np.mean(signatures[i] == signatures[j]) >= threshold:
                parent[root(i)] = root(j)
        lsh.insert(i, minhash, check_duplication=False)

    groups: dict[int, list[int]] = {}
    for i in range(len(texts)):
        groups.setdefault(root(i), []).append(i)
    return sorted((g for g in groups.values() if len(g) > 1), key=lambda g: g[0])


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
    splits = [split_of(doc_id) for doc_id in ids]
    groups = (
        find_near_duplicates([text for _, text in documents], threshold, shingle, progress)
        if threshold
        else []
    )
    stats = DedupStats(near_duplicate_groups=len(groups))
    for group in groups:
        split = splits[min(group, key=lambda i: ids[i])]
        stats.near_duplicate_documents += len(group)
        stats.largest_group = max(stats.largest_group, len(group))
        for i in group:
            stats.moved_to_group_split += splits[i] != split
            splits[i] = split
    return splits, stats
