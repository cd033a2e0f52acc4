"""Lossless compression with a trained model (`tenx compress`, `tenx decompress`): range coding driven by
its next-token probabilities."""
