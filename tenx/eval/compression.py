"""Classical compressors as baselines for a model's bits per byte (kept in tenx.utils.compression, which the
training loop's prequential code length also uses)."""

from tenx.utils.compression import xz_bits_per_byte, xz_bits_per_byte_per_document

__all__ = ["xz_bits_per_byte", "xz_bits_per_byte_per_document"]
