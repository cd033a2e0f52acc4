"""Lossless compression with a trained model: range coding driven by its next-token probabilities.

`compress_bytes` turns any bytes into a `.tenx` blob and `decompress_bytes` gives back exactly those bytes
(`tenx compress` / `tenx decompress` wrap the file versions).

Any bytes round-trip. The input becomes token ids whose byte strings, looked up in the tokenizer's
token-to-bytes table, concatenate to exactly the input: the byte tokenizer maps each byte to its id; with a
byte-level BPE each maximal run of valid UTF-8 is encoded as text, and each byte that is not valid UTF-8 (and
any run whose BPE ids do not spell it back byte for byte, checked here) becomes the single-byte token every
byte-level BPE holds. Decompression joins the table's byte strings: it never decodes text, so binary data,
NUL bytes and invalid UTF-8 come back unchanged. The end-of-document token is never coded (the header holds
the token count), so its probability is given to the other tokens.

Both sides compute bit-identical probabilities because they run one function, `_code`, on the same inputs.
The tokens are cut into chunks of seq_len, each coded with context from its own chunk only (its first token
conditioned on the end-of-document token, as documents start in training); up to MAX_GROUP chunks go through
the model together, one position per step, with a key/value cache. Step s feeds every chunk's token s-1
(known to the encoder, just decoded by the decoder). The logits come from `FixedStepper`
(tenx/compress/fixed.py), whose arithmetic every CPU kind, thread count and GPU rounds alike, and become
integer frequencies floor(exp(z - max z) * 2**24) + 1 (every token codable) before constriction's range
coder quantises them; format version 1's float32 kernels (`FloatStepper`) are still read, where they run.
The container (header, checksums, format versions) is tenx/compress/container.py; `tenx compress --adapt`
(format version 3) lets the output layer learn as it codes (tenx/compress/adapt.py).
The checksums stop accidents, not forgers: the token count is checked against the body's bits before
decoding (`fewest_bits` against `code_bits`) and the information decoded against them while decoding.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import constriction
import numpy as np
import torch

from tenx import checkpoint as ckpt
from tenx.compress.adapt import AdaptiveHead
from tenx.compress.container import (
    ADAPTIVE_VERSION,
    DEVICES,
    VERSION,
    CodecAdaptation,
    Header,
    _digest,
    read_header,
)
from tenx.compress.fixed import FixedStepper, FixedWeights, fixed_frequencies
from tenx.compress.float32 import FREQ_SCALE, FloatStepper, float_frequencies
from tenx.data.manifest import read_manifest
from tenx.data.tokenizer import BPETokenizer, Tokenizer, load_tokenizer
from tenx.errors import DataError, TenxError
from tenx.eval.load import LoadedModel, load_model
from tenx.model.transformer import Block, Transformer
from tenx.rundir import step_dir_name
from tenx.utils.cli import counted
from tenx.utils.io import atomic_write_bytes, check_output_file, file_xxhash

MAX_GROUP = 256
"""Chunks coded side by side: one forward step serves this many tokens (measured on the quickstart model,
1 thread: 2,200 tokens/s one chunk at a time, 9,200 with 64; a 120 KB file of 134 chunks in one group
instead of 64 + 64 + 6 compresses 1.2x and decompresses 1.4x faster). A file's chunks are split into
equal groups (`_balanced`), so no short last group steps through every position for a few rows."""
ENCODE_ROWS = 16
"""Chunks the encoder runs through the model at once, every position together (attention scores of
rows x heads x seq_len**2 float64 values)."""
ENCODE_BLOCK = 64
"""Positions the encoder runs through the model at once, each block attending to the ones before it."""
ENCODE_POSITIONS = 256
"""Positions whose output layer and frequencies the encoder computes at once (two float64 arrays of
positions x vocabulary)."""
CACHE_BYTES = 1 << 30
"""Fewer chunks side by side where their key/value cache would exceed this (large models)."""
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
    _fixed: FixedWeights | None = None

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return next(self.model.parameters()).device

    def fixed_weights(self) -> FixedWeights:
        """The model's weights on the fixed-point grid (built on first use)."""
        if self._fixed is None:
            self._fixed = FixedWeights(self.model, self.device)
        return self._fixed


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
        model=loaded.model,
        tokenizer=tokenizer,
        checkpoint=loaded.checkpoint,
        data_dir=loaded.data_dir,
        step=int(loaded.meta["step"]),
        table=table,
        byte_ids=byte_ids,
        model_hash=file_xxhash(loaded.checkpoint / ckpt.MANIFEST),
        tokenizer_hash=str(entry["xxhash"]),
    )


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


def _spell(codec: CodecModel, ids: np.ndarray | list[int]) -> bytes | None:
    """The bytes of `ids`, or None if one of them stands for no bytes."""
    table, listed = codec.table, ids.tolist() if isinstance(ids, np.ndarray) else ids
    try:
        return b"".join([table[i] for i in listed])  # type: ignore[misc]
    except TypeError:
        return None


def _to_ids(codec: CodecModel, data: bytes) -> np.ndarray:
    """Coding ids whose bytes concatenate to exactly `data` (see the module docstring)."""
    if not isinstance(codec.tokenizer, BPETokenizer):
        return codec.byte_ids[np.frombuffer(data, dtype=np.uint8)]
    pieces = _ESCAPED.split(data.decode("utf-8", errors="surrogateescape"))
    encoded = iter(codec.tokenizer.encode_batch(pieces[0::2]))  # even pieces are text, odd ones raw bytes
    parts = []
    for i, piece in enumerate(pieces):
        raw = piece.encode("utf-8", errors="surrogateescape")
        ids = next(encoded) if i % 2 == 0 else None
        if ids is not None and _spell(codec, ids) == raw:
            parts.append(np.asarray(ids, dtype=np.int64))
        else:
            parts.append(codec.byte_ids[np.frombuffer(raw, dtype=np.uint8)])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _most_likely(vocab: int) -> float:
    """The largest probability the range coder gives any token: every other one keeps 1 of its 2**24."""
    return 1.0 - (vocab - 1) / FREQ_SCALE


def fewest_bits(tokens: int, vocab: int) -> float:
    """The fewest bits any code of `tokens` tokens can take over a vocabulary of `vocab`: each costs at least
    -log2 of the largest probability the coder gives (`_most_likely`)."""
    return tokens * -np.log2(_most_likely(vocab))


def code_bits(words: int) -> float:
    """The most information a body of `words` 32-bit words can hold: its bits, the 64-bit state the range
    coder seals it with, and a margin for the coder's own rounding of the probabilities (measured below 1%
    over text, binary and 5,000 repeats of one byte: tests/test_codec.py)."""
    return 1.02 * 32 * words + 128


def _information(freqs_RV: np.ndarray, tokens_R: np.ndarray, vocab: int) -> float:
    """A lower bound of the bits coding `tokens_R` takes under `freqs_RV` (the coder quantises each
    probability to 2**-24 steps: each is allowed that much more, and never more than `_most_likely`)."""
    p_R = freqs_RV[np.arange(len(tokens_R)), tokens_R] / freqs_RV.sum(axis=1)
    return float(-np.log2(np.minimum(p_R * 1.001 + 2 / FREQ_SCALE, _most_likely(vocab))).sum())


@torch.inference_mode()
def _code(
    codec: CodecModel,
    tokens_N: np.ndarray,
    chunk: int,
    group: int,
    coder: Any,
    decoding: bool,
    budget_bits: float = float("inf"),
    version: int = VERSION,
    adapt: CodecAdaptation | None = None,
) -> None:
    """Encode `tokens_N` into `coder`, or (decoding) fill `tokens_N` from it: one loop for both, so both
    compute the same probabilities (see the module docstring). Decoding stops with a TenxError once the
    tokens decoded carry more information than `budget_bits` (`code_bits` of the body): the code is then
    exhausted, and what the range decoder gives after its end is made up of padding. `version` 1 runs the
    float32 kernels, 2 and 3 the fixed-point rules; with `adapt` (version 3) the output layer learns from
    the tokens coded: an update every `adapt.every` positions and at the end of each group."""
    family = constriction.stream.model.Categorical(perfect=False)
    vocab, eot, device = codec.tokenizer.vocab_size, codec.tokenizer.eot_id, codec.device
    starts = np.arange(0, len(tokens_N), chunk)
    spent, done = 0.0, 0
    head = None if adapt is None else AdaptiveHead(codec.fixed_weights(), adapt)
    for g in range(0, len(starts), group):
        first_R = starts[g : g + group]
        length_R = np.minimum(chunk, len(tokens_N) - first_R)  # only the last chunk may be shorter
        rows = len(first_R)
        frequencies = float_frequencies if version == 1 else fixed_frequencies
        inputs_R = torch.full((len(first_R),), eot, dtype=torch.long)
        known = None  # the encoder knows every token: all positions in one pass, the same bits (fixed.py)
        if not decoding and version != 1:
            known = _hidden_all(codec.fixed_weights(), tokens_N, first_R, int(length_R[0]), eot)
            if head is None:
                _encode_known(codec, known, tokens_N, first_R, length_R, coder)
                continue
        elif version == 1:
            step: Any = FloatStepper(codec.model, rows)
        else:
            step = FixedStepper(codec.fixed_weights(), rows)
        for s in range(int(length_R[0])):
            active = int(np.count_nonzero(length_R > s))
            if known is not None:
                hidden = known[:active, s]
                logits = codec.fixed_weights().head(hidden) if head is None else head.logits(hidden)
                freqs = frequencies(logits, vocab, eot)
            elif head is None:
                freqs = frequencies(step(inputs_R.to(device), s)[:active], vocab, eot)
            else:
                hidden = step.hidden(inputs_R.to(device), s)[:active]
                freqs = frequencies(head.logits(hidden), vocab, eot)
            where = first_R[:active] + s
            if decoding:
                tokens_N[where] = coder.decode(family, freqs)
                spent, done = spent + _information(freqs, tokens_N[where], vocab), done + active
                if spent > budget_bits:
                    raise TenxError(
                        f"its code ran out after {done:,} of the {len(tokens_N):,} tokens its header "
                        f"claims ({spent:,.0f} bits decoded from a body that holds at most "
                        f"{budget_bits:,.0f}): the file is corrupt or forged"
                    )
            else:
                coder.encode(tokens_N[where].astype(np.int32), family, freqs)
            inputs_R[:active] = torch.from_numpy(tokens_N[where])
            if head is not None:
                head.record(hidden, freqs, tokens_N[where])
                if (s + 1) % head.settings.every == 0 or s + 1 == length_R[0]:
                    head.update()


def _encode_known(
    codec: CodecModel,
    known_RLD: torch.Tensor,
    tokens_N: np.ndarray,
    first_R: np.ndarray,
    length_R: np.ndarray,
    coder: Any,
) -> None:
    """Encode one group whose final-norm outputs the encoder computed already: the output layer and the
    frequencies of ENCODE_POSITIONS rows at a time (every active row of a run of positions, in the order the
    decoder steps: position by position, rows in order), one `encode` call each. The same symbols, the same
    frequencies (every output-layer sum is exact, every elementwise operation sees the same operands) and
    the same order as coding position by position, so the same code; the decoder has no such shortcut."""
    family = constriction.stream.model.Categorical(perfect=False)
    vocab, eot, weights = codec.tokenizer.vocab_size, codec.tokenizer.eot_id, codec.fixed_weights()
    rows = np.arange(len(first_R))
    steps = int(length_R[0])
    active = [rows[length_R > s] for s in range(steps)]  # every row but a shorter last chunk's, once past it
    per_block = max(1, ENCODE_POSITIONS // len(first_R))
    for s0 in range(0, steps, per_block):
        span = range(s0, min(steps, s0 + per_block))
        row_M = np.concatenate([active[s] for s in span])
        step_M = np.concatenate([np.full(len(active[s]), s) for s in span])
        hidden = known_RLD[torch.from_numpy(row_M), torch.from_numpy(step_M)]
        freqs = fixed_frequencies(weights.head(hidden), vocab, eot)
        coder.encode(tokens_N[first_R[row_M] + step_M].astype(np.int32), family, freqs)


def _hidden_all(
    weights: FixedWeights, tokens_N: np.ndarray, first_R: np.ndarray, length: int, eot: int
) -> torch.Tensor:
    """The final norm's outputs (R, length, D) of chunks starting at `first_R`, every position in one pass
    (ENCODE_ROWS rows at a time): the same bits as stepping (FixedStepper.hidden_all). Positions past a
    shorter chunk's end see other tokens; their outputs are not used."""
    where = np.clip(first_R[:, None] + np.arange(length)[None, :] - 1, 0, len(tokens_N) - 1)
    inputs = torch.from_numpy(tokens_N[where]).to(weights.device)
    inputs[:, 0] = eot  # every chunk starts as a document does
    parts = [
        FixedStepper(weights, len(rows)).hidden_all(rows, ENCODE_BLOCK) for rows in inputs.split(ENCODE_ROWS)
    ]
    return torch.cat(parts)


def _group(model: Transformer) -> int:
    """Chunks side by side: MAX_GROUP, fewer where their key/value cache would pass CACHE_BYTES."""
    attn = cast(Block, model.blocks[0]).attn
    per_row = 2 * len(model.blocks) * attn.n_kv_heads * model.cfg.seq_len * attn.head_dim * 8  # float64
    return max(1, min(MAX_GROUP, CACHE_BYTES // per_row))


def _balanced(chunks: int, group: int) -> int:
    """The group size that splits `chunks` chunks into as few groups of at most `group` as before, all of
    nearly equal size (134 chunks at most 64 a group: 45, 45, 44 rather than 64, 64, 6)."""
    groups = max(1, -(-chunks // group))
    return max(1, -(-chunks // groups))


@contextmanager
def _fixed_numerics(threads: int) -> Iterator[None]:
    """fp32 without TF32 or reduced-precision matmuls, on `threads` torch threads; restored after."""
    saved = (
        torch.get_num_threads(),
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.set_float32_matmul_precision(saved[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2], saved[3]


def _hex_digest(hex_hash: str) -> bytes:
    """8 bytes for an xxh3-64 hex digest (any other identity string: the digest of its text)."""
    try:
        raw = bytes.fromhex(hex_hash)
    except ValueError:
        raw = b""
    return raw if len(raw) == 8 else _digest(hex_hash.encode("utf-8"))


def compress_bytes(
    model: CodecModel | LoadedModel | str | Path,
    data: bytes,
    *,
    threads: int = 1,
    version: int = VERSION,
    adapt: CodecAdaptation | None = None,
) -> bytes:
    """`data` compressed with `model` (a run or checkpoint directory, or one loaded already) into a `.tenx`
    blob; stored verbatim when the model's code would be longer (random bytes: at most the header is added).
    `threads`: torch threads while coding (recorded; any count decodes a version-2 file). `adapt`: the
    output layer learns as it codes (format version 3, tenx/compress/adapt.py). `version` 1 writes the old
    kernel-dependent format (for tests of its reader)."""
    if not 1 <= threads <= 255:
        raise TenxError(f"--threads must be 1..255, got {threads}")
    if adapt is not None:
        adapt.validate()
        if version not in (VERSION, ADAPTIVE_VERSION):
            raise TenxError(
                f"adaptation needs the fixed-point rules (format {ADAPTIVE_VERSION}), not {version}"
            )
        version = ADAPTIVE_VERSION
    codec = load_codec(model)
    if codec.device.type not in DEVICES:
        raise TenxError(f"compression runs on {' or '.join(DEVICES)}, not {codec.device.type}")
    tokens = _to_ids(codec, data)
    chunk = codec.model.cfg.seq_len
    group = _balanced(-(-len(tokens) // chunk), _group(codec.model))
    encoder = constriction.stream.queue.RangeEncoder()
    with _fixed_numerics(threads):
        _code(codec, tokens, chunk, group, encoder, decoding=False, version=version, adapt=adapt)
    code = encoder.get_compressed().astype("<u4").tobytes()
    stored = len(code) >= len(data)
    header = Header(
        threads=threads,
        device=codec.device.type,
        stored=stored,
        chunk=chunk,
        group=group,
        length=len(data),
        tokens=0 if stored else len(tokens),
        words=0 if stored else len(code) // 4,
        step=codec.step,
        data_hash=_digest(data),
        model_hash=_hex_digest(codec.model_hash),
        tokenizer_hash=_hex_digest(codec.tokenizer_hash),
        code_hash=_digest(data if stored else code),
        version=version,
        adapt=adapt,
    ).pack()
    return header + (data if stored else code)


MAX_BYTES = 1 << 30
"""The largest original a `.tenx` file may claim unless the caller allows more (a forged header could
otherwise make decompression allocate without bound)."""

MAX_THREADS = 256


def decompress_bytes(
    model: CodecModel | LoadedModel | str | Path,
    blob: bytes,
    *,
    name: str = "input",
    max_bytes: int = MAX_BYTES,
) -> bytes:
    """The original bytes of a `.tenx` blob, decoded with the model that compressed it (a run or checkpoint
    directory, or one loaded already); a TenxError for another model or tokenizer, a damaged blob, or one
    that claims an original above `max_bytes` or more threads than MAX_THREADS."""
    header = read_header(blob, name)
    if header.length > max_bytes:
        raise TenxError(
            f"{name} says its original is {header.length:,} bytes, above the limit of {max_bytes:,}; "
            "pass --max-bytes to allow it if you trust the file"
        )
    if header.threads > MAX_THREADS:
        raise TenxError(f"{name} is corrupt: it asks for {header.threads} threads (at most {MAX_THREADS})")
    codec = load_codec(model, device=header.device if header.version == 1 else "cpu")  # a loaded one: its own
    if header.version == 1 and codec.device.type != header.device:
        raise TenxError(f"{name} was compressed on {header.device}; load the model there to decompress it")
    model_hash, tokenizer_hash = _hex_digest(codec.model_hash), _hex_digest(codec.tokenizer_hash)
    if (header.model_hash, header.tokenizer_hash) != (model_hash, tokenizer_hash):
        raise TenxError(
            f"{name} was compressed with another model: checkpoint manifest xxhash {header.model_hash.hex()} "
            f"(step {header.step}) and tokenizer xxhash {header.tokenizer_hash.hex()}; {codec.checkpoint} has "
            f"{model_hash.hex()} (step {codec.step}) and tokenizer {tokenizer_hash.hex()}. "
            "Decompress with the checkpoint that compressed it (its directory: RUN_DIR/checkpoints/"
            f"{step_dir_name(header.step)})"
        )
    if header.stored:
        data: bytes | None = blob[header.size :]
    else:
        if header.chunk > codec.model.cfg.seq_len or header.group > MAX_GROUP:
            raise TenxError(f"{name} is corrupt: chunks of {header.chunk} tokens in groups of {header.group}")
        budget, needed = code_bits(header.words), fewest_bits(header.tokens, codec.tokenizer.vocab_size)
        if needed > budget:
            raise TenxError(
                f"{name} is corrupt or forged: its header claims {header.tokens:,} tokens, which take at "
                f"least {needed:,.0f} bits, but its body of {counted(header.words, 'word')} holds at most "
                f"{budget:,.0f}"
            )
        tokens = np.zeros(header.tokens, dtype=np.int64)
        words = np.frombuffer(blob, dtype="<u4", offset=header.size).astype(np.uint32)
        decoder = constriction.stream.queue.RangeDecoder(words)
        try:
            with _fixed_numerics(header.threads):
                _code(
                    codec,
                    tokens,
                    header.chunk,
                    header.group,
                    decoder,
                    True,
                    budget,
                    version=header.version,
                    adapt=header.adapt,
                )
        except (AssertionError, ValueError) as e:  # constriction's answer to code no model could have written
            raise TenxError(f"{name} cannot be decoded with this model ({e})") from None
        except TenxError as e:
            raise TenxError(f"{name}: {e}") from None
        data = _spell(codec, tokens)
    if data is None or len(data) != header.length or _digest(data) != header.data_hash:
        raise TenxError(
            f"{name}: the decoded bytes do not match the original's xxhash, so nothing was written; the "
            "probabilities differed from compression's (another CPU type or torch build?)"
        )
    return data


def compress_file(
    run: CodecModel | LoadedModel | str | Path,
    src: str | Path,
    dst: str | Path,
    force: bool = False,
    *,
    threads: int = 1,
    device: str = "cpu",
    adapt: CodecAdaptation | None = None,
) -> dict[str, Any]:
    """Compress file `src` into `dst` (atomically; an existing `dst` only with `force`) and report the
    figures: bits per byte of the whole `.tenx` file, coding speed in KB/s (1 KB = 1000 bytes of input).
    `adapt`: the output layer learns as it codes (compress_bytes)."""
    data = _read(src, dst, force)
    started = time.perf_counter()
    codec = load_codec(run, device)
    loaded = time.perf_counter()
    blob = compress_bytes(codec, data, threads=threads, adapt=adapt)
    coded = time.perf_counter()
    atomic_write_bytes(dst, blob)
    return _report(src, dst, len(data), len(blob), loaded - started, coded - loaded, adapt)


def decompress_file(
    run: CodecModel | LoadedModel | str | Path,
    src: str | Path,
    dst: str | Path,
    force: bool = False,
    max_bytes: int = MAX_BYTES,
    device: str = "cpu",
) -> dict[str, Any]:
    """Decompress `.tenx` file `src` into `dst` (written atomically after its xxhash matched; an existing
    `dst` only with `force`) on `device` (a version-1 file: where it was compressed) and report the
    figures, as compress_file does."""
    blob = _read(src, dst, force)
    started = time.perf_counter()
    header = read_header(blob, str(src))
    codec = load_codec(run, header.device if header.version == 1 else device)
    loaded = time.perf_counter()
    data = decompress_bytes(codec, blob, name=str(src), max_bytes=max_bytes)
    coded = time.perf_counter()
    atomic_write_bytes(dst, data)
    return _report(src, dst, len(data), len(blob), loaded - started, coded - loaded, header.adapt)


def _read(src: str | Path, dst: str | Path, force: bool) -> bytes:
    """`src`'s bytes, once `dst` is known to be a file this command may write: not a directory, not `src`
    itself (even with `force`), and an existing file only with `force`."""
    check_output_file(dst, force=force, inputs=(src,))
    try:
        return Path(src).read_bytes()
    except OSError as e:
        raise TenxError(f"cannot read {src}: {e.strerror or e}") from None


def _report(
    src: str | Path,
    dst: str | Path,
    raw: int,
    packed: int,
    load_s: float,
    code_s: float,
    adapt: CodecAdaptation | None,
) -> dict[str, Any]:
    return {
        "src": str(src),
        "dst": str(dst),
        "bytes": raw,
        "compressed_bytes": packed,
        "bits_per_byte": 8 * packed / raw if raw else None,
        "kb_per_s": raw / 1000 / code_s if code_s > 0 else None,
        "seconds": code_s,
        "load_seconds": load_s,
        "adapt": None if adapt is None else {"lr": adapt.lr, "every": adapt.every},
    }
