"""The prequential code length of the training stream: training as compression, measured for every run.

Each step's loss is computed before the update that uses its batch, so during the first epoch (every token
new to the model) the step's loss times its target tokens is the number of nats an online coder driven by
the model would need for that data (Blier & Ollivier 2018, "The Description Length of Deep Learning
Models"). Summed over the first epoch and divided by the bytes those tokens stand for (the tokenizer's
`token_bytes`; the end-of-document token is no byte), it is the prequential bits per byte of the training
stream. The model pays for everything it learns while learning it, so the figure includes the untrained
start.

Rank 0 keeps the sums (in every checkpoint, so a resume or a rollback continues them exactly), adds the
running figure to each step's metrics as `prequential_bpb`, and at the end writes RUN_DIR/prequential.json
with xz -9e on the same bytes beside it: the first `log.prequential_xz_mb` MB of the stream in the order
the model read it, against the model's code length for exactly those bytes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from tenx.data.tokenizer import load_tokenizer
from tenx.train.hooks import Callback, TrainerView
from tenx.utils.io import atomic_write_json
from tenx.utils.xz import xz_bits_per_byte

LN2 = math.log(2)


class Prequential(Callback):
    """Sums the first epoch's code length and bytes; writes prequential.json at the end (rank 0)."""

    name = "prequential"

    def __init__(self, xz_mb: float = 8.0) -> None:
        self.xz_bytes = int(xz_mb * 2**20)
        self.nats = 0.0
        self.tokens = 0
        self.bytes = 0
        self.steps = 0
        self.prefix: list[list[float]] = []
        """[nats, bytes, window ids...] of each step of the first `xz_bytes` bytes, in the order read."""
        self.prefix_nats = 0.0
        self.prefix_bytes = 0
        self._lengths: np.ndarray | None = None
        self._pieces: list[bytes] = []

    def on_train_start(self, trainer: TrainerView) -> None:
        tokenizer = load_tokenizer(trainer.train_stream.data_dir, trainer.data_manifest["tokenizer"])
        self._pieces = tokenizer.token_bytes()
        self._lengths = np.array([len(p) for p in self._pieces], dtype=np.int64)

    def _targets(self, trainer: TrainerView, window: int) -> np.ndarray:
        seq_len = trainer.model_cfg.seq_len
        return trainer.train_stream.read(window * seq_len, seq_len + 1)[1:]

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        flight = trainer.in_flight
        position = flight.get("position") or [0, 0]
        if self._lengths is None or position[0] >= trainer.loader.num_windows:
            return  # past the first epoch: the model has seen these tokens, no longer a code length
        loss = float(metrics.get("loss", math.nan))
        if not math.isfinite(loss):
            return  # a non-finite step codes nothing (the guard skipped it); counted in neither sum
        windows = [w for ids in flight.get("all", []) for w in ids]
        targets = [self._targets(trainer, w) for w in windows]
        tokens = sum(len(t) for t in targets)
        step_bytes = sum(int(self._lengths[t].sum()) for t in targets)
        nats = loss * tokens
        self.nats += nats
        self.tokens += tokens
        self.bytes += step_bytes
        self.steps += 1
        if self.prefix_bytes < self.xz_bytes:
            self.prefix.append([nats, step_bytes, *windows])
            self.prefix_nats += nats
            self.prefix_bytes += step_bytes
        if self.bytes:
            metrics["prequential_bpb"] = self.nats / LN2 / self.bytes

    def summary(self, trainer: TrainerView, with_xz: bool = True) -> dict[str, Any]:
        """The figures of prequential.json (xz on the prefix only when `with_xz`)."""
        out: dict[str, Any] = {
            "bits_per_byte": self.nats / LN2 / self.bytes if self.bytes else None,
            "bits": self.nats / LN2,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "steps": self.steps,
            "first_epoch_complete": trainer.loader.position >= trainer.loader.num_windows,
        }
        if with_xz and self.prefix_bytes:
            t0 = time.perf_counter()
            stream, seq_len = trainer.train_stream, trainer.model_cfg.seq_len
            # a step whose data can no longer be read (a shard damaged since) leaves both sides
            kept = [
                s for s in self.prefix if all(stream.window_ok(int(w) * seq_len, seq_len + 1) for w in s[2:])
            ]
            data = b"".join(
                b"".join(self._pieces[t] for t in self._targets(trainer, int(w)).tolist())
                for step in kept
                for w in step[2:]
            )
            if data:
                out["same_bytes"] = {
                    "bytes": len(data),
                    "model_bits_per_byte": sum(s[0] for s in kept) / LN2 / sum(s[1] for s in kept),
                    "xz_bits_per_byte": xz_bits_per_byte(data),
                    "xz_seconds": round(time.perf_counter() - t0, 2),
                    "steps_unreadable_now": len(self.prefix) - len(kept),
                }
        return out

    def on_train_end(self, trainer: TrainerView) -> None:
        if self.bytes:
            atomic_write_json(trainer.rundir.prequential, self.summary(trainer))

    def state_dict(self) -> dict[str, Any]:
        return {
            "nats": self.nats,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "steps": self.steps,
            "prefix": list(self.prefix),
            "prefix_nats": self.prefix_nats,
            "prefix_bytes": self.prefix_bytes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.nats = float(state.get("nats", 0.0))
        self.tokens = int(state.get("tokens", 0))
        self.bytes = int(state.get("bytes", 0))
        self.steps = int(state.get("steps", 0))
        self.prefix = [list(step) for step in state.get("prefix", []) if isinstance(step, list)]
        self.prefix_nats = float(state.get("prefix_nats", 0.0))
        self.prefix_bytes = int(state.get("prefix_bytes", 0))
