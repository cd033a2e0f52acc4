"""The `.tenx` container: its header, written and read back with every check a damaged or forged file needs.

Little-endian: the 80 bytes of HEADER (magic b"TENX", format version, torch threads, device 0 cpu / 1 cuda,
stored flag, tokens per chunk, chunks per group, original length, token count, 32-bit words of code,
checkpoint step, then the xxh3-64 digests of the original bytes, of the checkpoint's manifest file, of the
tokenizer (its manifest entry's hash) and of the body); in format version 3 the 12 bytes of the
adaptation's settings (tenx/compress/adapt.py: learning rate as float64, positions between updates); in
format version 5 the member count (16 bits) and each member's xxh3-64 of its checkpoint's manifest file and
its step (16 bytes a member; the fixed header's checkpoint fields then hold the xxh3-64 of the members'
digests in order and member 0's step); 8 bytes of xxh3-64 of all that; then the body: the code as 32-bit words, or the original bytes when the code
would be longer (the stored flag set).

Versions: 1, float32 kernels (decodes only where the same kernels run; still read); 2, the fixed-point
rules of tenx/compress/fixed.py (decodes anywhere); 3, version 2 with an output layer that learns as it
codes (`tenx compress --adapt`); 4, version 2 with the linear layers' products on a 7-bit grid (int8 x int8
sums, exact in int32: `torch._int_mm`, ~1.7x faster coding for 0.05% larger files); 5, an ensemble of K
members, each computing version 4's frequencies, coded with their mixture (tenx/compress/mixture.py).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import xxhash

from tenx.errors import TenxError

MAGIC = b"TENX"
VERSION = 4
"""What plain `tenx compress` writes: probabilities by the fixed-point rules, the same on every machine, with
int8 products in the linear layers."""
ADAPTIVE_VERSION = 3
"""What `tenx compress --adapt` writes: version 2's rules and an output layer that learns as it codes."""
ENSEMBLE_VERSION = 5
"""What `tenx compress` writes for an ensemble: version 4's frequencies of each member, mixed."""
VERSIONS = (1, 2, 3, 4, 5)
LINEAR_BITS = {2: 15, 3: 15, 4: 7, 5: 7}
"""The grid of the linear layers' products in each fixed-point version (tenx/compress/fixed.py)."""
HEADER = struct.Struct("<4sBBBBIIQQQQ8s8s8s8s")
"""magic, version, then the fields of Header in order (digests as 8 bytes each)."""
HEADER_BYTES = HEADER.size + 8
"""A header's bytes, its checksum included, in versions 1, 2 and 4 (version 3: SETTINGS.size more)."""
DEVICES = ("cpu", "cuda")
MAX_THREADS = 255
"""The most torch threads a header records (its one byte) and `tenx compress --threads` writes. Only format
version 1 decodes on the recorded count; the others decode alike on any (tenx.compress.codec.decode_threads)."""
MAX_EVERY = 4096
"""The most positions between two updates of an adaptive file."""
SETTINGS = struct.Struct("<dI")
"""The learning rate and `every`, as the header of an adaptive `.tenx` file stores them."""
COUNT = struct.Struct("<H")
"""An ensemble file's member count."""
MEMBER = struct.Struct("<8sQ")
"""An ensemble file's member: the xxh3-64 of its checkpoint's manifest file and its step."""


@dataclass(frozen=True)
class CodecAdaptation:
    """How the output layer learns while coding: Adam's learning rate and the positions between updates."""

    lr: float = 2e-3
    every: int = 4

    def validate(self, what: str = "--adapt") -> None:
        """A TenxError naming the setting that is out of range (also what a forged header gets)."""
        if not (math.isfinite(self.lr) and 0 < self.lr <= 1):
            raise TenxError(f"{what}: the learning rate must be in (0, 1], got {self.lr}")
        if not 1 <= self.every <= MAX_EVERY:
            raise TenxError(
                f"{what}: positions between updates must be in [1, {MAX_EVERY}], got {self.every}"
            )

    def pack(self) -> bytes:
        """The settings' bytes in a header."""
        return SETTINGS.pack(self.lr, self.every)

    @staticmethod
    def unpack(raw: bytes, name: str) -> CodecAdaptation:
        """The settings a header holds, checked (`name`: the file, for the error)."""
        lr, every = SETTINGS.unpack(raw)
        settings = CodecAdaptation(lr, every)
        settings.validate(f"{name} is corrupt: its adaptation settings")
        return settings


def _digest(data: bytes) -> bytes:
    return xxhash.xxh3_64_digest(data)


def header_bytes(version: int, members: int = 0) -> int:
    """The bytes of a header of format `version` (5: of an ensemble of `members`), its checksum included."""
    if version == ENSEMBLE_VERSION:
        return HEADER_BYTES + COUNT.size + members * MEMBER.size
    return HEADER_BYTES + (SETTINGS.size if version == ADAPTIVE_VERSION else 0)


def members_digest(members: list[tuple[bytes, int]]) -> bytes:
    """An ensemble's identity in the fixed header: the xxh3-64 of its members' manifest digests in order."""
    return _digest(b"".join(digest for digest, _ in members))


@dataclass
class Header:
    """The fields of a `.tenx` header (see the module docstring)."""

    threads: int
    device: str
    stored: bool
    """The body is the original bytes (the model's code would have been longer)."""
    chunk: int
    group: int
    length: int
    tokens: int
    words: int
    step: int
    data_hash: bytes
    model_hash: bytes
    tokenizer_hash: bytes
    code_hash: bytes
    version: int = VERSION
    """Not a packed field: the byte after the magic."""
    adapt: CodecAdaptation | None = None
    """Version 3: how the output layer learned while coding."""
    members: list[tuple[bytes, int]] | None = None
    """Version 5: each member's xxh3-64 of its checkpoint's manifest file and its step, in order."""

    def pack(self) -> bytes:
        """The header's bytes (`header_bytes(version)`), its checksum included."""
        fields = [*vars(self).values()][:-3]
        fields[1] = DEVICES.index(self.device)
        packed = HEADER.pack(MAGIC, self.version, *fields)
        if (self.version == ADAPTIVE_VERSION) != (self.adapt is not None):
            raise ValueError(f"format version {self.version} with adaptation settings {self.adapt}")
        if (self.version == ENSEMBLE_VERSION) != (self.members is not None):
            raise ValueError(f"format version {self.version} with members {self.members}")
        if self.adapt is not None:
            packed += self.adapt.pack()
        if self.members is not None:
            packed += COUNT.pack(len(self.members))
            packed += b"".join(MEMBER.pack(digest, step) for digest, step in self.members)
        return packed + _digest(packed)

    @property
    def size(self) -> int:
        """The header's bytes."""
        return header_bytes(self.version, len(self.members or ()))

    @property
    def body_bytes(self) -> int:
        """Bytes after the header."""
        return self.length if self.stored else 4 * self.words


def read_header(blob: bytes, name: str = "input") -> Header:
    """The checked header of a `.tenx` blob; a TenxError says what is wrong with a foreign, truncated or
    corrupt one."""
    if blob[: len(MAGIC)] != MAGIC:
        raise TenxError(f"{name} is not a tenx compressed file (it does not start with {MAGIC!r})")
    if len(blob) < HEADER_BYTES:
        raise TenxError(
            f"{name} is truncated: {len(blob)} bytes, shorter than a tenx header ({HEADER_BYTES})"
        )
    _, version, threads, device, stored, *rest = HEADER.unpack_from(blob)
    if version not in VERSIONS:
        raise TenxError(
            f"{name} has format version {version}; this tenx reads versions {', '.join(map(str, VERSIONS))}"
        )
    count = _member_count(blob, name) if version == ENSEMBLE_VERSION else 0
    size = header_bytes(version, count)
    if len(blob) < size:
        raise TenxError(f"{name} is truncated: {len(blob)} bytes, shorter than its header ({size})")
    if _digest(blob[: size - 8]) != blob[size - 8 : size]:
        raise TenxError(f"{name} is corrupt: its header does not match its checksum")
    if device >= len(DEVICES) or stored > 1 or 0 in (threads, rest[0], rest[1]):
        raise TenxError(f"{name} is corrupt: its header holds impossible values")
    adapt = members = None
    if version == ADAPTIVE_VERSION:
        adapt = CodecAdaptation.unpack(blob[HEADER.size : size - 8], name)
    if version == ENSEMBLE_VERSION:
        table = blob[HEADER.size + COUNT.size : size - 8]
        members = [MEMBER.unpack_from(table, i * MEMBER.size) for i in range(count)]
    header = Header(
        threads, DEVICES[device], bool(stored), *rest, version=version, adapt=adapt, members=members
    )
    if not header.stored and (header.tokens > header.length or bool(header.length) != bool(header.tokens)):
        raise TenxError(f"{name} is corrupt: {header.tokens} tokens cannot spell {header.length} bytes")
    body = len(blob) - size
    if body != header.body_bytes:
        problem = "truncated" if body < header.body_bytes else "longer than its header says"
        raise TenxError(f"{name} is {problem}: {body} bytes after the header, which says {header.body_bytes}")
    if _digest(blob[size:]) != header.code_hash:
        raise TenxError(f"{name} is corrupt: the bytes after its header do not match their checksum")
    return header


def _member_count(blob: bytes, name: str) -> int:
    """The member count of an ensemble file's header, checked against what an ensemble may have."""
    from tenx.checkpoint.models import MAX_MEMBERS  # imports torch: not when the CLI starts

    if len(blob) < HEADER.size + COUNT.size:
        raise TenxError(f"{name} is truncated: {len(blob)} bytes, shorter than an ensemble's header")
    (count,) = COUNT.unpack_from(blob, HEADER.size)
    if not 1 <= count <= MAX_MEMBERS:
        raise TenxError(
            f"{name} is corrupt: its header's member count is {count}; an ensemble has 1 to {MAX_MEMBERS}"
        )
    return count
