"""bench/data_efficiency.py's check of the data-constrained law on points it was not fitted on, on losses
from a known law: an exact law predicts every left-out point, a point that is off the law shows as its own
error, and each point's seed noise is the spread over the square root of its seeds."""

from __future__ import annotations

import math

import pytest

from tenx.scaling.fit import effective_data

TRUE = {"E": 1.2, "A": 40.0, "B": 300.0, "alpha": 0.3, "beta": 0.35, "R_D_star": 6.0}
FRESH = 1e9


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("data_efficiency")


def law(N: float, D: float, U: float) -> float:
    d_eff = float(effective_data(D, U, TRUE["R_D_star"]))
    return TRUE["E"] + TRUE["A"] / N ** TRUE["alpha"] + TRUE["B"] / d_eff ** TRUE["beta"]


def study(spread: float = 0.0, off: tuple[float, float, float] | None = None, by: float = 0.0):
    """Baseline rows like the study's: 3 sizes x 3 token counts, fresh and at 2 unique budgets, two seeds
    `spread` apart around the law (so their mean is on it); the point `off` moved by the factor 1 + by."""
    rows = []
    for N in (1e5, 5e5, 1.5e6):
        for D in (5e5, 1e6, 2e6):
            for U in (FRESH, 2.5e5, 1e6):
                if U < FRESH and D <= U:
                    continue
                for sign in (-1, 1):
                    loss = law(N, D, U) * (1 + by * ((N, D, U) == off)) + sign * spread / 2
                    rows.append({"params": N, "tokens": D, "unique_tokens": U, "heldout_loss": loss})
    return rows


def test_an_exact_law_predicts_every_left_out_point(bench):
    held = bench.heldout_errors(study())  # no seed spread given: the noise is unknown
    assert all(math.isnan(e["noise"]) for e in held["leave_one_out"])
    assert len(held["leave_one_out"]) == 3 * 4  # every repeated point: 3 at 250k, 1 at 1M, per size
    assert {round(e["epochs"], 6) for e in held["leave_one_out"]} == {2.0, 4.0, 8.0}
    assert held["leave_one_out_max_abs"] < 1e-3
    assert [e["params"] for e in held["largest_size_repeated"]] == [1.5e6] * 4
    assert held["largest_size_repeated_max_abs"] < 1e-3


def test_the_largest_size_check_keeps_its_fresh_points_in_the_fit_so_it_is_no_size_extrapolation(bench):
    """A largest size wholly off the law (every point 5% high): its fresh points are fitted, so the check of
    its repeated points sees far less than 5%: what the check's name (`largest_size_repeated`) and the
    docs say, an extrapolation in epochs, not in model size."""
    rows = study()
    for r in rows:
        if r["params"] == 1.5e6:
            r["heldout_loss"] *= 1.05
    held = bench.heldout_errors(rows)
    assert held["largest_size_repeated_max_abs"] < 0.02
    assert "largest_size" not in held and "size_extrapolation" not in held


def test_a_point_off_the_law_shows_as_its_own_error_with_its_seed_noise(bench):
    off = (5e5, 2e6, 2.5e5)  # the middle size at 8 epochs, 4% above the law
    held = bench.heldout_errors(study(spread=0.02, off=off, by=0.04), seed_sigma=0.05)
    errors = {(e["params"], e["epochs"], e["unique_tokens"]): e for e in held["leave_one_out"]}
    moved = errors[(5e5, 8.0, 2.5e5)]
    assert moved["rel_error"] == pytest.approx(1 / 1.04 - 1, abs=0.01)  # the law, fitted without it
    assert held["leave_one_out_max_abs"] == pytest.approx(abs(moved["rel_error"]))
    mean = law(*off) * 1.04
    assert moved["noise"] == pytest.approx(0.05 / mean / math.sqrt(2), rel=1e-9)
    assert moved["seeds"] == 2
    others = [abs(e["rel_error"]) for k, e in errors.items() if k != (5e5, 8.0, 2.5e5)]
    assert max(others) < 0.02  # a robust (Huber) fit is not dragged far by the one point
    by_size = held["leave_one_out_max_abs_by_size"]  # the miss is named by its size
    assert list(by_size) == ["100000", "500000", "1500000"]
    assert by_size["500000"] == held["leave_one_out_max_abs"]
    assert max(by_size["100000"], by_size["1500000"]) < 0.02


def test_a_points_measured_loss_is_the_median_of_its_seeds(bench):
    """One seed of three that trained slowly (10% above its siblings, as depth 1's rare runs do) does not
    move the point: the law is compared with the median of its seeds, not their mean."""
    point = (1e5, 2e6, 1e6)  # the smallest size at 2 epochs of 1M
    rows = study()
    rows.append(
        {
            "params": point[0],
            "tokens": point[1],
            "unique_tokens": point[2],
            "heldout_loss": law(*point) * 1.10,
        }
    )
    held = bench.heldout_errors(rows, seed_sigma=0.02)
    moved = next(
        e for e in held["leave_one_out"] if (e["params"], e["unique_tokens"], e["epochs"]) == (1e5, 1e6, 2.0)
    )
    assert moved["seeds"] == 3
    assert abs(moved["rel_error"]) < 1e-3  # the mean of the three would be 3.3% above the law
    assert moved["noise"] == pytest.approx(0.02 / law(*point) / math.sqrt(3), rel=1e-6)
