"""`tenx plan failures`: Llama 3 rates, closed forms against the discrete-event simulation, the ledger case."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tenx.checkpoint.interval import expected_goodput, young_daly_interval_s
from tenx.errors import TenxError
from tenx.monitor.goodput import Ledger, compute_goodput
from tenx.plan import failsim

DRILL = Path(__file__).resolve().parents[1] / "runs" / "chaos_drill" / "drill.json"


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    failsim.register(ap.add_subparsers())
    return ap.parse_args(["failures", *argv])


def test_rates_sum_to_llama3_unexpected_interruptions():
    rates = failsim.component_rates_per_gpu_s()
    assert len(rates) == 18 and sum(failsim.LLAMA3_UNEXPECTED.values()) == 419
    assert sum(rates.values()) == pytest.approx(419 / (16384 * 54 * 86400))
    assert rates["faulty GPU"] / rates["GPU HBM3 memory"] == pytest.approx(148 / 72)
    # 16,384 GPUs: one unexpected interruption every ~3.1 hours, as the paper reports
    assert failsim.job_mtbf_s(16384) / 3600 == pytest.approx(54 * 24 / 419)
    assert failsim.job_mtbf_s(1e5) == pytest.approx(failsim.job_mtbf_s(1e4) / 10)  # linear in GPUs


def test_intervals_agree_where_checkpoints_are_cheap():
    m = failsim.job_mtbf_s(1e4)
    exact = failsim.exact_interval_s(60.0, m)
    assert failsim.daly_interval_s(60.0, m) == pytest.approx(exact, rel=0.01)
    assert young_daly_interval_s(60.0, m) == pytest.approx(exact, rel=0.1)
    # the exact goodput is maximal there, whatever the restart and detection costs
    for restart, detect in ((0.0, 0.0), (600.0, 300.0)):
        best = failsim.sync_goodput_exact(exact, 60.0, m, restart, detect)
        assert best > failsim.sync_goodput_exact(exact * 1.2, 60.0, m, restart, detect)
        assert best > failsim.sync_goodput_exact(exact / 1.2, 60.0, m, restart, detect)
    slower = failsim.sync_goodput_exact(exact, 60.0, m, 600.0, 300.0)
    assert slower < failsim.sync_goodput_exact(exact, 60.0, m, 600.0, 0.0)


@pytest.mark.parametrize(("gpus", "detect"), [(1e5, 0.0), (3e4, 120.0)])
def test_sync_closed_form_matches_simulation_within_2_percent(gpus, detect):
    m = failsim.job_mtbf_s(gpus)
    tau = failsim.exact_interval_s(60.0, m)
    closed = failsim.sync_goodput_exact(tau, 60.0, m, 600.0, detect)
    sims = [
        failsim.simulate_sync(m, tau, 60.0, 600.0, detect, 30, np.random.default_rng(r)) for r in range(6)
    ]
    assert abs(np.mean(sims) - closed) < 0.02
    assert 0.3 < closed < 0.95  # a regime where failures matter


def test_first_order_goodput_matches_simulation_where_mtbf_is_long():
    m = failsim.job_mtbf_s(1e4)
    tau = young_daly_interval_s(60.0, m)
    sims = [failsim.simulate_sync(m, tau, 60.0, 600.0, 0.0, 30, np.random.default_rng(r)) for r in range(6)]
    assert abs(np.mean(sims) - expected_goodput(tau, 60.0, m, 600.0)) < 0.02


def test_semi_sync_closed_form_matches_simulation():
    m = failsim.job_mtbf_s(1e6)
    closed = failsim.semi_sync_goodput(8, m, 600.0, 600.0, 60.0)
    sims = [
        failsim.simulate_semi_sync(8, m, 600.0, 600.0, 60.0, 10, np.random.default_rng(r)) for r in range(4)
    ]
    assert abs(np.mean(sims) - closed) < 0.02
    assert 0.5 < closed < 0.95


def test_young_daly_optimum_is_the_argmin_of_simulated_lost_time():
    m = failsim.job_mtbf_s(1e5)
    young = young_daly_interval_s(60.0, m)
    factors = [0.25, 0.5, 1.0, 2.0, 4.0]
    lost = [
        1
        - np.mean(
            [
                failsim.simulate_sync(m, young * f, 60.0, 600.0, 0.0, 30, np.random.default_rng(r))
                for r in range(4)
            ]
        )
        for f in factors
    ]
    assert int(np.argmin(lost)) == factors.index(1.0)


def test_semi_sync_is_at_least_sync_and_the_answers():
    rows = failsim.failure_table([1e3, 1e4, 1e5, 1e6, 1e7], simulate=False)
    assert all(r.goodput_semi_sync >= r.goodput_sync for r in rows)
    assert rows[0].groups == 1  # 1,000 GPUs cannot hold two 1,024-GPU groups
    assert [r.groups for r in rows[1:]] == [9, 97, 976, 9765]
    half = failsim.sync_below_half_gpus(60.0, 600.0, 0.0)
    m = failsim.job_mtbf_s(half)
    at_half = failsim.sync_goodput_exact(failsim.exact_interval_s(60.0, m), 60.0, m, 600.0)
    assert at_half == pytest.approx(0.5, abs=1e-6) and 1e5 < half < 1e6
    for r in rows[1:]:
        k = r.groups_for_90
        assert failsim.semi_sync_goodput(k, r.mtbf_s, 600.0, 600.0) >= 0.9
        assert k == 2 or failsim.semi_sync_goodput(k - 1, r.mtbf_s, 600.0, 600.0) < 0.9


def test_cli_json_rows_have_the_keys(tmp_path, capsys):
    out = tmp_path / "failures.json"
    args = parse(["--gpus", "1e4,1e6", "--days", "2", "--replicas", "2", "--json", str(out)])
    args.func(args)
    rows = json.loads(out.read_text())
    keys = {"gpus", "mtbf_s", "checkpoint_interval_s", "goodput_sync", "goodput_semi_sync", "groups"}
    assert [r["gpus"] for r in rows] == [1e4, 1e6] and all(keys <= set(r) for r in rows)
    assert rows[1]["mtbf_s"] == pytest.approx(rows[0]["mtbf_s"] / 100)
    text = capsys.readouterr().out
    assert "falls below 50% at about" in text and "goodput_semi_sync" in text
    with pytest.raises(TenxError):
        failsim.cmd_failures(parse(["--groups", "many", "--no-sim"]))


def synthetic_drill(run_dir: Path, steps: int, p: float, every: int, rng: np.random.Generator) -> None:
    """A supervised run's ledger under `sigkill@p`: jittered ~0.1 s steps, 0.02 s saves, ~0.6 s restarts."""
    kills = {s for s in range(1, steps + 1) if rng.random() < p}
    supervisor = Ledger(run_dir, pid=1)
    t, attempt, step, saved = 0.0, 0, 0, 0
    supervisor.launch(0, at=t)
    trainer = Ledger(run_dir, pid=100)
    t += 2.0
    trainer.start(0, process_start=0.2, at=t)
    while step < steps:
        s = step + 1
        if s in kills:  # fires at the start of step s, once: the replay of s runs normally
            kills.discard(s)
            supervisor.exit(attempt, -9, "killed by SIGKILL", at=t)
            attempt += 1
            supervisor.launch(attempt, at=t)
            trainer.close()
            trainer = Ledger(run_dir, pid=100 + attempt)
            t += rng.uniform(0.4, 0.8)
            step = saved
            trainer.start(step, process_start=t - 0.3, at=t)
            continue
        seconds = rng.uniform(0.09, 0.11)
        t += seconds
        trainer.step(s, seconds, at=t)
        t += 0.005  # logging between steps: the ledger's other_s
        step = s
        if s % every == 0:
            t += 0.02
            trainer.checkpoint(s, 0.02, at=t)
            saved = s
    trainer.end(steps, at=t)
    supervisor.exit(attempt, 0, "finished", at=t)
    for ledger in (trainer, supervisor):
        ledger.close()


def test_ledger_case_predicts_a_synthetic_drill(tmp_path):
    steps, p, every = 300, 0.03, 10
    measured = []
    for r in range(3):
        run = tmp_path / f"run{r}"
        synthetic_drill(run, steps, p, every, np.random.default_rng(r))
        measured.append(compute_goodput(run)["goodput"])
    pred = failsim.simulate_ledger_case(
        0.1, p, every, 0.02, 0.6, steps, startup_s=2.0, other_s_per_step=0.005
    )
    assert abs(pred["goodput"] - np.mean(measured)) < 0.05
    assert pred["goodput"] == pytest.approx(pred["goodput_expected"], abs=0.01)
    assert pred["kills_expected"] == pytest.approx(9.0)
    none = failsim.simulate_ledger_case(0.1, 0.0, every, 0.02, 0.6, steps)
    assert none["goodput"] == pytest.approx(30 / (30 + 30 * 0.02))


@pytest.mark.skipif(not DRILL.exists(), reason="no local chaos drill (bench/chaos_drill.py)")
def test_ledger_case_predicts_the_local_chaos_drill():
    pred = failsim.ledger_case_from_drill(DRILL)
    assert math.isfinite(pred["measured"]) and abs(pred["goodput"] - pred["measured"]) < 0.05
