"""Launching runs: `tenx train` and `tenx quickstart` (cli.py), the supervisor that restarts runs, and its
warm spare worker."""
