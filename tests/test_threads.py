"""CPU counts that honour affinity, cgroup quotas and Slurm, and torch thread counts chosen around other
programs' load, with `--threads` on every compute command (issue 28). Load readings are injected: no test
here depends on how busy the machine running it is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tenx import hardware
from tenx.cli import main
from tenx.utils import cpus
from tenx.utils.cpus import cgroup_cpu_limit, others_busy, read_cpu_times, slurm_cpu_limit, usable_cpu_count

SLURM = ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE")


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    """No thread variables, no Slurm job, an empty cgroup tree; torch's thread count restored after."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", *SLURM):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "cgroup").mkdir()
    (tmp_path / "self-cgroup").write_text("0::/\n")
    monkeypatch.setattr(cpus, "CGROUP_ROOT", tmp_path / "cgroup")
    monkeypatch.setattr(cpus, "PROC_SELF_CGROUP", tmp_path / "self-cgroup")
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def _machine(monkeypatch, cpu_count: int, affinity: set[int] | None) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cpu_count)
    if affinity is None:
        monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    else:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity), raising=False)


def _contention(monkeypatch, cpus_usable: int, busy: float) -> None:
    """A machine with `cpus_usable` CPUs of which other programs keep `busy` CPUs' worth busy."""
    monkeypatch.setattr(cpus, "usable_cpu_count", lambda: cpus_usable)
    monkeypatch.setattr(cpus, "torch_default_threads", lambda: cpus_usable)
    monkeypatch.setattr(cpus, "busy_cpus", lambda: busy)


# ----- item 1: usable CPUs -------------------------------------------------------------------------------
def test_affinity_limits_the_count(monkeypatch):
    _machine(monkeypatch, 8, {0, 2, 5})
    assert usable_cpu_count() == 3
    _machine(monkeypatch, 8, None)  # macOS: no affinity call
    assert usable_cpu_count() == 8


def _cgroup(root: Path, rel: str, **files: str) -> None:
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text + "\n")


def test_cgroup_v2_quota_of_the_process_and_its_ancestors(tmp_path, monkeypatch):
    root, me = tmp_path / "v2", tmp_path / "me"
    _cgroup(root, "", cpu_max="max 100000")
    me.write_text("0::/\n")
    assert cgroup_cpu_limit(root, me) is None  # `max`: no quota
    _cgroup(root, "", cpu_max="150000 100000")
    assert cgroup_cpu_limit(root, me) == 1.5
    # a job's cgroup two levels down: its parent's quota binds it too, and the least wins
    _cgroup(root, "", cpu_max="max 100000")
    _cgroup(root, "job", cpu_max="100000 100000")
    _cgroup(root, "job/step", cpu_max="max 100000")
    me.write_text("0::/job/step\n")
    assert cgroup_cpu_limit(root, me) == 1.0
    _machine(monkeypatch, 8, set(range(8)))
    assert usable_cpu_count(root, me) == 1
    _cgroup(root, "job", cpu_max="250000 100000")  # 2.5 CPUs: bursts run 3 workers' worth
    assert usable_cpu_count(root, me) == 3


def test_cgroup_v1_quota(tmp_path, monkeypatch):
    root, me = tmp_path / "v1", tmp_path / "me"
    me.write_text("12:memory:/\n4:cpu,cpuacct:/docker/abc\n")
    _cgroup(root, "cpu,cpuacct/docker/abc", cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    assert cgroup_cpu_limit(root, me) is None  # -1: no quota
    _cgroup(root, "cpu,cpuacct/docker/abc", cpu_cfs_quota_us="200000", cpu_cfs_period_us="100000")
    assert cgroup_cpu_limit(root, me) == 2.0
    _machine(monkeypatch, 16, set(range(16)))
    assert usable_cpu_count(root, me) == 2
    assert cgroup_cpu_limit(tmp_path / "absent", me) is None  # no cgroup filesystem


def test_slurm_allocation(monkeypatch):
    _machine(monkeypatch, 64, set(range(64)))
    assert slurm_cpu_limit({}) is None
    assert slurm_cpu_limit({"SLURM_CPUS_ON_NODE": "6"}) == 6
    assert slurm_cpu_limit({"SLURM_CPUS_PER_TASK": "4", "SLURM_CPUS_ON_NODE": "6"}) == 4
    assert slurm_cpu_limit({"SLURM_CPUS_PER_TASK": "four"}) is None
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    assert usable_cpu_count() == 4


def test_the_least_limit_wins(tmp_path, monkeypatch):
    _machine(monkeypatch, 32, set(range(12)))
    _cgroup(cpus.CGROUP_ROOT, "", cpu_max="600000 100000")
    assert usable_cpu_count() == 6
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "5")
    assert usable_cpu_count() == 5
    _machine(monkeypatch, 32, {3, 4})
    assert usable_cpu_count() == 2
    assert hardware.hardware_summary(torch.device("cpu"))["usable_cpus"] == 2


def test_data_prepare_workers_default_to_the_usable_cpus(corpus_dir, tmp_path, monkeypatch):
    """`data prepare` without --workers starts as many worker processes as the process may use."""
    from tenx.data.prepare import stream
    from tenx.data.prepare.pipeline import PrepareConfig, prepare

    _machine(monkeypatch, 8, {0, 1, 2})  # os.cpu_count() says 8; the affinity mask allows 3
    seen: list[int] = []
    real = stream.ordered_map

    def spy(fn, items, workers, *rest):
        seen.append(workers)
        return real(fn, items, 1, *rest)  # the figure is checked, not the machine loaded

    monkeypatch.setattr(stream, "ordered_map", spy)
    prepare(
        PrepareConfig(source=str(corpus_dir / "json"), out=str(tmp_path / "d"), tokenizer="bytes"),
        progress=False,
    )
    assert seen and set(seen) == {3}


# ----- item 2: busy CPUs and the torch thread count ------------------------------------------------------
def test_proc_stat_readings_and_other_processes_load(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  300 0 100 1900 0 0 0 0 0 0\n"
        "cpu0 200 0 50 700 50 0 0 0 0 0\n"
        "cpu1 100 0 50 1100 0 0 0 0 0 0\n"
        "intr 12345\nctxt 99\n"
    )
    assert read_cpu_times(stat) == {0: (250, 1000), 1: (150, 1250)}
    assert read_cpu_times(tmp_path / "absent") is None
    before = {0: (250, 1000), 1: (150, 1250)}
    after = {0: (340, 1100), 1: (160, 1350)}  # cpu0 90% busy, cpu1 10% over 100 ticks each
    assert others_busy(before, after, own_cpu_s=0.0, wall_s=1.0) == pytest.approx(1.0)
    # this process's own 0.4 s of CPU in that second is not contention
    assert others_busy(before, after, own_cpu_s=0.4, wall_s=1.0) == pytest.approx(0.6)
    assert others_busy(before, after, own_cpu_s=0.0, wall_s=1.0, cpus={1}) == pytest.approx(0.1)
    # steal time (another guest on the hypervisor) is busy time
    stat.write_text("cpu0 10 0 0 80 0 0 0 10 0 0\n")
    assert read_cpu_times(stat) == {0: (20, 100)}


def test_an_explicit_count_or_omp_num_threads_wins_without_measuring(monkeypatch):
    def never() -> float:
        raise AssertionError("measured the load although the count was given")

    monkeypatch.setattr(cpus, "busy_cpus", never)
    assert cpus.choose_threads(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpus.choose_threads() == 5
    assert cpus.choose_threads(2) == 2


@pytest.mark.parametrize(
    ("usable", "busy", "share", "threads"),
    [
        (2, 0.0, 1, 2),  # idle: every CPU
        (2, 0.2, 1, 2),  # background noise below BUSY_SHARE of a core
        (2, 1.0, 1, 1),  # one other process on one of two cores: the collapse
        (4, 0.35, 1, 3),
        (4, 2.9, 1, 1),
        (2, 7.0, 1, 1),  # never below one
        (8, 0.0, 2, 4),  # two ranks of a job on this machine share its CPUs
        (8, 2.0, 2, 3),
        (1, 5.0, 1, 1),
    ],
)
def test_auto_leaves_busy_cpus_alone(monkeypatch, capsys, usable, busy, share, threads):
    _contention(monkeypatch, usable, busy)
    assert cpus.choose_threads(None, "--threads N", share=share) == threads
    err = capsys.readouterr().err
    if threads < usable // share:
        assert err.count("\n") == 1 and f"{busy:.1f} of {usable} CPUs busy" in err
        assert f"torch uses {threads} thread" in err and "--threads N to choose" in err
    else:
        assert err == ""


def test_auto_never_exceeds_torchs_own_default(monkeypatch):
    """torch's default is the physical cores; hyperthreads beyond them only slow a matmul down."""
    _contention(monkeypatch, 16, 0.0)
    monkeypatch.setattr(cpus, "torch_default_threads", lambda: 8)
    assert cpus.choose_threads() == 8


def _eval_threads(monkeypatch, argv: list[str]) -> int:
    """Run `tenx eval ...` in-process with the evaluation replaced: torch's thread count when it ran."""
    from tenx.eval import evaluate as evaluate_module

    seen: list[int] = []

    def evaluate(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return {"datasets": {}, "path": "eval.json"}

    monkeypatch.setattr(evaluate_module, "evaluate", evaluate)
    assert main(["eval", "RUN", *argv]) == 0
    return seen[0]


def test_eval_threads_flag_sets_torchs_threads(monkeypatch):
    _contention(monkeypatch, 2, 0.0)
    torch.set_num_threads(2)
    assert _eval_threads(monkeypatch, ["--threads", "1"]) == 1
    assert _eval_threads(monkeypatch, ["--threads", "2"]) == 2
    with pytest.raises(SystemExit):
        main(["eval", "RUN", "--threads", "0"])


def test_eval_on_a_busy_machine_uses_fewer_threads_and_says_so(monkeypatch, capsys):
    _contention(monkeypatch, 2, 1.0)
    torch.set_num_threads(2)
    assert _eval_threads(monkeypatch, []) == 1
    err = capsys.readouterr().err
    assert "1.0 of 2 CPUs busy" in err and "torch uses 1 thread" in err and "--threads N" in err


def test_sample_threads_flag_sets_torchs_threads(monkeypatch, capsys):
    from tenx.checkpoint import models as load

    class Loaded(Exception):
        pass

    seen: list[int] = []

    def load_model(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise Loaded

    monkeypatch.setattr(load, "load_model", load_model)
    _contention(monkeypatch, 2, 1.0)
    torch.set_num_threads(2)
    for argv, threads in ((["--threads", "1"], 1), (["--threads", "2"], 2), ([], 1)):
        with pytest.raises(Loaded):
            main(["sample", "RUN", *argv])
        assert seen[-1] == threads
    assert "--threads N" in capsys.readouterr().err  # the auto choice said why


def test_compress_threads(monkeypatch):
    """compress keeps 1 thread by default (the count is part of the file's numerics), takes N or auto."""
    from tenx.compress import files

    seen: list[int] = []

    def compress_file(run, src, dst, force, *, threads, device, adapt=None):
        seen.append(threads)
        return {"bits_per_byte": None, "kb_per_s": None, "src": src, "dst": dst, "bytes": 0, "adapt": adapt}

    monkeypatch.setattr(files, "compress_file", compress_file)
    _contention(monkeypatch, 4, 1.0)
    for argv in ([], ["--threads", "3"], ["--threads", "auto"]):
        assert main(["compress", "RUN", "FILE", "--json", *argv]) == 0
    assert seen == [1, 3, 3]


def test_ladder_and_derisk_threads_reach_the_probe_and_every_run(monkeypatch):
    from tenx.scaling.derisk import compute_multiplier as derisk
    from tenx.scaling.ladder import runner as ladder

    seen: dict[str, object] = {}

    def run_ladder(base, lc, out, **kwargs):
        seen["ladder"] = (torch.get_num_threads(), base.train.threads)

    def derisk_from_args(*args, **data_mode):
        seen["derisk_sets"] = args[-1]
        return derisk.DeriskConfig()  # the compute mode: run_derisk below

    def run_derisk(dc, out, dry_run=False):
        seen["derisk_threads"] = torch.get_num_threads()

    monkeypatch.setattr(ladder, "run_ladder", run_ladder)
    monkeypatch.setattr(derisk, "derisk_from_args", derisk_from_args)
    monkeypatch.setattr(derisk, "run_derisk", run_derisk)
    torch.set_num_threads(2)
    main(["ladder", "--out", "L", "--dry-run", "--threads", "1"])
    assert seen["ladder"] == (1, 1)
    torch.set_num_threads(2)
    main(["derisk", "--out", "D", "--dry-run", "--threads", "1"])
    assert seen["derisk_threads"] == 1 and "train.threads=1" in seen["derisk_sets"]
    _contention(monkeypatch, 2, 0.0)
    main(["ladder", "--out", "L", "--dry-run"])
    assert seen["ladder"] == (2, None)  # auto: each run chooses when it starts


@pytest.mark.parametrize("command", ["eval", "sample", "ladder", "derisk"])
def test_help_shows_the_threads_default(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--threads auto|N" in out and "(default: auto)" in out


def test_training_auto_threads_use_the_same_chooser(tiny_data, tiny_config, tmp_path, monkeypatch, capsys):
    from tenx.train.run import train

    _contention(monkeypatch, 2, 1.0)
    torch.set_num_threads(2)
    run = tmp_path / "run"
    train(tiny_config(tiny_data, "train.steps=1", "checkpoint.every=0", "train.eval_every=0"), run)
    assert json.loads((run / "run.json").read_text())["hardware"]["torch_threads"] == 1
    assert "--set train.threads=N to choose" in capsys.readouterr().err


def test_a_training_run_follows_a_program_that_stops_and_replay_takes_its_threads(
    tiny_data, tiny_config, tmp_path, monkeypatch
):
    """With train.follow_load, a program busy on one of two cores when the run starts, gone after step 3: the run goes from one
    torch thread to two instead of training at half speed to its end; each step's record says which it
    ran on, and replay runs each step on that count, so the steps still reproduce bit for bit."""
    import tenx.train.trainer as trainer_module
    from tenx.monitor.events import read_events
    from tenx.train.callbacks.record import read_steps
    from tenx.train.hooks import Callback
    from tenx.train.run import train
    from tenx.triage.replay import replay

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    _contention(monkeypatch, 2, 1.0)
    monkeypatch.setattr(trainer_module, "THREADS_RECHECK_S", 0.0)
    steps_done = []
    monkeypatch.setattr(trainer_module, "choose_threads", lambda quiet=False: 1 if len(steps_done) < 3 else 2)

    class Count(Callback):
        name = "count"

        def on_step_end(self, trainer, metrics) -> None:
            steps_done.append(trainer.step)

    run = tmp_path / "run"
    cfg = tiny_config(
        tiny_data, "train.steps=6", "checkpoint.every=0", "train.eval_every=0", "train.follow_load=true"
    )
    try:
        train(cfg, run, extra_callbacks=[Count()])
    finally:
        torch.set_num_threads(1)
    assert [r["threads"] for r in read_steps(run / "steps.jsonl")] == [1, 1, 1, 2, 2, 2]
    changed = [e for e in read_events(run) if e["kind"] == "threads-changed"]
    assert [(e["step"], e["before"], e["threads"]) for e in changed] == [(3, 1, 2)]
    torch.set_num_threads(2)
    try:
        assert replay(run, 3, repeat=1).verdict == "reproduces"
        assert replay(run, 5, repeat=1).verdict == "reproduces"
    finally:
        torch.set_num_threads(1)


def _auto(monkeypatch, threads: int) -> None:
    """Auto threads that choose `threads` (the load of this moment), and torch set to it as a run's start."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "choose_threads", lambda requested=None, *a, **k: requested or threads)


def test_a_resume_under_another_load_keeps_the_runs_thread_count_and_matches_bit_for_bit(
    tiny_data, tiny_config, tmp_path, monkeypatch, capsys, crash_at
):
    """The uninterrupted run chose 2 threads; it crashes after step 7 and resumes (checkpoint at 5) while
    another program keeps a core busy, so this moment's load says 1: the resume takes the checkpoint's 2,
    says so, and steps 6-10 equal the uninterrupted run's bit for bit."""
    from tenx.monitor.events import read_events
    from tenx.monitor.metrics_file import read_metrics
    from tenx.train.run import train

    overrides = ("train.steps=10", "checkpoint.every=5", "train.eval_every=0", "train.precision=fp32")
    try:
        _auto(monkeypatch, 2)
        train(tiny_config(tiny_data, *overrides), tmp_path / "straight")
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(tiny_config(tiny_data, *overrides), tmp_path / "crashed", extra_callbacks=[crash_at(7)])
        _auto(monkeypatch, 1)  # a busier machine now
        trainer, _ = train(tiny_config(tiny_data, *overrides), tmp_path / "crashed", resume="auto")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert trainer.resumed_from is not None and trainer.resumed_from.name == "step_00000005"
    a = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    b = read_metrics(tmp_path / "crashed" / "metrics.jsonl")
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]
    restored = [e for e in read_events(tmp_path / "crashed") if e["kind"] == "threads-restored"]
    assert [(e["saved"], e["chosen"]) for e in restored] == [(2, 1)]
    assert "resuming on the 2 torch threads the run used" in capsys.readouterr().err


def test_a_count_given_on_resume_wins_and_the_difference_is_said(
    tiny_data, tiny_config, tmp_path, monkeypatch, capsys, crash_at
):
    from tenx.monitor.events import read_events
    from tenx.train.run import train

    overrides = ("train.steps=6", "checkpoint.every=3", "train.eval_every=0", "train.precision=fp32")
    try:
        _auto(monkeypatch, 2)
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(tiny_config(tiny_data, *overrides), tmp_path / "run", extra_callbacks=[crash_at(4)])
        train(tiny_config(tiny_data, *overrides, "train.threads=1"), tmp_path / "run", resume="auto")
        assert torch.get_num_threads() == 1
        _auto(monkeypatch, 2)
        train(tiny_config(tiny_data, *overrides), tmp_path / "straight")
    finally:
        torch.set_num_threads(1)
    # what the restored count prevents: one thread where the run used two is another computation
    from tenx.monitor.metrics_file import read_metrics

    a = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    b = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["loss"], r["grad_norm"]) for r in a] != [(r["loss"], r["grad_norm"]) for r in b]
    differ = [e for e in read_events(tmp_path / "run") if e["kind"] == "threads-differ"]
    assert [(e["saved"], e["threads"]) for e in differ] == [(2, 1)]
    assert "no longer bit for bit" in capsys.readouterr().err
