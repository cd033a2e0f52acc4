"""Scaling ladders: planning rules, idempotent runs with crash resume, results table, launch scripts."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess

import pytest

from tenx.cli import main
from tenx.errors import ConfigError
from tenx.scaling.ladder import (
    LadderConfig,
    config_key,
    parse_budgets,
    plan_ladder,
    read_results,
    run_ladder,
    run_one,
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


def test_ladder_runs_once_resumes_a_crash_and_records_every_field(tiny_config, tiny_data, tmp_path):
    base = _base(tiny_config, tiny_data, "checkpoint.async_save=false")
    lc = LadderConfig(
        budgets=[2e10, 5e10],
        grid="isoflop",
        sizes=2,
        min_tokens_per_param=0,
        noise_seeds=1,
        min_steps=20,
        eval_bytes=30000,
    )
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
