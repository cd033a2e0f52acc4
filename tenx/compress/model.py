"""A trained model and its tokenizer ready to code bytes: the id of each byte string, both identities.

`to_ids` turns any bytes into coding ids whose byte strings concatenate to exactly the input (the codec's
module docstring says how); `spell` joins them back. `load_codec` checks the tokenizer is the one the
checkpoint was trained with and can spell every byte. An ensemble's directory loads as one `CodecModel` whose
model is the `Ensemble`, with each member's identity (`Member`) for the header of format version 5.
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
from tenx.compress.container import members_digest
from tenx.compress.fixed import GRID_BITS, FixedWeights
from tenx.data.manifest import read_manifest
from tenx.data.tokenizer import BPETokenizer, Tokenizer, load_tokenizer
from tenx.errors import DataError, TenxError
from tenx.model.ensemble import Ensemble
from tenx.model.transformer import Transformer
from tenx.utils.io import file_xxhash

_ESCAPED = re.compile("([\udc80-\udcff]+)")
"""Runs of bytes that are not UTF-8, as decode(errors="surrogateescape") spells them."""


@dataclass(frozen=True)
class Member:
    """One member of an ensemble, as a `.tenx` header names it."""

    checkpoint: Path
    step: int
    model_hash: str
    """xxh3-64 of the member checkpoint's manifest file."""


@dataclass
class CodecModel:
    """A model (or an ensemble) and its tokenizer ready to code: the token-to-bytes table and the identities."""

    model: Transformer | Ensemble
    tokenizer: Tokenizer
    checkpoint: Path
    """The checkpoint directory (an ensemble: its directory)."""
    data_dir: Path
    """The prepared data directory the model was trained on (its tokenizer's)."""
    step: int
    table: list[bytes | None]
    """Bytes of each coding id (None: an id no input is coded with, e.g. end-of-document)."""
    byte_ids: np.ndarray
    """The id of each single byte 0..255."""
    model_hash: str
    """xxh3-64 of the checkpoint's manifest file: its identity (an ensemble: of its members' digests)."""
    tokenizer_hash: str
    members: list[Member] = field(default_factory=list)
    """An ensemble's members in order; empty for one model."""
    _fixed: dict[int, list[FixedWeights]] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return next(self.model.parameters()).device

    @property
    def transformers(self) -> list[Transformer]:
        """The model, or an ensemble's members."""
        if isinstance(self.model, Ensemble):
            return [cast(Transformer, m) for m in self.model.members]
        return [self.model]

    def fixed_weights(self, linear_bits: int = GRID_BITS) -> FixedWeights:
        """The model's weights on the fixed-point grid, its linear layers' on `linear_bits` (built on first
        use); one model only (an ensemble: `member_weights`)."""
        if isinstance(self.model, Ensemble):
            raise TenxError(f"{self.checkpoint} is an ensemble: one model's weights are asked for")
        return self.member_weights(linear_bits)[0]

    def member_weights(self, linear_bits: int = GRID_BITS) -> list[FixedWeights]:
        """Each member's weights on the fixed-point grid (one model: its own), as `fixed_weights`."""
        if linear_bits not in self._fixed:
            self._fixed[linear_bits] = [FixedWeights(m, self.device, linear_bits) for m in self.transformers]
        return self._fixed[linear_bits]


def load_codec(target: CodecModel | LoadedModel | str | Path, device: str = "cpu") -> CodecModel:
    """The model of a run or checkpoint directory (or one loaded already) with what coding needs."""
    if isinstance(target, CodecModel):
        return target
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
    members = _members(loaded, entry["xxhash"]) if isinstance(loaded.model, Ensemble) else []
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
    digests = [(bytes.fromhex(m.model_hash), m.step) for m in members]
    return CodecModel(
        model=loaded.model,
        tokenizer=tokenizer,
        checkpoint=cast(Path, loaded.run_dir) if members else loaded.checkpoint,
        data_dir=loaded.data_dir,
        step=int(loaded.meta["step"]),
        table=table,
        byte_ids=byte_ids,
        model_hash=members_digest(digests).hex()
        if members
        else file_xxhash(loaded.checkpoint / ckpt.MANIFEST),
        tokenizer_hash=str(entry["xxhash"]),
        members=members,
    )


def _members(loaded: LoadedModel, tokenizer_hash: str) -> list[Member]:
    """Each member of a loaded ensemble with its identity; a DataError for one trained with another
    tokenizer than the ensemble's data directory holds (its manifest named)."""
    members = []
    for recorded in loaded.meta["members"]:
        path = Path(recorded)
        meta = ckpt.read_checkpoint_meta(path, require=("step",))  # verified when it was loaded
        trained = meta.get("data_tokenizer")
        if isinstance(trained, dict) and trained.get("xxhash") not in (None, tokenizer_hash):
            raise DataError(
                f"ensemble {loaded.run_dir}: member checkpoint {path} was trained with tokenizer xxhash "
                f"{trained['xxhash']}, not the one of {loaded.data_dir} ({tokenizer_hash})"
            )
        members.append(Member(path, int(meta["step"]), file_xxhash(path / ckpt.MANIFEST)))
    return members


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
