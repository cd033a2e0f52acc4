"""Adaptive (prequential) evaluation: the model keeps learning as it reads.

Pre-training is compression: a model that learns from what it has read codes the rest in fewer bits. Here
the dataset's stream (documents in their listed order, each followed by the end-of-document token, as
`tenx eval` scores it) is cut into the static evaluation's non-overlapping windows of seq_len tokens and
read a chunk of `batch` windows at a time. Each chunk is first **scored** with the model as it is, then the
model takes `steps` AdamW steps on that chunk (its mean cross-entropy), so every token is coded before the
model has trained on it: the sum of those code lengths is a prequential code length that a decoder running
the same updates could reproduce. The figure sits beside the static one (the model's quality, unchanged)
and xz's.

What adapts (`params`): `all`; `norms` (normalisation gains and biases only: a few thousand numbers);
`head` (the output layer); `last` (the last block, the final norm and the output layer). The caller's
model is never changed: a copy adapts.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from tenx.errors import ConfigError
from tenx.eval.bpb import window_plan
from tenx.model.transformer import Transformer
from tenx.utils.xz import xz_bits_per_byte, xz_bits_per_byte_per_document

PARAMS = ("all", "norms", "head", "last")


@dataclass
class AdaptConfig:
    """How the model adapts while it reads (see the module docstring)."""

    lr: float = 3e-4
    """AdamW learning rate of the adaptation steps."""
    steps: int = 1
    """Optimizer steps on each chunk after it is scored."""
    batch: int = 8
    """Windows of seq_len tokens per chunk."""
    params: Literal["all", "norms", "head", "last"] = "all"

    def validate(self) -> None:
        """Finite, positive settings; a TenxError naming the flag."""
        if not (self.lr > 0 and self.lr < 1):
            raise ConfigError(f"--adapt-lr must be in (0, 1), got {self.lr}")
        if not 1 <= self.steps <= 100:
            raise ConfigError(f"--adapt-steps must be 1..100, got {self.steps}")
        if not 1 <= self.batch <= 4096:
            raise ConfigError(f"adaptation batch must be 1..4096 windows, got {self.batch}")
        if self.params not in PARAMS:
            raise ConfigError(f"--adapt-params must be one of {', '.join(PARAMS)}, got {self.params!r}")


def _adapted_parameters(model: Transformer, which: str) -> list[torch.nn.Parameter]:
    if which == "all":
        return list(model.parameters())
    if which == "head":
        return [model.lm_head.weight]
    if which == "norms":
        return [p for name, p in model.named_parameters() if "norm" in name]
    last = len(model.blocks) - 1
    chosen = {id(model.lm_head.weight)}
    chosen |= {id(p) for p in model.blocks[last].parameters()} | {
        id(p) for p in model.final_norm.parameters()
    }
    return [p for p in model.parameters() if id(p) in chosen]


def adaptive_token_nll(
    model: Transformer, tokens: np.ndarray, eot_id: int, cfg: AdaptConfig
) -> tuple[np.ndarray, np.ndarray]:
    """(adaptive, static) NLL in nats of each token of `tokens`, both on the same windows: each chunk is
    scored by the static model and by the adapting one before it takes its steps on the chunk."""
    cfg.validate()
    device = next(model.parameters()).device
    static_model = model
    adapting = copy.deepcopy(model).train()
    trained = _adapted_parameters(adapting, cfg.params)
    for p in adapting.parameters():
        p.requires_grad_(any(p is q for q in trained))
    optimizer = torch.optim.AdamW(trained, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    T = model.cfg.seq_len
    stream = np.concatenate([np.array([eot_id], dtype=np.int64), np.asarray(tokens, dtype=np.int64)])
    length, plan = window_plan(len(stream) - 1, T, T)
    adaptive = np.zeros(len(tokens), dtype=np.float64)
    static = np.zeros(len(tokens), dtype=np.float64)
    for at in range(0, len(plan), cfg.batch):
        chunk = plan[at : at + cfg.batch]
        x = torch.from_numpy(np.stack([stream[s : s + length] for s, _ in chunk])).to(device)
        y = torch.from_numpy(np.stack([stream[s + 1 : s + 1 + length] for s, _ in chunk])).to(device)
        with torch.no_grad():
            for target, net in ((adaptive, adapting), (static, static_model)):
                logits = net(x).float()
                nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
                values = nll.double().cpu().numpy()
                for row, (start, first) in enumerate(chunk):
                    target[start + first : start + length] = values[row, first:]
        for _ in range(cfg.steps):  # only after the chunk is coded: prequential
            optimizer.zero_grad(set_to_none=True)
            loss, _ = adapting(x, y)
            loss.backward()
            optimizer.step()
    return adaptive, static


def adaptive_report(
    model: Transformer, docs: list[Any], token_bytes: list[bytes], eot_id: int, cfg: AdaptConfig
) -> dict[str, Any]:
    """The adaptive and static bits per byte of `docs` (tenx.eval.documents.Document, in order) on the same
    windows, xz -9e on the same bytes (concatenated and file by file), the settings and the time; `files`:
    each document's bytes (for other compressors)."""
    started = time.perf_counter()
    pieces = [np.append(d.tokens, eot_id) for d in docs]
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    adaptive, static = adaptive_token_nll(model, stream, eot_id, cfg)
    files = [b"".join(token_bytes[t] for t in d.tokens.tolist()) for d in docs]
    num_bytes = sum(len(f) for f in files) or 1
    return {
        "adaptive_bits_per_byte": float(adaptive.sum()) / math.log(2) / num_bytes,
        "static_bits_per_byte": float(static.sum()) / math.log(2) / num_bytes,
        "xz_bits_per_byte": xz_bits_per_byte(b"".join(files)),
        "xz_per_file_bits_per_byte": xz_bits_per_byte_per_document(files),
        "bytes": num_bytes,
        "seconds": time.perf_counter() - started,
        "settings": {"lr": cfg.lr, "steps": cfg.steps, "batch": cfg.batch, "params": cfg.params},
        "order": "the documents in sorted path order (a prepared split: its stored order)",
        "files": files,
    }
