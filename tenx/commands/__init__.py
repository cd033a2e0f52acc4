"""The commands that start runs, at the top of the layers: `tenx train` and `tenx quickstart` (cli.py), and
the supervisor's warm spare (worker.py), which runs a `tenx` command line. A run `tenx train` trains is
watched by tenx.scaling's self-extrapolation, so these sit above every package they drive; the supervisor
itself (tenx/launch/) sits low, where tenx.scaling's ladders can start it."""
