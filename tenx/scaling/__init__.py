"""Scaling laws: read run tables, fit loss laws with bootstrap intervals, extrapolate to larger runs."""
