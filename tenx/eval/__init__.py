"""Judging a model: held-out bits per byte, compression baselines, sampling."""
