"""Derisking: change parsing, multipliers on known synthetic laws, verdicts, and a tiny end-to-end study."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tenx.cli import main
from tenx.errors import ConfigError
from tenx.scaling.derisk.compute_multiplier import (
    ChangeConfig,
    DeriskConfig,
    analyse,
    load_derisk,
    parse_change,
    plan_derisk,
    verdict,
)
from tenx.scaling.ladder.runner import LadderConfig, config_key, load_base
from tenx.train.config import CONFIG_DIR

DERISK_CONFIGS = sorted((CONFIG_DIR / "derisk").glob("*.toml"))


def test_parse_change():
    c = parse_change("swiglu:model.mlp=swiglu,model.d_ff=256")
    assert c.name == "swiglu" and c.set == ["model.mlp=swiglu", "model.d_ff=256"]
    assert parse_change("lst:optim.betas=[0.9, 0.95]").set == ["optim.betas=[0.9, 0.95]"]
    with pytest.raises(ConfigError, match="expected NAME:section.key=value"):
        parse_change("model.mlp=swiglu")
    with pytest.raises(ConfigError, match="is not section.key=value"):
        parse_change("x:mlp")
    with pytest.raises(ConfigError, match="change.name"):
        parse_change("a b:model.mlp=swiglu")


@pytest.mark.parametrize(
    "ms, expected",
    [
        ([2.0, 2.1, 1.9], "persists"),
        ([2.0, 4.0, 8.0], "grows"),
        ([4.0, 2.5, 1.5], "fades"),
        ([2.0, 1.2, 0.8], "reverses"),
        ([0.8, 0.9, 0.7], "hurts"),
        ([0.9, 1.2, 1.6], "grows"),
    ],
)
def test_verdicts(ms, expected):
    logc = np.log10([1e12, 1e13, 1e14])
    slope, intercept = np.polyfit(logc, np.log10(ms), 1)
    fitted = list(10 ** (intercept + slope * logc))
    m = {
        "multipliers": ms,
        "slope_per_decade": slope,
        "at_target": 10 ** (intercept + slope * 15),
        "fitted": fitted,
    }
    assert verdict(m, 1.25) == expected


@pytest.mark.parametrize("path", DERISK_CONFIGS, ids=[p.name for p in DERISK_CONFIGS])
def test_shipped_derisk_configs_load(path):
    dc = load_derisk(path)
    dc.validate()
    sets = list(dc.set)
    for change in dc.change:
        sets += change.set
        load_base(dc.base, sets)  # every stacked config is a valid run config
    assert len(dc.budgets) >= 3 and len(dc.change) >= 1


def _law(C, m=1.0):
    """A known baseline law L(C) = 9 C^-0.06, read at m times the compute."""
    return 9.0 * (m * np.asarray(C, dtype=float)) ** -0.06


def test_multipliers_recover_known_gains_and_verdicts(tiny_config, tiny_data):
    """Changes whose losses are the previous config's law at m(C) x C: the analysis returns m and its trend."""
    base = Path(CONFIG_DIR / "tiny.toml")
    gains = {  # multiplier a * (C / 3e10) ** b of each change against the config before it
        "same": (3.0, 0.0),
        "grow": (1.5, 0.6),
        "rev": (2.0, -0.6),
        "bad": (0.5, 0.0),
    }

    def gain(name, C):
        a, b = gains[name]
        return a * (C / 3e10) ** b

    dc = DeriskConfig(
        base=str(base),
        set=[f'data.dir="{tiny_data}"', "log.progress=false", "train.threads=1"],
        budgets=[3e10, 1e11, 3e11],
        change=[ChangeConfig(name=n, set=[f"optim.eps={i + 2}e-8"]) for i, n in enumerate(gains)],
        seeds=2,
        bootstrap=100,
        ladder=LadderConfig(grid="ratio", min_steps=20, max_depth=2),
    )
    stages = plan_derisk(dc)
    assert [s.name for s in stages] == ["baseline", *gains]
    rng = np.random.default_rng(0)
    rows = {}
    for k, st in enumerate(stages):
        for r in st.runs:
            total = np.prod([gain(s.name, r.flops) for s in stages[1 : k + 1]])
            noise = rng.normal(0, 1e-4) if r.budget == min(dc.budgets) else 0.0
            rows[config_key(r.config)] = {
                "flops": r.flops,
                "heldout_loss": float(_law(r.flops, total)) + noise,
            }
    result = analyse(stages, rows, dc)
    assert 0 < result["seed_sigma"] < 5e-4
    by = {c["name"]: c for c in result["changes"]}
    names = list(gains)
    for k, name in enumerate(names):
        got = by[name]["marginal"]
        # the previous config's law is 9 (a C^b C)^-0.06 with a, b of the changes before; solve L_prev(C') = L
        a_prev = np.prod([gains[n][0] for n in names[:k]])
        b_prev = sum(gains[n][1] for n in names[:k])
        m = []
        for c in [p["flops"] for p in by[name]["budgets"]]:
            target = a_prev * (c / 3e10) ** b_prev * gain(name, c) * c
            m.append((target * 3e10**b_prev / a_prev) ** (1 / (1 + b_prev)) / c)
        if b_prev == 0:
            assert m == pytest.approx([gain(name, c) for c in (p["flops"] for p in by[name]["budgets"])])
        assert got["multipliers"] == pytest.approx(m, rel=0.05), name
        for x, lo, hi in zip(m, got["low"], got["high"]):
            assert lo <= x * 1.05 and x / 1.05 <= hi, (name, x, lo, hi)
    assert {n: by[n]["marginal"]["verdict"] for n in gains} == {
        "same": "persists",
        "grow": "grows",
        "rev": "reverses",
        "bad": "hurts",
    }
    # cumulative: against the baseline, 3 x 1.5 = 4.5 at the smallest budget for "grow"
    assert by["grow"]["cumulative"]["multipliers"][0] == pytest.approx(4.5, rel=0.05)
    assert by["grow"]["marginal"]["slope_per_decade"] == pytest.approx(0.6, abs=0.03)
    assert by["same"]["marginal"]["slope_per_decade"] == pytest.approx(0.0, abs=0.02)


def test_cli_derisk_end_to_end_writes_the_report(tiny_data, tmp_path, capsys):
    study = tmp_path / "study.toml"
    study.write_text(
        'base = "tiny"\n'
        f"set = ['data.dir=\"{tiny_data}\"', 'log.progress=false', 'train.threads=1']\n"
        "budgets = [2e10, 4e10, 8e10]\nseeds = 2\nbootstrap = 50\n"
        '[[change]]\nname = "rope"\nset = [\'model.pos="rope"\']\n'
        '[ladder]\ngrid = "ratio"\nmin_steps = 20\nmax_depth = 1\neval_bytes = 20000\n'
    )
    out = tmp_path / "out"
    assert main(["derisk", "--config", str(study), "--out", str(out), "--dry-run"]) == 0
    planned = capsys.readouterr().out  # the stages, then the plan with each run's time measured here
    assert "\nrope: " in planned and 'model.pos="rope"' in planned and "est. time" in planned
    assert "8 runs, " in planned and " on this machine (measured step times)" in planned
    assert main(["derisk", "--config", str(study), "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "| rope | baseline |" in report and "**" in report
    assert (out / "report.png").stat().st_size > 10000
    printed = capsys.readouterr().out
    assert "[1/8] baseline-C2.00e10-d1" in printed  # 3 budgets x 2 configs + 1 extra seed each
    # a second run reuses every run
    assert main(["derisk", "--config", str(study), "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("(reused)") == 8
    # flags override the file; a bad change is a clear error
    assert main(["derisk", "--config", str(study), "--change", "oops", "--out", str(out)]) == 2
    assert "--change 'oops'" in capsys.readouterr().err


def test_derisk_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('budgets = [1e12]\n[[change]]\nname = "x"\nset = ["model.pos=rope"]\n')
    with pytest.raises(ConfigError, match="budgets: give at least 2"):
        load_derisk(bad).validate()
    dc = DeriskConfig(change=[ChangeConfig(name="x", set=["model.pos=rope"])])
    with pytest.raises(ConfigError, match="ladder.grid"):
        dataclasses.replace(dc, ladder=LadderConfig(grid="isoflop")).validate()


@pytest.mark.parametrize(
    "ms, low, high, expected",
    [
        ([1.03, 1.05, 1.08], [0.7, 0.5, 0.7], [1.5, 1.5, 2.0], "unresolved"),  # the data study's wd-x8
        ([1.03, 1.05, 1.08], [0.7, 0.5, 1.05], [1.5, 1.5, 2.0], "persists"),  # the largest excludes 1
        ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], "unresolved"),  # exactly no change
        ([0.7, 0.6, 0.7], [0.4, 0.4, 0.4], [0.95, 0.9, 0.99], "hurts"),
    ],
)
def test_a_change_no_budget_resolves_is_unresolved_whatever_its_point_estimates(ms, low, high, expected):
    """Point estimates of 1.03, 1.05, 1.08 read alone say 'persists'; intervals that all hold 1 say the runs
    cannot tell the change from none."""
    m = {"multipliers": ms, "slope_per_decade": 0.0, "at_target": ms[-1], "low": low, "high": high}
    assert verdict(m, 1.25) == expected
