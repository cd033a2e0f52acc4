"""Held-out data scored document by document: contamination against the training split, the clean part's
score, and breakdowns by directory, file type and language ("monorepo loss").

A dataset's documents (a prepared split, cut at its shard indexes; the text files of a directory, as
tenx.data.codebase reads them; or another source's documents, cleaned as `tenx data prepare` cleans them)
form one token stream, each followed by the end-of-document token, scored exactly as `tenx eval` scores
it (tenx.eval.bpb.token_nll); each document owns its tokens and its end-of-document token. A document is
*contaminated* when more than `threshold` of its n-grams (token n-grams of the training split's index,
tenx.data.ngrams) also occur in training; the clean part's bits per byte leave those documents out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from tenx.data.codebase import CODEBASE_SKIP_REASONS, Codebase, language_of
from tenx.data.manifest import INDEX_DTYPE, np_dtype, read_manifest
from tenx.data.prepare.clean import CleaningStats, clean_text
from tenx.data.prepare.sources import iter_documents
from tenx.data.tokenizer import Tokenizer, check_round_trip, round_trip_sample
from tenx.errors import DataError
from tenx.eval.bpb import Scoring, summarize, token_nll
from tenx.model.transformer import Transformer


@dataclass
class Document:
    name: str
    """Its path relative to the source (a directory), or `split#N` for a prepared split."""
    tokens: np.ndarray
    num_bytes: int


def split_documents(data_dir: str | Path, split: str) -> list[Document]:
    """The documents of a prepared split, cut at its shard indexes (each without its end-of-document id)."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    dtype = np_dtype(manifest)
    from tenx.data.tokenizer import load_tokenizer

    lengths = np.array([len(p) for p in load_tokenizer(data_dir, manifest["tokenizer"]).token_bytes()])
    docs: list[Document] = []
    for shard in manifest["splits"][split]["shards"]:
        if not int(shard["tokens"]):
            continue
        tokens = np.fromfile(data_dir / shard["file"], dtype=dtype).astype(np.int64)
        starts = np.fromfile(data_dir / shard["index_file"], dtype=INDEX_DTYPE)
        ends = [*starts[1:].tolist(), len(tokens)]
        for start, end in zip(starts.tolist(), ends):
            body = tokens[start : end - 1]  # the shard keeps each document's end-of-document id
            if np.any(body >= len(lengths)) or np.any(body < 0):
                raise DataError(
                    f"{data_dir / shard['file']}: a token id outside the vocabulary; re-run prepare"
                )
            docs.append(Document(f"{split}#{len(docs)}", body, int(lengths[body].sum())))
    return docs


def source_documents(spec: str, tokenizer: Tokenizer) -> list[Document]:
    """The documents of any source `tenx data prepare` reads, cleaned the same way, named by their ids."""
    stats = CleaningStats()
    names, texts = [], []
    for raw in iter_documents(spec):
        cleaned = clean_text(raw.data, stats)
        if cleaned:
            names.append(raw.id)
            texts.append(cleaned[0])
    if not texts:
        raise DataError(f"{spec}: no text documents to evaluate")
    encoded = encode_texts(tokenizer, texts)
    check_texts(tokenizer, names, texts, encoded, spec)
    return [Document(name, ids, len(text.encode("utf-8"))) for name, ids, text in zip(names, encoded, texts)]


def codebase_documents(codebase: Codebase, tokenizer: Tokenizer) -> list[Document]:
    """The documents of a directory read by tenx.data.codebase.read_codebase, named by their paths."""
    if not codebase.files:
        skipped = ", ".join(f"{n} {CODEBASE_SKIP_REASONS[k]}" for k, n in sorted(codebase.skipped.items()))
        skipped = skipped or "none: the directory is empty"
        raise DataError(
            f"{codebase.root}: no text files to evaluate (skipped: {skipped})"
            "; check --include/--exclude/--max-file-bytes and the .gitignore files"
        )
    names, texts = [f.path for f in codebase.files], [f.text for f in codebase.files]
    encoded = encode_texts(tokenizer, texts)
    check_texts(tokenizer, names, texts, encoded, str(codebase.root))
    return [Document(f.path, ids, f.num_bytes) for f, ids in zip(codebase.files, encoded)]


ENCODE_CHARS = 1 << 20
"""Texts are encoded about this many characters at a time: a long file is cut into pieces (see _pieces), so
the tokenizer's per-token objects (a Python int each, or a `tokenizers` Encoding) exist for one piece at a time,
never for a 50 MB file at once."""
_CUT = re.compile(r"\S\n(?=\w)")
"""A newline between a non-space and a word character: byte-level BPE pre-tokenizers (GPT-2's, Llama 3's) end
a piece before it and after it, so cutting after it gives the same tokens as encoding the whole text."""


def encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each text's token ids (int64), encoded ENCODE_CHARS at a time: memory bounded by the ids themselves."""
    pieces: list[tuple[int, str]] = [(i, piece) for i, text in enumerate(texts) for piece in _pieces(text)]
    parts: list[list[np.ndarray]] = [[] for _ in texts]
    group: list[tuple[int, str]] = []
    size = 0
    for k, (i, piece) in enumerate(pieces):
        group.append((i, piece))
        size += len(piece)
        if size >= ENCODE_CHARS or k == len(pieces) - 1:
            for (owner, _), ids in zip(group, tokenizer.encode_batch([p for _, p in group])):
                parts[owner].append(np.asarray(ids, dtype=np.int32))  # vocabularies are below 2**31
            group, size = [], 0
    return [np.concatenate(p, dtype=np.int64) if p else np.zeros(0, np.int64) for p in parts]


def _pieces(text: str) -> list[str]:
    """`text` cut into pieces of about ENCODE_CHARS at newlines where the tokens do not change (_CUT); a text
    without one for another ENCODE_CHARS is cut where it is (decoding still gives the text back)."""
    if len(text) <= ENCODE_CHARS:
        return [text]
    out, start = [], 0
    while len(text) - start > ENCODE_CHARS:
        found = _CUT.search(text, start + ENCODE_CHARS - 1, start + 2 * ENCODE_CHARS)
        end = found.start() + 2 if found else start + ENCODE_CHARS
        out.append(text[start:end])
        start = end
    out.append(text[start:])
    return out


def check_texts(
    tokenizer: Tokenizer,
    names: list[str],
    texts: list[str],
    encoded: list[list[int]] | list[np.ndarray] | None,
    where: str,
) -> None:
    """Refuse to score a dataset whose text the tokenizer does not give back (its bits per byte would be
    another text's), checked on documents spread over it (tenx.data.tokenizer.check_round_trip)."""
    chosen = round_trip_sample([len(text) for text in texts])
    check_round_trip(
        tokenizer, ((names[i], texts[i], encoded[i] if encoded else None) for i in chosen), where
    )


def document_nll(
    model: Transformer,
    docs: list[Document],
    eot_id: int,
    scoring: Scoring,
) -> np.ndarray:
    """Each document's NLL (nats) within the whole dataset's stream, its end-of-document token included."""
    bounds = np.cumsum([len(doc.tokens) + 1 for doc in docs], dtype=np.int64)
    stream = np.empty(1 + (int(bounds[-1]) if len(docs) else 0), dtype=np.int64)  # filled once, no copies
    stream[0] = eot_id  # the context of the first token
    at = 1
    for doc in docs:
        stream[at : at + len(doc.tokens)] = doc.tokens
        stream[at + len(doc.tokens)] = eot_id
        at += len(doc.tokens) + 1
    per_token = token_nll(model, stream, eot_id, scoring, context_given=True)
    return (
        np.add.reduceat(per_token, [0, *bounds[:-1].tolist()], dtype=np.float64) if len(docs) else np.zeros(0)
    )


def _part(docs: list[Document], nll: np.ndarray, idx: list[int]) -> dict[str, Any]:
    """The figures of the documents `idx` (each with its end-of-document token) and their count."""
    return {
        **summarize(
            float(nll[idx].sum()),
            int(sum(len(docs[i].tokens) + 1 for i in idx)),
            int(sum(docs[i].num_bytes for i in idx)),
        ),
        "documents": len(idx),
    }


def _group(docs: list[Document], nll: np.ndarray, key: Callable[[str], str]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[int]] = {}
    for i, doc in enumerate(docs):
        groups.setdefault(key(doc.name), []).append(i)
    return {name: _part(docs, nll, idx) for name, idx in sorted(groups.items())}


def by_directory(name: str, depth: int = 1) -> str:
    """The first `depth` directories of a document's path (`.` for files at the top)."""
    parts = PurePosixPath(name).parts[:-1]
    return "/".join(parts[:depth]) or "."


def by_extension(name: str) -> str:
    """A document's file type: its suffix (`(none)` without one)."""
    return PurePosixPath(name).suffix or "(none)"


def score_documents(
    docs: list[Document],
    nll: np.ndarray,
    *,
    contaminated: np.ndarray | None = None,
    breakdown: bool = False,
    languages: bool = False,
) -> dict[str, Any]:
    """The dataset's figures (as eval_texts gives them) from each document's NLL (`document_nll`), plus the
    clean part and breakdowns when asked (`languages`: also by language, for the files of a directory)."""
    tokens = int(sum(len(d.tokens) + 1 for d in docs))
    result = summarize(float(nll.sum()), tokens, int(sum(d.num_bytes for d in docs)))
    if contaminated is not None:
        result["clean"] = _part(docs, nll, [i for i in range(len(docs)) if not contaminated[i]])
    if breakdown:
        result["by_directory"] = _group(docs, nll, by_directory)
        result["by_file_type"] = _group(docs, nll, by_extension)
    if languages:
        result["by_language"] = _group(docs, nll, language_of)
    return result


def contamination_report(data_dir: Path, docs: list[Document], n: int, threshold: float) -> dict[str, Any]:
    """Per-dataset contamination against the training split's n-gram index: the data directory's own (from
    `tenx data prepare --ngram-index` or `tenx data index`), else one built into tenx's cache directory
    (keyed by the manifest's xxhash): the user's data directory is never written."""
    from tenx.data import ngrams
    from tenx.utils.io import cache_dir, file_xxhash

    try:
        index = ngrams.load_index(data_dir, n)
    except DataError as missing:
        if "tenx data index" not in str(missing):
            raise
        cached = cache_dir() / "ngram-indexes" / file_xxhash(Path(data_dir) / "manifest.json")
        try:
            index = ngrams.load_index(data_dir, n, index_dir=cached)
        except DataError as stale:
            if "tenx data index" not in str(stale):
                raise
            print(f"tenx eval: building the {n}-gram index of the training split of {data_dir} in {cached}")
            ngrams.build_index(data_dir, n, index_dir=cached)
            index = ngrams.load_index(data_dir, n, index_dir=cached)
    found = ngrams.contamination(
        index, [d.tokens for d in docs], threshold, document_bytes=[d.num_bytes for d in docs]
    )
    flagged = np.array(found["contaminated"], dtype=bool)
    fraction = np.array(found["overlap"], dtype=np.float64)
    worst = int(np.argmax(fraction)) if len(docs) else None
    return {
        "n": n,
        "threshold": threshold,
        "documents": len(docs),
        "contaminated_documents": found["documents_contaminated"],
        "contaminated_fraction": float(flagged.mean()) if len(docs) else 0.0,
        "contaminated_bytes": found["bytes_contaminated"],
        "contaminated_bytes_fraction": found["bytes_contaminated"] / max(1, found["bytes"]),
        "shared_ngram_fraction": found["ngrams_found"] / max(1, found["ngrams"]),
        "most_contaminated": (
            {"document": docs[worst].name, "shared_fraction": float(fraction[worst])}
            if worst is not None
            else None
        ),
        "contaminated_names": [docs[i].name for i in np.flatnonzero(flagged)[:20]],
        "_flags": flagged,
    }
