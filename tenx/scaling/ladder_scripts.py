"""Launch scripts of a ladder for a cluster: one torchrun script, or one Slurm job per run and a submitter."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Literal

from tenx import config as cfglib
from tenx import rundir
from tenx.errors import TenxError
from tenx.scaling.rungs import PlannedRun
from tenx.utils.io import atomic_write_text
from tenx.utils.scripts import sbatch_value


def emit_launch(
    plan: list[PlannedRun],
    ladder_dir: str | Path,
    how: Literal["torchrun", "slurm"],
    collect: str,
    nproc: int = 8,
    nodes: int = 1,
) -> list[Path]:
    """Write each run's config and the commands that train them on a cluster; returns the scripts.

    The last command, `collect`, is this ladder's own command without --emit: it finds the finished
    runs, evaluates them and writes results.jsonl.
    """
    ladder_dir = Path(ladder_dir)
    for value, flag in ((nproc, "--nproc"), (nodes, "--nodes")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TenxError(f"{flag} must be an integer >= 1, got {value!r}")
    ranks = nproc * nodes
    runs = []
    for run in plan:
        if run.global_batch % ranks:
            raise TenxError(
                f"run {run.name}: its global batch of {run.global_batch} sequences cannot be split over "
                f"{ranks} ranks; raise the base config's train.global_batch or lower --nproc/--nodes"
            )
        run_dir = ladder_dir / "runs" / run.name
        config = rundir.RunDir(run_dir).config
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(config, cfglib.dumps_toml(run.config))
        micro = min(run.config.train.micro_batch, run.global_batch // ranks)
        while (run.global_batch // ranks) % micro:
            micro -= 1
        train_args = (
            f"-m tenx train --config {shlex.quote(str(config))} "
            f"--run-dir {shlex.quote(str(run_dir))} --resume auto --set train.micro_batch={micro}"
        )
        runs.append((run, run_dir, train_args))
    out_dir = ladder_dir / "launch"
    out_dir.mkdir(parents=True, exist_ok=True)
    cwd = shlex.quote(str(Path.cwd()))
    if how == "torchrun":
        lines = [
            "#!/usr/bin/env bash",
            f"# {len(runs)} ladder runs, one after another on this node; rerunning resumes or skips them.",
            "set -euo pipefail",
            f"cd {cwd}",
            f'NPROC="${{NPROC_PER_NODE:-{int(nproc)}}}"',
        ]
        lines += [f'torchrun --standalone --nproc_per_node "$NPROC" {args}' for _, _, args in runs]
        lines += ["# evaluate the finished runs and write results.jsonl", collect]
        path = out_dir / "torchrun.sh"
        atomic_write_text(path, "\n".join(lines) + "\n")
        path.chmod(0o755)
        return [path]
    scripts = []
    for run, run_dir, args in runs:
        text = "\n".join(
            [
                "#!/bin/bash",
                f"#SBATCH --job-name=tenx-{sbatch_value(run.name, 'run name')}",
                f"#SBATCH --nodes={sbatch_value(nodes, '--nodes')}",
                "#SBATCH --ntasks-per-node=1",
                f"#SBATCH --gpus-per-node={sbatch_value(nproc, '--nproc')}",
                f"#SBATCH --output={sbatch_value(run_dir.absolute(), '--out')}/slurm-%j.out",
                "set -euo pipefail",
                f"cd {cwd}",
                'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                f'srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node {int(nproc)} --rdzv_id "$SLURM_JOB_ID" '
                f'--rdzv_backend c10d --rdzv_endpoint "$head:29500" {args}',
            ]
        )
        path = out_dir / f"{run.name}.sbatch"
        atomic_write_text(path, text + "\n")
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
    path = out_dir / "submit.sh"
    atomic_write_text(path, "\n".join(submit) + "\n")
    path.chmod(0o755)
    return [*scripts, path]
