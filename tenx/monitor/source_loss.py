"""The loss per data source: which source each scored token of a validation batch came from, and the mean
loss of each source's tokens.

A prepared split lists its documents' ids in manifest order (`splits.<split>.documents`), and the ids
`tenx data prepare` gives are paths relative to the source (tenx.data.prepare.sources.RawDocument.id). A
document's *source* is the first folder of its id: a corpus directory holding `wiki/`, `code/` and
`books/` has three sources, the standard library one per package; a document at the top (a top-level
file, a line of a .jsonl, a dataset row) belongs to `.`, as in `tenx eval --breakdown`'s by_directory. A
token belongs to the document that holds it, its end-of-document token included.

The statistics callback (tenx/train/callbacks/stats.py) logs `stats/loss_source/<source>` for its probe
batch of the validation split, each source by name; past `MAX_SOURCES` sources, the `MAX_SOURCES - 1`
with the most tokens in the batch by name and the rest together as `(other)`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import PurePosixPath
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tenx.data.loader import TokenStream

LOSS_SOURCE = "loss_source"
"""The statistic's name: `stats/loss_source/<source>`."""
MAX_SOURCES = 8
"""At most this many series per run: the largest sources of the batch, then `(other)`."""
OTHER = "(other)"
TOP = "."


def document_source(document_id: str) -> str:
    """The source of a document of a prepared split: the first folder of its id, `.` for one at the top."""
    parts = PurePosixPath(document_id.lstrip("/")).parts  # a record's own id may look absolute
    return parts[0] if len(parts) > 1 else TOP


def token_sources(stream: TokenStream, offsets: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(source names, index of each offset's source in them) for stream offsets of any shape; an offset
    whose document is unknown (its shard index unreadable, or the manifest's ids do not match) gets -1.

    Sources are named by `document_source`; past `MAX_SOURCES` of them, all but the `MAX_SOURCES - 1`
    with the most offsets are `(other)`."""
    ids: list[Any] = stream.manifest["splits"][stream.split].get("documents", [])
    flat = np.asarray(offsets, dtype=np.int64).reshape(-1)
    names: list[str | None] = []
    for offset in flat.tolist():
        doc = stream.document_of(offset)
        known = doc is not None and doc < len(ids) and isinstance(ids[doc], str)
        names.append(document_source(ids[doc]) if doc is not None and known else None)
    counts = Counter(n for n in names if n is not None)
    ranked = sorted(counts, key=lambda n: (-counts[n], n))
    kept = ranked if len(ranked) <= MAX_SOURCES else ranked[: MAX_SOURCES - 1]
    sources = sorted(kept) + ([OTHER] if len(kept) < len(ranked) else [])
    position = {name: i for i, name in enumerate(sources)}
    other = position.get(OTHER, -1)
    index = np.array([-1 if n is None else position.get(n, other) for n in names], dtype=np.int64)
    return sources, index.reshape(np.shape(offsets))


def probe_sources(stream: TokenStream, windows: np.ndarray, seq_len: int) -> tuple[list[str], np.ndarray]:
    """`token_sources` of the targets of a batch of windows (rows of `sequential_windows`): (B, seq_len)."""
    offsets = np.asarray(windows, dtype=np.int64)[:, None] * seq_len + 1 + np.arange(seq_len)[None, :]
    return token_sources(stream, offsets)


def loss_by_source(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, index_BT: torch.Tensor, n: int
) -> torch.Tensor:
    """The mean cross-entropy (nats/token, fp32; float64 logits stay float64) of the tokens of each of `n`
    sources, as an n-vector on the logits' device, without a host synchronisation. `targets_BT` and
    `index_BT` (each target's source, -1 for none) are on the same device. A source without tokens is NaN."""
    logits_NV = logits_BTV.detach().flatten(0, 1)
    logits_NV = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
    nll_N = F.cross_entropy(logits_NV, targets_BT.flatten(), reduction="none")
    bucket_N = torch.where(index_BT.flatten() < 0, n, index_BT.flatten())  # unknown: a bucket left out
    sums = torch.zeros(n + 1, dtype=nll_N.dtype, device=nll_N.device).index_add_(0, bucket_N, nll_N)
    counts = torch.zeros(n + 1, dtype=nll_N.dtype, device=nll_N.device).index_add_(
        0, bucket_N, torch.ones_like(nll_N)
    )
    return (sums / counts)[:n]
