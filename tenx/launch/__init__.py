"""Launching runs: `tenx train` and `tenx quickstart` (cli.py), the supervisor that restarts runs, its
warm spare worker, and the Slurm job that runs them on a cluster (slurm.py)."""
