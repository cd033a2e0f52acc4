"""Launch scripts of a ladder for a cluster: one torchrun script, or one Slurm job per run and a submitter.

Each run's Slurm job is the one `tenx train --emit slurm` writes (tenx/launch/slurm.py): supervised torchrun on
every node, requeued with `--resume auto` after a SIGTERM."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Literal

from tenx import config as cfglib
from tenx import rundir
from tenx.errors import TenxError
from tenx.launch.slurm import SlurmJob, job_script
from tenx.scaling.ladder.rungs import PlannedRun
from tenx.utils.io import FILE_MODE, atomic_write_text

LaunchFile = tuple[Path, str, int, bool]
"""A file of a ladder's launch: its path, its text, its mode, and whether it is a launch script."""


def write_launch_files(files: list[LaunchFile]) -> list[Path]:
    """Write the files launch_files built; returns the launch scripts' paths."""
    for path, text, mode, _ in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text, mode=mode)
    return [path for path, _, _, script in files if script]


def launch_files(
    plan: list[PlannedRun],
    ladder_dir: str | Path,
    how: Literal["torchrun", "slurm"],
    collect: str,
    nproc: int = 8,
    nodes: int = 1,
) -> list[LaunchFile]:
    """Every file that trains the runs of `plan` on a cluster, built and checked in memory: each run's config,
    then the scripts (`write_launch_files` writes them). The last command, `collect`, is this ladder's own
    command without --emit: it finds the finished runs, evaluates them and writes results.jsonl. Raises
    TenxError on what emit refuses, before anything is written, so a refusal leaves `ladder_dir` as it was."""
    ladder_dir = Path(ladder_dir)
    for value, flag in ((nproc, "--nproc"), (nodes, "--nodes")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TenxError(f"{flag} must be an integer >= 1, got {value!r}")
    ranks = nproc * nodes
    files: list[LaunchFile] = []
    runs = []
    for run in plan:
        if run.global_batch % ranks:
            raise TenxError(
                f"run {run.name}: its global batch of {run.global_batch} sequences cannot be split over "
                f"{ranks} ranks; raise the base config's train.global_batch or lower --nproc/--nodes"
            )
        run_dir = ladder_dir / "runs" / run.name
        config = rundir.RunDir(run_dir).config
        files.append((config, cfglib.dumps_toml(run.config), FILE_MODE, False))
        micro = min(run.config.train.micro_batch, run.global_batch // ranks)
        while (run.global_batch // ranks) % micro:
            micro -= 1
        train_args = [
            "--config",
            str(config),
            "--run-dir",
            str(run_dir),
            "--set",
            f"train.micro_batch={micro}",
        ]
        runs.append((run, run_dir, train_args))
    out_dir = ladder_dir / "launch"
    cwd = shlex.quote(str(Path.cwd()))
    if how == "torchrun":
        lines = [
            "#!/usr/bin/env bash",
            f"# {len(runs)} ladder runs, one after another on this node; rerunning resumes or skips them.",
            "set -euo pipefail",
            f"cd {cwd}",
            f'NPROC="${{NPROC_PER_NODE:-{int(nproc)}}}"',
        ]
        lines += [
            f'torchrun --standalone --nproc_per_node "$NPROC" -m tenx train {shlex.join(args)} --resume auto'
            for _, _, args in runs
        ]
        lines += ["# evaluate the finished runs and write results.jsonl", collect]
        return [*files, (out_dir / "torchrun.sh", "\n".join(lines) + "\n", 0o755, True)]
    scripts = []
    for run, run_dir, train_args in runs:
        job = SlurmJob(
            run.name, run_dir, nodes, nproc, flags={"nproc_per_node": "--nproc", "log_dir": "--out"}
        )
        path = out_dir / f"{run.name}.sbatch"  # the text write_job_script writes
        files.append((path, job_script(job, train_args) + "\n", 0o755, True))
        scripts.append(path)
    submit = [
        "#!/usr/bin/env bash",
        "# submits every run, then a job that collects the results once all have finished",
        "set -euo pipefail",
        f"cd {cwd}",
        "ids=()",
        *[f'ids+=("$(sbatch --parsable {shlex.quote(str(p))})")' for p in scripts],
        f'sbatch --dependency="afterok:$(IFS=:; echo "${{ids[*]}}")" --job-name=tenx-ladder-collect '
        f"--wrap {shlex.quote(collect)}",
    ]
    return [*files, (out_dir / "submit.sh", "\n".join(submit) + "\n", 0o755, True)]
