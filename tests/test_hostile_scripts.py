"""Every script tenx writes (`data prepare --emit slurm`, `train --emit slurm`, `ladder --emit torchrun|slurm`)
with hostile values:
a value that cannot go into a `#SBATCH` line is refused by name, and every value on a shell line reaches
the command as one argument, run by a real bash with stand-ins for torchrun, sbatch and python."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tenx.cli import main

HOSTILE = [
    "gpu\ntouch PWNED",
    "gpu touch",
    "gpu;touch PWNED",
    "$(touch PWNED)",
    "`touch PWNED`",
    "gpu'\"",
    "",
]

RECORDER = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
if os.path.basename(sys.argv[0]) == "sbatch":
    print("123")
"""


def _recorders(tmp_path: Path) -> dict[str, str]:
    """An environment whose torchrun, sbatch, srun, scontrol, python and tenx only record their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "sbatch", "srun", "scontrol", "python", "tenx"):
        path = bin_dir / name
        path.write_text(RECORDER)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path / "record.jsonl")}


def _recorded(tmp_path: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]


def _sbatch_header_is_whole(text: str) -> None:
    """sbatch reads #SBATCH lines only before the first command: every one must come before it."""
    lines = text.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert not any(line.startswith("#SBATCH") for line in lines[first_command:]), text
    assert all(" " not in line.partition(" ")[2] for line in lines if line.startswith("#SBATCH")), text


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("flag", ["--slurm-partition", "--slurm-time"])
def test_prepare_refuses_values_that_cannot_go_into_a_sbatch_line(corpus_dir, tmp_path, capsys, flag, value):
    out = tmp_path / "data"
    args = ["data", "prepare", "--source", str(corpus_dir), "--out", str(out), "--emit", "slurm"]
    extra = [flag, value] + (["--slurm-partition", "gpu"] if flag != "--slurm-partition" else [])
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
    assert not list(tmp_path.glob("*.sbatch")) and not (tmp_path / "PWNED").exists()


def test_prepare_script_passes_hostile_paths_as_single_arguments(corpus_dir, tmp_path, monkeypatch, capsys):
    weird = tmp_path / "it's $(touch PWNED);`x`"
    weird.mkdir()
    source = weird / "src"
    source.symlink_to(corpus_dir)
    out = tmp_path / "data"
    monkeypatch.chdir(weird)
    args = ["data", "prepare", "--source", str(source), "--out", str(out), "--emit", "slurm"]
    assert main([*args, "--slurm-partition", "gpu,debug", "--slurm-time", "1-00:00:00"]) == 0
    script = tmp_path / "data.sbatch"
    text = script.read_text()
    _sbatch_header_is_whole(text)
    assert "#SBATCH --partition=gpu,debug" in text and "#SBATCH --time=1-00:00:00" in text
    env = _recorders(tmp_path)
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ((program, *argv),) = _recorded(tmp_path)
    assert program == "python" and argv[argv.index("--source") + 1] == str(source)
    assert not list(tmp_path.rglob("PWNED"))
    # a directory with a blank cannot be a #SBATCH --output path: refused, naming --out
    assert main([*args[:5], str(tmp_path / "my data"), "--emit", "slurm", "--slurm-partition", "gpu"]) == 2
    assert "--out" in capsys.readouterr().err


def test_prepare_emit_refuses_a_directory_in_the_scripts_place_and_the_root(corpus_dir, tmp_path, capsys):
    (tmp_path / "data.sbatch").mkdir()
    base = ["data", "prepare", "--source", str(corpus_dir), "--emit", "slurm", "--slurm-partition", "gpu"]
    assert main([*base, "--out", str(tmp_path / "data")]) == 2
    assert "data.sbatch is a directory" in capsys.readouterr().err
    assert main([*base, "--out", "/"]) == 2
    assert "root" in capsys.readouterr().err


def _ladder(tiny_data, lad: Path, how: str, *extra: str) -> int:
    args = ["ladder", "--config", "tiny", "--set", f'data.dir="{tiny_data}"', "--budgets", "3e10"]
    return main([*args, "--grid", "ratio", "--max-depth", "1", "--out", str(lad), "--emit", how, *extra])


def test_ladder_scripts_pass_hostile_paths_as_single_arguments(tiny_data, tmp_path, monkeypatch):
    weird = tmp_path / "lab's $(touch PWNED);`x`"
    weird.mkdir()
    monkeypatch.chdir(weird)
    lad = weird / "lad"
    assert _ladder(tiny_data, lad, "torchrun", "--nproc", "2") == 0
    env = _recorders(tmp_path)
    done = subprocess.run(
        ["bash", str(lad / "launch" / "torchrun.sh")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    torchrun, collect = _recorded(tmp_path)
    assert torchrun[0] == "torchrun" and torchrun[torchrun.index("--run-dir") + 1].startswith(str(lad))
    assert collect[0] == "tenx" and collect[collect.index("--out") + 1] == str(lad)
    assert not list(tmp_path.rglob("PWNED"))


def test_ladder_slurm_scripts_refuse_what_cannot_go_into_a_sbatch_line(tiny_data, tmp_path, capsys):
    assert _ladder(tiny_data, tmp_path / "my ladder", "slurm") == 2
    assert "--out" in capsys.readouterr().err
    lad = tmp_path / "lad"
    assert _ladder(tiny_data, lad, "slurm", "--nproc", "4", "--nodes", "2") == 0
    scripts = sorted((lad / "launch").glob("*.sbatch"))
    assert scripts
    for script in scripts:
        _sbatch_header_is_whole(script.read_text())
    env = _recorders(tmp_path)
    done = subprocess.run(
        ["bash", str(lad / "launch" / "submit.sh")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    calls = _recorded(tmp_path)
    assert [c[0] for c in calls] == ["sbatch"] * (len(scripts) + 1)
    assert calls[-1][calls[-1].index("--wrap") + 1].startswith("tenx ladder ")


@pytest.mark.parametrize("flag", ["--partition", "--time"])
def test_train_refuses_values_that_cannot_go_into_a_sbatch_line(tmp_path, capsys, flag):
    args = ["train", "--config", "tiny", "--run-dir", str(tmp_path / "run"), "--emit", "slurm"]
    for value in HOSTILE:
        assert main([*args, flag, value]) == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err
    assert main([*args[:3], "--run-dir", str(tmp_path / "my run"), "--emit", "slurm"]) == 2
    assert "--run-dir" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.sbatch")) and not list(tmp_path.rglob("PWNED"))


def test_train_script_passes_hostile_paths_as_single_arguments(tmp_path, monkeypatch):
    weird = tmp_path / "lab's $(touch PWNED);`x`"
    weird.mkdir()
    monkeypatch.chdir(weird)
    config = weird / "my $(touch PWNED) config.toml"
    config.write_text((Path(__file__).resolve().parents[1] / "configs" / "tiny.toml").read_text())
    run = tmp_path / "runs" / "r1"
    args = [
        "train",
        "--config",
        str(config),
        "--run-dir",
        str(run),
        "--set",
        'data.dir="d b;$(touch PWNED)`c`"',
    ]
    assert main([*args, "--emit", "slurm", "--nodes", "2", "-o", "it's.sbatch"]) == 0
    script = weird / "it's.sbatch"
    _sbatch_header_is_whole(script.read_text())
    env = {**_recorders(tmp_path), "SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_CPUS_ON_NODE": "4"}
    env["SLURM_JOB_NODELIST"] = "n[1-2]"
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    scontrol, (program, *argv) = _recorded(tmp_path)
    assert scontrol[0] == "scontrol" and program == "srun"
    assert argv[argv.index("--config") + 1] == str(config)
    assert argv[argv.index("--run-dir") + 1] == str(run)
    assert argv[argv.index("--set") + 1] == 'data.dir="d b;$(touch PWNED)`c`"'
    assert not list(tmp_path.rglob("PWNED"))
