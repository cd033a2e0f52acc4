"""Fault tolerance end to end: faults are injected on purpose and the run survives them, or stops clearly."""

from __future__ import annotations

import json
import math
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from tenx import checkpoint as ckpt
from tenx.checkpoint.interval import expected_goodput, young_daly_interval_s
from tenx.checkpoint.models import load_model
from tenx.cli import main
from tenx.errors import ConfigError, DataError
from tenx.launch.supervise import SupervisorConfig, describe_failure_point, supervise
from tenx.monitor.events import read_events
from tenx.monitor.goodput import compute_goodput, format_goodput
from tenx.monitor.metrics_file import read_metrics
from tenx.train.callbacks.faults import parse_fault
from tenx.train.run import train

# Child processes of the supervised tests: one thread each, so two never fight over the 2 cores.
TINY = ["--config", "tiny", "--set", "train.threads=1", "--set", "log.progress=false"]


@pytest.fixture(autouse=True)
def _restore_threads():
    """In-process runs here use train.threads=1; give the rest of the session its threads back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _train_args(data_dir, run_dir, *overrides: str) -> list[str]:
    """`tenx train` arguments of the tiny config on `data_dir` into `run_dir`, with `--set` overrides."""
    sets = [x for item in (f'data.dir="{data_dir}"', *overrides) for x in ("--set", item)]
    return ["train", *TINY, *sets, "--run-dir", str(run_dir)]


def _final_params(run_dir) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_model(run_dir, "cpu").model.state_dict().items()}


def _same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _kinds(run_dir) -> list[str]:
    return [e["kind"] for e in read_events(run_dir)]


@pytest.fixture(scope="module")
def clean_run(tiny_data, tmp_path_factory):
    """40 steps of the tiny config with checkpoints every 10, no faults: the reference result."""
    run = tmp_path_factory.mktemp("clean") / "run"
    threads = torch.get_num_threads()
    rc = main(
        [
            "train",
            *TINY,
            "--set",
            f'data.dir="{tiny_data}"',
            "--set",
            "checkpoint.every=10",
            "--run-dir",
            str(run),
        ]
    )
    torch.set_num_threads(threads)
    assert rc == 0
    return run


# ----- fault specs ----------------------------------------------------------------------------------
def test_fault_specs_parse_and_bad_ones_are_named():
    spec = parse_fault("spike@step=25,count=3,factor=50")
    assert (spec.kind, spec.step, spec.count, spec.factor) == ("spike", 25, 3, 50.0)
    assert [s for s in range(1, 40) if spec.fires_at(s, 0, 0)] == [25, 26, 27]
    assert parse_fault("sigkill@step=20,phase=save").phase == "save"
    assert math.isinf(parse_fault("hang@step=3").seconds)
    random_kills = parse_fault("sigkill@p=0.1")
    fired = [s for s in range(1, 1001) if random_kills.fires_at(s, 7, 0)]
    assert fired == [s for s in range(1, 1001) if random_kills.fires_at(s, 7, 0)]  # seeded
    assert 60 < len(fired) < 140
    assert fired != [s for s in range(1, 1001) if random_kills.fires_at(s, 8, 0)]
    for bad, message in [
        ("explode@step=3", "unknown fault kind 'explode'"),
        ("crash", "not a fault spec"),
        ("crash@step=3,p=0.1", "exactly one of"),
        ("crash@step=x", "step='x'"),
        ("crash@p=2", "within [0, 1]"),
        ("nan@step=3,phase=save", "only for sigkill"),
        ("slow@step=3,color=red", "unknown option 'color'"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_fault(bad)


def test_bad_fault_in_config_is_a_cli_error(tiny_data, tmp_path, capsys):
    rc = main(
        [
            "train",
            *TINY,
            "--set",
            f'data.dir="{tiny_data}"',
            "--fault",
            "boom@step=1",
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    assert rc == 2 and "faults.inject[0]" in capsys.readouterr().err


# ----- the guard ------------------------------------------------------------------------------------
def test_nan_step_is_skipped_and_the_run_completes(tiny_config, tiny_data, tmp_path):
    run = tmp_path / "run"
    trainer, last = train(tiny_config(tiny_data, "faults.inject=['nan@step=15']"), run)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 41))
    assert records[14]["skipped"] == "nonfinite-loss" and math.isnan(records[14]["loss"])
    assert all("skipped" not in r for i, r in enumerate(records) if i != 14)
    assert math.isfinite(last["loss"]) and last["loss"] < 3.6
    # the skipped step made no update: AdamW took 39 steps in a 40-step run
    state = trainer.optimizer.state[next(iter(trainer.model.parameters()))]
    assert int(state["step"]) == 39
    (event,) = [e for e in read_events(run) if e["kind"] == "skipped-step"]
    assert event["step"] == 15 and event["reason"] == "nonfinite-loss" and event["loss"] == "nan"
    assert len(event["data"]) == 8  # every sequence in flight: micro_batch 8
    assert all(d["shard"].startswith("train_") and d["offset"] >= 0 for d in event["data"])
    assert "rollback" not in _kinds(run)


def test_persistent_spike_rolls_back_and_skips_the_data(tiny_config, tiny_data, tmp_path):
    run = tmp_path / "run"
    overrides = ("checkpoint.every=10", "guard.min_history=10", "faults.inject=['spike@step=25,count=3']")
    trainer, last = train(tiny_config(tiny_data, *overrides), run)
    events = read_events(run)
    skipped = [e for e in events if e["kind"] == "skipped-step"]
    assert [(e["step"], e["reason"]) for e in skipped] == [
        (25, "loss-spike"),
        (26, "loss-spike"),
        (27, "loss-spike"),
    ]
    assert all(e["loss"] > e["threshold"] for e in skipped)
    (rollback,) = [e for e in events if e["kind"] == "rollback"]
    assert rollback["step"] == 27 and rollback["to_step"] == 20 and rollback["bad_steps"] == [25, 26, 27]
    # the windows of steps 25-27 (8 sequences each) are skipped, recorded beside the checkpoints...
    start, end = rollback["skipped_positions"]
    assert end - start == 3 * 8
    assert json.loads((run / "data_skips.json").read_text())["skips"] == [[start, end]]
    assert [start, end] in trainer.loader.state_dict()["skips"]
    # ...and the run still trains its 40 steps, logged once each
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all("skipped" not in r for r in records) and last["loss"] < 3.6
    assert compute_goodput(run)["rollbacks"] == 1


def test_spike_detection_ignores_a_healthy_run(tiny_config, tiny_data, tmp_path):
    train(tiny_config(tiny_data, "train.steps=60", "guard.min_history=10"), tmp_path / "run")
    assert "skipped-step" not in _kinds(tmp_path / "run")


# ----- checkpoints ----------------------------------------------------------------------------------
def test_sigkill_during_a_save_then_resume_matches_a_clean_run(tiny_data, tmp_path, clean_run):
    run = tmp_path / "run"
    args = [*TINY, "--set", f'data.dir="{tiny_data}"', "--set", "checkpoint.every=10", "--run-dir", str(run)]
    proc = subprocess.run(
        [sys.executable, "-m", "tenx", "train", *args, "--fault", "sigkill@step=20,phase=save"],
        capture_output=True,
        timeout=240,
    )
    assert proc.returncode == -signal.SIGKILL
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")] == [10]
    assert list((run / "checkpoints").glob(".step_00000020.tmp-*")), "the interrupted save left its temp dir"
    assert ckpt.latest_verified(run / "checkpoints")[0].name == "step_00000010"
    assert main(["train", *args, "--resume", "auto", "--fault", "sigkill@step=20,phase=save"]) == 0
    assert not list((run / "checkpoints").glob(".step_*"))  # leftovers cleaned by the next save
    assert _same_params(_final_params(run), _final_params(clean_run))


def test_supervised_run_survives_kills_and_a_corrupt_checkpoint(tiny_data, tmp_path, clean_run, capsys):
    """SIGKILL at 15, damage to checkpoint 20 at step 23, crash at 27: the final model equals the clean run's."""
    run = tmp_path / "run"
    faults = ["sigkill@step=15", "corrupt-checkpoint@step=23", "crash@step=27"]
    args = _train_args(tiny_data, run, "checkpoint.every=10")
    args += ["--set", f"faults.inject={json.dumps(faults)}"]
    report = supervise(args, run, SupervisorConfig(max_restarts=5, backoff_s=0.0))
    assert report.finished and report.restarts == 2
    assert [a.returncode for a in report.attempts] == [-signal.SIGKILL, 1, 0]
    assert [a.last_step for a in report.attempts] == [14, 26, 40]
    # each restart names the step its fault fired at, and the last step that finished
    restarts = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("tenx supervise: attempt")
    ]
    assert restarts == [
        "tenx supervise: attempt 0 killed by SIGKILL at step 15 (fault sigkill@step=15), after step 14 "
        "finished; restarting",
        "tenx supervise: attempt 1 crashed (exit 1) at step 27 (fault crash@step=27), after step 26 "
        "finished; restarting",
    ]
    # the third attempt skipped the damaged step 20 and resumed from step 10
    assert report.attempts[2].start_step == 10
    assert _same_params(_final_params(run), _final_params(clean_run))
    kinds = _kinds(run)
    assert kinds.count("fault") == 3 and kinds.count("restart") == 2
    goodput = compute_goodput(run)
    assert goodput["restarts"] == 2 and goodput["finished"] and 0 < goodput["goodput"] < 1
    assert goodput["recompute_s"] > 0


def test_failure_point_names_the_step_a_failure_happened_in():
    """The restart line's step comes from the attempt's last fatal event; without one, the last finished."""
    fault = {"kind": "fault", "step": 25, "fault": "sigkill@step=25", "fault_kind": "sigkill"}
    slow = {"kind": "fault", "step": 26, "fault": "slow@step=26", "fault_kind": "slow"}  # not fatal
    assert (
        describe_failure_point([fault, slow], 24)
        == "at step 25 (fault sigkill@step=25), after step 24 finished"
    )
    save = {"kind": "fault", "step": 20, "fault": "sigkill@step=20,phase=save", "fault_kind": "sigkill"}
    assert (
        describe_failure_point([save], 20)
        == "while saving step 20's checkpoint (fault sigkill@step=20,phase=save)"
    )
    crash = {"kind": "crash", "step": 8, "phase": "step", "exception": "ValueError"}
    assert describe_failure_point([crash], 7) == "at step 8 (ValueError), after step 7 finished"
    after = {**crash, "phase": "after-step"}
    assert describe_failure_point([after], 8) == "after step 8 finished (ValueError)"
    # an injected crash's exception and the watchdog's report of an injected hang defer to the fault
    injected = {"kind": "fault", "step": 27, "fault": "crash@step=27", "fault_kind": "crash"}
    raised = {"kind": "crash", "step": 26, "phase": "after-step", "exception": "InjectedFault"}
    assert describe_failure_point([injected, raised], 26) == (
        "at step 27 (fault crash@step=27), after step 26 finished"
    )
    stuck = {"kind": "fault", "step": 12, "fault": "hang@step=12", "fault_kind": "hang"}
    assert describe_failure_point([stuck, {"kind": "hang", "step": 12}], 11) == (
        "at step 12 (fault hang@step=12), after step 11 finished"
    )
    hang = {"kind": "hang", "step": 12}
    assert describe_failure_point([{"kind": "hang", "step": None}, hang], 11) == (
        "at step 12 (no progress), after step 11 finished"
    )
    assert describe_failure_point([], 24) == "after step 24 finished"  # e.g. a SIGKILL from outside
    assert describe_failure_point([], None) == "before its first step finished"
    first = {**fault, "step": 1, "fault": "sigkill@p=0.05"}
    assert describe_failure_point([first], 0) == "at step 1 (fault sigkill@p=0.05), before any step finished"


def test_young_daly_interval():
    assert young_daly_interval_s(2.0, 3600.0) == pytest.approx(120.0)
    assert young_daly_interval_s(0.0, 3600.0) == 0.0
    assert expected_goodput(120.0, 2.0, 3600.0, 30.0) == pytest.approx(1 - 2 / 120 - 90 / 3600)
    with pytest.raises(ValueError):
        young_daly_interval_s(1.0, 0.0)


def test_auto_checkpoint_interval_follows_young_daly(tiny_config, tiny_data, tmp_path):
    run = tmp_path / "run"
    train(
        tiny_config(tiny_data, "checkpoint.every='auto'", "checkpoint.mtbf_s=5.0", "checkpoint.keep_last=0"),
        run,
    )
    (plan, *_) = [e for e in read_events(run) if e["kind"] == "checkpoint-interval"]
    assert plan["step"] == 10 and plan["mtbf_source"] == "assumed" and plan["interval_steps"] >= 1
    # sqrt(2 * save cost * MTBF), floored at the background write time
    assert plan["interval_s"] >= math.sqrt(2 * plan["save_cost_s"] * 5.0) - 1e-3  # the event rounds to ms
    steps = [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")]
    assert steps[0] == 10 and steps[-1] == 40
    if 10 + plan["interval_steps"] < 40:
        assert steps[1] == 10 + plan["interval_steps"]


# ----- hangs, data, supervisor policy ----------------------------------------------------------------
def test_hang_is_detected_dumped_and_restarted(tiny_data, tmp_path):
    run = tmp_path / "run"
    args = _train_args(tiny_data, run, "train.steps=20")
    args += [
        "--set",
        "checkpoint.every=10",
        "--set",
        "watchdog.timeout_s=1.5",
        "--set",
        "faults.inject=['hang@step=12']",
    ]
    report = supervise(args, run, SupervisorConfig(max_restarts=2, backoff_s=0.0))
    assert report.finished and [a.returncode for a in report.attempts] == [3, 0]
    (dump,) = run.glob("hang-step12-pid*.txt")
    text = dump.read_text()
    assert "no step completed" in text and "faults.py" in text and "most recent call first" in text
    (hang,) = [e for e in read_events(run) if e["kind"] == "hang"]
    assert hang["step"] == 12 and hang["stacks"] == str(dump)


def test_corrupt_shard_skip_mode_trains_around_it(tiny_corpus_multishard, tiny_config, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_corpus_multishard, data)
    run = tmp_path / "run"
    overrides = (
        "data.on_corrupt_shard='skip'",
        "faults.inject=['corrupt-shard@step=5,shard=1']",
        "train.steps=30",
    )
    train(tiny_config(data, *overrides), run)
    bad = [e for e in read_events(run) if e["kind"] == "corrupt-shard"]
    assert len(bad) == 1 and bad[0]["shard"].endswith("train_00001.bin") and bad[0]["action"] == "skipped"
    assert len(read_metrics(run / "metrics.jsonl")) == 30


def test_corrupt_shard_stops_a_supervised_run_without_restarts(tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    run = tmp_path / "run"
    args = [
        "train",
        *TINY,
        "--set",
        f'data.dir="{data}"',
        "--run-dir",
        str(run),
        "--set",
        "faults.inject=['corrupt-shard@step=3']",
    ]
    report = supervise(args, run, SupervisorConfig(max_restarts=5, backoff_s=0.0))
    assert not report.finished and len(report.attempts) == 1 and report.attempts[0].returncode == 2
    assert "cannot fix" in (report.gave_up or "")
    assert [e["fault_kind"] for e in read_events(run) if e["kind"] == "fault"] == ["corrupt-shard"]


def test_corrupt_shard_error_names_the_shard_at_first_read(tiny_config, tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    with pytest.raises(DataError, match="train_00000.bin"):
        train(tiny_config(data, "faults.inject=['corrupt-shard@step=4']"), tmp_path / "run")
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 3


def test_supervisor_gives_up_on_a_repeating_failure(tmp_path):
    """A child that always fails the same way is restarted twice, then the supervisor stops."""
    script = "import sys; sys.exit(7)"
    launcher = shlex.join([sys.executable])
    report = supervise(
        ["-c", script], tmp_path, SupervisorConfig(launcher=launcher, backoff_s=0.0, same_failure_limit=3)
    )
    assert [a.returncode for a in report.attempts] == [7, 7, 7]
    assert not report.finished and "3 times in a row" in (report.gave_up or "")
    report = supervise(
        ["-c", "import sys; sys.exit(9)"],
        tmp_path,
        SupervisorConfig(launcher=launcher, backoff_s=0.0, max_restarts=1, same_failure_limit=9),
    )
    assert len(report.attempts) == 2 and "max-restarts 1" in (report.gave_up or "")


def test_status_command_reports_goodput(clean_run, capsys):
    assert main(["status", str(clean_run)]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out.lower() and "step_00000040" in out
    assert main(["status", str(clean_run / "nowhere")]) == 2


def test_memory_tier_resumes_from_the_last_step_and_falls_back_when_damaged(tiny_data, tmp_path, clean_run):
    """Snapshots every step to tmpfs: a kill loses ~1 step; a damaged snapshot falls back to the disk tier."""
    run = tmp_path / "run"
    memory = tmp_path / "shm"
    faults = ["sigkill@step=15", "corrupt-checkpoint@step=27", "sigkill@step=27"]
    args = _train_args(tiny_data, run, "checkpoint.every=10")
    args += ["--set", "checkpoint.memory_every=1", "--set", f'checkpoint.memory_dir="{memory}"']
    args += ["--set", f"faults.inject={json.dumps(faults)}"]
    report = supervise(args, run, SupervisorConfig(max_restarts=5, backoff_s=0.0))
    assert report.finished and [a.returncode for a in report.attempts] == [
        -signal.SIGKILL,
        -signal.SIGKILL,
        0,
    ]
    assert 10 < report.attempts[1].start_step <= 14  # the newest snapshot whose write had finished
    (damage,) = [e for e in read_events(run) if e.get("fault_kind") == "corrupt-checkpoint"]
    assert damage["damaged"].startswith(str(memory / "step_00000026"))
    assert report.attempts[2].start_step == 20  # the damaged snapshot was skipped: disk checkpoint 20
    assert _same_params(_final_params(run), _final_params(clean_run))
    assert not memory.exists()  # freed when training finished


def test_cli_supervise_with_a_launcher_and_status(tiny_data, tmp_path, capfd):
    """`tenx train --supervise --launcher ...` restarts the launched command; goodput is printed once, the
    whole run's (the children, launched through the launcher, leave it to the supervisor)."""
    run = tmp_path / "run"
    launcher = f"{sys.executable} -m tenx"
    args = _train_args(tiny_data, run, "train.steps=12")
    rc = main([*args, "--supervise", "--launcher", launcher, "--backoff", "0", "--fault", "crash@step=5"])
    out, err = capfd.readouterr()  # the children's output too (fd-level)
    assert (
        rc == 0
        and "crashed (exit 1)" in out
        and "finished after 1 restart" in out
        and "restart(s)" not in out
    )
    assert [line for line in out.splitlines() if line.startswith("goodput")] == [
        format_goodput(compute_goodput(run)).splitlines()[0]
    ]
    assert out.rstrip().endswith(format_goodput(compute_goodput(run)))  # `tenx status`'s figure, last
    assert "attempt 0 crashed (exit 1) at step 5 (fault crash@step=5), after step 4 finished" in err
    assert [e["kind"] for e in read_events(run)].count("restart") == 1
