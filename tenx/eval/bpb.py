"""Held-out loss in bits per byte: the model as a compressor of text it never trained on.

The split's documents form one token stream (each document followed by the end-of-document token), with
one end-of-document token prepended so the first token has a context. The stream is scored in windows of
seq_len; each window moves `stride` tokens (default: seq_len, so windows do not overlap) and scores only
targets not scored before, so every token, the end-of-document ones included, is predicted exactly once. Bits per byte divides the total code length by the UTF-8 bytes of the documents,
which makes models with different tokenizers, and xz, comparable on exactly the same bytes.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tenx.data.loader import TokenStream
from tenx.data.tokenizer import Tokenizer
from tenx.hardware import host_to_device
from tenx.model.transformer import Transformer


def window_plan(n_targets: int, seq_len: int, stride: int) -> tuple[int, list[tuple[int, int]]]:
    """(window length, [(start, first scored position)]) so every target is scored exactly once.

    Each window after the first starts so that its first unscored target has seq_len - stride tokens of
    context (stride == seq_len: non-overlapping windows); the last window is moved back to stay full length.
    """
    length = min(seq_len, n_targets)
    plan, scored = [], 0
    while scored < n_targets:
        start = min(max(0, scored + stride - seq_len), n_targets - length)
        plan.append((start, scored - start))
        scored = start + length
    return length, plan


@dataclass(frozen=True)
class Scoring:
    """How a token stream is scored: the windows of a batch, how far each moves, and the autocast dtype.

    A `stride` below seq_len (the default: windows that do not overlap) gives every scored token at least
    seq_len - stride tokens of context, at seq_len / stride times the compute; float32 is no autocast."""

    batch_size: int = 8
    stride: int | None = None
    amp_dtype: torch.dtype = torch.float32


@torch.no_grad()
def _scored_windows(
    model: Transformer, tokens: np.ndarray, eot_id: int, scoring: Scoring, context_given: bool = False
) -> Iterator[tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]]:
    """For each batch of windows: their (start, first scored position), per-position NLL and scored mask.

    On a GPU the windows and the mask go over in non-blocking copies, so the host prepares the next batch
    while the GPU still scores this one."""
    device = next(model.parameters()).device
    T = model.cfg.seq_len
    stride = min(scoring.stride or T, T)
    batch_size, amp_dtype = scoring.batch_size, scoring.amp_dtype
    if context_given:  # tokens[0] is the end-of-document id the caller put first (no copy of a long stream)
        stream = np.asarray(tokens, dtype=np.int64)
    else:
        stream = np.concatenate([np.array([eot_id], dtype=np.int64), np.asarray(tokens, dtype=np.int64)])
    n_targets = len(stream) - 1
    if n_targets == 0:
        return
    length, plan = window_plan(n_targets, T, stride)
    positions = np.arange(length)
    model.eval()
    batches: Iterable[int] = range(0, len(plan), batch_size)
    if sys.stderr.isatty():  # minutes on a CPU: show progress on a terminal
        from tqdm import tqdm

        batches = tqdm(batches, desc="eval", unit="batch", leave=False)
    else:  # and a line every PROGRESS_S in a log, so that a long file never looks like a hang
        batches = _logged(batches, n_targets)
    for i in batches:
        chunk = plan[i : i + batch_size]
        batch = host_to_device(
            torch.from_numpy(np.stack([stream[s : s + length + 1] for s, _ in chunk])), device
        )
        first = np.array([f for _, f in chunk])
        scored = host_to_device(torch.from_numpy(positions[None, :] >= first[:, None]), device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
            logits = model(batch[:, :-1])
        nll = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
        yield chunk, nll.view(len(chunk), length), scored


PROGRESS_S = 30.0
"""Seconds between two progress lines of a long evaluation whose stderr is not a terminal."""


def _logged(batches: range, n_targets: int) -> Iterator[int]:
    started = last = time.monotonic()
    for k, i in enumerate(batches):
        now = time.monotonic()
        if now - last >= PROGRESS_S:
            last = now
            print(
                f"tenx eval: {k:,}/{len(batches):,} batches of {n_targets:,} tokens scored "
                f"({k / len(batches):.0%}, {now - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        yield i


def stream_nll(
    model: Transformer, tokens: np.ndarray, eot_id: int, scoring: Scoring = Scoring()
) -> tuple[float, int]:
    """(total negative log-likelihood in nats, tokens scored) of `tokens` under `model`."""
    sums = []  # each batch's sum stays on the device: one copy to the host at the end, not one per batch
    for _, nll, mask in _scored_windows(model, tokens, eot_id, scoring):
        sums.append(torch.where(mask, nll, 0.0).sum())
    return (sum(torch.stack(sums).tolist()) if sums else 0.0), len(tokens)


def token_nll(
    model: Transformer,
    tokens: np.ndarray,
    eot_id: int,
    scoring: Scoring = Scoring(),
    *,
    context_given: bool = False,
) -> np.ndarray:
    """The NLL (nats) of each token of `tokens`, scored as `stream_nll` scores them (a float32 array: the
    values the model computed, 4 bytes a token; sum them in float64). `context_given`: tokens[0] is the
    end-of-document id that gives the first token its context, and is not scored."""
    out = np.zeros(len(tokens) - (1 if context_given else 0), dtype=np.float32)
    for chunk, nll, _ in _scored_windows(model, tokens, eot_id, scoring, context_given):
        values = nll.float().cpu().numpy()
        for row, (start, first) in enumerate(chunk):
            out[start + first : start + nll.shape[1]] = values[row, first:]
    return out


def summarize(nll: float, tokens: int, num_bytes: int) -> dict[str, Any]:
    """Loss (nats/token), perplexity and bits per byte from a total NLL (None for an empty dataset)."""
    loss = nll / tokens if tokens else None
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss is not None else None,
        "bits_per_byte": nll / math.log(2) / num_bytes if num_bytes else None,
        "bits_per_token": loss / math.log(2) if loss is not None else None,
        "tokens": tokens,
        "bytes": num_bytes,
        "nll_nats": nll,
    }


def eval_split(
    model: Transformer,
    data_dir: str | Path,
    split: str,
    batch_size: int = 8,
    *,
    stride: int | None = None,
    amp_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Bits per byte of `model` on a prepared split (checksums verified first)."""
    stream = TokenStream(data_dir, split, verify=True)
    eot = int(stream.manifest["tokenizer"]["eot_id"])
    tokens = stream.read(0, len(stream)) if len(stream) else np.zeros(0, dtype=np.int64)
    # The stream already ends each document with EOT; the prepended EOT gives the first document context.
    nll, n = stream_nll(model, tokens, eot, Scoring(batch_size, stride, amp_dtype))
    return summarize(nll, n, int(stream.manifest["splits"][split]["bytes"]))


def eval_texts(
    model: Transformer,
    texts: list[str],
    tokenizer: Tokenizer,
    batch_size: int = 8,
    *,
    stride: int | None = None,
    amp_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Bits per byte of `model` on arbitrary documents, tokenized with the run's tokenizer."""
    ids: list[int] = []
    for doc in tokenizer.encode_batch(texts):
        ids.extend(doc)
        ids.append(tokenizer.eot_id)
    nll, n = stream_nll(
        model, np.array(ids, dtype=np.int64), tokenizer.eot_id, Scoring(batch_size, stride, amp_dtype)
    )
    return summarize(nll, n, sum(len(t.encode("utf-8")) for t in texts))


def combine(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Overall figures over several datasets: total NLL over total tokens and total bytes."""
    nll = sum(r["nll_nats"] for r in results.values())
    tokens = sum(r["tokens"] for r in results.values())
    num_bytes = sum(r["bytes"] for r in results.values())
    return summarize(nll, tokens, num_bytes)
