"""`tenx plan failures`: Llama 3 rates, closed forms against the discrete-event simulation, the ledger case."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from tenx.checkpoint.interval import expected_goodput, young_daly_interval_s
from tenx.cli import build_parser
from tenx.errors import ConfigError
from tenx.monitor.goodput import Ledger, compute_goodput
from tenx.plan import failsim, failure_rates
from tenx.plan.cli import cmd_failures

DRILL = Path(__file__).resolve().parents[1] / "runs" / "chaos_drill" / "drill.json"
"""The chaos drill this checkout last ran (`python bench/chaos_drill.py` writes it), if any."""
RECORDED_DRILL = Path(__file__).parent / "fixtures" / "chaos_drill.json"
"""A real chaos drill, recorded (2 CPU cores; 5 SIGKILLs, a corrupt checkpoint; bitwise-identical model):
`python bench/chaos_drill.py --steps 100 --every 10 --p 0.05 --seed 2 --out OUT`, then OUT/drill.json."""


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["plan", "failures", *argv])


def test_rates_sum_to_llama3_unexpected_interruptions():
    rates = failsim.component_rates_per_gpu_s()
    assert len(rates) == 18 and sum(failure_rates.LLAMA3_UNEXPECTED.values()) == 419
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
        failsim.simulate_groups(1, m, tau + 60.0, tau, 600.0, detect, 30, np.random.default_rng(r))
        for r in range(6)
    ]
    assert abs(np.mean(sims) - closed) < 0.02
    assert 0.3 < closed < 0.95  # a regime where failures matter


def test_first_order_goodput_matches_simulation_where_mtbf_is_long():
    m = failsim.job_mtbf_s(1e4)
    tau = young_daly_interval_s(60.0, m)
    sims = [
        failsim.simulate_groups(1, m, tau + 60.0, tau, 600.0, 0.0, 30, np.random.default_rng(r))
        for r in range(6)
    ]
    assert abs(np.mean(sims) - expected_goodput(tau, 60.0, m, 600.0)) < 0.02


def test_semi_sync_closed_form_matches_simulation():
    m = failsim.job_mtbf_s(1e6)
    closed = failsim.semi_sync_goodput(8, m, 600.0, 600.0, 60.0)
    sims = [
        failsim.simulate_groups(8, m, 600.0, 600.0, 600.0, 60.0, 10, np.random.default_rng(r))
        for r in range(4)
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
                failsim.simulate_groups(
                    1, m, young * f + 60.0, young * f, 600.0, 0.0, 30, np.random.default_rng(r)
                )
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
    with pytest.raises(SystemExit):  # argparse: "argument --groups: must be an integer >= 1"
        parse(["--groups", "many", "--no-sim"])


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


@pytest.mark.parametrize("drill", [RECORDED_DRILL, DRILL], ids=["recorded", "local"])
def test_ledger_case_predicts_the_chaos_drill(drill):
    """The recorded drill always runs (the fixture is committed); this checkout's own only once made."""
    if drill == DRILL and not DRILL.exists():
        pytest.skip("no local chaos drill (python bench/chaos_drill.py writes runs/chaos_drill/drill.json)")
    summary = json.loads(drill.read_text())
    assert summary["identical"] and summary["kills"] >= 5 and summary["ledger"]["finished"]
    pred = failsim.ledger_case_from_drill(drill)
    assert pred["measured"] == summary["goodput"] and 0 < pred["measured"] < 1
    assert pred["kills_expected"] == pytest.approx(summary["steps"] * summary["p"])
    assert abs(pred["goodput"] - pred["measured"]) < 0.05


def cluster_file(path: Path, failures: str) -> Path:
    """A one-node cluster file with the given [failures] table."""
    path.write_text(f'name = "test"\n[node]\naccelerators = 8\n[cluster]\nnodes = 2\n{failures}')
    return path


def test_failures_take_the_clusters_rates(tmp_path, capsys):
    """`tenx plan failures` used hard-coded rates whatever the cluster; now the cluster file's [failures]."""
    doubled = cluster_file(
        tmp_path / "doubled.toml",
        '[failures]\nsource = "our fleet"\ngpu_days = 442368\n'
        'components = [{ name = "GPU", count = 300 }, { name = "network", count = 119 }]\n',
    )
    default_json, doubled_json = tmp_path / "default.json", tmp_path / "doubled.json"
    base = ["--gpus", "1e4,1e5", "--no-sim", "--json"]
    cmd_failures(parse([*base, str(default_json)]))
    cmd_failures(parse([*base, str(doubled_json), "--cluster", str(doubled)]))
    out = capsys.readouterr().out
    assert "rates (cluster test): our fleet: 419 interruptions / 442,368 GPU-days" in out
    assert "cluster test: 16 accelerators, one interruption every" in out
    default, twice = json.loads(default_json.read_text()), json.loads(doubled_json.read_text())
    for d, t in zip(default, twice):  # the same 419 interruptions in half the exposure: twice the rate
        assert t["mtbf_s"] == pytest.approx(d["mtbf_s"] / 2) and t["goodput_sync"] < d["goodput_sync"]


def test_shipped_clusters_carry_llama3_rates_by_default():
    from tenx.plan.estimate import load_cluster

    explicit = load_cluster("gpu-16384").failures  # written out in the file, as measured at its scale
    assert explicit == failure_rates.FailureRates() and len(explicit.components) == 18
    assert sum(c.count for c in explicit.components) == 419 and explicit.gpu_days == 16384 * 54
    for name in ("cpu", "h100-node", "gpu-1024"):
        assert load_cluster(name).failures == explicit  # no [failures]: the documented default
    assert failsim.job_mtbf_s(16384, explicit) == pytest.approx(failsim.job_mtbf_s(16384))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            '[failures]\ncomponents = [{ name = "GPU", count = -1 }]',
            r"failures.components\[0\].count: must be >= 0",
        ),
        (
            '[failures]\ncomponents = [{ name = "GPU", count = nan }]',
            r"failures.components\[0\].count: must be a finite",
        ),
        (
            '[failures]\ncomponents = [{ name = "GPU", count = "many" }]',
            r"failures.components\[0\].count: expected",
        ),
        ('[failures]\ncomponents = [{ name = "GPU" }]', r"failures.components\[0\].count: missing"),
        ("[failures]\ncomponents = [{ count = 3 }]", r"failures.components\[0\].name: must name"),
        (
            '[failures]\ncomponents = [{ name = "GPU", count = 1 }, { name = "GPU", count = 2 }]',
            r"failures.components\[1\].name: 'GPU' is listed twice",
        ),
        (
            '[failures]\ncomponents = [{ name = "GPU", count = 0 }]',
            "failures.components: their counts sum to 0",
        ),
        ("[failures]\ncomponents = []", "failures.components: their counts sum to 0"),
        ("[failures]\ngpu_days = 0", "failures.gpu_days: must be > 0"),
        (
            '[failures]\ncomponents = [{ name = "GPU", rate = 1 }]',
            r"unknown key 'failures.components\[0\].rate'",
        ),
    ],
)
def test_a_bad_rate_in_a_cluster_file_is_named_with_the_file_and_field(tmp_path, table, message):
    from tenx.plan.estimate import load_cluster

    path = cluster_file(tmp_path / "bad.toml", table + "\n")
    with pytest.raises(ConfigError, match=f"{path}: {message}"):
        load_cluster(str(path))
    with pytest.raises(ConfigError, match=message):  # the command too, before any work
        cmd_failures(parse(["--cluster", str(path), "--no-sim"]))
