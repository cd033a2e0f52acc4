"""Judging a model: held-out bits per byte (whole splits and document by document), sampling."""
