"""Launching runs: the supervisor that restarts them, and its warm spare worker."""
