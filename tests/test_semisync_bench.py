"""bench/semisync_scaling.py's analysis on made-up losses: multipliers and trends from a known power law,
the scale of parity, bytes ratios and the budgets' shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest

BUDGETS = [1e11, 1e12, 1e13]


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("semisync_scaling")


def sync_loss(c: float) -> float:
    return 5.0 * c**-0.05


def rows(name: str, multiplier) -> dict[str, dict]:
    """Runs of a mode whose loss at C is sync's at multiplier(C) x C."""
    return {
        f"{name}@{i}": {"mode": name, "budget": c, "flops": c, "heldout_loss": sync_loss(multiplier(c) * c)}
        for i, c in enumerate(BUDGETS)
    }


def test_multiplier_trend_and_parity_of_known_power_laws(bench):
    growing = lambda c: 0.5 * (c / 1e11) ** 0.1  # noqa: E731 - x1.26 per decade, 1 at 1e11 * 2^10
    runs = {**rows("sync", lambda c: 1.0), **rows("half", lambda c: 0.5), **rows("growing", growing)}
    out = bench.analyse_modes(runs, ["sync", "half", "growing"], BUDGETS, bootstrap=0)["modes"]
    assert out["half"]["multiplier"] == pytest.approx([0.5] * 3, rel=1e-3)
    assert out["half"]["trend_per_decade"] == pytest.approx(1.0, abs=1e-3)
    assert out["half"]["gap_at_largest"] == pytest.approx(2**0.05 - 1, rel=1e-3)
    assert out["half"]["parity_flops"] is None  # a flat trend below 1 never reaches parity
    assert out["growing"]["multiplier"] == pytest.approx([growing(c) for c in BUDGETS], rel=1e-3)
    assert out["growing"]["trend_per_decade"] == pytest.approx(10**0.1, rel=1e-3)
    assert out["growing"]["parity_flops"] == pytest.approx(1e11 * 2**10, rel=1e-2)


def test_parity_interval_pivots_on_the_centroid_and_never_means_a_flat_slope(bench):
    logc = np.log10(BUDGETS)
    log_m = -0.3 + 0.1 * (logc - 11)  # m = 0.5 at 1e11, rising 10^0.1 per decade: parity at 10^14
    out = bench.parity(logc, log_m, [0.05, 0.2])
    assert out["parity_flops"] == pytest.approx(1e14, rel=1e-6)
    lo, hi = out["parity_interval"]
    # the centroid is (12, -0.2): parity at 12 + 0.2/s for s = 0.2 and 0.05
    assert math.log10(lo) == pytest.approx(13.0) and math.log10(hi) == pytest.approx(16.0)
    assert bench.parity(logc, log_m, [-0.1, 0.2])["parity_interval"][1] is None


def test_bytes_ratio_is_sync_bytes_over_the_modes(bench):
    ratios = bench.bytes_ratios({"sync": 400.0, "diloco-h40": 10.0, "diloco-h40-int8": 2.5})
    assert ratios == {"sync": 1.0, "diloco-h40": 40.0, "diloco-h40-int8": 160.0}


def test_budgets_train_tokens_per_param_in_whole_outer_steps(bench):
    budgets = bench.plan_budgets("2x96,1x64", 16, 2048, 40)
    assert [(b.depth, b.d_model) for b in budgets] == [(1, 64), (2, 96)]  # sorted by compute
    for b in budgets:
        assert b.steps % 40 == 0 and abs(b.tokens / b.params - 16) < 40 * 2048 / b.params
        assert b.flops > 6 * b.params * b.tokens  # embeddings, head and attention come on top
