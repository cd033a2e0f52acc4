"""The classical compressor a model's bits per byte is measured against: `xz -9e` (liblzma).

Named for what it holds, not `compression`: tenx/compress/ is the model-driven compressor."""

from __future__ import annotations

import lzma


def xz_bits_per_byte(data: bytes) -> float:
    """Bits per byte of `xz -9e` (liblzma, preset 9 extreme, .xz container) on `data`."""
    if not data:
        return float("nan")
    compressed = lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    return 8 * len(compressed) / len(data)


def xz_bits_per_byte_per_document(documents: list[bytes]) -> float:
    """Bits per byte of xz -9e compressing each document on its own (no history shared between them)."""
    total = sum(len(d) for d in documents)
    if not total:
        return float("nan")
    compressed = sum(
        len(lzma.compress(d, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)) for d in documents
    )
    return 8 * compressed / total
