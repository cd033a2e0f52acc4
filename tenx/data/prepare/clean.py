"""Cleaning a document: UTF-8 text (bad bytes and lone surrogates become U+FFFD), binary and empty ones
skipped, with counts."""

from __future__ import annotations

from dataclasses import dataclass

BINARY_SNIFF_BYTES = 8192
"""A NUL byte within this many leading bytes marks a document as binary."""


@dataclass
class CleaningStats:
    """Counts of what cleaning did to the source's documents."""

    documents_seen: int = 0
    decoded_with_replacement: int = 0
    empty_skipped: int = 0
    binary_skipped: int = 0
    duplicates_removed: int = 0
    documents_kept: int = 0


def clean_text(data: bytes | str, stats: CleaningStats) -> tuple[str, bytes] | None:
    """Cleaned text and its UTF-8 bytes, or None (counted in `stats`) when the document is skipped."""
    if isinstance(data, bytes):
        if b"\x00" in data[:BINARY_SNIFF_BYTES]:
            stats.binary_skipped += 1
            return None
        try:
            text = data.decode("utf-8")
            encoded = data
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="replace")
            encoded = text.encode("utf-8")
            stats.decoded_with_replacement += 1
    else:
        try:
            text, encoded = data, data.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates (e.g. from a JSON "\ud800" escape) are not UTF-8; make them U+FFFD like bad bytes.
            text = data.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
            encoded = text.encode("utf-8")
            stats.decoded_with_replacement += 1
        if b"\x00" in encoded[:BINARY_SNIFF_BYTES]:
            stats.binary_skipped += 1
            return None
    if not text.strip():
        stats.empty_skipped += 1
        return None
    return text, encoded
