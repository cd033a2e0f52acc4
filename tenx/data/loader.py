"""Memory-mapped, seeded, resumable token loader.

A split's shards form one token stream. The stream is cut into windows of seq_len+1 tokens that start
every seq_len tokens, so each token is a prediction target exactly once per epoch. Each epoch visits the
windows in a permutation drawn from (seed, epoch); a micro-batch is the next `micro_batch * world_size`
windows of that order, and rank r takes its own contiguous slice. The loader's whole position is
(epoch, cursor), which goes into every checkpoint, so a resumed or re-sharded run sees the same global
batches.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tenx.config import field
from tenx.data.manifest import np_dtype, read_manifest, verify_split
from tenx.errors import ConfigError, DataError


@dataclass
class DataConfig:
    """Where training data comes from and how it is read."""

    dir: str = field("runs/data/stdlib", help="prepared data directory (from `tenx data prepare`)")
    train_split: str = field("train", help="split to train on")
    val_split: str = field("val", help="split for periodic validation loss")
    max_unique_tokens: int | None = field(
        None, help="use only the first N tokens of the training split (data-constrained experiments)"
    )
    verify: bool = field(True, help="verify shard checksums against the manifest when opening a split")

    def validate(self) -> None:
        """Check field values (the directory itself is checked when the run opens it)."""
        if not self.dir:
            raise ConfigError("data.dir: must name a prepared data directory")
        if self.max_unique_tokens is not None and self.max_unique_tokens < 2:
            raise ConfigError(f"data.max_unique_tokens: must be >= 2, got {self.max_unique_tokens}")


class TokenStream:
    """The concatenated tokens of one split, read through memory maps without copying the shards."""

    def __init__(self, data_dir: str | Path, split: str, verify: bool = True, max_tokens: int | None = None):
        self.data_dir = Path(data_dir)
        self.manifest = read_manifest(self.data_dir)
        splits = self.manifest["splits"]
        if split not in splits:
            raise DataError(
                f"{self.data_dir / 'manifest.json'}: no split '{split}'; available: {', '.join(splits)}"
            )
        if verify:
            verify_split(self.data_dir, self.manifest, split)
        self.split = split
        dtype = np_dtype(self.manifest)
        self.shards: list[np.ndarray] = []
        self.starts: list[int] = []
        total = 0
        for shard in splits[split]["shards"]:
            path = self.data_dir / shard["file"]
            arr = np.memmap(path, dtype=dtype, mode="r") if shard["tokens"] else np.zeros(0, dtype=dtype)
            if len(arr) != shard["tokens"]:
                raise DataError(
                    f"{path}: holds {len(arr)} tokens, manifest says {shard['tokens']}; re-run prepare"
                )
            self.starts.append(total)
            self.shards.append(arr)
            total += len(arr)
        self.total_tokens = total
        self.num_tokens = min(total, max_tokens) if max_tokens is not None else total

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) as int64, crossing shard boundaries as needed."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"read [{start}, {start + length}) outside stream of {self.num_tokens} tokens")
        out = np.empty(length, dtype=np.int64)
        pos = 0
        i = bisect.bisect_right(self.starts, start) - 1
        while pos < length:
            local = start + pos - self.starts[i]
            take = min(length - pos, len(self.shards[i]) - local)
            out[pos : pos + take] = self.shards[i][local : local + take]
            pos += take
            i += 1
        return out


class TokenLoader:
    """Yields (inputs, targets) micro-batches of shape (micro_batch, seq_len) for one rank."""

    def __init__(
        self,
        stream: TokenStream,
        seq_len: int,
        micro_batch: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.stream, self.seq_len, self.micro_batch = stream, seq_len, micro_batch
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.num_windows = (len(stream) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(
                f"split '{stream.split}' of {stream.data_dir} has {len(stream)} tokens, fewer than one "
                f"sequence of {seq_len + 1}; prepare more data or lower model.seq_len"
            )
        self.epoch = 0
        self.cursor = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    def _window_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            else:
                self._order = np.arange(self.num_windows)
            self._order_epoch = epoch
        return self._order

    def _take_windows(self, count: int) -> np.ndarray:
        """The next `count` window ids of the global order, advancing (epoch, cursor)."""
        ids = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            order = self._window_order(self.epoch)
            take = min(count - filled, self.num_windows - self.cursor)
            ids[filled : filled + take] = order[self.cursor : self.cursor + take]
            filled += take
            self.cursor += take
            if self.cursor == self.num_windows:
                self.epoch, self.cursor = self.epoch + 1, 0
        return ids

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: inputs and next-token targets, int64 (B, T)."""
        ids = self._take_windows(self.micro_batch * self.world_size)
        mine = ids[self.rank * self.micro_batch : (self.rank + 1) * self.micro_batch]
        rows = np.stack([self.stream.read(int(w) * self.seq_len, self.seq_len + 1) for w in mine])
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1], tokens[:, 1:]

    @property
    def epochs_seen(self) -> float:
        """How many times, on average, each training token has been a target so far."""
        return self.epoch + self.cursor / self.num_windows

    def state_dict(self) -> dict[str, Any]:
        """Position in the global window order (plain ints, JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict`; refuses one made for a different stream."""
        if state["num_windows"] != self.num_windows or state["seed"] != self.seed:
            raise DataError(
                f"loader state was saved for {state['num_windows']} windows with seed {state['seed']}, but this "
                f"data has {self.num_windows} windows with seed {self.seed}: the data or seq_len changed since "
                "the checkpoint"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def sequential_windows(stream: TokenStream, seq_len: int, batch_size: int, max_batches: int | None = None):
    """Deterministic (inputs, targets) batches for validation loss.

    With `max_batches`, the windows are spread evenly over the whole split (not its first documents, which
    in sorted-id order can all come from one unusual file); without it, every window in order.
    """
    n = (len(stream) - 1) // seq_len
    windows = np.arange(n)
    if max_batches is not None and max_batches * batch_size < n:
        windows = np.unique(np.linspace(0, n - 1, max_batches * batch_size).round().astype(np.int64))
    for first in range(0, len(windows), batch_size):
        rows = np.stack(
            [stream.read(int(w) * seq_len, seq_len + 1) for w in windows[first : first + batch_size]]
        )
        tokens = torch.from_numpy(rows)
        yield tokens[:, :-1], tokens[:, 1:]
