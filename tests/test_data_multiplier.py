"""Effective data multipliers (`tenx derisk` mode 'data', tenx/scaling/derisk/data_multiplier.py) on synthetic losses
from a known data-constrained law, its plan and errors, and `tenx plan choose --unique-tokens`."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from tenx.cli import main
from tenx.errors import ConfigError
from tenx.scaling.derisk.compute_multiplier import ChangeConfig, DeriskConfig, load_derisk
from tenx.scaling.derisk.data_multiplier import (
    LAW_PARAMS,
    MIN_CAPPED_EPOCHS,
    analyse_data,
    baseline_seeds,
    data_needed,
    effective_data_multiplier,
    format_data_derisk,
    plan_data_derisk,
)
from tenx.scaling.fit import compute_optimal, data_limited_optimal, effective_data
from tenx.scaling.fit.laws import FitResult
from tenx.scaling.ladder.rungs import LadderConfig
from tenx.scaling.ladder.runner import config_key
from tenx.train.config import CONFIG_DIR

TRUE = {"E": 1.5, "A": 50.0, "B": 200.0, "alpha": 0.3, "beta": 0.3, "R_D_star": 5.0}
"""The known law the synthetic losses come from."""


def law(N, D, U):
    """L(N, D, U) of TRUE (Muennighoff et al.'s effective data)."""
    d_eff = effective_data(D, U, TRUE["R_D_star"])
    return TRUE["E"] + TRUE["A"] / np.asarray(N, float) ** TRUE["alpha"] + TRUE["B"] / d_eff ** TRUE["beta"]


def known_fit(samples=None):
    return FitResult(
        "data-constrained", "", dict(TRUE), {}, np.zeros((0, 6)) if samples is None else samples, 0, 0.0
    )


def test_the_multiplier_is_the_unique_tokens_the_law_needs_at_the_same_epochs():
    values = np.array([[TRUE[k] for k in LAW_PARAMS]])
    N, D, U = 2e6, 1e8, 1e7  # 10 epochs
    base = law(N, D, U)
    for m in (0.5, 1.0, 3.0):  # the loss of m x the unique tokens, repeated as often
        loss = law(N, m * D, m * U)
        assert effective_data_multiplier(values, N, loss, base)[0, 0] == pytest.approx(m, rel=1e-9)
    # the measured baseline anchors it: a law that misses the baseline's point (here by 2% of the loss,
    # both losses equally) still gives the factor between the two losses, not the law's offset
    for m in (0.5, 3.0):
        shift = 0.02 * base
        got = effective_data_multiplier(values, N, law(N, m * D, m * U) + shift, base + shift)[0, 0]
        assert got == pytest.approx(m, rel=0.1) and abs(got / m - 1) > 1e-6  # its slope only: near m
        crude = data_needed(values, N, law(N, m * D, m * U) + shift)[0, 0] / effective_data(
            D, U, TRUE["R_D_star"]
        )
        assert abs(crude / m - 1) > 3 * abs(got / m - 1)  # reading the law alone is further off
    # a run of D tokens over more unique ones reads D of them once: its effective data is D, not U
    assert effective_data(1e6, 1e9, 5.0) == pytest.approx(1e6)
    floor = TRUE["E"] + TRUE["A"] / N ** TRUE["alpha"]  # no data reaches the law's floor for this size
    assert effective_data_multiplier(values, N, floor, base)[0, 0] == math.inf
    assert math.isnan(effective_data_multiplier(values, N, base, floor)[0, 0])  # the baseline past it


SCALES = [(1e6, 4e7), (2.5e6, 1e8), (6e6, 2.4e8)]  # (N, D) of each scale: one model size per budget
UNIQUE = [10_000_000, 20_000_000]
GAINS = {  # true multiplier a * (C / C0) ** b of each change
    "same": (2.0, 0.0),
    "grow": (1.5, 0.3),
    "fade": (4.0, -0.2),
    "rev": (2.0, -0.5),
    "bad": (0.5, 0.0),
}


def synthetic_study(noise=1e-4, seeds=2):
    """Baseline rows like plan_data_derisk's (fresh, each U, each U read once) and each change's rows at
    U_c, all from TRUE; the change's loss is the baseline's at m x U_c unique tokens, same epochs."""
    rng = np.random.default_rng(1)
    budgets = [6 * n * d for n, d in SCALES]
    dc = DeriskConfig(
        budgets=budgets,
        change=[ChangeConfig(name=n, set=["optim.eps=1e-7"]) for n in GAINS],
        mode="data",
        unique_tokens=UNIQUE,
        bootstrap=60,
    )
    baseline, changes = [], {n: [] for n in GAINS}

    def row(budget, n, d, u, loss):
        return {"budget": budget, "params": n, "tokens": d, "unique_tokens": u, "heldout_loss": float(loss)}

    for budget, (n, d) in zip(budgets, SCALES):
        k = seeds if budget == budgets[0] else 1
        baseline.append(row(budget, n, d, 1e12, law(n, d, 1e12)))
        for u in UNIQUE:
            baseline.append(row(budget, n, u, 1e12, law(n, u, u)))
            for _ in range(k if u == dc.compare_u else 1):
                noisy = law(n, d, u) + (rng.normal(0, noise) if k > 1 else 0.0)
                baseline.append(row(budget, n, d, u, noisy))
        for name, (a, b) in GAINS.items():
            m = a * (budget / budgets[0]) ** b
            u = dc.compare_u
            for _ in range(k):
                noisy = law(n, m * d, m * u) + (rng.normal(0, noise) if k > 1 else 0.0)
                changes[name].append(row(budget, n, d, u, noisy))
    return dc, baseline, changes


def test_analysis_recovers_known_data_multipliers_intervals_and_verdicts():
    dc, baseline, changes = synthetic_study()
    result = analyse_data(baseline, changes, dc)
    assert result["law"]["params"]["R_D_star"] == pytest.approx(TRUE["R_D_star"], rel=0.05)
    assert result["law_max_abs_rel_error"] < 1e-3
    assert 0 < result["seed_sigma"] < 3e-4
    by = {c["name"]: c for c in result["changes"]}
    for name, (a, b) in GAINS.items():
        truth = [a * (budget / dc.budgets[0]) ** b for budget in dc.budgets]
        got = by[name]
        assert got["multipliers"] == pytest.approx(truth, rel=0.05), name
        for x, lo, hi in zip(truth, got["low"], got["high"]):
            assert lo <= x * 1.02 and x / 1.02 <= hi, (name, x, lo, hi)
        assert got["slope_per_decade"] == pytest.approx(b, abs=0.03), name
        assert [s["epochs"] for s in got["scales"]] == pytest.approx([4.0, 10.0, 24.0])
    assert {n: by[n]["verdict"] for n in GAINS} == {
        "same": "persists",
        "grow": "grows",
        "fade": "fades",
        "rev": "reverses",
        "bad": "hurts",
    }
    report = format_data_derisk(result)
    assert "| grow |" in report and "**grows**" in report and "10,000,000 unique tokens" in report


def test_wider_seed_noise_widens_the_intervals():
    dc, baseline, changes = synthetic_study(noise=1e-4)
    quiet = analyse_data(baseline, changes, dc)["changes"][0]
    dc, baseline, changes = synthetic_study(noise=2e-3)
    loud = analyse_data(baseline, changes, dc)["changes"][0]
    width = [h / lo for lo, h in zip(quiet["low"], quiet["high"])]
    assert all(h / lo > w for lo, h, w in zip(loud["low"], loud["high"], width))


def test_too_few_single_epoch_runs_is_an_error_naming_the_fields():
    dc, baseline, changes = synthetic_study()
    repeated = [r for r in baseline if r["tokens"] > r["unique_tokens"]]
    with pytest.raises(Exception, match="add budgets or unique_tokens"):
        analyse_data(repeated + baseline[:2], changes, dc)


def test_data_mode_config_errors_name_the_field(tmp_path):
    dc = DeriskConfig(change=[ChangeConfig(name="x", set=["model.pos=rope"])], mode="data")
    with pytest.raises(ConfigError, match="unique_tokens: mode 'data' needs 2 or more"):
        dataclasses.replace(dc, unique_tokens=[1000]).validate()
    with pytest.raises(ConfigError, match="compare_unique_tokens: 5000 is not one of unique_tokens"):
        dataclasses.replace(dc, unique_tokens=[1000, 2000], compare_unique_tokens=5000).validate()
    with pytest.raises(ConfigError, match="ladder.unique_tokens: mode 'data'"):
        ladder = LadderConfig(grid="ratio", unique_tokens=100)
        dataclasses.replace(dc, unique_tokens=[1000, 2000], ladder=ladder).validate()
    assert dataclasses.replace(dc, unique_tokens=[3000, 1000]).compare_u == 1000
    with pytest.raises(
        ConfigError, match="unique_tokens, compare_unique_tokens, law_seeds: only mode 'data'"
    ):
        dataclasses.replace(dc, mode="compute", unique_tokens=[1000, 2000]).validate()
    with pytest.raises(ConfigError, match=r"unique_tokens\[1\]: must be a whole number of tokens >= 2"):
        dataclasses.replace(dc, unique_tokens=[1000, -1]).validate()
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'mode = "data"\nunique_tokens = [1e6, 2e6]\n[[change]]\nname = "x"\nset = ["model.pos=rope"]\n'
    )
    with pytest.raises(ConfigError, match="unique_tokens"):
        load_derisk(bad).validate()
    out = tmp_path / "out"
    argv = ["derisk", "--mode", "data", "--unique-tokens", "1000", "--change", "x:model.pos=rope", "--out"]
    assert main([*argv, str(out)]) == 2


def test_plan_trains_the_baseline_at_every_unique_budget_and_the_changes_at_the_compared_one(tiny_data):
    dc = DeriskConfig(
        base=str(CONFIG_DIR / "tiny.toml"),
        set=[f'data.dir="{tiny_data}"', "log.progress=false", "train.threads=1"],
        budgets=[2e10, 6e10],
        change=[ChangeConfig(name="rope", set=['model.pos="rope"'])],
        seeds=2,
        mode="data",
        unique_tokens=[20_000, 40_000],
        token_fractions=[0.5, 1.0],
        ladder=LadderConfig(grid="ratio", min_steps=20, max_depth=1),
    )
    planned = plan_data_derisk(dc)
    by = {(p.stage, p.scale, p.unique, p.run.tokens, p.run.seed) for p in planned}
    assert len(by) == len(planned)
    for scale in dc.budgets:
        base = [p for p in planned if p.stage == "baseline" and p.scale == scale]
        assert {p.fraction for p in base} == {0.5, 1.0} and {p.run.depth for p in base} == {1}
        assert {p.run.global_batch for p in base} == {base[0].run.global_batch}  # only the length differs
        for fraction in (0.5, 1.0):
            runs = [p.run for p in base if p.fraction == fraction]
            tokens = {r.tokens for r in runs}
            assert len(tokens) == 1 and tokens.pop() == pytest.approx(
                scale * fraction / runs[0].flops_per_token, rel=0.05
            )
            caps = sorted(r.config.data.max_unique_tokens or 0 for r in runs)
            seeds = 2 if scale == min(dc.budgets) else 1  # every baseline run of the smallest scale
            # fresh, and each U its tokens repeat (a U it would read about once is the fresh run)
            repeated = [u for u in (20_000, 40_000) if u * MIN_CAPPED_EPOCHS <= runs[0].tokens]
            assert caps == sorted([0, *repeated] * seeds)
        assert all(r.config.model.pos != "rope" for r in (p.run for p in base))
        rope = [p for p in planned if p.stage == "rope" and p.scale == scale]
        seeds = 2 if scale == min(dc.budgets) else 1
        assert len(rope) == seeds and {p.run.config.data.max_unique_tokens for p in rope} == {20_000}
        assert {p.run.config.model.pos for p in rope} == {"rope"} and {p.fraction for p in rope} == {1.0}
        full = [p.run for p in base if p.fraction == 1.0]
        assert {p.run.depth for p in rope} == {full[0].depth} and {p.run.tokens for p in rope} == {
            full[0].tokens
        }
    # with a spread sample, a fresh point reads a spread sample of its own tokens once (and the token
    # after them, the last window's last target), drawn as the capped runs draw theirs
    spread = plan_data_derisk(dataclasses.replace(dc, set=[*dc.set, "data.unique_sample=spread"]))
    fresh = [p.run for p in spread if p.stage == "baseline" and p.unique is None]
    assert len(fresh) == len([p for p in planned if p.stage == "baseline" and p.unique is None])
    assert all(r.config.data.max_unique_tokens == r.tokens + 1 for r in fresh)
    assert all(r.config.data.unique_sample == "spread" for r in fresh)
    capped = {(p.run.name, p.run.config.data.max_unique_tokens) for p in spread if p.unique is not None}
    assert capped == {
        (p.run.name, p.run.config.data.max_unique_tokens) for p in planned if p.unique is not None
    }
    # a U the run would repeat under 5% is not trained: it is the fresh point again; one it repeats 20% is
    smallest = min(p.run.tokens for p in planned if p.stage == "baseline" and p.fraction == 1.0)
    near, far = int(smallest / 1.02), int(smallest / 1.2)
    caps = {
        p.run.config.data.max_unique_tokens
        for p in plan_data_derisk(
            dataclasses.replace(dc, unique_tokens=[near, far], compare_unique_tokens=far)
        )
        if p.stage == "baseline" and p.run.tokens == smallest
    }
    assert caps == {None, far} and MIN_CAPPED_EPOCHS == 1.05
    # law_seeds: the baseline's seeds per scale (the law's points); the changes keep `seeds` at the smallest
    more = plan_data_derisk(dataclasses.replace(dc, law_seeds=[1, 3]))
    for scale, want in zip(sorted(dc.budgets), (1, 3), strict=True):
        for fraction in (0.5, 1.0):
            fresh = [p for p in more if p.stage == "baseline" and p.scale == scale and p.fraction == fraction]
            fresh = [p for p in fresh if p.unique is None]
            assert len(fresh) == want and len({p.run.seed for p in fresh}) == want
        rope = [p for p in more if p.stage == "rope" and p.scale == scale]
        assert len(rope) == (2 if scale == min(dc.budgets) else 1)
    assert (
        baseline_seeds(dataclasses.replace(dc, law_seeds=[1, 3]), 6e10) == 3 and baseline_seeds(dc, 6e10) == 1
    )
    for bad in ([3], [3, 0], [3, True]):
        with pytest.raises(
            ConfigError, match=r"law_seeds \(--law-seeds\): give one whole number >= 1 per budget \(2\)"
        ):
            dataclasses.replace(dc, law_seeds=bad).validate()
    with pytest.raises(ConfigError, match="token_fractions: 0.001 of budget 2e"):
        plan_data_derisk(dataclasses.replace(dc, token_fractions=[0.001, 1.0]))
    with pytest.raises(ConfigError, match=r"token_fractions: give fractions in \(0, 1\]"):
        plan_data_derisk(dataclasses.replace(dc, token_fractions=[0.5, 2.0]))


# ----- tenx plan choose --unique-tokens -----------------------------------------------------------------
def test_the_data_limited_optimum_is_the_lowest_loss_the_law_allows():
    fit = known_fit()
    C = 1e19
    free = compute_optimal(fit, C)
    assert data_limited_optimal(fit, C, 1e15)["N"] == pytest.approx(free["N"], rel=1e-3)  # no real limit
    for U in (1e9, 2e8):
        best = data_limited_optimal(fit, C, U)
        N = np.geomspace(free["N"] / 10, free["N"] * 1000, 400_001)
        loss = law(N, C / (6 * N), U)
        assert best["N"] == pytest.approx(N[np.argmin(loss)], rel=1e-3)
        assert best["loss"] == pytest.approx(loss.min(), rel=1e-9)
        assert best["epochs"] == pytest.approx(C / (6 * best["N"]) / U)
        assert best["N"] > free["N"] and not best["at_edge"]  # repeats cost: a bigger model, fewer epochs
    rng = np.random.default_rng(0)
    samples = np.array([[v * (1 + rng.normal(0, 0.01)) for v in TRUE.values()] for _ in range(100)])
    spread = data_limited_optimal(known_fit(samples), C, 2e8)
    assert spread["loss_interval"][0] < spread["loss"] < spread["loss_interval"][1]
    assert spread["N_interval"][0] < spread["N"] < spread["N_interval"][1]


def test_plan_choose_with_a_data_limit_ranks_by_the_data_constrained_law(tmp_path, capsys):
    from tenx.plan.allocate import choose, load_fit
    from tenx.plan.estimate import load_cluster
    from tenx.train.config import load_run_config, resolve_config_path

    rng = np.random.default_rng(0)
    samples = [[v * (1 + rng.normal(0, 0.01)) for v in TRUE.values()] for _ in range(50)]
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"fit": {"law": "data-constrained", "params": TRUE, "samples": samples}}))
    fit = load_fit(path)
    assert fit.samples.shape == (50, 6)
    run = load_run_config(resolve_config_path("gpt2-d12"))
    cluster = load_cluster("h100-node")
    C, U = 1e19, 2e8
    result = choose(run, cluster, fit, C, vocab=50257, unique_tokens=U)
    fitting = [r for r in result["choices"] if r["fits"]]
    best = fitting[0]
    assert best["loss"] == pytest.approx(min(r["loss"] for r in fitting), rel=1e-3)
    limited = result["data_limited_optimal"]
    assert limited["N"] / 1.5 < best["N"] < limited["N"] * 1.5
    for r in fitting:
        assert r["loss"] == pytest.approx(float(law(r["N"], r["D"], U)))
        assert r["epochs"] == pytest.approx(r["D"] / U)
        assert r["loss_interval"][0] < r["loss"] < r["loss_interval"][1]
    plain = choose(run, cluster, fit, C, vocab=50257)  # without a limit the law reads D fresh tokens
    assert plain["choices"][0]["loss"] < best["loss"] and "epochs" not in plain["choices"][0]
    chinchilla = tmp_path / "chinchilla.json"
    params = {k: TRUE[k] for k in ("E", "A", "B", "alpha", "beta")}
    chinchilla.write_text(json.dumps({"fit": {"law": "chinchilla", "params": params}}))
    with pytest.raises(ConfigError, match="--unique-tokens needs a data-constrained fit"):
        choose(run, cluster, load_fit(chinchilla), C, vocab=50257, unique_tokens=U)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fit": {"law": "data-constrained", "params": TRUE, "samples": [[1, 2]]}}))
    with pytest.raises(ConfigError, match="fit.samples must be rows of 6 numbers"):
        load_fit(bad)
    argv = ["plan", "choose", "--config", "gpt2-d12", "--cluster", "h100-node", "--fit", str(path)]
    assert main([*argv, "--budget", "1e19", "--unique-tokens", "2e8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "with 2e+08 unique tokens: N" in out and "epochs" in out and "loss interval" in out
    with pytest.raises(SystemExit):
        main([*argv, "--budget", "1e19", "--unique-tokens", "-1"])
    assert "--unique-tokens" in capsys.readouterr().err


def test_cli_data_mode_end_to_end_writes_the_report(tiny_data, tmp_path, capsys):
    """Two sizes, two unique-token budgets and one change on the tiny corpus: every run trains, the law is
    fitted, the report and plot are written, and a second call reuses every run."""
    study = tmp_path / "study.toml"
    study.write_text(
        'base = "tiny"\n'
        f"set = ['data.dir=\"{tiny_data}\"', 'log.progress=false', 'train.threads=1', "
        "'data.unique_sample=spread']\n"
        'budgets = [2e10, 1.2e11]\nseeds = 1\nbootstrap = 20\nmode = "data"\nunique_tokens = [20000, 40000]\n'
        "token_fractions = [0.25, 0.5, 1.0]\n"
        '[[change]]\nname = "rope"\nset = [\'model.pos="rope"\']\n'
        '[ladder]\ngrid = "ratio"\nmin_steps = 20\nmax_depth = 2\ntokens_per_param = 0.5\n'
        "min_tokens_per_param = 0.1\neval_bytes = 20000\nevals_per_run = 0\n"
    )
    out = tmp_path / "out"
    assert main(["derisk", "--config", str(study), "--out", str(out), "--dry-run"]) == 0
    planned = capsys.readouterr().out  # the plan, each run's time measured here and the sum: as the ladder's
    assert (
        "est. time" in planned
        and "14 runs, " in planned
        and " on this machine (measured step times)" in planned
    )
    assert not out.exists()  # nothing trained, nothing written
    assert main(["derisk", "--config", str(study), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    # 2 sizes x (3 fractions x (fresh + each U below their tokens) + rope): 14 runs, the first the shortest
    assert "[1/14] baseline-fresh-C5.00e09-d1" in printed and "[14/14] rope-U2.00e04-C1.20e11" in printed
    result = json.loads((out / "derisk.json").read_text())
    assert result["mode"] == "data" and result["law"]["law"] == "data-constrained"
    assert len(result["baseline"]) == 12 and result["law"]["n_points"] == 12
    (rope,) = result["changes"]
    assert [s["epochs"] for s in rope["scales"]] == pytest.approx(
        [2.15, 2.15], rel=0.01
    )  # 43,008 over 20,000
    assert [s["unique_tokens"] for s in rope["scales"]] == [20000, 20000]
    # the multipliers and verdict depend on these few tiny runs (the law fitted to 12 of them can put the
    # baseline below its floor: nan, or the change: inf); that each scale gets one, and a verdict, is checked
    assert len(rope["multipliers"]) == 2 and len(rope["low"]) == 2
    assert rope["verdict"] in ("grows", "persists", "fades", "reverses", "hurts", "unresolved")
    assert "| rope |" in (out / "report.md").read_text() and (out / "report.png").stat().st_size > 10000
    rows = [json.loads(line) for line in (out / "ladder" / "results.jsonl").read_text().splitlines()]
    # scored on the held-out split alone: the one the law and the multipliers read
    assert all(
        r["heldout_loss"] > 0 and r["val_loss"] is None and set(r["eval_bytes"]) == {"heldout"} for r in rows
    )
    assert main(["derisk", "--config", str(study), "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("(reused)") == 14


def test_a_bootstrap_fit_whose_coefficient_underflowed_still_fits_r_star():
    """A resample can drive A (or B, E) to exp(-800) = 0.0; its term then vanishes instead of raising
    'math domain error' (the data-efficiency study crashed on exactly that)."""
    from tenx.scaling.fit.laws import _R_STAR_GRID, _fit_decays

    N, D, U = np.array([1e5, 1e6, 1e6]), np.array([1e6, 4e6, 4e6]), np.array([1e5, 1e6, 4e6])
    logL = np.log(np.array([2.2, 2.0, 1.9]))
    log_starts = np.array([[math.log(start)] for start in _R_STAR_GRID])
    for base in ([1.0, 0.0, 100.0, 0.3, 0.3], [1.0, 50.0, 0.0, 0.3, 0.3], [0.0, 50.0, 100.0, 0.3, 0.3]):
        r_star = math.exp(_fit_decays(np.array(base), N, D, U, logL, 1e-3, log_starts)[0])
        assert math.isfinite(r_star) and r_star > 0


# ----- the kinds of change beyond overrides (tenx/scaling/derisk/data_changes.py) ------------------------
def _rows_at(dc, rows, factor=1.0, loss_shift=0.0):
    """Per scale, rows like the compared point's baseline rows, at `factor` times its tokens and unique
    tokens (the same epochs), their loss the law's there plus `loss_shift`."""
    out = []
    for budget in dc.budgets:
        same = [r for r in rows if r["budget"] == budget and r["unique_tokens"] == dc.compare_u]
        d = max(r["tokens"] for r in same)
        n = same[0]["params"]
        k = len([r for r in same if r["tokens"] == d])
        out.append(
            [
                {
                    "budget": budget,
                    "params": n,
                    "tokens": d * factor,
                    "unique_tokens": dc.compare_u * factor,
                    "heldout_loss": float(law(n, d * factor, dc.compare_u * factor)) + loss_shift,
                }
                for _ in range(k)
            ]
        )
    return out


def test_kinds_of_change_planted_ensemble_and_tuned_are_read_as_they_should_be():
    """One fit of the law, read five ways (tenx/scaling/derisk/data_changes.py):
    - a planted win of 1.3 (the baseline given 1.3x the unique tokens at the same epochs) is anchored at the
      baseline's run at U_c, not at a run of its own U (the baseline has none), and reads 1.3;
    - S ensembles drawn cyclically from shared members are not S independent repeats: with `independent`
      = 1 the seed noise is that of one, and the interval is wider than S repeats would give; an
      ensemble's rows stay out of the seed noise (a single-run kind's seeds count in it);
    - tuned against tuned: with `anchors` (the baseline's best candidate per scale), a change exactly as
      good as the tuned baseline is worth 1.0 however far both are below the untuned baseline."""
    from tenx.scaling.derisk.data_changes import ChangeRows

    dc, baseline, changes = synthetic_study(noise=3e-3, seeds=4)
    dc = dataclasses.replace(dc, bootstrap=20)
    planted = ChangeRows(_rows_at(dc, baseline, 1.3), compute_multiple=1.3, planted=True)
    ensemble = _rows_at(dc, baseline, 1.5)
    for r in (x for at in ensemble for x in at):
        r["unique_tokens"], r["tokens"] = dc.compare_u, r["tokens"] / 1.5  # an ensemble trains at U_c
    better = _rows_at(dc, baseline, 1.0, loss_shift=-0.05)
    kinds = {
        "planted": planted,
        "repeats": ChangeRows(ensemble, single_runs=False),
        "shared": ChangeRows(ensemble, independent=[1, 1, 1], compute_multiple=4.0, single_runs=False),
        "untuned": ChangeRows(better),
        "tuned": ChangeRows(better, anchors=_rows_at(dc, baseline, 1.0, loss_shift=-0.05)),
    }
    result = analyse_data(baseline, changes, dc, kinds)
    got = {c["name"]: c for c in result["changes"]}
    p = got["planted"]
    assert p["multipliers"] == pytest.approx([1.3] * 3, rel=0.02)
    assert all(lo <= 1.3 * 1.02 and 1.3 / 1.02 <= hi for lo, hi in zip(p["low"], p["high"]))
    assert p["compute_multiple"] == 1.3
    assert [s["unique_tokens"] for s in p["scales"]] == [dc.compare_u * 1.3] * 3
    a, b = got["repeats"], got["shared"]
    assert a["multipliers"] == pytest.approx(b["multipliers"]) and b["compute_multiple"] == 4.0
    width = [math.log(c["high"][0] / c["low"][0]) for c in (a, b)]
    assert width[1] > 1.4 * width[0]  # sigma / sqrt(1) against sigma / sqrt(4), on top of the law's spread
    singles = {k: v for k, v in kinds.items() if v.single_runs}
    without = analyse_data(baseline, changes, dataclasses.replace(dc, bootstrap=0), singles)
    assert result["seed_sigma"] == pytest.approx(without["seed_sigma"])
    # a planted win's own seeds are repeats of one run: they count (here four identical losses a scale)
    alone = analyse_data(baseline, changes, dataclasses.replace(dc, bootstrap=0))
    assert without["seed_sigma"] < alone["seed_sigma"]
    assert min(got["untuned"]["multipliers"]) > 1.1  # against the untuned baseline it looks like a gain
    assert got["tuned"]["multipliers"] == pytest.approx([1.0] * 3, abs=1e-9)
    # the case the planted anchor rule could wrongly excuse: anchored at its own U, there is no such run
    with pytest.raises(Exception, match="no run at budget"):
        analyse_data(baseline, changes, dataclasses.replace(dc, bootstrap=0), {"p": ChangeRows(planted.rows)})


def test_change_kinds_are_validated_naming_the_change():
    from tenx.scaling.derisk.change import sweep_candidates

    assert sweep_candidates(["optim.lr=1e-3,2e-3", "optim.weight_decay=0.1,0.8"]) == [
        ["optim.lr=1e-3", "optim.weight_decay=0.1"],
        ["optim.lr=1e-3", "optim.weight_decay=0.8"],
        ["optim.lr=2e-3", "optim.weight_decay=0.1"],
        ["optim.lr=2e-3", "optim.weight_decay=0.8"],
    ]
    for bad, match in (
        (ChangeConfig(name="p", planted=0.9), "'p': planted = 0.9; a planted win is a factor > 1"),
        (ChangeConfig(name="e", ensemble=2, planted=1.3), "'e': ensemble and planted are different kinds"),
        (ChangeConfig(name="s", sweep=["optim.lr"]), r"'s': sweep: 'optim.lr' is not section.key=value1"),
        (ChangeConfig(name="b", sweep=["optim.lr=1,2,3,4,5,6,7", "optim.eps=1,2"]), "14 candidates"),
        (ChangeConfig(name="n"), "'n': 'set' is empty"),
    ):
        with pytest.raises(ConfigError, match=match):
            bad.validate()
    ChangeConfig(name="ok", ensemble=4).validate()
    ChangeConfig(name="ok", planted=1.3).validate()
    with pytest.raises(ConfigError, match="change 'e': ensemble: only mode 'data' uses them"):
        DeriskConfig(change=[ChangeConfig(name="e", ensemble=2)]).validate()


def _kinds_study(tiny_data, **kw):
    settings = dict(
        base=str(CONFIG_DIR / "tiny.toml"),
        set=[f'data.dir="{tiny_data}"', "log.progress=false", "train.threads=1", "checkpoint.every=0"],
        budgets=[2e10, 6e10],
        change=[
            ChangeConfig(name="ens", ensemble=3),
            ChangeConfig(name="student", distill_from="ens", set=["train.distill_weight=0.5"]),
            ChangeConfig(
                name="tuned", sweep=["optim.weight_decay=0.1,0.8"], baseline_sweep=["optim.lr=5e-3,1e-2"]
            ),
            ChangeConfig(name="planted", planted=1.5),
            ChangeConfig(name="wd", set=["optim.weight_decay=0.8"], seeds=[1, 2]),
        ],
        seeds=2,
        mode="data",
        unique_tokens=[20_000, 40_000],
        token_fractions=[0.5, 1.0],
        ladder=LadderConfig(grid="ratio", min_steps=20, max_depth=1, evals_per_run=0),
    )
    return DeriskConfig(**{**settings, **kw})


def test_plan_of_each_kind_of_change(tiny_data, tmp_path):
    """An ensemble trains max(seeds, K) members (seed 0.. of the change's config: a change of no overrides
    shares them with the baseline's seeds); a student trains after them (phase 1) from ensemble 0 at its
    scale; a sweep trains every candidate, and its baseline grid the baseline's; a planted win trains the
    baseline at f x U and f x the tokens."""
    from tenx.scaling.derisk.data_changes import ensemble_dir

    dc = _kinds_study(tiny_data)
    planned = plan_data_derisk(dc, out=tmp_path)
    for scale in dc.budgets:
        seeds = 2 if scale == min(dc.budgets) else 1
        at = [p for p in planned if p.scale == scale]
        members = [p for p in at if p.stage == "ens/member"]
        assert sorted(p.run.seed for p in members) == [0, 1, 2] and {p.phase for p in members} == {0}
        base = {config_key(p.run.config) for p in at if p.stage == "baseline" and p.unique == 20_000}
        shared = [p for p in members if config_key(p.run.config) in base]
        assert len(shared) == seeds  # the baseline's own seeds at the compared point
        students = [p for p in at if p.stage == "student"]
        assert len(students) == seeds and {p.phase for p in students} == {1}
        assert {p.run.config.train.distill_from for p in students} == {
            str(ensemble_dir(tmp_path, "ens", scale, 0).resolve())
        }
        for i, wd in enumerate((0.1, 0.8)):
            cand = [p for p in at if p.stage == f"tuned/candidate{i}"]
            assert len(cand) == seeds and {p.run.config.optim.weight_decay for p in cand} == {wd}
        anchors = [p for p in at if p.stage.startswith("tuned/anchor")]
        assert len(anchors) == 2 * seeds and {p.run.config.optim.weight_decay for p in anchors} == {0.1}
        (planted,) = {p.run.tokens for p in at if p.stage == "planted"}
        full = max(p.run.tokens for p in at if p.stage == "baseline" and p.unique == 20_000)
        assert planted == pytest.approx(1.5 * full, rel=0.02)
        assert {p.run.config.data.max_unique_tokens for p in at if p.stage == "planted"} == {30_000}
    with pytest.raises(Exception, match="'student': distill_from = 'tuned' is not an ensemble change"):
        bad = _kinds_study(tiny_data)
        bad.change[1].distill_from = "tuned"
        plan_data_derisk(bad, out=tmp_path)


@pytest.mark.slow
def test_a_study_of_each_kind_of_change_trains_assembles_and_prices_them(tiny_data, tmp_path, capsys):
    """End to end on the tiny corpus: the ensembles are assembled in OUT/ensembles before the students train,
    each kind is read and priced (ensemble K, student 1 + K/3 + K, planted f), a tuned change names what it
    picked, and a second call reuses every run and score."""
    from tenx.scaling.derisk.data_multiplier import run_data_derisk

    ladder = LadderConfig(
        grid="ratio",
        min_steps=10,
        max_depth=2,
        evals_per_run=0,
        tokens_per_param=0.3,
        min_tokens_per_param=0.1,
    )  # depth 1 at 2e10 FLOPs and depth 2 at 1e11 (the law needs two sizes, and 5 single-epoch points)
    dc = _kinds_study(
        tiny_data,
        bootstrap=10,
        budgets=[2e10, 1e11],
        ladder=ladder,
        unique_tokens=[10_000, 20_000],
        token_fractions=[0.4, 0.7, 1.0],
    )
    result = run_data_derisk(dc, tmp_path)
    by = {c["name"]: c for c in result["changes"]}
    assert by["ens"]["compute_multiple"] == 3.0 and by["planted"]["compute_multiple"] == 1.5
    assert [s["seeds"] for s in by["wd"]["scales"]] == [1, 2]  # a plain change with its own seeds
    assert by["student"]["compute_multiple"] == pytest.approx(1 + 1 + 3)
    assert len(by["tuned"]["notes"]) == 2 and "baseline: optim.lr=" in by["tuned"]["notes"][0]
    assert all(len(c["multipliers"]) == 2 for c in by.values())
    # the ensemble's members are seeds of the baseline: at the larger scale its compared point (and so every
    # change's anchor there) is the median of all three, not of seed 0 alone
    compared = [r for r in result["baseline"] if r["budget"] == 1e11 and r["unique_tokens"] == 10_000]
    longest = max(r["tokens"] for r in compared)
    assert len([r for r in compared if r["tokens"] == longest]) == 3
    assert (tmp_path / "ensembles" / "scores.json").exists()
    assert sorted(p.name for p in (tmp_path / "ensembles").iterdir() if p.is_dir()) == sorted(
        f"ens-C{s:.2e}-e{j}".replace("+", "") for s, n in ((2e10, 2), (1e11, 1)) for j in range(n)
    )
    capsys.readouterr()
    again = run_data_derisk(dc, tmp_path)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[")]
    assert lines and all(x.endswith("(reused)") for x in lines)
    assert [c["multipliers"] for c in again["changes"]] == [c["multipliers"] for c in result["changes"]]


def test_each_size_has_its_own_seed_noise_and_few_repeats_widen_it():
    """tenx.scaling.derisk.data_multiplier.seed_noise / sigma_draws / median_noise:
    - each size's sigma is its own repeats' pooled standard deviation; a size with none borrows the figure
      pooled over all sizes, and a warning names it;
    - a sigma from few repeats is drawn as Student's t would widen it (its posterior), not taken as exact;
    - a point that is the median of n seeds carries the median of n draws (a median of 3 has 0.449 of one
      run's variance; of 2, their mean's 0.5)."""
    from tenx.scaling.derisk.data_multiplier import median_noise, seed_noise, sigma_draws

    rng = np.random.default_rng(0)
    quiet, noisy = [1.0, 1.002, 0.998], [2.0, 2.06, 1.94]
    noise = seed_noise(
        {("b", 1.0, 5, 2): quiet, ("c", 1.0, 5, 2): quiet, ("b", 9.0, 5, 2): noisy}, [1.0, 3.0, 9.0]
    )
    assert noise[1.0] == (pytest.approx(0.002), 4, True)
    assert noise[9.0] == (pytest.approx(0.06), 2, True)  # not the quiet size's figure
    pooled = math.sqrt((4 * 0.002**2 + 2 * 0.06**2) / 6)
    assert noise["pooled"] == (pytest.approx(pooled), 6) and noise[3.0] == (pytest.approx(pooled), 6, False)
    assert (
        len(noise["warnings"]) == 1 and "budget 3: no run trained more than one seed" in noise["warnings"][0]
    )
    few = sigma_draws(rng, {1.0: (1.0, 1, True)}, [1.0], 100_000)[:, 0]
    many = sigma_draws(rng, {1.0: (1.0, 60, True)}, [1.0], 100_000)[:, 0]
    assert np.percentile(many, 97.5) < 1.3 and np.percentile(few, 97.5) > 10  # 1 dof: sigma barely known
    assert np.all(sigma_draws(rng, {1.0: (0.5, 0, True)}, [1.0], 10) == 0.5)
    sd = np.ones((200_000, 3))
    var = np.var(median_noise(rng, sd, np.array([1, 2, 3])), axis=0)
    assert var == pytest.approx([1.0, 0.5, 0.449], rel=0.02)


def test_a_noisy_largest_size_does_not_borrow_the_smallest_sizes_quiet_noise():
    """The case per-size noise could wrongly excuse: the largest size's repeats spread 0.02 nats while the
    smallest's spread 1e-4; its interval must be the wider for it (with one pooled figure, the smallest
    size's many quiet repeats would have narrowed it), and the smallest size's must not widen."""
    dc, baseline, changes = synthetic_study(noise=1e-4, seeds=4)
    dc = dataclasses.replace(dc, bootstrap=100)
    top = max(dc.budgets)

    def with_repeats(spread):
        rows = [dict(r) for r in baseline]
        point = max(
            (r for r in rows if r["budget"] == top and r["unique_tokens"] == dc.compare_u),
            key=lambda r: r["tokens"],
        )
        # symmetric about the point, so its median (what the law is fitted to) stays where it was: only the
        # seed noise differs between the two studies
        rows += [{**point, "heldout_loss": point["heldout_loss"] + d} for d in (-spread, spread, 0.0)]
        return analyse_data(rows, {"same": changes["same"]}, dc)

    tight, loose = with_repeats(1e-4), with_repeats(0.02)
    (t,), (w,) = tight["changes"], loose["changes"]
    widths = [[math.log(c["high"][j] / c["low"][j]) for j in range(3)] for c in (t, w)]
    assert widths[1][2] > 3 * widths[0][2]
    assert widths[1][0] == pytest.approx(widths[0][0], rel=0.25)
    assert loose["seed_sigma_by_scale"][2]["sigma"] > 0.01 and loose["seed_sigma_by_scale"][2]["own"]
    assert loose["seed_sigma_by_scale"][0]["sigma"] < 1e-3


def test_a_change_trains_its_own_seeds_and_the_teachers_members_train_first(tiny_data, tmp_path):
    """A change's `seeds` (one count a budget) set its runs per size; a wrong count is refused naming the
    change; the teachers' members train in phase 0 and every other run (students, baseline) in phase 1, and a
    study with no distilled change trains in one phase."""
    from tenx.scaling.derisk.data_multiplier import train_phases

    dc = _kinds_study(tiny_data)
    dc.change[3].seeds = [1, 3]
    dc.validate()
    planned = plan_data_derisk(dc, out=tmp_path)
    assert [
        len([p for p in planned if p.stage == "planted" and p.scale == s]) for s in sorted(dc.budgets)
    ] == [1, 3]
    keys: dict[str, int] = {}
    of = [keys.setdefault(config_key(p.run.config), len(keys)) for p in planned]
    phases = train_phases(dc, planned, of, len(keys))
    members = {of[i] for i, p in enumerate(planned) if p.stage == "ens/member"}
    assert {phases[k] for k in members} == {0}  # the baseline's seeds they share train with them
    assert {phases[of[i]] for i, p in enumerate(planned) if of[i] not in members} == {1}
    assert {phases[of[i]] for i, p in enumerate(planned) if p.stage == "student"} == {1}
    plain = _kinds_study(tiny_data)
    plain.change = [c for c in plain.change if not c.distill_from]
    assert set(train_phases(plain, planned, of, len(keys))) == {0}
    dc.change[3].seeds = [1]
    with pytest.raises(
        ConfigError, match=r"change 'planted': seeds: give one whole number >= 1 per budget \(2\)"
    ):
        dc.validate()
    with pytest.raises(ConfigError, match="change 's': seeds: only mode 'data' uses them"):
        DeriskConfig(change=[ChangeConfig(name="s", set=["optim.eps=1e-7"], seeds=[1, 1, 1])]).validate()


def test_a_run_two_parts_share_counts_once_in_the_seed_noise():
    """A tuned change that picked the baseline's own setting reads the baseline's runs: their seeds must not
    count twice (twice the degrees of freedom would narrow every interval for no new repeat)."""
    from tenx.scaling.derisk.data_changes import ChangeRows

    dc, baseline, changes = synthetic_study(noise=1e-3, seeds=3)
    dc = dataclasses.replace(dc, bootstrap=0)
    for i, r in enumerate(baseline):
        r["key"] = f"run{i}"
    smallest = min(dc.budgets)
    compared = [r for r in baseline if r["budget"] == smallest and r["unique_tokens"] == dc.compare_u]
    longest = max(r["tokens"] for r in compared)
    own = [[r for r in compared if r["tokens"] == longest]] + [
        [r for r in baseline if r["budget"] == s and r["unique_tokens"] == dc.compare_u][-1:]
        for s in sorted(dc.budgets)[1:]
    ]
    alone = analyse_data(baseline, {"same": changes["same"]}, dc)
    shared = analyse_data(baseline, {"same": changes["same"]}, dc, {"tuned": ChangeRows(own)})
    assert len(own[0]) == 3
    assert shared["seed_sigma_by_scale"][0]["dof"] == alone["seed_sigma_by_scale"][0]["dof"]
    assert shared["seed_sigma"] == pytest.approx(alone["seed_sigma"])
