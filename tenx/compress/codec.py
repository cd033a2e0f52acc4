"""Lossless compression with a trained model: range coding driven by its next-token probabilities.

`compress_bytes` turns any bytes into a `.tenx` blob and `decompress_bytes` gives back exactly those bytes;
`decompress_many` decodes many blobs together (tenx/compress/files.py has the file versions that
`tenx compress` / `tenx decompress` run).

Any bytes round-trip. The input becomes token ids whose byte strings, looked up in the tokenizer's
token-to-bytes table, concatenate to exactly the input (tenx/compress/model.py: `to_ids`, `spell`);
decompression joins the table's byte strings and never decodes text, so binary data, NUL bytes and invalid
UTF-8 come back unchanged. The end-of-document token is never coded (the header holds the token count), so
its probability is given to the other tokens.

Both sides compute bit-identical probabilities: format versions 1 and 3 run one function, `_code`, on the
same inputs; the arithmetic of versions 2 and 4 is exact and per row (fixed.py), so their encoder computes
every position's output layer at once (`_encode_known`) and their decoder steps the chunks of several files
side by side (`_decode_jointly`), with the same bits as `_code` would give (the golden files of
tests/test_codec_golden.py hold both to it). Version 4 (what `tenx compress` writes) differs from 2 in one
rule: its linear layers multiply integers of at most 127 (int8 products, `torch._int_mm` on a CPU). The tokens are cut into chunks of seq_len, each coded with context from its own chunk only (its first token
conditioned on the end-of-document token, as documents start in training); up to MAX_GROUP chunks go through
the model together, one position per step, with a key/value cache. Step s feeds every chunk's token s-1
(known to the encoder, just decoded by the decoder). The logits come from `FixedStepper`
(tenx/compress/fixed.py), whose arithmetic every CPU kind, thread count and GPU rounds alike, and become
integer frequencies floor(exp(z - max z) * 2**24) + 1 (every token codable) before constriction's range
coder quantises them; format version 1's float32 kernels (`FloatStepper`) are still read, where they run.
An ensemble codes with version 5: each member's version-4 frequencies, mixed exactly (tenx/compress/mixture.py).
The container (header, checksums, format versions) is tenx/compress/container.py; `tenx compress --adapt`
(format version 3) lets the output layer learn as it codes (tenx/compress/adapt.py).
The checksums stop accidents, not forgers: the token count is checked against the body's bits before
decoding (`fewest_bits` against `code_bits`) and the information decoded against them while decoding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import constriction
import numpy as np
import torch

from tenx.checkpoint.models import LoadedModel
from tenx.compress import mixture
from tenx.compress.adapt import AdaptiveHead
from tenx.compress.container import (
    ADAPTIVE_VERSION,
    DEVICES,
    LINEAR_BITS,
    MAX_THREADS,
    VERSION,
    CodecAdaptation,
    Header,
    _digest,
    read_header,
)
from tenx.compress.fixed import FixedStepper, FixedWeights, fixed_frequencies
from tenx.compress.float32 import FREQ_SCALE, FloatStepper, float_frequencies
from tenx.compress.model import CodecModel, load_codec, spell, to_ids
from tenx.errors import TenxError
from tenx.model.transformer import Block, Transformer
from tenx.rundir import step_dir_name
from tenx.utils.cpus import usable_cpu_count
from tenx.utils.text import counted

__all__ = ["CodecModel", "compress_bytes", "decompress_bytes", "decompress_many", "load_codec", "to_ids"]

JOINT_VERSIONS = (2, 4, 5)
"""Format versions whose files `_decode_jointly` decodes (exact arithmetic, no learning while coding)."""
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
    members = [] if version == 1 else codec.member_weights(LINEAR_BITS[version])
    weights = cast(FixedWeights, members[0] if members else None)  # one model's: versions 1 and 3
    head = None if adapt is None else AdaptiveHead(weights, adapt)
    for g in range(0, len(starts), group):
        first_R = starts[g : g + group]
        length_R = np.minimum(chunk, len(tokens_N) - first_R)  # only the last chunk may be shorter
        rows = len(first_R)
        frequencies = float_frequencies if version == 1 else fixed_frequencies
        inputs_R = torch.full((len(first_R),), eot, dtype=torch.long)
        known = None  # the encoder knows every token: all positions in one pass, the same bits (fixed.py)
        if not decoding and head is None and version != 1:
            known_K = [_hidden_all(w, tokens_N, first_R, int(length_R[0]), eot) for w in members]
            _encode_known(codec, members, known_K, tokens_N, first_R, length_R, coder)
            continue
        if not decoding and version != 1:
            known = _hidden_all(weights, tokens_N, first_R, int(length_R[0]), eot)
        elif version == 1:
            step: Any = FloatStepper(cast(Transformer, codec.model), rows)  # one model (ensemble_version)
        else:
            step = FixedStepper(weights, rows)
        for s in range(int(length_R[0])):
            active = int(np.count_nonzero(length_R > s))
            if known is not None:  # the encoder of version 3 (2 and 4 took _encode_known)
                hidden = known[:active, s]
                freqs = frequencies(cast(AdaptiveHead, head).logits(hidden), vocab, eot)
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
                    raise _ran_out(done, len(tokens_N), spent, budget_bits)
            else:
                coder.encode(tokens_N[where].astype(np.int32), family, freqs)
            inputs_R[:active] = torch.from_numpy(tokens_N[where])
            if head is not None:
                head.record(hidden, freqs, tokens_N[where])
                if (s + 1) % head.settings.every == 0 or s + 1 == length_R[0]:
                    head.update()


@dataclass
class _Stream:
    """A file of format 2 or 4 being decoded side by side with others (`_decode_jointly`)."""

    name: str
    header: Header
    blob: bytes
    tokens: np.ndarray = field(init=False)
    decoder: Any = field(init=False)
    spent: float = 0.0
    """Bits of information decoded so far, against the body's `code_bits`."""
    done: int = 0
    """Tokens decoded so far."""
    error: TenxError | None = None

    def __post_init__(self) -> None:
        self.tokens = np.zeros(self.header.tokens, dtype=np.int64)
        self.decoder = constriction.stream.queue.RangeDecoder(_body(self.blob, self.header))

    def groups(self) -> list[np.ndarray]:
        """The first token of each chunk, group by group, as the encoder coded them."""
        starts = np.arange(0, self.header.tokens, self.header.chunk)
        return [starts[g : g + self.header.group] for g in range(0, len(starts), self.header.group)]


@torch.inference_mode()
def _decode_jointly(codec: CodecModel, streams: list[_Stream]) -> None:
    """Fill each stream's tokens from its code, the groups of several files side by side in one model step
    (at most `_group(model)` chunks; a file's groups in order, never two of one file at once, the largest
    files first so that small files share steps). A row's logits depend on its own tokens only (every sum
    is exact, every other operation elementwise or within the row), so each file decodes as if alone. A
    stream whose code is exhausted or undecodable gets its `error` and is skipped from then on. Files of
    versions 2 and 4 (other grids) go in separate batches."""
    versions = sorted({stream.header.version for stream in streams})
    if len(versions) != 1:
        for version in versions:
            _decode_jointly(codec, [stream for stream in streams if stream.header.version == version])
        return
    members = codec.member_weights(LINEAR_BITS[versions[0]])
    family = constriction.stream.model.Categorical(perfect=False)
    vocab, eot, limit = codec.tokenizer.vocab_size, codec.tokenizer.eot_id, _group(codec)
    pending = {i: stream.groups() for i, stream in enumerate(streams)}
    order = sorted(pending, key=lambda i: -streams[i].header.tokens)
    threads = max([decode_threads(s.header, s.name) for s in streams], default=1)
    while any(pending.values()):
        batch: list[tuple[_Stream, np.ndarray]] = []
        rows = 0
        for i in order:
            if streams[i].error is not None:
                pending[i] = []  # a failed file's later groups are not decoded
            elif pending[i] and (not batch or rows + len(pending[i][0]) <= limit):
                batch.append((streams[i], pending[i].pop(0)))
                rows += len(batch[-1][1])
        if not batch:
            break
        length_R = np.concatenate([np.minimum(st.header.chunk, st.header.tokens - f) for st, f in batch])
        steps = [FixedStepper(w, rows) for w in members]
        inputs_R = torch.full((rows,), eot, dtype=torch.long)
        with _fixed_numerics(threads):
            for s in range(int(length_R.max())):
                if all(stream.error is not None for stream, _ in batch):
                    break
                live = np.flatnonzero(length_R > s)  # each file's live rows: a prefix of its own
                live_t = torch.from_numpy(live).to(codec.device)
                freqs = mixture.frequencies(
                    [(st.w, st.hidden(inputs_R.to(codec.device), s)[live_t]) for st in steps], vocab, eot
                )
                row = cursor = 0
                for stream, first in batch:
                    active = int(np.count_nonzero(length_R[row : row + len(first)] > s))
                    where = first[:active] + s
                    if active and stream.error is None:
                        _decode_step(stream, where, freqs[cursor : cursor + active], family, vocab)
                        inputs_R[row : row + active] = torch.from_numpy(stream.tokens[where])
                    row, cursor = row + len(first), cursor + active


def _decode_step(stream: _Stream, where: np.ndarray, freqs: np.ndarray, family: Any, vocab: int) -> None:
    """One position of a stream's active chunks; on failure the stream's error is set (see `_code`)."""
    try:
        stream.tokens[where] = stream.decoder.decode(family, freqs)
    except (AssertionError, ValueError) as e:  # constriction's answer to code no model could have written
        stream.error = _undecodable(stream.name, e, stream.header)
        return
    stream.spent += _information(freqs, stream.tokens[where], vocab)
    stream.done += len(where)
    budget = code_bits(stream.header.words)
    if stream.spent > budget:
        stream.error = TenxError(
            f"{stream.name}: {_ran_out(stream.done, stream.header.tokens, stream.spent, budget)}"
        )


def _ran_out(done: int, tokens: int, spent: float, budget: float) -> TenxError:
    """The error of a code exhausted before its header's token count (see `_code`)."""
    return TenxError(
        f"its code ran out after {done:,} of the {tokens:,} tokens its header claims ({spent:,.0f} bits "
        f"decoded from a body that holds at most {budget:,.0f}): the file is corrupt or forged"
    )


def _encode_known(
    codec: CodecModel,
    members: list[FixedWeights],
    known_KRLD: list[torch.Tensor],
    tokens_N: np.ndarray,
    first_R: np.ndarray,
    length_R: np.ndarray,
    coder: Any,
) -> None:
    """Encode one group whose final-norm outputs the encoder computed already: the output layer and the
    frequencies of ENCODE_POSITIONS rows at a time (every active row of a run of positions, in the order the
    decoder steps: position by position, rows in order), one `encode` call each. The same symbols, the same
    frequencies (every output-layer sum is exact, every elementwise operation sees the same operands) and
    the same order as coding position by position, so the same code; the decoder has no such shortcut.
    An ensemble's members each computed theirs (`known_KRLD`, one per member), and their frequencies mix."""
    family = constriction.stream.model.Categorical(perfect=False)
    vocab, eot = codec.tokenizer.vocab_size, codec.tokenizer.eot_id
    rows = np.arange(len(first_R))
    steps = int(length_R[0])
    active = [rows[length_R > s] for s in range(steps)]  # every row but a shorter last chunk's, once past it
    per_block = max(1, ENCODE_POSITIONS // len(first_R))
    for s0 in range(0, steps, per_block):
        span = range(s0, min(steps, s0 + per_block))
        row_M = np.concatenate([active[s] for s in span])
        step_M = np.concatenate([np.full(len(active[s]), s) for s in span])
        at = (torch.from_numpy(row_M), torch.from_numpy(step_M))
        freqs = mixture.frequencies([(w, known[at]) for w, known in zip(members, known_KRLD)], vocab, eot)
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


def _group(codec: CodecModel) -> int:
    """Chunks side by side: MAX_GROUP, fewer where their key/value cache (every member's) would pass
    CACHE_BYTES."""
    per_row = 0
    for model in codec.transformers:
        attn = cast(Block, model.blocks[0]).attn
        per_row += 2 * len(model.blocks) * attn.n_kv_heads * model.cfg.seq_len * attn.head_dim * 8  # float64
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
    `threads`: torch threads while coding (recorded; any count decodes a file of version 2 or 4). `adapt`: the
    output layer learns as it codes (format version 3, tenx/compress/adapt.py). `version` 1 writes the old
    kernel-dependent format, 2 the fixed-point rules with 15-bit linear layers (for tests of their readers)."""
    if not 1 <= threads <= MAX_THREADS:
        raise TenxError(f"--threads must be 1..{MAX_THREADS}, got {threads}")
    if adapt is not None:
        adapt.validate()
        if version not in (VERSION, ADAPTIVE_VERSION):
            raise TenxError(
                f"adaptation needs the fixed-point rules (format {ADAPTIVE_VERSION}), not {version}"
            )
        version = ADAPTIVE_VERSION
    codec = load_codec(model)
    version = mixture.ensemble_version(codec, version, adapt)
    if codec.device.type not in DEVICES:
        raise TenxError(f"compression runs on {' or '.join(DEVICES)}, not {codec.device.type}")
    tokens = to_ids(codec, data)
    chunk = codec.model.cfg.seq_len
    group = _balanced(-(-len(tokens) // chunk), _group(codec))
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
        members=mixture.header_members(codec),
    ).pack()
    return header + (data if stored else code)


MAX_BYTES = 1 << 30
"""The largest original a `.tenx` file may claim unless the caller allows more (a forged header could
otherwise make decompression allocate without bound)."""


def decode_threads(header: Header, name: str) -> int:
    """The torch threads to decode a file with `header` on. Formats 2-4 decode alike on any count, so the
    recorded one only caps it at this machine's usable CPUs: more threads than cores wait on each other (a
    forged header asking for 255 made a 1.4 s decode take 90 s on 2 cores). Format 1's float32 kernels need
    the recorded count itself, so one above the usable CPUs is refused, the field and the file named."""
    cpus = usable_cpu_count()
    if header.version != 1:
        return min(header.threads, cpus)
    if header.threads > cpus:
        raise TenxError(
            f"{name}: its header's threads field asks for {header.threads} torch threads, more than the {cpus} "
            f"CPUs this process may use; a format-1 file decodes only on the count it was written with (at "
            f"most {MAX_THREADS}): decompress it on a machine with {header.threads} CPUs"
        )
    return header.threads


def decompress_bytes(
    model: CodecModel | LoadedModel | str | Path,
    blob: bytes,
    *,
    name: str = "input",
    max_bytes: int = MAX_BYTES,
) -> bytes:
    """The original bytes of a `.tenx` blob, decoded with the model that compressed it (a run or checkpoint
    directory, or one loaded already); a TenxError for another model or tokenizer, a damaged blob, or one
    that claims an original above `max_bytes` or (format 1) more threads than this machine has CPUs."""
    header, codec = _opened(model, blob, name, max_bytes)
    if header.stored:
        return _verified(codec, header, blob[header.size :], name)
    if header.version in JOINT_VERSIONS:
        stream = _Stream(name, header, blob)
        _decode_jointly(codec, [stream])
        if stream.error is not None:
            raise stream.error
        return _verified(codec, header, spell(codec, stream.tokens), name)
    tokens = np.zeros(header.tokens, dtype=np.int64)
    decoder = constriction.stream.queue.RangeDecoder(_body(blob, header))
    budget = code_bits(header.words)
    try:
        with _fixed_numerics(decode_threads(header, name)):
            _code(
                codec, tokens, header.chunk, header.group, decoder, True, budget, header.version, header.adapt
            )
    except (AssertionError, ValueError) as e:  # constriction's answer to code no model could have written
        raise _undecodable(name, e, header) from None
    except TenxError as e:
        raise TenxError(f"{name}: {e}{_settings_note(header)}") from None
    return _verified(codec, header, spell(codec, tokens), name)


def decompress_many(
    model: CodecModel | LoadedModel | str | Path,
    blobs: list[bytes],
    *,
    names: list[str] | None = None,
    max_bytes: int = MAX_BYTES,
) -> list[bytes | TenxError]:
    """The original bytes of each `.tenx` blob, or the TenxError that blob raised (a damaged file does not
    stop the others): what `decompress_bytes` gives for each, faster for many small files. Files of formats 2 and 4
    are decoded together, the chunks of several files side by side in one model step (`_decode_jointly`:
    each file's probabilities are those it was coded with, since every row's arithmetic is exact and its
    own); stored files and other formats one by one."""
    names = names if names is not None else [f"input {i}" for i in range(len(blobs))]
    if len(names) != len(blobs):
        raise ValueError(f"{len(blobs)} blobs but {len(names)} names")
    codec = load_codec(model)
    results: list[bytes | TenxError] = []
    streams: dict[int, _Stream] = {}
    for i, (blob, name) in enumerate(zip(blobs, names)):
        try:
            header, _ = _opened(codec, blob, name, max_bytes)
            if header.version in JOINT_VERSIONS and not header.stored:
                streams[i] = _Stream(name, header, blob)
                results.append(b"")
            else:
                results.append(decompress_bytes(codec, blob, name=name, max_bytes=max_bytes))
        except TenxError as e:
            results.append(e)
    _decode_jointly(codec, list(streams.values()))
    for i, stream in streams.items():
        try:
            if stream.error is not None:
                raise stream.error
            results[i] = _verified(codec, stream.header, spell(codec, stream.tokens), stream.name)
        except TenxError as e:
            results[i] = e
    return results


def _opened(
    model: CodecModel | LoadedModel | str | Path, blob: bytes, name: str, max_bytes: int
) -> tuple[Header, CodecModel]:
    """The header of `blob` and the model to decode it with, once both are checked: the claimed size and
    threads, the model's and tokenizer's identities, and (a coded body) its chunks and its bits."""
    header = read_header(blob, name)
    if header.length > max_bytes:
        raise TenxError(
            f"{name} says its original is {header.length:,} bytes, above the limit of {max_bytes:,}; "
            "pass --max-bytes to allow it if you trust the file"
        )
    decode_threads(header, name)  # a format-1 file asking for more threads than CPUs: refused before loading
    codec = load_codec(model, device=header.device if header.version == 1 else "cpu")  # a loaded one: its own
    if header.version == 1 and codec.device.type != header.device:
        raise TenxError(f"{name} was compressed on {header.device}; load the model there to decompress it")
    mixture.check_members(header, codec, name)
    model_hash, tokenizer_hash = _hex_digest(codec.model_hash), _hex_digest(codec.tokenizer_hash)
    if (header.model_hash, header.tokenizer_hash) != (model_hash, tokenizer_hash):
        raise TenxError(
            f"{name} was compressed with another model: checkpoint manifest xxhash {header.model_hash.hex()} "
            f"(step {header.step}) and tokenizer xxhash {header.tokenizer_hash.hex()}; {codec.checkpoint} has "
            f"{model_hash.hex()} (step {codec.step}) and tokenizer {tokenizer_hash.hex()}. "
            "Decompress with the checkpoint that compressed it (its directory: RUN_DIR/checkpoints/"
            f"{step_dir_name(header.step)})"
        )
    if not header.stored:
        if header.chunk > codec.model.cfg.seq_len or header.group > MAX_GROUP:
            raise TenxError(f"{name} is corrupt: chunks of {header.chunk} tokens in groups of {header.group}")
        budget, needed = code_bits(header.words), fewest_bits(header.tokens, codec.tokenizer.vocab_size)
        if needed > budget:
            raise TenxError(
                f"{name} is corrupt or forged: its header claims {header.tokens:,} tokens, which take at "
                f"least {needed:,.0f} bits, but its body of {counted(header.words, 'word')} holds at most "
                f"{budget:,.0f}"
            )
    return header, codec


def _body(blob: bytes, header: Header) -> np.ndarray:
    return np.frombuffer(blob, dtype="<u4", offset=header.size).astype(np.uint32)


def _undecodable(name: str, e: Exception, header: Header) -> TenxError:
    return TenxError(f"{name} cannot be decoded with this model ({e}){_settings_note(header)}")


def _settings_note(header: Header) -> str:
    """What an error decoding an adaptive file adds: its header's adaptation settings, which are part of the
    code (a header forged or damaged there, in range and with its checksum recomputed, decodes to other
    bytes); empty for other files."""
    if header.adapt is None:
        return ""
    return (
        f"; its header's adaptation settings (learning rate {header.adapt.lr!r}, every {header.adapt.every} "
        "positions) are part of the code: settings other than those it was compressed with (a forged or "
        "damaged header) decode to other bytes"
    )


def _verified(codec: CodecModel, header: Header, data: bytes | None, name: str) -> bytes:
    """`data` if it is the original the header describes (length and xxhash), else a TenxError."""
    if data is None or len(data) != header.length or _digest(data) != header.data_hash:
        raise TenxError(
            f"{name}: the decoded bytes do not match the original's xxhash, so nothing was written; the "
            "probabilities differed from compression's (another CPU type or torch build?)"
            + _settings_note(header)
        )
    return data
