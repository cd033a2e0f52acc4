"""Launching runs: the supervisor that restarts them (supervise.py) and the Slurm job that runs them on a
cluster (slurm.py). The commands that start them, `tenx train` and `tenx quickstart`, and the supervisor's
warm spare worker are entry points: tenx/commands/."""
