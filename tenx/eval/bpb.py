"""Held-out loss in bits per byte: the model as a compressor of text it never trained on.

The split's documents form one token stream (each document followed by the end-of-document token), with
one end-of-document token prepended so the first token has a context. The stream is scored in windows of
seq_len that each start where the last one ended, so every token, the end-of-document ones included, is
predicted exactly once. Bits per byte divides the total code length by the UTF-8 bytes of the documents,
which makes models with different tokenizers, and xz, comparable on exactly the same bytes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tenx.data.loader import TokenStream
from tenx.data.tokenizer import Tokenizer
from tenx.model.transformer import Transformer


@torch.no_grad()
def stream_nll(
    model: Transformer, tokens: np.ndarray, eot_id: int, batch_size: int = 8, device: torch.device | None = None,
    amp_dtype: torch.dtype = torch.float32,
) -> tuple[float, int]:
    """(total negative log-likelihood in nats, tokens scored) of `tokens` under `model`."""
    device = device or next(model.parameters()).device
    T = model.cfg.seq_len
    stream = np.concatenate([np.array([eot_id], dtype=np.int64), np.asarray(tokens, dtype=np.int64)])
    n_targets = len(stream) - 1
    starts = list(range(0, n_targets, T))
    full = [s for s in starts if s + T <= n_targets]
    model.eval()
    total = 0.0
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype != torch.float32 else None

    def score(rows: np.ndarray) -> float:
        batch = torch.from_numpy(rows).to(device)
        if autocast is not None:
            with autocast:
                logits = model(batch[:, :-1])
        else:
            logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()

    for i in range(0, len(full), batch_size):
        rows = np.stack([stream[s : s + T + 1] for s in full[i : i + batch_size]])
        total += score(rows)
    if len(full) < len(starts):  # the last, shorter window
        total += score(stream[starts[-1] :][None, :])
    return total, n_targets


def summarize(nll: float, tokens: int, num_bytes: int) -> dict[str, Any]:
    """Loss (nats/token), perplexity and bits per byte from a total NLL."""
    loss = nll / tokens if tokens else float("nan")
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if tokens else float("nan"),
        "bits_per_byte": nll / math.log(2) / num_bytes if num_bytes else float("nan"),
        "bits_per_token": loss / math.log(2) if tokens else float("nan"),
        "tokens": tokens,
        "bytes": num_bytes,
        "nll_nats": nll,
    }


def eval_split(
    model: Transformer, data_dir: str | Path, split: str, batch_size: int = 8, amp_dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """Bits per byte of `model` on a prepared split (checksums verified first)."""
    stream = TokenStream(data_dir, split, verify=True)
    eot = int(stream.manifest["tokenizer"]["eot_id"])
    tokens = stream.read(0, len(stream)) if len(stream) else np.zeros(0, dtype=np.int64)
    # The stream already ends each document with EOT; the prepended EOT gives the first document context.
    nll, n = stream_nll(model, tokens, eot, batch_size, amp_dtype=amp_dtype)
    return summarize(nll, n, int(stream.manifest["splits"][split]["bytes"]))


def eval_texts(
    model: Transformer, texts: list[str], tokenizer: Tokenizer, batch_size: int = 8,
    amp_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Bits per byte of `model` on arbitrary documents, tokenized with the run's tokenizer."""
    ids: list[int] = []
    for doc in tokenizer.encode_batch(texts):
        ids.extend(doc)
        ids.append(tokenizer.eot_id)
    nll, n = stream_nll(model, np.array(ids, dtype=np.int64), tokenizer.eot_id, batch_size, amp_dtype=amp_dtype)
    return summarize(nll, n, sum(len(t.encode("utf-8")) for t in texts))


def combine(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Overall figures over several datasets: total NLL over total tokens and total bytes."""
    nll = sum(r["nll_nats"] for r in results.values())
    tokens = sum(r["tokens"] for r in results.values())
    num_bytes = sum(r["bytes"] for r in results.values())
    return summarize(nll, tokens, num_bytes)
