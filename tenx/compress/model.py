"""A trained model and its tokenizer ready to code bytes: the id of each byte string, both identities.

`to_ids` turns any bytes into coding ids whose byte strings concatenate to exactly the input (the codec's
module docstring says how); `spell` joins them back. `load_codec` checks the tokenizer is the one the
checkpoint was trained with and can spell every byte.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch

from tenx import checkpoint as ckpt
from tenx.checkpoint.models import LoadedModel, load_model
from tenx.compress.fixed import GRID_BITS, FixedWeights
from tenx.data.manifest import read_manifest
from tenx.data.tokenizer import BPETokenizer, Tokenizer, load_tokenizer
from tenx.errors import DataError, TenxError
from tenx.model.ensemble import Ensemble
from tenx.model.transformer import Transformer
from tenx.rundir import RunDir
from tenx.utils.io import file_xxhash

_ESCAPED = re.compile("([\udc80-\udcff]+)")
"""Runs of bytes that are not UTF-8, as decode(errors="surrogateescape") spells them."""


@dataclass
class CodecModel:
    """A model and its tokenizer ready to code: the token-to-bytes table and both identities."""

    model: Transformer
    tokenizer: Tokenizer
    checkpoint: Path
    data_dir: Path
    """The prepared data directory the model was trained on (its tokenizer's)."""
    step: int
    table: list[bytes | None]
    """Bytes of each coding id (None: an id no input is coded with, e.g. end-of-document)."""
    byte_ids: np.ndarray
    """The id of each single byte 0..255."""
    model_hash: str
    """xxh3-64 of the checkpoint's manifest file: its identity."""
    tokenizer_hash: str
    _fixed: dict[int, FixedWeights] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return next(self.model.parameters()).device

    def fixed_weights(self, linear_bits: int = GRID_BITS) -> FixedWeights:
        """The model's weights on the fixed-point grid, its linear layers' on `linear_bits` (built on first
        use)."""
        if linear_bits not in self._fixed:
            self._fixed[linear_bits] = FixedWeights(self.model, self.device, linear_bits)
        return self._fixed[linear_bits]


def load_codec(target: CodecModel | LoadedModel | str | Path, device: str = "cpu") -> CodecModel:
    """The model of a run or checkpoint directory (or one loaded already) with what coding needs."""
    if isinstance(target, CodecModel):
        return target
    if _is_ensemble(target):
        raise TenxError(
            f"{getattr(target, 'run_dir', None) or target} is an ensemble: the .tenx formats (1 to 4) code "
            "with one model's probabilities and name one checkpoint in their header, so they cannot code an "
            "ensemble's mixture; compress with one member (give its run directory, RUN/members/K), or "
            "measure the mixture's code length with `tenx eval` (its bits per byte)"
        )
    loaded = target if isinstance(target, LoadedModel) else load_model(target, device)
    if loaded.model.cfg.vocab_size is None:
        raise TenxError(f"checkpoint {loaded.checkpoint}: its model has no vocabulary size")
    entry = read_manifest(loaded.data_dir)["tokenizer"]
    tokenizer = load_tokenizer(loaded.data_dir, entry)
    trained = loaded.meta.get("data_tokenizer")
    if isinstance(trained, dict) and trained.get("xxhash") not in (None, entry["xxhash"]):
        raise DataError(
            f"{loaded.data_dir}: its tokenizer (xxhash {entry['xxhash']}) is not the one checkpoint "
            f"{loaded.checkpoint} was trained with (xxhash {trained['xxhash']})"
        )
    if tokenizer.vocab_size > loaded.model.cfg.vocab_size:
        raise DataError(
            f"{loaded.data_dir}: its tokenizer has {tokenizer.vocab_size} tokens but the model of "
            f"{loaded.checkpoint} has {loaded.model.cfg.vocab_size}: not the data the run was trained on"
        )
    table = _token_bytes(tokenizer)
    byte_ids = np.full(256, -1, dtype=np.int64)
    for i, spelled in enumerate(table):
        if spelled is not None and len(spelled) == 1 and byte_ids[spelled[0]] < 0:
            byte_ids[spelled[0]] = i
    if (byte_ids < 0).any():
        missing = ", ".join(f"0x{b:02x}" for b in np.flatnonzero(byte_ids < 0)[:8])
        raise TenxError(
            f"tokenizer of {loaded.data_dir} has no token for byte(s) {missing}: it cannot code any bytes"
        )
    return CodecModel(
        model=cast(Transformer, loaded.model),  # not an ensemble (refused above)
        tokenizer=tokenizer,
        checkpoint=loaded.checkpoint,
        data_dir=loaded.data_dir,
        step=int(loaded.meta["step"]),
        table=table,
        byte_ids=byte_ids,
        model_hash=file_xxhash(loaded.checkpoint / ckpt.MANIFEST),
        tokenizer_hash=str(entry["xxhash"]),
    )


def _is_ensemble(target: LoadedModel | str | Path) -> bool:
    """Whether `target` is an ensemble (loaded, or a directory with an ensemble manifest)."""
    if isinstance(target, LoadedModel):
        return isinstance(target.model, Ensemble)
    return Path(target).is_dir() and RunDir(target).ensemble.exists()


def _byte_level_chars() -> list[str]:
    """The character byte-level BPE spells each byte with (GPT-2's table: printable Latin-1 bytes stand for
    themselves, the others take the code points from 256 up, in byte order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def _token_bytes(tokenizer: Tokenizer) -> list[bytes | None]:
    """The bytes each id stands for; None for the end-of-document id (and BPE tokens outside the byte
    alphabet, which no input is coded with)."""
    table: list[bytes | None] = [None] * tokenizer.vocab_size
    if not isinstance(tokenizer, BPETokenizer):
        table[:256] = [bytes([b]) for b in range(256)]
        return table
    byte_of = {c: b for b, c in enumerate(_byte_level_chars())}
    vocab = json.loads(tokenizer.to_json())["model"]["vocab"]
    for token, i in vocab.items():
        if 0 <= i < len(table) and i != tokenizer.eot_id and token and all(c in byte_of for c in token):
            table[i] = bytes(byte_of[c] for c in token)
    return table


def spell(codec: CodecModel, ids: np.ndarray | list[int]) -> bytes | None:
    """The bytes of `ids`, or None if one of them stands for no bytes."""
    table, listed = codec.table, ids.tolist() if isinstance(ids, np.ndarray) else ids
    try:
        return b"".join([table[i] for i in listed])  # type: ignore[misc]
    except TypeError:
        return None


def to_ids(codec: CodecModel, data: bytes) -> np.ndarray:
    """Coding ids whose bytes concatenate to exactly `data` (see the module docstring)."""
    if not isinstance(codec.tokenizer, BPETokenizer):
        return codec.byte_ids[np.frombuffer(data, dtype=np.uint8)]
    pieces = _ESCAPED.split(data.decode("utf-8", errors="surrogateescape"))
    encoded = iter(codec.tokenizer.encode_batch(pieces[0::2]))  # even pieces are text, odd ones raw bytes
    parts = []
    for i, piece in enumerate(pieces):
        raw = piece.encode("utf-8", errors="surrogateescape")
        ids = next(encoded) if i % 2 == 0 else None
        if ids is not None and spell(codec, ids) == raw:
            parts.append(np.asarray(ids, dtype=np.int64))
        else:
            parts.append(codec.byte_ids[np.frombuffer(raw, dtype=np.uint8)])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
