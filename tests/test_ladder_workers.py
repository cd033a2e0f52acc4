"""A ladder's runs trained `ladder.workers` at a time (tenx.scaling.ladder.runner.run_planned)."""

from __future__ import annotations

import dataclasses

import pytest

from tenx.cli import build_parser, main
from tenx.errors import ConfigError
from tenx.scaling.ladder.cost import workers_seconds
from tenx.scaling.ladder.runner import plan_ladder, read_results, run_ladder, slot_config


@pytest.fixture
def ladder(small_ladder):
    """`ladder(workers)`: the small ladder, no evaluation during a run, trained `workers` at a time."""
    return lambda workers: small_ladder(eval_bytes=20000, evals_per_run=0, workers=workers)


def test_two_workers_train_the_same_numbers_side_by_side(tiny_config, tiny_data, ladder, tmp_path):
    """Two at a time on one thread each: every row equals, bit for bit, the one-at-a-time run on one thread;
    the runs overlapped in time; this process wrote every row once."""
    base = tiny_config(tiny_data, "train.micro_batch=8", "checkpoint.async_save=false")
    one = run_ladder(
        dataclasses.replace(base, train=dataclasses.replace(base.train, threads=1)),
        ladder(1),
        tmp_path / "one",
    )
    two = run_ladder(
        dataclasses.replace(base, train=dataclasses.replace(base.train, threads=2)),
        ladder(2),
        tmp_path / "two",
    )
    assert [r["name"] for r in two] == [r["name"] for r in one] and len(two) == 4
    for a, b in zip(one, two, strict=True):
        assert a["key"] == b["key"]  # the thread count is not part of a run's identity
        assert b["config"]["train"]["threads"] == 1
        assert (a["heldout_loss"], a["val_loss"], a["train_loss"]) == (
            b["heldout_loss"],
            b["val_loss"],
            b["train_loss"],
        )
    spans = sorted((r["time"] - r["wall_s"], r["time"]) for r in two)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans
    assert sorted(r["name"] for r in read_results(tmp_path / "two")) == sorted(r["name"] for r in two)
    again = run_ladder(base, ladder(2), tmp_path / "two")  # nothing trains again
    assert all(r.get("reused") for r in again)


def test_a_slot_is_a_share_of_the_threads_or_a_gpu_of_its_own(tiny_config, tiny_data, ladder, monkeypatch):
    base = tiny_config(tiny_data, "train.micro_batch=8", "train.threads=4")
    run = plan_ladder(base, ladder(2))[0]
    assert slot_config(run, 1, 1) is run
    assert slot_config(run, 1, 2).config.train.threads == 2
    assert slot_config(run, 0, 8).config.train.threads == 1  # never below one
    auto = dataclasses.replace(
        run, config=dataclasses.replace(run.config, train=dataclasses.replace(run.config.train, threads=0))
    )
    assert slot_config(auto, 0, 2).config.train.threads >= 1
    cuda = dataclasses.replace(
        run,
        config=dataclasses.replace(run.config, train=dataclasses.replace(run.config.train, device="cuda")),
    )
    import torch

    import tenx.hardware

    # as on a machine with one GPU (the slot asks the device of train.device, 'auto' included)
    monkeypatch.setattr(tenx.hardware, "pick_device", lambda name, what: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ConfigError, match="ladder.workers=64 trains one run per GPU"):
            slot_config(cuda, 0, 64)


def test_workers_is_a_flag_of_ladder_and_derisk():
    parser = build_parser()
    assert parser.parse_args(["ladder", "--workers", "2", "--out", "x"]).workers == 2
    assert parser.parse_args(["derisk", "--workers", "3", "--out", "x"]).workers == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["derisk", "--workers", "0", "--out", "x"])


def test_the_dry_run_estimates_the_plan_as_the_workers_will_train_it(
    tiny_config, tiny_data, ladder, tmp_path, capsys
):
    """Each run timed on its worker's share of the threads; the plan's wall time is the schedule's, costliest
    first onto the first free worker (run_planned's order), not the sum of its runs."""
    plan = plan_ladder(tiny_config(tiny_data, "train.micro_batch=8"), ladder(2))
    seconds = {r.name: float(i + 1) for i, r in enumerate(sorted(plan, key=lambda r: -r.flops))}  # 1, 2, 3, 4
    assert workers_seconds(plan, seconds, 1) == 10.0
    assert workers_seconds(plan, seconds, 2) == 6.0  # 1 then 3 on one worker; 2 then 4 on the other: 4, 6
    seconds = {
        r.name: s for r, s in zip(sorted(plan, key=lambda r: -r.flops), (10.0, 6.0, 5.0, 1.0), strict=True)
    }
    assert workers_seconds(plan, seconds, 2) == 11.0  # 10 | 6 + 5, then 1 after the 10
    args = ["ladder", "--config", "tiny", "--set", f'data.dir="{tiny_data}"', "--set", "train.threads=2"]
    args += [
        "--budgets",
        "1.3e12,3e12",
        "--sizes",
        "2",
        "--workers",
        "2",
        "--out",
        str(tmp_path),
        "--dry-run",
    ]
    assert main(args) == 0
    tail = [line for line in capsys.readouterr().out.splitlines() if " FLOPs, about " in line]
    assert (
        tail
        and "on this machine, 2 runs at a time (" in tail[0]
        and " of runs; measured step times)" in tail[0]
    )


def test_a_sigterm_to_the_ladder_stops_its_workers_runs_with_a_checkpoint(tiny_data, tmp_path, capfd):
    """A scheduler's SIGTERM reaches the ladder's process alone: it is passed on to the workers, each run
    saves a checkpoint and stops (exit 130, the command that continues named), and that command resumes."""
    import os
    import signal
    import threading
    import time

    lad = tmp_path / "lad"
    args = ["ladder", "--config", "tiny", "--set", f'data.dir="{tiny_data}"', "--set", "train.threads=2"]
    args += ["--budgets", "3e11,4e11", "--grid", "ratio", "--max-depth", "1", "--eval-bytes", "10000"]
    args += ["--workers", "2", "--out", str(lad)]

    def stop_once_both_train() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if len(list(lad.glob("runs/*/steps.jsonl"))) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    before = signal.getsignal(signal.SIGTERM)
    stopper = threading.Thread(target=stop_once_both_train, daemon=True)
    stopper.start()
    assert main(args) == 130
    stopper.join()
    out = capfd.readouterr().out
    stopped = [line for line in out.splitlines() if "SIGTERM at step" in line]
    assert len(stopped) == 2 and all("saved checkpoint" in line for line in stopped), out[-2000:]
    assert not read_results(lad)  # nothing finished, nothing recorded
    assert signal.getsignal(signal.SIGTERM) == before  # the ladder's forwarding handler is gone again
    assert main(args) == 0
    assert "resumed from" in capfd.readouterr().out
    assert len(read_results(lad)) == 2
