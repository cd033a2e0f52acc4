"""An index of the hashed token n-grams of a split, to measure how much of a text training has seen.

`ngrams-{n}.npy` (train; `ngrams-{split}-{n}.npy` for another split) holds the sorted unique uint64 hashes
of every run of n consecutive tokens inside one document (a window holding the end-of-document id is
skipped, so no n-gram spans two documents); `ngrams-{n}.json` beside it records n, the count, the hash
function, the file's xxhash and the xxhash of each shard it was built from, so an index whose shards were
re-prepared is refused as stale rather than silently answering for other data. n = 13 tokens follows the
decontamination convention of GPT-3 and lm-evaluation-harness for subword (BPE) tokens; a byte-level
tokenizer's tokens are 3-4 times shorter, so its n is counted in bytes of about the same text (`default_n`:
50 bytes), or ordinary boilerplate would pass for contamination.

The hash of a window (t_0 .. t_{n-1}) is h = fmix64(... fmix64(fmix64(n) ^ t_0) ... ^ t_{n-1}), with fmix64
the MurmurHash3 finalizer (a bijection of 64-bit integers), computed for all windows at once in uint64
numpy arithmetic. Two distinct n-grams collide with probability about 2^-64: for the 8.0 M windows of the
stdlib train split (BPE 8192) the chance of any collision is about 2e-6.

`decontaminate` picks the val and held-out documents that prepare moves into train so that none left shares
more than the threshold of its n-grams with train; on the stdlib it moves 9 (7 held-out, 2 val) in 2 passes
and 1.5 s, after which no held-out file exceeds 0.5 (the highest is 0.40) and 64 of 70 share some 13-gram.
"""

from __future__ import annotations

import io
import json
import re
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tenx.data.manifest import MANIFEST_NAME, SPLITS, np_dtype, read_manifest, regular_file_size, verify_split
from tenx.errors import DataError
from tenx.utils.io import atomic_write_bytes, atomic_write_json, bytes_xxhash, file_xxhash

DEFAULT_N = 13
"""n-gram length for subword (BPE) tokens: GPT-3's and lm-evaluation-harness's decontamination convention."""
BYTES_N = 50
"""n-gram length for the bytes tokenizer: about DEFAULT_N BPE tokens of text.

On the CPython 3.11 stdlib, BPE 8192 averages 3.6 bytes per token, so 13 tokens span about 47 bytes. With
13-byte n-grams, decontamination moved 85 documents into train (60 of 77 held-out: short runs such as
`self.assertEqual(` are everywhere); with 50 bytes it moves the very 9 documents that BPE's 13-grams move
(codec tables and template copies; 7 held-out, 2 val)."""
MAX_N = 1024
HASH_VERSION = "fmix64-chain/1"
INDEX_FILE = re.compile(r"^ngrams-(?:(val|heldout)-)?([1-9]\d{0,3})\.(?:npy|json)$")
"""Names of the index files tenx writes into a data directory."""
DEFAULT_CONTAMINATION_THRESHOLD = 0.5
"""A document is contaminated when more than this fraction of its n-grams occur in training.

Measured on the CPython 3.11 stdlib (BPE 8192, 13-grams, 77 held-out files): any shared 13-gram (0.0)
flags 71 of them, through boilerplate such as `if __name__ == "__main__":\\n    unittest.main()`; the median
file shares 3% of its 13-grams. Above 0.5 are the 7 files that are mostly copies (generated codec tables
and codec modules from one template, 66-87% shared), which prepare therefore moves into train
(decontaminate); below come a partial copy at 0.40 (test_grammar.py of lib2to3's test data) and then a
continuum from 0.33 down."""
MAX_DECONTAMINATION_ROUNDS = 20
"""Passes of `decontaminate` at most; the stdlib needs 2 (7 documents moved, then none exceeds)."""
_CHUNK = 1 << 22
"""Windows hashed per step (a few arrays of this many uint64 are live at once)."""
_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, elementwise (a bijection of uint64)."""
    x = x ^ (x >> _S33)
    x = x * _M1
    x = x ^ (x >> _S33)
    x = x * _M2
    return x ^ (x >> _S33)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique of a 1-D array, by sort and mask (numpy 2.4's np.unique: 3 s for 4 M uint64; this: 0.1 s)."""
    values = np.sort(values)
    keep = np.ones(len(values), dtype=bool)
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """uint64 hash of each window of `n` consecutive tokens, in order (len(tokens) - n + 1 of them)."""
    if n < 1:
        raise ValueError(f"n must be a positive integer, got {n}")
    tokens = np.asarray(tokens)
    count = max(len(tokens) - n + 1, 0)
    values = tokens.astype(np.uint64)
    hashes = np.full(count, fmix64(np.array([n], dtype=np.uint64))[0], dtype=np.uint64)
    for k in range(n):
        hashes = fmix64(hashes ^ values[k : k + count])
    return hashes


def _document_ngram_hashes(tokens: np.ndarray, n: int, eot_id: int) -> np.ndarray:
    """Hashes of the windows of `tokens` that hold no end-of-document id, in order."""
    hashes = ngram_hashes(tokens, n)
    ends = np.concatenate(([0], np.cumsum(np.asarray(tokens) == eot_id)))
    return hashes[ends[n:] == ends[: len(hashes)]]


def _stream_unique_hashes(tokens: np.ndarray, n: int, eot_id: int) -> np.ndarray:
    """Sorted unique hashes of a long token stream, hashed in chunks of windows to bound memory."""
    parts = [np.empty(0, dtype=np.uint64)]
    for start in range(0, max(len(tokens) - n + 1, 0), _CHUNK):
        parts.append(sorted_unique(_document_ngram_hashes(tokens[start : start + _CHUNK + n - 1], n, eot_id)))
    return sorted_unique(np.concatenate(parts))


def default_n(tokenizer_kind: str) -> int:
    """The decontamination n-gram length for a tokenizer kind ("bpe" or "bytes"), in its tokens."""
    return BYTES_N if tokenizer_kind == "bytes" else DEFAULT_N


def data_n(manifest: dict[str, Any]) -> int:
    """The n-gram length a prepared directory's manifest decontaminated with, else its tokenizer's default."""
    n = manifest.get("prepare", {}).get("ngram_index")
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N:
        return n
    return default_n(manifest["tokenizer"]["kind"])


def index_paths(
    data_dir: str | Path, n: int = DEFAULT_N, split: str = "train", index_dir: str | Path | None = None
) -> tuple[Path, Path]:
    """The index file (.npy) and its sidecar (.json) for n-grams of `split` of `data_dir`: in `data_dir`,
    or in `index_dir` when given (an index built for reading, outside the user's data directory)."""
    stem = f"ngrams-{n}" if split == "train" else f"ngrams-{split}-{n}"
    where = Path(index_dir if index_dir is not None else data_dir)
    return where / f"{stem}.npy", where / f"{stem}.json"


def build_index(
    data_dir: str | Path, n: int = DEFAULT_N, split: str = "train", index_dir: str | Path | None = None
) -> Path:
    """Verify the shards of `split`, write the n-gram index of its documents and its sidecar (into
    `index_dir` when given, else `data_dir`); the index's path."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise DataError(f"n-gram length must be an integer in [1, {MAX_N}], got {n!r}")
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    verify_split(data_dir, manifest, split)
    eot_id = int(manifest["tokenizer"]["eot_id"])
    shards = manifest["splits"][split]["shards"]
    parts = [np.empty(0, dtype=np.uint64)]
    for shard in shards:
        tokens = np.fromfile(data_dir / shard["file"], dtype=np_dtype(manifest))
        parts.append(_stream_unique_hashes(tokens, n, eot_id))
    hashes = sorted_unique(np.concatenate(parts))
    path, sidecar = index_paths(data_dir, n, split, index_dir)
    data = _npy_bytes(hashes)
    atomic_write_bytes(path, data)
    atomic_write_json(
        sidecar,
        {
            "n": n,
            "split": split,
            "count": int(len(hashes)),
            "hash": HASH_VERSION,
            "eot_id": eot_id,
            "xxhash": bytes_xxhash(data),
            "shards": [shard["xxhash"] for shard in shards],
        },
    )
    return path


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


@dataclass(frozen=True)
class NgramIndex:
    """The sorted unique n-gram hashes of a split, loaded from its verified index file."""

    n: int
    eot_id: int
    hashes: np.ndarray
    path: Path

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        """For each hash, whether the index holds it (a bool array of the same length)."""
        return _in_sorted(self.hashes, np.asarray(hashes, dtype=np.uint64))

    def overlap(self, tokens: np.ndarray) -> tuple[int, int]:
        """(n-grams of `tokens` found in the index, n-grams in all) for one document's token ids; windows
        holding the end-of-document id are not counted, so a trailing one makes no difference."""
        hashes = _document_ngram_hashes(np.asarray(tokens), self.n, self.eot_id)
        return int(self.contains(hashes).sum()), int(len(hashes))


def load_index(
    data_dir: str | Path, n: int = DEFAULT_N, split: str = "train", index_dir: str | Path | None = None
) -> NgramIndex:
    """Load and check the n-gram index of `split` (from `index_dir` when given, else `data_dir`): DataError
    naming the file when it is missing, corrupt, or stale (built from other shards than the manifest lists)."""
    data_dir = Path(data_dir)
    path, sidecar_path = index_paths(data_dir, n, split, index_dir)
    rebuild = f"`{shlex.join(['tenx', 'data', 'index', str(data_dir), '--n', str(n)])}` rebuilds it"
    manifest = read_manifest(data_dir)
    for file in (sidecar_path, path):
        if regular_file_size(file) is None:  # never opens a FIFO or device
            raise DataError(f"n-gram index {file} is missing (or not a regular file); {rebuild}")
    try:
        sidecar = json.loads(sidecar_path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"n-gram index {sidecar_path} cannot be read ({e}); {rebuild}") from None
    if not isinstance(sidecar, dict):
        raise DataError(f"n-gram index {sidecar_path} is corrupt: not a JSON object; {rebuild}")
    expected = {
        "n": n,
        "split": split,
        "hash": HASH_VERSION,
        "eot_id": manifest["tokenizer"]["eot_id"],
        "shards": [shard["xxhash"] for shard in manifest["splits"][split]["shards"]],
    }
    changed = [key for key, value in expected.items() if sidecar.get(key) != value]
    if changed:
        raise DataError(
            f"n-gram index {sidecar_path} is stale: its {', '.join(changed)} differ from what "
            f"{data_dir / MANIFEST_NAME} and this tenx give; {rebuild}"
        )
    try:
        actual = file_xxhash(path)
    except OSError as e:
        raise DataError(f"n-gram index {path} cannot be read ({e.strerror or e}); {rebuild}") from None
    if actual != sidecar.get("xxhash"):
        raise DataError(
            f"n-gram index {path} is corrupt: xxhash {actual}, {sidecar_path.name} says "
            f"{sidecar.get('xxhash')}; {rebuild}"
        )
    try:
        hashes = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"n-gram index {path} is corrupt ({e}); {rebuild}") from None
    if (
        hashes.dtype != np.uint64
        or hashes.ndim != 1
        or len(hashes) != sidecar.get("count")
        or (len(hashes) > 1 and not np.all(hashes[1:] > hashes[:-1]))
    ):
        raise DataError(f"n-gram index {path} is corrupt: not a sorted unique uint64 array; {rebuild}")
    return NgramIndex(n=n, eot_id=int(expected["eot_id"]), hashes=hashes, path=path)


def remove_stale_indexes(data_dir: str | Path) -> list[str]:
    """Delete the n-gram index files of `data_dir` that no longer match its shards (after a re-prepare), or
    that are damaged; the names removed. Only files named like tenx's index files (INDEX_FILE) are touched."""
    data_dir = Path(data_dir)
    indexes = {
        (match.group(1) or "train", int(match.group(2)))
        for match in map(INDEX_FILE.match, sorted(p.name for p in data_dir.iterdir()))
        if match is not None
    }
    removed = []
    for split, n in sorted(indexes):
        try:
            load_index(data_dir, n, split)
        except DataError:
            for stale in index_paths(data_dir, n, split):
                if stale.is_file() and not stale.is_symlink():
                    stale.unlink()
                    removed.append(stale.name)
    return removed


@dataclass(frozen=True)
class Decontamination:
    """What `decontaminate` moved: indices into its candidates (ascending), passes made, and whether the last
    pass found no candidate left above the threshold."""

    moved: list[int]
    rounds: int
    converged: bool


def decontaminate(
    train_tokens: Sequence[np.ndarray],
    candidate_tokens: Sequence[np.ndarray],
    n: int,
    eot_id: int,
    threshold: float = DEFAULT_CONTAMINATION_THRESHOLD,
    max_rounds: int = MAX_DECONTAMINATION_ROUNDS,
) -> Decontamination:
    """The candidates (held-out and val documents' tokens) to move into training so that no candidate left
    has more than `threshold` of its n-grams (the windows `NgramIndex.overlap` counts) in training.

    Moving a document adds its n-grams to training, which can push another candidate over: each pass moves
    every candidate above the threshold at once, then checks the rest against training plus everything
    moved, until a pass moves none (or after `max_rounds` passes). The result depends on the tokens alone."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be a fraction in [0, 1], got {threshold}")
    parts = [sorted_unique(np.concatenate(b)) for b in _batched_document_hashes(train_tokens, n, eot_id)]
    train = sorted_unique(np.concatenate([np.empty(0, dtype=np.uint64), *parts]))
    grams = [hashes for batch in _batched_document_hashes(candidate_tokens, n, eot_id) for hashes in batch]
    left = [i for i, hashes in enumerate(grams) if len(hashes)]  # no n-grams: never contaminated
    moved: list[int] = []
    added = np.empty(0, dtype=np.uint64)
    for rounds in range(1, max_rounds + 1):
        over = {i for i in left if _shared_fraction(grams[i], train, added) > threshold}
        if not over:
            return Decontamination(sorted(moved), rounds, True)
        moved += over
        left = [i for i in left if i not in over]
        added = sorted_unique(np.concatenate([added, *(grams[i] for i in sorted(over))]))
    return Decontamination(sorted(moved), max_rounds, False)


def _batched_document_hashes(
    documents_tokens: Sequence[np.ndarray], n: int, eot_id: int
) -> Iterator[list[np.ndarray]]:
    """Each document's n-gram hashes (the windows `NgramIndex.overlap` counts), in lists of consecutive
    documents hashed as one stream of about _CHUNK tokens, so that many small documents cost few numpy calls."""
    batch: list[np.ndarray] = []
    size = 0
    for i, tokens in enumerate(documents_tokens):
        batch.append(np.asarray(tokens))
        size += len(batch[-1]) + 1
        if size < _CHUNK and i + 1 < len(documents_tokens):
            continue
        eot = np.array([eot_id], dtype=batch[0].dtype)
        stream = np.concatenate([piece for doc in batch for piece in (doc, eot)])  # no window spans two
        hashes = ngram_hashes(stream, n)
        ends = np.concatenate(([0], np.cumsum(stream == eot_id)))
        clean = ends[n:] == ends[: len(hashes)]
        bounds = np.cumsum([len(doc) + 1 for doc in batch])[:-1]
        yield [h[c] for h, c in zip(np.split(hashes, bounds), np.split(clean, bounds))]
        batch, size = [], 0


def _shared_fraction(hashes: np.ndarray, *indexes: np.ndarray) -> float:
    """The fraction of `hashes` (non-empty) that one of the sorted `indexes` holds."""
    found = np.zeros(len(hashes), dtype=bool)
    for index in indexes:
        found |= _in_sorted(index, hashes)
    return int(found.sum()) / len(hashes)


def _in_sorted(haystack: np.ndarray, needles: np.ndarray) -> np.ndarray:
    """For each of `needles`, whether the sorted array `haystack` holds it."""
    at = np.searchsorted(haystack, needles)
    found = np.zeros(len(needles), dtype=bool)
    inside = at < len(haystack)
    found[inside] = haystack[at[inside]] == needles[inside]
    return found


def contamination(
    index: NgramIndex,
    documents_tokens: Sequence[np.ndarray],
    threshold: float = DEFAULT_CONTAMINATION_THRESHOLD,
    *,
    document_bytes: Sequence[int] | None = None,
) -> dict[str, Any]:
    """How much of each document's n-grams training holds, and which documents count as contaminated.

    A document is contaminated when the fraction of its n-grams found in the index exceeds `threshold`
    (0.0: any shared n-gram); a document shorter than n tokens has no n-grams and is never contaminated.
    `document_bytes` (each document's size in bytes) adds byte counts; token counts are always given."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be a fraction in [0, 1], got {threshold}")
    if document_bytes is not None and len(document_bytes) != len(documents_tokens):
        raise ValueError(f"{len(document_bytes)} byte counts for {len(documents_tokens)} documents")
    overlap, contaminated, found_total, ngram_total = [], [], 0, 0
    for tokens in documents_tokens:
        found, total = index.overlap(tokens)
        fraction = found / total if total else 0.0
        overlap.append(fraction)
        contaminated.append(fraction > threshold)
        found_total += found
        ngram_total += total
    tokens_per_document = [int(len(t)) for t in documents_tokens]
    report: dict[str, Any] = {
        "n": index.n,
        "threshold": threshold,
        "documents": len(documents_tokens),
        "documents_contaminated": sum(contaminated),
        "tokens": sum(tokens_per_document),
        "tokens_contaminated": sum(t for t, c in zip(tokens_per_document, contaminated) if c),
        "bytes": None,
        "bytes_contaminated": None,
        "ngrams": ngram_total,
        "ngrams_found": found_total,
        "overlap": overlap,
        "contaminated": contaminated,
    }
    if document_bytes is not None:
        report["bytes"] = int(sum(document_bytes))
        report["bytes_contaminated"] = int(sum(b for b, c in zip(document_bytes, contaminated) if c))
    return report
