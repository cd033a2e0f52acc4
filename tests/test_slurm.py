"""`tenx train --emit slurm`: the sbatch script's directives and each node's torchrun, run by a real bash with
a stand-in `srun` and `scontrol`: once to completion with real torchrun (2 processes, gloo), and with a
SIGTERM that must reach the job step once and requeue the job."""

from __future__ import annotations

import json
import os
import shlex
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tenx import rundir
from tenx.checkpoint.store import list_checkpoints
from tenx.cli import main
from tenx.launch.slurm import SlurmJob, job_script

RECORDER = """#!/usr/bin/env python3
import json, os, signal, sys, time
name = os.path.basename(sys.argv[0])
def record(entry):
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps(entry) + "\\n")
waits = name == "srun" and os.environ.get("SRUN_WAITS") == "1"
if waits:  # a job step that runs until SIGTERM, as training does (handler first: then it is recorded)
    def stop(signum, frame):
        record(["srun-got", signal.Signals(signum).name])
        sys.exit(143)
    signal.signal(signal.SIGTERM, stop)
record([name, *sys.argv[1:]])
if name == "scontrol" and sys.argv[1:3] == ["show", "hostnames"]:
    print(os.environ["HEAD_NODE"])
while waits:
    time.sleep(0.05)
"""

FAKE_SRUN = """#!/usr/bin/env bash
# one node of the allocation, here: drop srun's own options, export what srun sets in a task, run the command
while [[ "$1" == --* ]]; do shift; done
export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_STEP_ID=0
exec "$@"
"""


def _bin(tmp_path: Path, programs: dict[str, str]) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in programs.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _slurm_env(bin_dir: Path, tmp_path: Path, nodes: int, head: str) -> dict[str, str]:
    """What sbatch puts in the batch shell's environment, and the stand-ins first on PATH."""
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RECORD": str(tmp_path / "record.jsonl"),
        "HEAD_NODE": head,
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": f"{head}" if nodes == 1 else "node[01-04]",
        "SLURM_CPUS_ON_NODE": "2",
        "OMP_NUM_THREADS": "1",
    }


def _recorded(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_script_starts_a_supervised_torchrun_on_every_node_at_the_head_nodes_rendezvous(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--config", "tiny", "--run-dir", "runs/big", "--emit", "slurm", "--nodes", "4"]
    extra = ["--partition", "gpu", "--time", "2-00:00:00", "--max-restarts", "3", "--set", "train.steps=7"]
    assert main([*argv, *extra]) == 0
    script = tmp_path / "runs" / "big.sbatch"
    assert f"sbatch {Path('runs') / 'big.sbatch'}" in capsys.readouterr().out
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert header == [
        "#SBATCH --job-name=tenx-big",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:TERM@120",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={tmp_path / 'runs' / 'big'}/slurm-%j.out",
    ]
    (srun_line,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert (
        '--launcher "torchrun --nnodes $SLURM_NNODES --nproc-per-node 8 --rdzv-backend c10d '
        '--rdzv-endpoint $head:29500 --rdzv-id $SLURM_JOB_ID -m tenx"' in srun_line
    )
    # run by bash: the batch shell expands the rendezvous from the allocation; srun gets one command
    bin_dir = _bin(tmp_path, {"srun": RECORDER, "scontrol": RECORDER})
    env = _slurm_env(bin_dir, tmp_path, nodes=4, head="node01")
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
    scontrol, srun = _recorded(tmp_path)
    assert scontrol == ["scontrol", "show", "hostnames", "node[01-04]"]
    assert srun[:3] == ["srun", "--kill-on-bad-exit=1", "--cpus-per-task=2"]
    command = srun[3:]
    assert command[:4] == ["python", "-m", "tenx", "train"]
    assert command[command.index("--launcher") + 1] == (
        "torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node01:29500 "
        "--rdzv-id 4242 -m tenx"
    )
    assert command[command.index("--resume") + 1] == "auto" and "--supervise" in command
    assert command[command.index("--node-env") + 1] == "SLURM_NODEID"  # one supervisor per node
    assert command[command.index("--max-restarts") + 1] == "3"
    assert command[command.index("--run-dir") + 1] == "runs/big"
    assert command[command.index("--set") + 1] == "train.steps=7"
    assert not list(tmp_path.glob("runs/big/*"))  # nothing trained here

    # one node: no --node-env, the supervisor holds the run's lock as it does without Slurm
    single = job_script(
        SlurmJob("one", tmp_path, nodes=1, nproc_per_node=2, gpus_per_node=0), ["--config", "c"]
    )
    assert "--node-env" not in single and "--gpus-per-node" not in single


def test_emit_refuses_what_it_cannot_write(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = ["train", "--config", "tiny", "--run-dir", "runs/r", "--emit", "slurm"]
    with pytest.raises(SystemExit) as stopped:
        main([*base, "--nproc-per-node", "0"])
    assert stopped.value.code == 2
    assert "argument --nproc-per-node: must be an integer >= 1" in capsys.readouterr().err
    assert main([*base, "--resume", "runs/x/checkpoints/step_00000010"]) == 2
    assert "always resumes with --resume auto" in capsys.readouterr().err
    assert main([*base, "--set", "train.global_batch=16", "--nproc-per-node", "8"]) == 2
    assert "--nodes 1 x --nproc-per-node 8" in capsys.readouterr().err
    assert main(["train", "--config", "tiny", "--partition", "gpu"]) == 2  # would train, ignoring it
    assert "--partition: only with --emit slurm" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    assert main(base) == 0
    first = (tmp_path / "runs" / "r.sbatch").read_text()
    assert main([*base, "--nodes", "2"]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert (tmp_path / "runs" / "r.sbatch").read_text() == first
    assert main([*base, "--nodes", "2", "--force", "-o", "job.sbatch"]) == 0
    assert "#SBATCH --nodes=2" in (tmp_path / "job.sbatch").read_text()


def test_a_fake_srun_runs_the_script_to_completion_with_two_torchrun_processes(
    tiny_data, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    port = _free_port()
    args = ["train", "--config", "tiny", "--set", f'data.dir="{tiny_data}"', "--set", "log.progress=false"]
    args += ["--set", "train.steps=6", "--set", "checkpoint.every=3", "--set", "train.eval_every=0"]
    args += ["--run-dir", "runs/slurm", "--emit", "slurm", "--nodes", "1", "--nproc-per-node", "2"]
    assert main([*args, "--gpus-per-node", "0", "--rdzv-port", str(port), "--backoff", "0"]) == 0
    script = tmp_path / "runs" / "slurm.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    python = f'#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)} "$@"\n'
    torchrun = f'#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)} -m torch.distributed.run "$@"\n'
    bin_dir = _bin(
        tmp_path, {"srun": FAKE_SRUN, "scontrol": RECORDER, "python": python, "torchrun": torchrun}
    )
    env = _slurm_env(bin_dir, tmp_path, nodes=1, head="localhost")
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = rundir.RunDir(tmp_path / "runs" / "slurm")
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 6
    assert [step for step, _ in list_checkpoints(run.checkpoints)][-1] == 6
    assert json.loads(run.provenance.read_text())["data_parallel"] == 2  # two torchrun ranks
    assert "tenx supervise:" in done.stdout and "finished after 0 restarts" in done.stdout
    assert ["scontrol", "requeue", "4242"] not in _recorded(tmp_path)


@pytest.mark.parametrize("finishes", [False, True])
def test_sigterm_reaches_the_step_once_and_requeues_the_job_unless_it_finished(
    tmp_path, monkeypatch, finishes
):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "job.sbatch"
    script.write_text(
        job_script(SlurmJob("r", tmp_path, nodes=2, nproc_per_node=2), ["--config", "c"]) + "\n"
    )
    srun = RECORDER.replace("sys.exit(143)", "sys.exit(0)") if finishes else RECORDER
    bin_dir = _bin(tmp_path, {"srun": srun, "scontrol": RECORDER})
    env = {**_slurm_env(bin_dir, tmp_path, nodes=2, head="node01"), "SRUN_WAITS": "1"}
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60  # a bound on a hang, not a measurement
    while not any(r[0] == "srun" for r in _recorded(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    job.terminate()  # Slurm's SIGTERM to the batch shell (--signal=B:TERM)
    time.sleep(0.2)
    job.terminate()  # a second one is not forwarded
    _, err = job.communicate(timeout=60)
    calls = _recorded(tmp_path)
    assert [c for c in calls if c[0] == "srun-got"] == [["srun-got", "SIGTERM"]]
    requeued = ["scontrol", "requeue", "4242"] in calls
    assert requeued is not finishes, err
    assert job.returncode == (0 if finishes else 143)


def test_in_a_multi_node_job_only_node_0s_supervisor_writes_the_records_and_none_holds_the_lock(
    tmp_path, monkeypatch
):
    from tenx.errors import TenxError
    from tenx.launch.supervise import SupervisorConfig, supervise
    from tenx.monitor.goodput import read_ledger

    options = SupervisorConfig(launcher=f"{shlex.quote(sys.executable)} -c pass", node_env="NODE_INDEX")
    kinds = {}
    for node in ("0", "1"):
        monkeypatch.setenv("NODE_INDEX", node)
        run = tmp_path / f"node{node}"
        report = supervise(["train", "--config", "tiny"], run, options, resume="auto")
        assert report.finished and len(report.attempts) == 1
        kinds[node] = [r["kind"] for r in read_ledger(run)]
        assert not rundir.RunDir(run).writer_lock.exists()  # training rank 0 takes it, on its own node
    assert kinds == {"0": ["launch", "exit"], "1": []}
    monkeypatch.delenv("NODE_INDEX")
    with pytest.raises(TenxError, match="--node-env NODE_INDEX: the variable is unset"):
        supervise(["train"], tmp_path / "unset", options)
