"""Watching a run: the comparison with prediction.json, off-prediction events, the trend detectors, and the
self-extrapolated final loss (tenx.monitor.deviation, tenx.monitor.trends, tenx.train.callbacks.watch,
tenx.scaling.self_extrapolation)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tenx.errors import ConfigError
from tenx.monitor.deviation import PredictionWatch, check_target, deviation
from tenx.monitor.events import read_events
from tenx.monitor.metrics_file import read_metrics
from tenx.monitor.prediction_file import Prediction, read_prediction, write_prediction
from tenx.monitor.trends import TrendConfig, TrendDetectors
from tenx.rundir import RunDir


def _flat(steps: int, loss: float = 2.0, band: float = 0.05, window: int = 5, quantity: str = "train_loss"):
    s = list(range(6, steps + 1))
    return Prediction(
        step=s,
        tokens=[512 * i for i in s],
        loss=[loss] * len(s),
        lower=[loss * (1 - band)] * len(s),
        upper=[loss * (1 + band)] * len(s),
        window=window,
        quantity=quantity,
        target={"steps": steps, "tokens_per_step": 512},
    )


def test_deviation_is_in_band_half_widths_on_the_side_the_loss_lies():
    assert deviation(2.1, 2.0, 1.9, 2.1) == pytest.approx(1.0)
    assert deviation(1.9, 2.0, 1.9, 2.1) == pytest.approx(-1.0)
    assert deviation(2.0, 2.0, 1.9, 2.1) == 0.0
    # twice as far out (in log space) as the upper edge
    assert deviation(2.0 * (2.1 / 2.0) ** 2, 2.0, 1.9, 2.1) == pytest.approx(2.0)


def test_a_persistent_excursion_is_one_off_prediction_event_and_coming_back_is_another():
    watch = PredictionWatch(_flat(200), persist=10)
    events = []
    for step in range(1, 201):
        loss = 2.3 if 50 <= step < 120 else 2.0  # 15% above a 5% band from step 50 to 119
        figures, event = watch.observe(step, {"step": step, "loss": loss})
        if step >= 10:
            assert set(figures) == {"pred_loss", "pred_lower", "pred_upper", "pred_actual", "pred_dev"}
        if event:
            events.append(event)
    kinds = [e["kind"] for e in events]
    assert kinds == ["off-prediction", "on-prediction"]
    off = events[0]
    # the 5-step mean leaves the band at step 51 (two of five steps at 2.3: mean 2.12 > 2.1)
    assert off["direction"] == "above" and off["since_step"] == 51 and off["step"] == 60
    assert off["relative"] > 0.05 and off["deviation"] > 1
    assert events[1]["step"] >= 120


def test_short_excursions_and_noise_inside_the_band_raise_nothing():
    rng = np.random.default_rng(0)
    watch = PredictionWatch(_flat(500, band=0.05), persist=20)
    for step in range(1, 501):
        loss = 2.0 * math.exp(0.04 * rng.standard_normal()) + (0.5 if step % 97 == 0 else 0.0)
        _, event = watch.observe(step, {"step": step, "loss": loss})
        assert event is None, step


def test_a_validation_prediction_compares_only_validations_and_two_in_a_row_are_enough():
    watch = PredictionWatch(_flat(100, quantity="val_loss"), persist=50)
    assert watch.persist == 2 and watch.window == 1
    assert watch.observe(20, {"step": 20, "loss": 9.0}) == ({}, None)
    figures, event = watch.observe(20, {"step": 20, "loss": 9.0, "val_loss": 1.7})
    assert figures["pred_actual"] == 1.7 and figures["pred_dev"] < -1 and event is None
    _, event = watch.observe(40, {"step": 40, "loss": 9.0, "val_loss": 1.7})
    assert event["kind"] == "off-prediction" and event["direction"] == "below" and event["since_step"] == 20


def test_a_prediction_for_another_run_is_refused_naming_both_lengths():
    p = _flat(100)
    check_target(p, "p.json", 100, 512)
    with pytest.raises(ConfigError, match="p.json predicts a run of 100 steps, this run has 300"):
        check_target(p, "p.json", 300, 512)
    with pytest.raises(ConfigError, match="predicts 512 tokens per step, this run trains 1024"):
        check_target(p, "p.json", 100, 1024)


def _feed(detectors: TrendDetectors, steps: range, make) -> list[dict]:
    events = []
    for step in steps:
        events += detectors.observe(step, make(step))
    return events


def test_steady_growth_of_a_layer_statistic_is_one_growth_event_with_its_evidence():
    cfg = TrendConfig(window=100, growth_factor=2.0)
    d = TrendDetectors(cfg, total_steps=1000)

    def metrics(step):
        out = {"grad_norm": 1.0 + 0.01 * math.sin(step)}
        if step % 10 == 0:  # statistics every 10 steps
            out["stats/attn_logit_max/1"] = 5.0 * math.exp(0.01 * step)  # e^1 = 2.7x per 100 steps
            out["stats/attn_logit_max/0"] = 5.0
        return out

    events = _feed(d, range(1, 1001), metrics)
    assert [e["kind"] for e in events] == ["growth"]
    (e,) = events
    assert e["key"] == "stats/attn_logit_max/1" and e["factor"] == pytest.approx(math.e, rel=0.01)
    assert e["r2"] > 0.99 and e["step"] == 100  # reported once, as soon as detectors start


def test_the_detectors_wait_for_the_start_of_the_run_and_ignore_noise():
    d = TrendDetectors(TrendConfig(window=100), total_steps=2000)
    assert d.start == 200  # 10% of the run
    rng = np.random.default_rng(1)
    events = _feed(
        d,
        range(1, 2001),
        lambda s: {
            "grad_norm": 3.0 * math.exp(-s / 50) + 0.5 * math.exp(0.2 * rng.standard_normal()),
            "tokens_per_s": 20000 * math.exp(0.05 * rng.standard_normal()),
            **({"stats/act_rms/0": 1 + 0.1 * rng.standard_normal() ** 2} if s % 10 == 0 else {}),
        },
    )
    assert events == []


def test_a_slow_rank_and_falling_throughput_are_events():
    d = TrendDetectors(TrendConfig(window=100, straggler_ratio=1.5, throughput_drop=0.3), total_steps=400)

    def metrics(step):
        out = {"tokens_per_s": 10000.0 if step < 300 else 5000.0}
        if step % 10 == 0:
            out |= {
                "stats/step_time_s/rank0": 0.10,
                "stats/step_time_s/rank1": 0.25,
                "stats/step_time_s/rank2": 0.11,
            }
        return out

    events = _feed(d, range(1, 401), metrics)
    stragglers = [e for e in events if e["kind"] == "straggler"]
    assert [e["rank"] for e in stragglers] == [1] and stragglers[0]["ratio"] == pytest.approx(2.5, rel=0.1)
    (drop,) = [e for e in events if e["kind"] == "throughput-drop"]
    assert drop["before"] == 10000 and drop["now"] == 5000 and drop["drop"] == pytest.approx(0.5)
    assert 300 < drop["step"] < 320


def test_drift_from_the_prediction_is_an_event():
    d = TrendDetectors(TrendConfig(window=100), total_steps=500)
    events = _feed(d, range(1, 501), lambda s: {"pred_dev": 0.02 * s - 1.0})
    (e,) = events
    assert (
        e["kind"] == "drift"
        and e["direction"] == "above"
        and e["slope_per_1000_steps"] == pytest.approx(20, rel=0.05)
    )


# ----- a real run -----------------------------------------------------------------------------------
def test_a_run_watched_against_a_prediction_logs_it_and_reports_leaving_its_band(
    tiny_config, tiny_data, tmp_path
):
    from tenx.scaling.self_extrapolation import SelfExtrapolation, summary_fields
    from tenx.train.run import train

    steps = 120
    # a prediction 30% above what this run reaches: the run lies below the band from early on
    pred = _flat(steps, loss=4.0, band=0.05, window=4)
    pred.target["tokens_per_step"] = 8 * 64
    path = write_prediction(tmp_path / "predicted.json", pred)
    cfg = tiny_config(
        tiny_data,
        f"train.steps={steps}",
        "train.eval_every=0",
        "checkpoint.every=0",
        f'monitor.prediction="{path}"',
        "monitor.off_prediction_steps=10",
        "monitor.extrapolate_every=40",
    )
    run = tmp_path / "run"
    train(cfg, run, extra_callbacks=[SelfExtrapolation(cfg)])
    records = read_metrics(RunDir(run).metrics)
    watched = [r for r in records if "pred_dev" in r]
    # every step whose 4-step window is centred (step - 1) on a predicted step (from 6): steps 7..120
    assert [r["step"] for r in watched] == list(range(7, steps + 1))
    assert all(r["pred_loss"] == 4.0 and r["pred_lower"] == pytest.approx(3.8) for r in watched)
    off = [e for e in read_events(run) if e["kind"] == "off-prediction"]
    assert len(off) == 1 and off[0]["direction"] == "below" and off[0]["steps"] == 10
    assert read_prediction(RunDir(run).prediction).final["loss"] == 4.0  # kept with the run
    finals = [r for r in records if "pred_final_self" in r]
    assert finals and all(r["pred_final"] == 4.0 for r in finals)
    last = records[-1]
    assert finals[-1]["pred_final_self"] == pytest.approx(last["loss"], rel=0.25)
    summary = summary_fields(run)
    assert summary["off_prediction_events"] == 1 and summary["pred_final"] == 4.0
    json.dumps(summary)


def test_a_prediction_made_for_another_length_stops_the_run_before_it_starts(
    tiny_config, tiny_data, tmp_path
):
    from tenx.train.run import train

    path = write_prediction(tmp_path / "p.json", _flat(500))
    cfg = tiny_config(tiny_data, "train.steps=10", f'monitor.prediction="{path}"')
    with pytest.raises(ConfigError, match="predicts a run of 500 steps, this run has 10"):
        train(cfg, tmp_path / "run")


def test_a_prediction_from_shorter_runs_holds_for_a_clean_run_and_not_for_a_worse_learning_rate(
    tiny_config, tiny_data, tmp_path
):
    """The issue's acceptance in miniature: three cosine runs of 100-300 steps play the ladder; the
    prediction of a 400-step run watches a clean run (another seed: no event) and one whose learning rate
    is 10x too small (an off-prediction event, above)."""
    from tenx.scaling.predict import predict_from_ladder
    from tenx.train.run import train

    common = ["train.eval_every=0", "checkpoint.every=0", "checkpoint.at_end=false", "monitor.trends=false"]
    for steps in (100, 200, 300):
        train(
            tiny_config(tiny_data, f"train.steps={steps}", *common),
            tmp_path / "ladder" / "runs" / f"s{steps}",
        )
    target = tiny_config(tiny_data, "train.steps=400", *common)
    prediction, _ = predict_from_ladder(tmp_path / "ladder", target, bootstrap=10, quantity="loss")
    path = write_prediction(tmp_path / "prediction.json", prediction)
    watched = [f'monitor.prediction="{path}"', "monitor.off_prediction_steps=30", "train.steps=400", *common]
    for name, extra in (("clean", ["train.seed=7"]), ("slow-lr", ["optim.lr=1e-3"])):
        train(tiny_config(tiny_data, *watched, *extra), tmp_path / name)
    clean = read_metrics(RunDir(tmp_path / "clean").metrics)
    assert sum("pred_dev" in r for r in clean) >= 400 - 10 - prediction.window
    assert not [e for e in read_events(tmp_path / "clean") if e["kind"] == "off-prediction"]
    off = [e for e in read_events(tmp_path / "slow-lr") if e["kind"] == "off-prediction"]
    assert off and off[0]["direction"] == "above"
