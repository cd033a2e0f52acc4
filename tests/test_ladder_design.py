"""Ladder design: admissible tokens per parameter, windows that bracket the target ratio, noise seeds, the
per-budget checks, the default ladder, and the after-the-fact IsoFLOP minimum check (planning only)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tenx import config as cfglib
from tenx.errors import ConfigError
from tenx.scaling.derisk.compute_multiplier import load_derisk, plan_derisk
from tenx.scaling.ladder.runner import (
    DEFAULT_BUDGETS,
    LadderConfig,
    config_key,
    format_checks,
    load_base,
    minimum_checks,
    plan_checks,
    plan_ladder,
)
from tenx.train.config import CONFIG_DIR


@pytest.fixture(scope="module")
def base():
    """configs/ladder.toml with the bytes vocabulary: depths 1, 2, 3, 4 have 94k, 0.51M, 1.45M, 3.4M
    parameters and train 1 token per parameter from 6.0e10, 1.82e12, 1.47e13, 7.7e13 FLOPs."""
    return load_base("ladder", ["model.vocab_size=257"])


def _depths(plan, budget):
    return sorted({r.depth for r in plan if r.budget == budget})


def test_default_ladder_is_admissible_spans_10x_and_brackets_where_depths_allow(base):
    lc = LadderConfig()
    assert lc.budgets == DEFAULT_BUDGETS and max(lc.budgets) / min(lc.budgets) >= 10
    plan = plan_ladder(base, lc)
    assert all(1.0 <= r.tokens_per_param <= 300.0 for r in plan)
    checks = plan_checks(plan, lc)
    assert [c.budget for c in checks] == DEFAULT_BUDGETS
    # the smallest budget: depth 2 would see under 1 token per parameter, depth 1 alone sees more than 20
    assert not checks[0].brackets and checks[0].depths == [1] and checks[0].seeds == 3
    assert (
        "depth 2 would train 0.93 tokens per parameter (< ladder.min_tokens_per_param 1)" in checks[0].why_not
    )
    assert all(c.brackets and c.why_not == "" for c in checks[1:-1])
    assert checks[-2].depths == [1, 2, 3] and all(c.depths == [1, 2] for c in checks[1:-2])
    # the top rung trains only depths that the rungs below it train too (leave-largest-budget-out)
    assert checks[-1].depths == [2, 3] and not checks[-1].brackets
    footer = format_checks(checks, lc)
    assert footer.count("brackets it") == 5 and footer.count("does not bracket it") == 2


def test_windows_are_shifted_and_trimmed_to_the_admissible_depths(base):
    # the old default's 1e12 planned depth 3 at 0.1 and depth 2 at 0.5 tokens per parameter
    plan = plan_ladder(base, LadderConfig(budgets=[1e12, 3e13, 1e14], noise_seeds=1))
    assert _depths(plan, 1e12) == [1]
    # 3e13: depth 1 would train 497 tokens per parameter, depth 4 0.39: depths 2-3, both under 20
    assert _depths(plan, 3e13) == [2, 3]
    # 1e14: nearest 20 is depth 2 (27.5), whose window 1-3 is shifted past depth 1 (1658)
    assert _depths(plan, 1e14) == [2, 3, 4]
    checks = {c.budget: c for c in plan_checks(plan, LadderConfig(budgets=[1e12, 3e13, 1e14]))}
    assert "depth 1 is the smallest model" in checks[1e12].why_not
    assert "depth 1 would train 497 tokens per parameter (> ladder.max_tokens_per_param 300)" in (
        checks[3e13].why_not
    )
    assert checks[1e14].brackets
    # a wider range keeps depth 1 at 3e13, and its window brackets 20
    wide = plan_ladder(base, LadderConfig(budgets=[3e13], max_tokens_per_param=600))
    assert _depths(wide, 3e13) == [1, 2, 3] and plan_checks(wide, LadderConfig())[0].brackets
    # too many sizes for the admissible depths: the window is trimmed, not widened past the range
    assert _depths(plan_ladder(base, LadderConfig(budgets=[1e14], sizes=4)), 1e14) == [2, 3, 4]


def test_even_windows_put_the_extra_depth_across_the_target(base):
    # at 1.7e13 the nearest is depth 2 at 9.3 (< 20): the second size is the smaller depth 1 (282)
    assert _depths(plan_ladder(base, LadderConfig(budgets=[1.7e13], sizes=2)), 1.7e13) == [1, 2]
    # at 1e14 the nearest is depth 2 at 27.5 (> 20): the second size is depth 3
    assert _depths(plan_ladder(base, LadderConfig(budgets=[1e14], sizes=2)), 1e14) == [2, 3]


def test_no_admissible_depth_names_the_budget_and_the_field(base):
    with pytest.raises(
        ConfigError, match=r"3e\+10 FLOPs buys depth 1 only 0.5 .*ladder.min_tokens_per_param"
    ):
        plan_ladder(base, LadderConfig(budgets=[3e10]))
    with pytest.raises(ConfigError, match=r"3e\+13 FLOPs gives depth 1 497 .*ladder.max_tokens_per_param"):
        plan_ladder(base, LadderConfig(budgets=[3e13], max_depth=1))
    # depth 1 above 20 and depth 2 below 1: no depth between
    with pytest.raises(ConfigError, match=r"depth 1 24.9 .* and depth 2 0.82 .*widen that range"):
        plan_ladder(base, LadderConfig(budgets=[1.5e12], max_tokens_per_param=20))
    with pytest.raises(ConfigError, match="ladder.tokens_per_param: 0.5 is outside"):
        LadderConfig(tokens_per_param=0.5).validate()
    for budgets in ([2e12, 2e12], [2e12, 2.001e12]):
        with pytest.raises(ConfigError, match="base-C2.00e12-d1.* is planned twice"):
            plan_ladder(base, LadderConfig(budgets=budgets, noise_seeds=1))


def test_noise_seeds_repeat_the_smallest_budget_and_seeds_still_repeat_all(base):
    seed = base.train.seed
    plan = plan_ladder(base, LadderConfig(budgets=[5e12, 2e12]))
    small = [r for r in plan if r.budget == 2e12]
    assert [(r.depth, r.seed) for r in small] == [(d, seed + s) for d in (1, 2) for s in range(3)]
    assert [r.name for r in small[:3]] == [f"base-C2.00e12-d1-s{seed + s}" for s in range(3)]
    assert {r.seed for r in plan if r.budget == 5e12} == {seed}
    assert "base-C5.00e12-d1" in [r.name for r in plan]
    assert len({r.name for r in plan}) == len({config_key(r.config) for r in plan}) == len(plan) == 8
    # every run's row carries its seed
    assert all(r.record()["seed"] == r.config.train.seed for r in plan)

    both = plan_ladder(base, LadderConfig(budgets=[5e12, 2e12], seeds=2))
    assert sorted({r.seed for r in both if r.budget == 5e12}) == [seed, seed + 1]
    assert len([r for r in both if r.budget == 2e12]) == 6 and len(both) == 10
    assert len({r.name for r in both}) == len({config_key(r.config) for r in both}) == 10

    assert len(plan_ladder(base, LadderConfig(budgets=[5e12, 2e12], noise_seeds=1))) == 4
    # the ratio grid is one run per budget; tenx derisk owns its seeds
    assert len(plan_ladder(base, LadderConfig(budgets=[5e12, 2e12], grid="ratio"))) == 2


@pytest.mark.parametrize("path", sorted((CONFIG_DIR / "derisk").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_derisk_studies_still_plan(path):
    dc = load_derisk(path)
    stages = plan_derisk(dc, dry_run=True)
    for stage in stages:
        assert len(stage.runs) == len(dc.budgets) + dc.seeds - 1
        assert all(r.tokens_per_param >= 1 for r in stage.runs)


def _rows(budget, params, losses):
    rows = []
    for n, loss in zip(params, losses):
        tokens = budget / (6 * n)
        rows.append(
            {
                "budget": budget,
                "params": n,
                "tokens": tokens,
                "flops": budget,
                "unique_tokens": 1e9,
                "tokens_per_param": tokens / n,
                "heldout_loss": loss,
            }
        )
    return rows


def test_minimum_checks_say_where_the_measured_minimum_lies():
    sizes = [1e5, 4e5, 1.6e6]
    x = [math.log(n) for n in sizes]

    def parabola(centre):
        return [2.0 + 0.05 * (v - math.log(centre)) ** 2 for v in x]

    rows = (
        _rows(1e13, sizes, parabola(3e5))
        + _rows(3e13, sizes, parabola(1e7))
        + _rows(1e14, sizes[:2], [2, 1.9])
    )
    checks = {m["budget"]: m for m in minimum_checks(rows)}
    inside, outside, none = checks[1e13], checks[3e13], checks[1e14]
    # D/N at the minimum: C / (6 N^2) for these rows
    assert inside["inside"] is True and inside["tokens_per_param"] == pytest.approx(1e13 / (6 * 3e5**2))
    assert "outside" not in inside["message"]
    assert outside["inside"] is False and outside["tokens_per_param"] == pytest.approx(3e13 / (6 * 1e7**2))
    assert "outside the sizes tried (100,000..1,600,000 parameters)" in outside["message"]
    assert none["inside"] is None and "fewer than 3 distinct model sizes" in none["message"]


def test_plan_checks_record_is_plain_data(base):
    lc = LadderConfig(budgets=[4e12])
    (check,) = plan_checks(plan_ladder(base, lc), lc)
    assert dataclasses.asdict(check) == check.record()
    assert check.record()["depths"] == [1, 2] and check.record()["brackets"] is True


def test_ladder_runs_log_their_validation_curve_evals_per_run_times(base):
    plan = plan_ladder(base, LadderConfig(budgets=[4.3e12], noise_seeds=1))
    for run in plan:
        assert run.config.train.eval_every == -(-run.steps // 20)
    off = plan_ladder(base, LadderConfig(budgets=[4.3e12], noise_seeds=1, evals_per_run=0))
    assert all(r.config.train.eval_every == 0 for r in off)


def test_a_new_field_at_its_default_keeps_every_runs_identity(monkeypatch):
    """config_key hashes only fields that differ from their defaults: a field tenx adds later (whose default
    keeps the old behaviour) leaves a ladder's finished runs reusable; a field set away from it does not."""
    from tenx.train.config import RunConfig

    cfg = RunConfig()
    cfg.optim.lr = 2e-3
    before = config_key(cfg)
    original = cfglib.to_dict

    def with_new_field(obj):
        tree = original(obj)
        if isinstance(obj, RunConfig):
            tree["train"]["some_new_field"] = 7 if getattr(obj, "_set_new", False) else 0
        return tree

    monkeypatch.setattr(cfglib, "to_dict", with_new_field)
    assert config_key(cfg) == before
    cfg._set_new = True  # type: ignore[attr-defined]
    assert config_key(cfg) != before
    cfg.optim.lr = 1e-3
    assert config_key(cfg) != before
