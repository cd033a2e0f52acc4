"""Slurm jobs that train: the one sbatch script `tenx train --emit slurm` and `tenx ladder --emit slurm` write.

The script asks for whole nodes (`--nodes N --ntasks-per-node=1 --exclusive`, `--gpus-per-node`), and
`srun` starts one task on each: the tenx supervisor (`tenx train --supervise`, tenx/launch/supervise.py),
which runs torchrun and restarts it with `--resume auto` after a crash or a hang. Each node's torchrun
starts that node's ranks and meets the other nodes at a c10d rendezvous on the allocation's first node
(`scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1`, port `rdzv_port`), under the job id. The first
start also uses `--resume auto`, so a job Slurm starts again (requeued) continues from the newest checkpoint
that verifies instead of refusing a run directory that has checkpoints.

Stopping: `#SBATCH --signal=B:TERM@120` makes Slurm send SIGTERM to the batch shell 120 s before the time
limit. TERM, not USR1: tenx saves a checkpoint on SIGTERM (tenx/train/trainer.py), the supervisor forwards
it to torchrun, and SIGUSR1 already means "dump your stacks" to a tenx process. `B:` keeps the signal to the
batch shell, whose trap forwards it to the job step once (srun passes it to every node's tasks); when the
step has ended without finishing, the trap's script requeues the job (`scontrol requeue`, allowed by
`#SBATCH --requeue`), and the requeued job appends to the same log (`--open-mode=append`). A preemption
signals every process of the job itself; the same trap then requeues it where the preemption mode cancels.

Every value on a `#SBATCH` line goes through tenx.utils.scripts.sbatch_value (refused by the flag's name
when it could break the line); every value on a shell line is quoted with shlex.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tenx.errors import ConfigError
from tenx.utils.io import atomic_write_text
from tenx.utils.scripts import sbatch_value, slurm_time

RDZV_PORT = 29500
"""torchrun's usual rendezvous port on the head node."""
STOP_SIGNAL_LEAD_S = 120
"""Seconds before the time limit at which Slurm sends the batch shell SIGTERM: the time the job has to
finish its step and save a checkpoint (torchrun itself gives its workers 30 s after it forwards a signal)."""
JOB_NAME_PREFIX = "tenx-"
"""Every job tenx emits is named tenx-NAME (squeue shows which are tenx's)."""


@dataclass(frozen=True)
class SlurmJob:
    """What a training job asks Slurm for, and how its nodes meet."""

    name: str
    """The job's name after `tenx-` (the run's name)."""
    log_dir: Path
    """Where Slurm writes the job's output, slurm-JOBID.out (the run directory)."""
    nodes: int = 1
    """Nodes of the allocation: one srun task, supervisor and torchrun on each."""
    nproc_per_node: int = 8
    """Ranks torchrun starts on each node (one per GPU)."""
    gpus_per_node: int | None = None
    """GPUs asked for on each node: None means nproc_per_node, 0 asks for none (a CPU partition)."""
    partition: str | None = None
    """The partition (`--partition`), or the cluster's default."""
    time: str | None = None
    """The time limit (`--time`, e.g. 1-00:00:00), or the partition's default."""
    rdzv_port: int = RDZV_PORT
    """The c10d rendezvous port on the head node."""
    flags: Mapping[str, str] = field(default_factory=dict)
    """The command's flag for a field, as errors name it (default `--field-name`)."""

    def flag(self, name: str) -> str:
        """The flag errors name for field `name`."""
        return self.flags.get(name, "--" + name.replace("_", "-"))

    def validate(self) -> None:
        """Refuse counts out of range, naming the flag."""
        bounds = {"nodes": (1, 100_000), "nproc_per_node": (1, 1024), "rdzv_port": (1, 65535)}
        if self.gpus_per_node is not None:
            bounds["gpus_per_node"] = (0, 1024)
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"{self.flag(name)} must be an integer from {low} to {high}, got {value!r}")


def sbatch_header(job: SlurmJob) -> list[str]:
    """The script's first lines: the interpreter and every `#SBATCH` directive (values checked)."""
    job.validate()
    # the log directory first: a job named after it (a run directory's last part) is refused naming the whole path
    log_dir = sbatch_value(Path(job.log_dir).absolute(), job.flag("log_dir"))
    gpus = job.nproc_per_node if job.gpus_per_node is None else job.gpus_per_node
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={JOB_NAME_PREFIX}{sbatch_value(job.name, job.flags.get('name', 'run name'))}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
    ]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    if job.partition is not None:
        lines.append(f"#SBATCH --partition={sbatch_value(job.partition, job.flag('partition'))}")
    if job.time is not None:
        lines.append(f"#SBATCH --time={slurm_time(job.time, job.flag('time'))}")
    return [
        *lines,
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:TERM@{STOP_SIGNAL_LEAD_S}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={log_dir}/slurm-%j.out",
    ]


def torchrun_launcher(job: SlurmJob) -> str:
    """Each node's torchrun, as the supervisor's --launcher: shell text the batch shell expands, where
    `$head` is the allocation's first node."""
    return (
        f"torchrun --nnodes $SLURM_NNODES --nproc-per-node {int(job.nproc_per_node)} --rdzv-backend c10d "
        f"--rdzv-endpoint $head:{int(job.rdzv_port)} --rdzv-id $SLURM_JOB_ID -m tenx"
    )


def job_script(
    job: SlurmJob, train_args: Sequence[str], supervisor_args: Sequence[str] = (), cwd: Path | None = None
) -> str:
    """The sbatch script that runs `tenx train TRAIN_ARGS` on every node of the allocation (see the module
    docstring). `train_args` name the config, run directory and overrides, never --resume, --supervise or
    --launcher (the script adds them); `supervisor_args` are further supervisor flags (--max-restarts 3);
    `cwd` is where the job runs (default: here), so relative paths mean what they mean here."""
    for arg in train_args:
        if arg.split("=")[0] in ("--resume", "--supervise", "--launcher", "--node-env"):
            raise ConfigError(f"{arg.split('=')[0]} is the job script's to set; leave it out")
    command = ["python", "-m", "tenx", "train", *train_args, "--resume", "auto", "--supervise"]
    command += list(supervisor_args)
    if job.nodes > 1:  # one supervisor per node: node 0's writes the ledger, rank 0 holds the run's lock
        command += ["--node-env", "SLURM_NODEID"]
    srun = (
        'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" '
        f'{shlex.join(command)} --launcher "{torchrun_launcher(job)}" &'
    )
    return "\n".join(
        [
            *sbatch_header(job),
            "# One task per node: the tenx supervisor, which runs the node's torchrun and restarts it with",
            "# --resume auto after a crash or hang; the nodes meet at a c10d rendezvous on the first node.",
            "# On SIGTERM (120 s before the time limit, or a preemption) the trap forwards it to the step,",
            "# every rank saves a checkpoint at the end of its step, and the job is requeued; the requeued job",
            "# runs this script again and --resume auto continues from that checkpoint.",
            "set -euo pipefail",
            f"cd {shlex.quote(str(Path.cwd() if cwd is None else cwd))}",
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            'step=""',
            "stopping=0",
            "# forward once: a second SIGTERM would stop a rank before its checkpoint is written",
            'forward_term() { if [ "$stopping" = 0 ] && [ -n "$step" ]; then kill -TERM "$step" || true; fi; '
            "stopping=1; }",
            "trap forward_term TERM",
            srun,
            "step=$!",
            "status=0",
            'wait "$step" || status=$?',
            "# a trap ends `wait` early (status 143): wait again until the step has really ended",
            'while kill -0 "$step" 2>/dev/null; do status=0; wait "$step" || status=$?; done',
            'if [ "$stopping" = 1 ] && [ "$status" != 0 ]; then',
            '  echo "tenx: stopped by SIGTERM (exit $status); requeueing job $SLURM_JOB_ID to resume" >&2',
            '  scontrol requeue "$SLURM_JOB_ID" || echo "tenx: scontrol requeue failed; sbatch this script '
            'again to resume" >&2',
            "fi",
            'exit "$status"',
        ]
    )


def write_job_script(path: str | Path, text: str) -> Path:
    """Write a job script atomically, executable; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text + "\n", mode=0o755)
    return path
