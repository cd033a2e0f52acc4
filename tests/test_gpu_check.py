"""bench/gpu_check.py on a CPU: every command passes at tiny sizes, and its throughput and plan figures are
finite positive numbers; its error lines are the one line that says what went wrong."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.py"
COMMANDS = {
    "prepare",
    "train",
    "resume",
    "supervise-sigkill",
    "eval",
    "sample",
    "replay",
    "triage",
    "bisect",
    "compress",
    "export",
    "export-load",
    "plan-measure",
    "ladder",
    "derisk",
    "stats",
    "dashboard",
    "ddp",
    "fsdp",
}
MAY_SKIP = {"ddp", "fsdp", "export-load"}  # on one GPU, or without transformers: "skipped: REASON"


@pytest.fixture(scope="module")
def gpu_check(load_bench):
    return load_bench("gpu_check")


@pytest.mark.timeout(600)
def test_the_cpu_matrix_passes_and_reports_positive_figures(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert {"device", "commands", "throughput", "plan"} <= summary.keys()
    assert summary["device"]
    assert set(summary["commands"]) == COMMANDS
    bad = {
        name: entry
        for name, entry in summary["commands"].items()
        if entry != "pass" and not (name in MAY_SKIP and entry.startswith("skipped: "))
    }
    assert not bad, f"{bad}\n{done.stdout[-3000:]}"
    assert done.returncode == 0, done.stderr[-3000:]
    counts = summary["counts"]  # a skip is counted as a skip, never as a pass
    skips = sum(e.startswith("skipped") for e in summary["commands"].values())
    assert counts == {"passed": len(COMMANDS) - skips, "skipped": skips, "failed": 0, "dropped": 0}
    said = f"{counts['passed']} passed, {skips} skipped, 0 failed of {len(COMMANDS)} commands"
    assert said in done.stdout
    for shape in ("gpt2-d12", "llama-1b"):
        figures = summary["throughput"][shape]
        values = [figures["ratio"], figures["memory_ratio"]]
        values += [
            figures[who][k] for who in ("tenx", "reference") for k in ("tokens_per_s", "mfu", "peak_mib")
        ]
        values += [summary["plan"][shape]["step_time_ratio"], summary["plan"][shape]["memory_ratio"]]
        assert all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values), (
            shape,
            values,
        )
        assert math.isfinite(figures["tenx"]["final_loss"])
    fp8 = summary["throughput"]["llama-1b-fp8"]  # a CPU has no fp8 tensor cores: skipped, saying so
    assert "train.precision='fp8'" in fp8["skipped"] and "cpu" in fp8["skipped"], fp8
    assert not list(tmp_path.iterdir()), "the check wrote into the working directory"


def test_an_entry_is_the_line_that_says_what_went_wrong(gpu_check):
    tenx_error = (
        "Traceback ...\nValueError: inner\ntenx: error: runs/x does not exist; give a run directory\n"
    )
    assert (
        gpu_check.first_error(tenx_error, "", 2) == "tenx: error: runs/x does not exist; give a run directory"
    )
    torchrun = (
        "Traceback (most recent call last):\n  File x\nRuntimeError: rank 1 broke\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    assert gpu_check.first_error(torchrun, "", 1) == "RuntimeError: rank 1 broke"
    ranks = (
        "[rank0]: Traceback (most recent call last):\n[rank0]: NameError: name 'x' is not defined\n"
        + "=" * 60
    )
    assert gpu_check.first_error(ranks, "", 1) == "NameError: name 'x' is not defined"  # not the rule line
    assert gpu_check.first_error("", "last words\n", 3) == "last words"
    assert gpu_check.first_error("", "", -9) == "exit code -9"


def test_a_failed_need_is_named_and_a_skip_is_kept(gpu_check, tmp_path):
    import torch

    def fails(ctx):
        raise gpu_check.CheckFailed("tenx: error: broken")

    checks = [
        gpu_check.Check("a", fails),
        gpu_check.Check("b", lambda ctx: None, ("a",)),
        gpu_check.Check("c", lambda ctx: "skipped: needs 2 GPUs"),
        gpu_check.Check("d", lambda ctx: None, (), ("a",), slots=2),
    ]
    ctx = gpu_check.Context(tmp_path, torch.device("cpu"), 10.0)
    results = gpu_check.run_checks(ctx, checks, 2, 0.0)
    assert results == {
        "a": "tenx: error: broken",
        "b": "not run: a did not pass",
        "c": "skipped: needs 2 GPUs",
        "d": "pass",
    }


def test_counts_never_take_a_skip_for_a_pass(gpu_check):
    commands = {
        "train": "pass",
        "ddp": "skipped: needs 2 GPUs",  # a reason the machine gives
        "eval": "skipped: no data",  # a command that must run here: skipping it is a failure
        "ladder": "dropped: would not fit in --budget-s 300",
        "sample": "not run: train did not pass",
    }
    assert gpu_check.command_counts(commands) == {"passed": 1, "skipped": 1, "failed": 2, "dropped": 1}


def test_a_budget_drops_what_would_not_fit_names_it_and_each_entry_is_written_as_it_ends(gpu_check, tmp_path):
    import torch

    checks = [
        gpu_check.Check("fast", lambda ctx: None),
        gpu_check.Check("slow", lambda ctx: None),
        gpu_check.Check("after-slow", lambda ctx: None, ("slow",)),
    ]
    ctx = gpu_check.Context(tmp_path, torch.device("cpu"), 10.0)
    budget = gpu_check.Budget(60.0, {"slow": 600.0}, 1.0)
    results = gpu_check.run_checks(ctx, checks, 1, time_now(), budget=budget)
    assert results["fast"] == "pass"
    assert results["slow"].startswith("dropped: would not fit in --budget-s 60 (about 600 s")
    assert results["after-slow"] == "dropped: slow did not pass"
    assert gpu_check.command_counts(results) == {"passed": 1, "skipped": 0, "failed": 0, "dropped": 2}
    fragments = [json.loads(x) for x in (tmp_path / "fragments.jsonl").read_text().splitlines()]
    assert [f["name"] for f in fragments] == ["fast", "slow", "after-slow"]
    assert fragments[0]["entry"] == "pass" and "seconds" in fragments[0]
    # without a budget nothing is dropped
    ctx2 = gpu_check.Context(tmp_path / "b", torch.device("cpu"), 10.0)
    (tmp_path / "b").mkdir()
    unbounded = gpu_check.Budget(None, {"slow": 600.0}, 1.0)
    assert set(gpu_check.run_checks(ctx2, checks, 1, time_now(), budget=unbounded).values()) == {"pass"}


def time_now() -> float:
    import time

    return time.perf_counter()


def test_a_command_is_done_when_it_exits_and_its_leftovers_are_ended(gpu_check, tmp_path):
    """A descendant that outlives the command and holds its stdout (as a compile worker may) neither keeps
    the check waiting until the timeout nor survives it; a command that outlives the timeout fails by name."""
    import time

    import torch

    ctx = gpu_check.Context(tmp_path, torch.device("cpu"), 20.0, dict(os.environ))
    leaves = "import subprocess, sys; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True)"
    start = time.monotonic()
    done = ctx.process("leaves", [sys.executable, "-c", leaves])
    assert time.monotonic() - start < 10
    child = int(done.stdout.split()[0])
    for _ in range(100):  # SIGKILLed; reaped by init once it is gone
        if not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read().split()[2]:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the command's leftover process {child} is still running")
    assert done.returncode == 0 and (tmp_path / "logs" / "leaves.log").read_text().count(str(child)) == 1
    with pytest.raises(gpu_check.CheckFailed, match="slow: timed out after 1 s"):
        ctx.process("slow", [sys.executable, "-c", "import time; time.sleep(30)"], timeout=1.0)
