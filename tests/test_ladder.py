"""Scaling ladders: planning rules, idempotent runs with crash resume, results table, launch scripts."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
from types import SimpleNamespace

import pytest

from tenx.cli import build_parser, main
from tenx.data.manifest import read_manifest
from tenx.errors import ConfigError
from tenx.monitor.goodput import compute_goodput
from tenx.scaling.ladder import runner as ladder_mod
from tenx.scaling.ladder.cost import RUN_OVERHEAD_S
from tenx.scaling.ladder.runner import (
    LadderConfig,
    LadderProgress,
    config_key,
    estimate_seconds,
    parse_budgets,
    plan_ladder,
    read_results,
    run_ladder,
    run_one,
    steady_step_seconds,
)
from tenx.train.callbacks.faults import FaultConfig, InjectedFault


def _base(tiny_config, tiny_data, *overrides):
    return tiny_config(tiny_data, "train.micro_batch=8", "train.threads=1", *overrides)


def test_isoflop_plan_spends_each_budget_and_follows_the_size_rules(tiny_config, tiny_data):
    base = _base(tiny_config, tiny_data)
    # tiny budgets: the tokens-per-parameter range and the noise seeds are tests/test_ladder_design.py's
    lc = LadderConfig(
        budgets=[3e10, 1e11],
        grid="isoflop",
        sizes=3,
        tokens_per_param=5.0,
        min_tokens_per_param=0,
        noise_seeds=1,
        min_steps=20,
    )
    plan = plan_ladder(base, lc)
    assert len(plan) == 6 and [r.budget for r in plan] == [3e10] * 3 + [1e11] * 3
    for r in plan:
        # every run spends its budget (rounding to whole steps only)
        assert abs(r.flops / r.budget - 1) < 0.5 / r.steps + 0.02, r
        assert r.steps >= lc.min_steps // 2
        assert r.d_model == 64 * r.depth
        # lr rule: the base lr at the base width (tiny.toml's d_model 64), 1/sqrt(width) elsewhere
        assert r.lr == pytest.approx(1e-2 * (64 / r.d_model) ** 0.5, rel=1e-5)
        assert 1 <= r.warmup_steps <= max(1, int(0.25 * r.steps))
        assert r.config.model.depth == r.depth and r.config.model.d_model is None
        assert r.config.train.steps == r.steps and r.config.train.global_batch == r.global_batch
        assert r.tokens == r.steps * r.global_batch * r.seq_len
    # the three sizes of a budget are consecutive depths around the one nearest 5 tokens per parameter
    for budget in (3e10, 1e11):
        rungs = [r for r in plan if r.budget == budget]
        nearest = min(rungs, key=lambda r: abs(math.log(r.tokens_per_param / 5.0)))
        assert [r.depth for r in rungs] == sorted(r.depth for r in rungs)
        assert nearest.depth in [r.depth for r in rungs]
    # a bigger budget never picks a smaller centre
    ratio = plan_ladder(base, dataclasses.replace(lc, grid="ratio"))
    assert len(ratio) == 2 and ratio[0].depth <= ratio[1].depth


def test_batch_is_halved_for_short_runs(tiny_config, tiny_data):
    base = _base(tiny_config, tiny_data, "train.global_batch=64")
    small, big = plan_ladder(
        base, LadderConfig(budgets=[2e10, 1e12], grid="ratio", min_steps=100, max_depth=1)
    )
    assert big.global_batch == 64 and big.steps >= 100
    assert small.global_batch < 64 and small.steps >= 100 and small.global_batch * 2 * 100 * 64 > small.tokens


def test_bad_budgets_are_clear_errors(tiny_config, tiny_data):
    with pytest.raises(ConfigError, match="--budgets: 'x' is not a number"):
        parse_budgets("1e13,x")
    with pytest.raises(ConfigError, match="--budgets: '-1' must be a positive"):
        parse_budgets("-1")
    assert parse_budgets("1e12, 3e12") == [1e12, 3e12]
    with pytest.raises(
        ConfigError, match=r"1e\+06 FLOPs buys depth 1 only .*ladder.min_tokens_per_param 1\)"
    ):
        plan_ladder(_base(tiny_config, tiny_data), LadderConfig(budgets=[1e6]))
    with pytest.raises(ConfigError, match=r"1e\+06 FLOPs buys depth 1 only 2 tokens \(< 50 steps"):
        plan_ladder(_base(tiny_config, tiny_data), LadderConfig(budgets=[1e6], grid="ratio"))
    with pytest.raises(ConfigError, match="ladder.max_depth"):
        LadderConfig(min_depth=3, max_depth=2).validate()


def test_ladder_runs_once_resumes_a_crash_and_records_every_field(
    tiny_config, tiny_data, tmp_path, small_ladder
):
    base = _base(tiny_config, tiny_data, "checkpoint.async_save=false")
    lc = small_ladder(eval_bytes=30000)
    rows = run_ladder(base, lc, tmp_path / "lad")
    assert len(rows) == 4
    table = read_results(tmp_path / "lad")
    assert [r["name"] for r in table] == [r["name"] for r in rows]
    for r in table:
        assert r["heldout_loss"] < 5.0 and r["val_loss"] < 5.0 and r["heldout_bpb"] > 0
        assert r["eval_bytes"]["heldout"] >= 30000 or r["eval_bytes"]["heldout"] > 0
        assert r["epochs"] == pytest.approx(r["tokens"] / r["unique_tokens"])
        for key in ("params", "non_embedding_params", "tokens", "flops", "wall_s", "config", "val_bpb"):
            assert key in r
        assert (tmp_path / "lad" / "runs" / r["name"] / "loss_curve.png").stat().st_size > 0
    # each run's ledger start-up is its own, not every earlier run's of this process (goodput per run)
    for r in table:
        ledger = compute_goodput(r["run_dir"])
        assert 0 < ledger["startup_s"] < r["train_s"] and ledger["wall_s"] < r["train_s"] + 1.0
    # bigger model at the same budget: a different loss; a bigger budget for the same depth: lower loss
    by = {(r["budget"], r["depth"]): r["heldout_loss"] for r in table}
    assert by[(5e10, 1)] < by[(2e10, 1)]

    # rerunning trains nothing
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "lad" / "runs").rglob("metrics.jsonl")}
    again = run_ladder(base, lc, tmp_path / "lad")
    assert all(r.get("reused") for r in again)
    assert stamp == {p: p.stat().st_mtime_ns for p in (tmp_path / "lad" / "runs").rglob("metrics.jsonl")}

    # a run that crashes mid-way resumes from its checkpoint and ends where an uninterrupted one does
    run = plan_ladder(base, dataclasses.replace(lc, budgets=[5e10], sizes=1))[0]
    crashing = dataclasses.replace(
        run,
        config=dataclasses.replace(run.config, faults=FaultConfig(inject=[f"crash@step={run.steps - 3}"])),
    )
    assert config_key(crashing.config) == config_key(run.config)  # faults do not change the run's identity
    with pytest.raises(InjectedFault):
        run_one(crashing, tmp_path / "crash", lc)
    resumed = run_one(run, tmp_path / "crash", lc)
    assert resumed["heldout_loss"] == pytest.approx(by[(5e10, run.depth)], rel=1e-6)


def test_unique_tokens_cap_repeats_data(tiny_config, tiny_data, tmp_path):
    base = _base(tiny_config, tiny_data)
    lc = LadderConfig(
        budgets=[5e10], grid="ratio", max_depth=1, unique_tokens=20000, min_steps=20, eval_bytes=10000
    )
    (row,) = run_ladder(base, lc, tmp_path / "lad")
    assert row["unique_tokens"] == 20000 and row["epochs"] > 2
    assert row["config"]["data"]["max_unique_tokens"] == 20000


def test_cli_dry_run_prints_the_plan_with_estimated_time(tiny_data, tmp_path, capsys):
    # depth 2 of tiny.toml trains 1 token per parameter from 1.25e12 FLOPs
    args = ["ladder", "--config", "tiny", "--set", f'data.dir="{tiny_data}"', "--budgets", "1.3e12,3e12"]
    assert main([*args, "--sizes", "2", "--out", str(tmp_path / "lad"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "base-C1.30e12-d2-s2" in out and "base-C3.00e12-d2 " in out and "on this machine" in out
    assert "C=1.30e12  d1-2   D/N 37.3/1.04" in out and out.count("brackets it") == 2
    assert not (tmp_path / "lad").exists()
    assert main([*args, "--budgets", "1", "--out", str(tmp_path / "x")]) == 2
    assert "ladder.budgets" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_emitted_torchrun_script_trains_and_collects(tiny_data, tmp_path):
    lad = tmp_path / "lad"
    args = ["ladder", "--config", "tiny", "--set", f'data.dir="{tiny_data}"', "--set", "log.progress=false"]
    args += ["--budgets", "3e10", "--grid", "ratio", "--max-depth", "1", "--eval-bytes", "10000"]
    assert main([*args, "--out", str(lad), "--emit", "torchrun", "--nproc", "2"]) == 0
    script = (lad / "launch" / "torchrun.sh").read_text()
    assert script.count("torchrun --standalone") == 1 and "--emit" not in script
    assert script.rstrip().splitlines()[-1].startswith("tenx ladder ")
    env = {**os.environ, "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", str(lad / "launch" / "torchrun.sh")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = read_results(lad)
    assert (
        row["resumed_or_reused_training"] is True
    )  # trained by torchrun, only evaluated by the collect step
    meta = json.loads((lad / "runs" / row["name"] / "run.json").read_text())
    assert meta["data_parallel"] == 2


def test_ladder_data_goes_to_the_cache_and_a_dry_run_prepares_nothing(
    corpus_dir, tmp_path, monkeypatch, capsys
):
    """Unprepared data.dir: a dry run says what it would prepare and where; a real run prepares the source
    once into $TENX_CACHE_DIR (never relative to the working directory) and later ladders reuse it."""
    cache, work = tmp_path / "cache", tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TENX_CACHE_DIR", str(cache))
    args = ["ladder", "--config", "tiny", "--set", 'data.dir="runs/data/none"', "--set", "log.progress=false"]
    args += ["--prepare-source", str(corpus_dir), "--budgets", "2e10", "--grid", "ratio", "--max-depth", "1"]
    args += ["--eval-bytes", "10000"]
    assert main([*args, "--out", str(tmp_path / "lad"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "a real run would prepare" in out and str(cache / "data") in out and "prepared nothing" in out
    assert "base-C2.00e10-d1" in out
    assert not cache.exists() and list(work.iterdir()) == [] and not (tmp_path / "lad").exists()

    assert main([*args, "--out", str(tmp_path / "lad")]) == 0
    assert "preparing" in capsys.readouterr().out
    (prepared,) = (cache / "data").iterdir()
    assert (prepared / "manifest.json").exists() and list(work.iterdir()) == []
    assert main([*args, "--out", str(tmp_path / "lad2"), "--dry-run"]) == 0
    assert f"prepared in {prepared}" in capsys.readouterr().out


def test_a_ladder_run_says_how_far_it_is_while_it_trains(capsys):
    """A line at the first step and then every `every_s` seconds: step, loss, time so far and left (the
    ladder printed one line per finished run, and a 201-s run was silent)."""
    now = [100.0]
    progress = LadderProgress("[2/6] base-C1e11-d2", every_s=30.0, clock=lambda: now[0])
    trainer = SimpleNamespace(step=0, total_steps=100)
    progress.on_train_start(trainer)
    for step in range(1, 101):
        now[0] += 1.0  # a second a step
        trainer.step = step
        progress.on_step_end(trainer, {"loss": 5.0 - step / 100})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "  [2/6] base-C1e11-d2: step 1/100 | loss 4.9900 | 1 s so far, 99 s left"
    assert lines[1] == "  [2/6] base-C1e11-d2: step 31/100 | loss 4.6900 | 31 s so far, 69 s left"
    assert [line.split("|")[0].split()[-1] for line in lines] == ["1/100", "31/100", "61/100", "91/100"]


def test_the_ladder_estimate_adds_up_from_step_times_and_overheads(tiny_config, tiny_data, small_ladder):
    base = _base(tiny_config, tiny_data)
    lc = small_ladder(eval_bytes=30000)
    plan = plan_ladder(base, lc)
    asked = []

    def speed(cfg, micro_batch):
        asked.append((cfg.model.depth, micro_batch))
        return 1000.0 * cfg.model.depth

    seconds = estimate_seconds(plan, lc, tokens_per_s=speed)
    assert sorted(asked) == sorted({(r.depth, r.config.train.micro_batch) for r in plan})  # once per shape
    split = read_manifest(tiny_data)["splits"]["train"]
    bytes_per_token = split["bytes"] / split["tokens"]  # the byte tokenizer: 1 but for document ends
    for r in plan:
        tc = r.config.train
        validation = -(-tc.steps // tc.eval_every) * tc.eval_batches * tc.micro_batch * r.seq_len
        final = 2 * 30000 / bytes_per_token
        rate = 1000.0 * r.depth
        expected = r.tokens / rate + (validation + final) / (3 * rate) + RUN_OVERHEAD_S
        assert seconds[r.name] == pytest.approx(expected, rel=1e-9)


def test_the_timing_probe_takes_the_median_step_on_the_training_threads(tiny_config, tiny_data, monkeypatch):
    """A step or two slowed by another program (or a slow first step) does not set the estimate, and the
    probe runs on train.threads, the threads its training will use; it says what it measured."""
    assert steady_step_seconds([0.1, 0.1, 2.5, 0.1, 0.11]) == pytest.approx(0.1)  # the mean was 0.58
    import torch

    before = torch.get_num_threads()
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: set_to.append(n))
    said = []
    cfg = _base(tiny_config, tiny_data)
    rate = ladder_mod.measure_tokens_per_s(cfg, 8, steps=3, min_seconds=0.0, progress=said.append)
    assert rate > 0 and set_to == [1] and before == torch.get_num_threads()
    assert (
        said and said[0].startswith("  timed depth 2 (8 x 64 tokens a step): ") and "(median of 3)" in said[0]
    )


def test_a_stopped_ladder_names_the_command_that_continues_it(tiny_data, tmp_path, monkeypatch, capsys):
    """SIGTERM during a ladder run: the message names the ladder's own command (not `--resume auto`, which
    `tenx ladder` does not take); that command parses and resumes the run."""
    lad = tmp_path / "lad"
    args = ["ladder", "--config", "tiny", "--set", f'data.dir="{tiny_data}"', "--set", "train.threads=1"]
    args += ["--budgets", "3e10", "--grid", "ratio", "--max-depth", "1", "--eval-bytes", "10000"]
    args += ["--out", str(lad)]

    def stop_at_step_5(self, trainer, metrics):
        if trainer.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as patch:
        patch.setattr(LadderProgress, "on_step_end", stop_at_step_5)
        assert main(args) == 130
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if "SIGTERM at step 5" in x]
    assert "--resume" not in line
    command = shlex.split(line.split("): ", 1)[1])
    assert command[0] == "tenx" and command[1:] == args
    parsed = build_parser().parse_args(command[1:])
    assert parsed.command == "ladder" and parsed.out == str(lad)
    assert main(command[1:]) == 0
    assert "resumed from" in capsys.readouterr().out
    (row,) = read_results(lad)
    assert row["resumed_or_reused_training"] is False and row["steps"] > 5
