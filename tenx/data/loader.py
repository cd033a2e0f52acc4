"""Memory-mapped, seeded, resumable token loader.

A split's shards form one token stream. The stream is cut into windows of seq_len+1 tokens that start
every seq_len tokens, so each token is a prediction target exactly once per epoch. Each epoch visits the
windows in a permutation drawn from (seed, epoch); a micro-batch is the next `micro_batch * world_size`
windows of that order, and rank r takes its own contiguous slice. The loader's whole position is
(epoch, cursor), which goes into every checkpoint, so a resumed or re-sharded run sees the same global
batches.

Faults: each shard's checksums are verified the first time a read touches it, so a corrupt shard is
caught before its tokens are trained on. With `on_corrupt="skip"` the windows that overlap a corrupt
shard are passed over, and ranges of the global order can be skipped on purpose (the data of bad steps,
after a rollback); every rank walks the same global order, so all ranks pass over the same windows.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tenx.config import field
from tenx.data.manifest import check_token_ids, np_dtype, read_manifest, regular_file_size, verify_shard
from tenx.errors import ConfigError, DataError
from tenx.hardware import host_to_device

_SKIP_HINT = 'or set data.on_corrupt_shard = "skip" to train around it'


@dataclass
class DataConfig:
    """Where training data comes from and how it is read."""

    dir: str = field("runs/data/stdlib", help="prepared data directory (from `tenx data prepare`)")
    train_split: str = field("train", help="split to train on")
    val_split: str = field("val", help="split for periodic validation loss")
    max_unique_tokens: int | None = field(
        None, ge=2, help="use only N tokens of the training split (data-constrained experiments)"
    )
    unique_sample: Literal["first", "spread"] = field(
        "first",
        help="which max_unique_tokens tokens: 'first' (the split's first N, in document order) or 'spread' "
        "(blocks of model.seq_len tokens, one training sequence each, at even intervals over the whole split: "
        "a sample of every part of it, as diverse per token as a run on the whole split)",
    )
    verify: bool = field(True, help="verify each shard's checksums against the manifest when first read")
    on_corrupt_shard: Literal["error", "skip"] = field(
        "error",
        help="a training shard that fails its checksum: 'error' stops the run, 'skip' trains around it "
        "(its windows are never served; a corrupt-shard event is logged)",
    )

    def validate(self) -> None:
        """Check that a directory is named (the directory itself is checked when the run opens it)."""
        if not self.dir:
            raise ConfigError("data.dir: must name a prepared data directory")


class TokenStream:
    """The concatenated tokens of one split, read through memory maps without copying the shards.

    Shards are mapped at construction and each is verified against its manifest checksums when a read
    first touches it. A corrupt shard raises DataError (`on_corrupt="error"`) or is recorded in
    `bad_shards` and reported to `on_bad_shard(path, message)` (`on_corrupt="skip"`); reads never
    return its tokens.

    `max_tokens` caps the stream at that many tokens: the split's first ones (`sample="first"`), or
    (`sample="spread"`) blocks of `block` tokens whose starts are spaced evenly over the whole split, read
    one after another as one stream (offsets, `locate` and `document_of` take the stream's offsets). A
    training window over one whole block reads its last target where the block's text goes on (`_pieces`).
    """

    def __init__(
        self,
        data_dir: str | Path,
        split: str,
        verify: bool = True,
        max_tokens: int | None = None,
        on_corrupt: Literal["error", "skip"] = "error",
        sample: Literal["first", "spread"] = "first",
        block: int | None = None,
    ):
        if on_corrupt not in ("error", "skip"):
            raise ValueError(f"on_corrupt must be 'error' or 'skip', got {on_corrupt!r}")
        self.data_dir = Path(data_dir)
        self.manifest = read_manifest(self.data_dir)
        splits = self.manifest["splits"]
        if split not in splits:
            raise DataError(
                f"{self.data_dir / 'manifest.json'}: no split '{split}'; available: {', '.join(splits)}"
            )
        self.split = split
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        """Every id read must be below this (the manifest's vocabulary): a damaged shard never reaches a model."""
        self.verify = verify
        self.on_corrupt = on_corrupt
        self.on_bad_shard: Callable[[str, str], None] | None = None
        """Called once per shard found corrupt in skip mode, with its path and the reason."""
        self.entries: list[dict[str, Any]] = splits[split]["shards"]
        self.starts: list[int] = []
        total = 0
        for shard in self.entries:
            self.starts.append(total)
            total += int(shard["tokens"])
        self.total_tokens = total
        self.num_tokens = min(total, max_tokens) if max_tokens is not None else total
        if sample not in ("first", "spread"):
            raise ValueError(f"sample must be 'first' or 'spread', got {sample!r}")
        if sample == "spread" and (block is None or block < 1):
            raise ValueError(f"a spread sample needs a block of at least 1 token, got {block!r}")
        self._block = block or 1
        self._stride = 0  # a spread sample: block k starts at k * stride of the split (0: no spread)
        if sample == "spread" and self.num_tokens < total:
            blocks = -(-self.num_tokens // self._block)
            self._stride = total // blocks  # >= block: blocks * block < total + block
        self.layout = (
            f"spread {self._block}/{self._stride}"
            if self._stride
            else "first"
            if self.num_tokens < total
            else "all"
        )
        """Which of the split's tokens the stream reads: 'all', 'first' (a prefix) or 'spread BLOCK/STRIDE';
        a loader's state records it, so a checkpoint is not resumed on another sample of the same size."""
        self._doc_starts: dict[int, np.ndarray] | None = None
        self._open()

    def _open(self) -> None:
        """Map every shard and forget what was verified, as a fresh process would."""
        dtype = np_dtype(self.manifest)
        self.shards: list[np.ndarray] = []
        self.bad_shards: dict[int, str] = {}
        # Shards that need no check before a read: verified ones, and those no read can reach (empty, or
        # wholly past max_tokens). Once it holds every shard, window_ok is a single attribute test.
        self._sound: set[int] = set()
        # A missing shard, or one whose size disagrees with the manifest, is corrupt too; in skip mode it is
        # reported when first touched, like a checksum mismatch, so window ids keep their manifest places.
        self._open_errors: dict[int, str] = {}
        for i, shard in enumerate(self.entries):
            path = self.data_dir / shard["file"]
            tokens = int(shard["tokens"])
            if not tokens or (not self._stride and self.starts[i] >= self.num_tokens):
                self._sound.add(i)
            if not tokens:
                self.shards.append(np.zeros(0, dtype=dtype))
                continue
            size = regular_file_size(path)
            if size == tokens * dtype.itemsize:
                self.shards.append(np.memmap(path, dtype=dtype, mode="r"))
                continue
            if size is None:
                message = f"shard file {path} is missing; re-run `tenx data prepare`"
            else:
                message = (
                    f"shard file {path} holds {size // dtype.itemsize} tokens, manifest says {tokens}; "
                    "re-run `tenx data prepare`"
                )
            if self.on_corrupt == "error":
                raise DataError(f"{message}, {_SKIP_HINT}")
            self._open_errors[i] = message
            self.shards.append(np.zeros(0, dtype=dtype))
        self._all_good = len(self._sound) == len(self.entries)

    def reopen(self) -> None:
        """Re-map the shards and verify each again on its next read (catches damage done since)."""
        self._open()

    def __len__(self) -> int:
        return self.num_tokens

    def _check(self, i: int) -> bool:
        """Verify shard i once; False if it is bad (skip mode), DataError if it is bad (error mode)."""
        if i in self._sound:
            return True
        if i in self.bad_shards:
            return False
        path = str(self.data_dir / self.entries[i]["file"])
        message = self._open_errors.get(i)
        if message is None and self.verify:
            try:
                verify_shard(self.data_dir, self.entries[i])
            except DataError as e:
                message = str(e)
        if message is None:
            self._sound.add(i)
            self._all_good = len(self._sound) == len(self.entries)
            return True
        if self.on_corrupt == "error":
            raise DataError(f"{message}, {_SKIP_HINT}")
        self.bad_shards[i] = message
        if self.on_bad_shard is not None:
            self.on_bad_shard(path, message)
        return False

    def window_ok(self, start: int, length: int) -> bool:
        """Whether every shard under tokens [start, start+length) is sound, verifying each on first use."""
        if self._all_good:
            return True
        for begin, take in self._pieces(start, length):
            end = begin + take
            i = bisect.bisect_right(self.starts, begin) - 1
            while True:
                if not self._check(i):
                    return False
                i += 1
                if i == len(self.starts) or self.starts[i] >= end:
                    break
        return True

    def _physical(self, offset: int) -> int:
        """The split offset of stream offset `offset` (they differ in a spread sample)."""
        if not self._stride:
            return offset
        block, within = divmod(offset, self._block)
        return block * self._stride + within

    def _pieces(self, start: int, length: int) -> list[tuple[int, int]]:
        """Stream tokens [start, start+length) as (split offset, count) pieces, one per block crossed; a read
        of one block and one token more from a block's start (a training window over its block: its inputs
        and targets) is one piece of the split, its last target the token that follows the block in the
        text, not the first of the next block (taken from elsewhere, a random token to predict)."""
        if not self._stride:
            return [(start, length)]
        if length == self._block + 1 and start % self._block == 0:
            return [(self._physical(start), length)]
        pieces = []
        while length > 0:
            take = min(length, self._block - start % self._block)
            pieces.append((self._physical(start), take))
            start, length = start + take, length - take
        return pieces

    def document_of(self, token_offset: int) -> int | None:
        """The split-wide index of the document holding a stream offset (None: its shard's index is unreadable).

        Shards hold whole documents in order; `{split}_NNNNN.idx` lists each one's start within its shard."""
        if not 0 <= token_offset < self.num_tokens:
            raise IndexError(f"offset {token_offset} outside stream of {self.num_tokens} tokens")
        token_offset = self._physical(token_offset)
        i = bisect.bisect_right(self.starts, token_offset) - 1
        if self._doc_starts is None:
            self._doc_starts = {}
        if i not in self._doc_starts:
            try:
                self._doc_starts[i] = np.fromfile(self.data_dir / self.entries[i]["index_file"], dtype="<i8")
            except (OSError, KeyError, ValueError):
                return None
        before = sum(int(self.entries[k].get("documents", 0)) for k in range(i))
        local = int(np.searchsorted(self._doc_starts[i], token_offset - self.starts[i], side="right")) - 1
        return before + max(local, 0)

    def locate(self, token_offset: int) -> tuple[str, int]:
        """The shard file (relative to the data directory) holding a stream offset, and the offset in it."""
        if not 0 <= token_offset < self.num_tokens:
            raise IndexError(f"offset {token_offset} outside stream of {self.num_tokens} tokens")
        token_offset = self._physical(token_offset)
        i = bisect.bisect_right(self.starts, token_offset) - 1
        return self.entries[i]["file"], token_offset - self.starts[i]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) as int64, crossing shard boundaries as needed."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"read [{start}, {start + length}) outside stream of {self.num_tokens} tokens")
        out = np.empty(length, dtype=np.int64)
        pos = 0
        for begin, count in self._pieces(start, length):
            i = bisect.bisect_right(self.starts, begin) - 1
            end = pos + count
            while pos < end:
                if not self._check(i):
                    raise DataError(
                        f"read [{start}, {start + length}) touches a corrupt shard: {self.bad_shards[i]}"
                    )
                local = begin + count - (end - pos) - self.starts[i]
                take = min(end - pos, len(self.shards[i]) - local)
                piece = self.shards[i][local : local + take]
                check_token_ids(piece, self.vocab_size, self.data_dir / self.entries[i]["file"], local)
                out[pos : pos + take] = piece
                pos += take
                i += 1
        return out


def train_stream(
    data: DataConfig,
    seq_len: int,
    *,
    verify: bool | None = None,
    on_corrupt: Literal["error", "skip"] | None = None,
) -> TokenStream:
    """The training split's stream as `data` describes it (its cap of unique tokens and which ones, a spread
    sample in blocks of one training sequence, `seq_len` tokens); `verify` and `on_corrupt` override the
    config's (replay verifies always and reads around corrupt shards)."""
    return TokenStream(
        data.dir,
        data.train_split,
        data.verify if verify is None else verify,
        data.max_unique_tokens,
        on_corrupt=data.on_corrupt_shard if on_corrupt is None else on_corrupt,
        sample=data.unique_sample,
        block=seq_len,
    )


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
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy generators take no negative seeds), got {seed}")
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
        self.last_windows: list[int] = []
        """This rank's window ids in the most recent `next_batch()`."""
        self.last_global_windows: list[int] = []
        """Every rank's window ids in the most recent `next_batch()`, rank 0's first."""
        self._skips: list[tuple[int, int]] = []  # sorted, disjoint, non-adjacent [start, end) positions
        self._order_epoch = -1
        self._order = np.arange(0)

    @property
    def position(self) -> int:
        """Positions of the global window order consumed so far (served, skipped or rejected)."""
        return self.epoch * self.num_windows + self.cursor

    def _seek(self, position: int) -> None:
        self.epoch, self.cursor = divmod(position, self.num_windows)

    def add_skip(self, start: int, end: int) -> None:
        """Never serve the windows at global positions [start, end) (the data of bad steps)."""
        if not 0 <= start < end:
            raise ValueError(f"skip range [{start}, {end}) must satisfy 0 <= start < end")
        self._skips = _merge([*self._skips, (start, end)])

    def _window_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            else:
                self._order = np.arange(self.num_windows)
            self._order_epoch = epoch
        return self._order

    def _take_windows(self, count: int) -> list[int]:
        """The next `count` servable window ids of the global order, advancing (epoch, cursor)."""
        ids: list[int] = []
        rejected = 0
        while len(ids) < count:
            position = self.position
            k = bisect.bisect_right(self._skips, (position, float("inf")))
            if k and self._skips[k - 1][1] > position:  # inside a skip range: jump past it
                self._seek(self._skips[k - 1][1])
                continue
            stop = min(self.num_windows, self.cursor + count - len(ids))
            if k < len(self._skips):
                stop = min(stop, self._skips[k][0] - self.epoch * self.num_windows)
            order = self._window_order(self.epoch)
            for w in order[self.cursor : stop].tolist():
                if self.stream.window_ok(w * self.seq_len, self.seq_len + 1):
                    ids.append(w)
                else:
                    rejected += 1
            self._seek(self.epoch * self.num_windows + stop)
            if rejected >= self.num_windows:
                self._require_a_good_window()
                rejected = 0
        return ids

    def _require_a_good_window(self) -> None:
        """After a long run of rejected windows, make sure some window can ever be served."""
        if not any(
            self.stream.window_ok(w * self.seq_len, self.seq_len + 1) for w in range(self.num_windows)
        ):
            bad = ", ".join(
                str(self.stream.data_dir / self.stream.entries[i]["file"]) for i in self.stream.bad_shards
            )
            raise DataError(
                f"every window of split '{self.stream.split}' overlaps a corrupt shard ({bad}); "
                "re-run `tenx data prepare`"
            )

    def next_batch(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: inputs and next-token targets, int64 (B, T), on `device` (default:
        the host). To a GPU the (B, T+1) window block goes in one copy from pinned memory that does not
        block the host, and inputs and targets are views of it there."""
        ids = self._take_windows(self.micro_batch * self.world_size)
        self.last_global_windows = ids
        self.last_windows = ids[self.rank * self.micro_batch : (self.rank + 1) * self.micro_batch]
        rows = np.stack([self.stream.read(w * self.seq_len, self.seq_len + 1) for w in self.last_windows])
        tokens = torch.from_numpy(rows)
        if device is not None:
            tokens = host_to_device(tokens, device)
        return tokens[:, :-1], tokens[:, 1:]

    def describe_windows(self, ids: list[int]) -> list[dict[str, Any]]:
        """Where each window starts: its id, shard file, token offset within that shard and document index."""
        described = []
        for w in ids:
            shard, offset = self.stream.locate(int(w) * self.seq_len)
            document = self.stream.document_of(int(w) * self.seq_len)
            described.append({"window": int(w), "shard": shard, "offset": offset, "document": document})
        return described

    @property
    def epochs_seen(self) -> float:
        """How many times, on average, each training token has been a target so far."""
        return self.epoch + self.cursor / self.num_windows

    def state_dict(self) -> dict[str, Any]:
        """Position in the global window order and the skipped ranges (plain ints, JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "num_windows": self.num_windows,
            "sample": self.stream.layout,
            "skips": [[start, end] for start, end in self._skips],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict`; refuses one made for a different stream."""
        if state["num_windows"] != self.num_windows or state["seed"] != self.seed:
            raise DataError(
                f"loader state was saved for {state['num_windows']} windows with seed {state['seed']}, but this "
                f"data has {self.num_windows} windows with seed {self.seed}: the data or seq_len changed since "
                "the checkpoint"
            )
        saved = state.get("sample")
        if saved is None and self.stream.layout.startswith("spread"):
            raise DataError(
                "loader state was saved before tenx recorded which sample a run reads, and this run reads a "
                f"spread sample ({self.stream.layout}): spread samples were then blocks of 2,048 tokens, so "
                "resuming would read other data; start the run again, or resume it with the tenx that wrote it"
            )
        if saved is not None and saved != self.stream.layout:
            raise DataError(
                f"loader state was saved for the sample {saved!r} of the training split, but this run reads "
                f"{self.stream.layout!r}: data.max_unique_tokens, data.unique_sample or model.seq_len changed "
                "since the checkpoint"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._skips = _merge([(int(start), int(end)) for start, end in state.get("skips", [])])


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted union of [start, end) ranges, overlapping or touching ones joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def spread_windows(num_tokens: int, seq_len: int, count: int | None = None) -> np.ndarray:
    """The ids of the windows `sequential_windows` reads from a stream of `num_tokens` (window w: tokens
    [w * seq_len, w * seq_len + seq_len + 1)): `count` of them spread evenly, or every one."""
    n = (num_tokens - 1) // seq_len
    if count is not None and count < n:
        return np.unique(np.linspace(0, n - 1, count).round().astype(np.int64))
    return np.arange(n)


def sequential_windows(stream: TokenStream, seq_len: int, batch_size: int, max_batches: int | None = None):
    """Deterministic (inputs, targets) batches for validation loss.

    With `max_batches`, the windows are spread evenly over the whole split (not its first documents, which
    in sorted-id order can all come from one unusual file); without it, every window in order.
    """
    windows = spread_windows(len(stream), seq_len, None if max_batches is None else max_batches * batch_size)
    for first in range(0, len(windows), batch_size):
        rows = np.stack(
            [stream.read(int(w) * seq_len, seq_len + 1) for w in windows[first : first + batch_size]]
        )
        tokens = torch.from_numpy(rows)
        yield tokens[:, :-1], tokens[:, 1:]
