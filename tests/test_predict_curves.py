"""`tenx predict --curves`: fit anyone's curves (a curve table) and predict another table's runs, checked on
the multi-power-law paper's published 25M curves (tests/data/published-curves, MIT); the published run
sets' readers; the regime warnings in both directions."""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from tenx.cli import main
from tenx.errors import DataError
from tenx.monitor.prediction_file import read_prediction
from tenx.scaling.curve import fit_curves, shape_prior
from tenx.scaling.curve.curve_table import (
    curve_regime_warnings,
    read_curve_table,
    rows_of,
    table_from_rows,
    write_curve_table,
)
from tenx.scaling.curve.published_curves import MPL_FIT, gemstones, lr_scheduling, multipowerlaw

DATA = Path(__file__).parent / "data"
PUBLISHED = DATA / "published-curves"
FIT, TARGET = PUBLISHED / "mpl-25m-fit.csv", PUBLISHED / "mpl-25m-target.csv"


def test_predict_a_published_split_from_its_fitting_schedules(tmp_path, capsys):
    out = tmp_path / "pred"
    assert (
        main(
            ["predict", "--curves", str(FIT), "--target", str(TARGET), "--out", str(out), "--bootstrap", "4"]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "fitted tissue-rate" in text and "predicted 6 run(s)" in text and "WARNING" not in text
    target = read_curve_table(TARGET)
    first = {r.run: r.schedule().first_step for r in target.runs}
    expected = sum(int((r.steps >= first[r.run]).sum()) for r in target.runs)
    with open(out / "prediction.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == expected and list(rows[0]) == ["run", "step", "loss", "lower", "upper"]
    observed = {(r.run, int(s)): float(v) for r in target.runs for s, v in zip(r.steps, r.loss)}
    errors = [abs(float(r["loss"]) / observed[(r["run"], int(r["step"]))] - 1) for r in rows]
    assert sum(errors) / len(errors) < 0.003  # measured 0.11% (every row of the six unseen schedules)
    assert max(errors) < 0.012  # measured 0.68% (cosine_72000, 3x longer than any fitted run)
    inside = [float(r["lower"]) <= observed[(r["run"], int(r["step"]))] <= float(r["upper"]) for r in rows]
    assert sum(inside) / len(inside) > 0.8
    prediction = read_prediction(out / "prediction.json")
    assert prediction.quantity == "train_loss" and prediction.source["kind"] == "curves"
    assert prediction.target["run"] == target.runs[0].run and prediction.step[-1] == target.runs[0].last_step
    per_run = sorted(p.parent.name for p in (out / "runs").glob("*/prediction.json"))
    assert len(per_run) == 6 and "25M_cosine_72000" in per_run
    assert (out / "prediction.png").stat().st_size > 20_000
    # the outputs are the user's: a second run refuses to replace them, --force replaces them
    argv = ["predict", "--curves", str(FIT), "--target", str(TARGET), "--out", str(out), "--bootstrap", "0"]
    assert main(argv) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0


def test_predict_curves_needs_both_tables_and_an_output(tmp_path, capsys):
    assert main(["predict", "--target", str(TARGET), "--out", str(tmp_path / "o")]) == 2
    assert "--curves FIT" in capsys.readouterr().err
    assert main(["predict", "--curves", str(FIT), "--target", str(TARGET)]) == 2
    assert "--out DIR" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("run,params,tokens_per_step,step,lr,loss\nr,1e6,100,1,,3.0\nr,1e6,100,2,0.1,2.9\n")
    assert main(["predict", "--curves", str(bad), "--target", str(TARGET), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "line 2" in err and "'lr'" in err


def _rows(run: str, params: float, steps: range, loss, lr=1e-3, tps=1000.0, **extra):
    return [
        {"run": run, "params": params, "tokens_per_step": tps, "step": s, "lr": lr, "loss": loss(s), **extra}
        for s in steps
    ]


def test_regime_warnings_name_the_run_and_stay_quiet_on_healthy_runs(tmp_path):
    healthy = _rows("healthy", 1e3, range(10, 2001, 10), lambda s: 2 + 5 * s**-0.3)  # 2,000 tokens/param
    starved = _rows("starved", 1e6, range(10, 2001, 10), lambda s: 2 + 5 * s**-0.3)  # 2 tokens/param
    rising = _rows("overfit", 1e3, range(10, 2001, 10), lambda s: 2 + 5 * s**-0.3 + (s / 2000) ** 4 * 0.3)
    repeated = _rows("repeated", 1e3, range(10, 2001, 10), lambda s: 2 + 5 * s**-0.3, unique_tokens=5e5)
    path = write_curve_table(tmp_path / "t.jsonl", healthy + starved + rising + repeated)
    runs = {r.run: r for r in read_curve_table(path).runs}
    assert curve_regime_warnings([runs["healthy"]]) == []
    (starved_w,) = curve_regime_warnings([runs["starved"]], "predicted")
    assert "predicted run 'starved'" in starved_w and "2 tokens per parameter" in starved_w
    (rise_w,) = curve_regime_warnings([runs["overfit"]])
    assert "'overfit'" in rise_w and "rises again" in rise_w
    (rep_w,) = curve_regime_warnings([runs["repeated"]])
    assert "'repeated'" in rep_w and "4 epochs" in rep_w
    # the published curves raise none (a warning there would be a false alarm)
    assert curve_regime_warnings(read_curve_table(FIT).runs + read_curve_table(TARGET).runs) == []


def test_a_starved_target_gets_a_warning_on_the_command_line(tmp_path, capsys):
    table = read_curve_table(TARGET)
    run = next(r for r in table.runs if r.run.endswith("wsdld_20000_24000"))
    rows = [{**row, "tokens_per_step": 1000.0, "loss": None} for row in rows_of(run)]  # ~1 token/param
    target = write_curve_table(tmp_path / "starved.csv", rows)
    argv = ["predict", "--curves", str(FIT), "--target", str(target), "--out", str(tmp_path / "o")]
    assert main([*argv, "--bootstrap", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("WARNING: predicted run '25M/wsdld_20000_24000' trains 0.96 tokens per parameter")
    assert "observed rows" not in out  # nothing to compare: every loss left empty
    # a model size the fit has no level for is refused, naming the size
    big = write_curve_table(tmp_path / "big.csv", [{**row, "params": 25e9} for row in rows])
    argv = ["predict", "--curves", str(FIT), "--target", str(big), "--out", str(tmp_path / "o2")]
    assert main([*argv, "--bootstrap", "0"]) == 2
    assert "cannot predict a model of 2.5e+10" in capsys.readouterr().err


def test_published_readers_on_the_committed_subset_and_real_layouts(tmp_path):
    rows, infos = multipowerlaw(PUBLISHED / "MultiPowerLaw")
    assert len(infos) == 9 and {i.params for i in infos.values()} == {25e6}
    assert (
        infos["25M/wsdld_20000_24000"].schedule == "wsd" and infos["25M/wsdld_20000_24000"].decay == "linear"
    )
    assert math.isclose(infos["25M/wsd_20000_24000"].cooldown, 1 / 6)
    assert infos["25M/wsdcon_3"].schedule == "two-stage"
    assert {f"25M/{n}" for n in MPL_FIT} <= set(infos)
    # Gemstones' JSON-lines layout (two runs, constant learning rate)
    gem = tmp_path / "hot.jsonl"
    lines = [
        {"run_name": f"PyGemma-{w}x4_pretrain", "params_active_precise": p, "width": w, "depth": 4,
         "tokens": 4194304 * s, "step": s, "num_nodes": 1, "seconds_per_step": 1.0, "final_loss": 4 - s / 1e4}
        for w, p in ((256, 4.8e7), (512, 9.5e7)) for s in (477, 954, 1431)
    ]  # fmt: skip
    gem.write_text("".join(json.dumps(x) + "\n" for x in lines))
    grows, ginfo = gemstones(gem)
    assert sorted(ginfo) == ["PyGemma-256x4", "PyGemma-512x4"] and len(grows) == 6
    assert ginfo["PyGemma-512x4"].tokens_per_step == 4194304 and {r["lr"] for r in grows} == {1.0}
    # lr-scheduling's layout: a cooldown file joined to the constant run of the same model and peak
    data = tmp_path / "lr" / "data"
    data.mkdir(parents=True)
    config = {"dataset": "slimpajama", "n_layer": 2, "n_embd": 64, "n_head": 2, "lr": 1e-3, "batch_size": 2,
              "acc_steps": 1, "world_size": 1, "sequence_length": 8, "warmup_steps": 100}  # fmt: skip

    def run_file(name, iters, lrs, cfg):
        history = {
            "train": {"iter": iters, "train_loss": [5 - i / 1e3 for i in iters], "train_lr": lrs},
            "val": {"iter": iters[1::2], "val_loss": [5.1 - i / 1e3 for i in iters[1::2]]},
        }
        (data / name).write_text(
            json.dumps({"config": cfg, "summary": {"parameters": 1e5}, "history": history})
        )

    base_iters = list(range(50, 2001, 50))
    run_file("stable-x.json", base_iters, [min(1e-3, 1e-3 * i / 100) for i in base_iters],
             {**config, "scheduler": "wsd", "wsd_fract_decay": 0, "iterations": 2000})  # fmt: skip
    cool = list(range(850, 1001, 50))
    run_file("ann-x.json", cool, [1e-3 * (1000 - i) / 200 + 1e-6 for i in cool],
             {**config, "scheduler": "wsd", "wsd_fract_decay": 0.2, "iterations": 1000, "decay_type": "linear"})  # fmt: skip
    lrows, linfo = lr_scheduling(tmp_path / "lr")
    assert linfo["ann-x"].schedule == "wsd" and "stable-x.json" in linfo["ann-x"].source
    steps = [r["step"] for r in lrows if r["run"] == "ann-x" and r["split"] == "train"]
    assert steps[0] == 50 and steps[-1] == 1000 and 800 in steps and 850 in steps and 900 not in steps[:16]
    assert linfo["stable-x"].schedule == "constant" and linfo["ann-x"].tokens_per_step == 16
    # the joined rows are a valid curve table
    table = read_curve_table(write_curve_table(tmp_path / "lr.csv", lrows))
    assert {r.run for r in table.runs} == {"ann-x", "stable-x"}
    (data / "ann-orphan.json").write_text(
        (data / "ann-x.json").read_text().replace('"n_layer": 2', '"n_layer": 3')
    )
    with pytest.raises(DataError, match="ann-orphan.json: no constant-learning-rate run"):
        lr_scheduling(tmp_path / "lr")


def test_a_run_extrapolation_and_a_ladder_say_when_published_curves_gave_their_prior(tmp_path, capsys):
    part = tmp_path / "run"
    part.mkdir()
    src = DATA / "curves" / "d1b16-cos3000"
    for name in ("config.toml", "run.json"):
        shutil.copy(src / name, part / name)
    lines = (src / "metrics.jsonl").read_text().splitlines()
    (part / "metrics.jsonl").write_text("".join(x + "\n" for x in lines if json.loads(x)["step"] <= 900))
    argv = ["predict", "--run", str(part), "--curves", str(FIT), "--law", "tissue-rate", "--bootstrap", "2"]
    assert main(argv) == 0
    assert "prior: shape of tissue-rate fitted to 3 runs of" in capsys.readouterr().out
    prediction = read_prediction(part / "extrapolation" / "prediction.json")
    assert "mpl-25m-fit.csv" in prediction.source["prior"] and prediction.source["kind"] == "self"
    # without --curves, no such claim
    assert (
        main(["predict", "--run", str(part), "--bootstrap", "0", "--force", "-o", str(tmp_path / "o")]) == 0
    )
    assert "prior" not in read_prediction(tmp_path / "o" / "prediction.json").source


def test_shape_prior_carries_only_unit_free_parameters():
    curves = [r.curve() for r in read_curve_table(FIT).runs]
    for law, expected in (
        ("tissue-rate", {"alpha", "p"}),
        ("mpl", {"alpha", "beta", "gamma"}),
        ("power", {"alpha"}),
    ):
        prior = shape_prior(fit_curves(curves, law, bootstrap=0))
        assert set(prior) == expected
        assert all(sd > 0 for _, sd in prior.values())


def test_the_bench_measures_the_papers_split_on_the_subset():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import published_curves as bench
    finally:
        sys.path.pop(0)
    rows, _ = multipowerlaw(PUBLISHED / "MultiPowerLaw")
    errors = bench.task_mpl_split(table_from_rows(rows, "subset"), "tissue-rate", bootstrap=0)
    s = bench.summarise(errors)
    assert s["runs"] == 6 and s["mean"] < 0.003 and s["worst_window"] < 0.01  # measured 0.10%, 0.51%
    assert s["worst_mean"] <= s["worst_window"] and s["worst_final"] <= s["worst_window"]


def test_a_ladder_prediction_says_its_shape_prior_came_from_published_curves(tmp_path, capsys):
    ladder = tmp_path / "ladder"
    for run in (DATA / "curves").iterdir():
        if run.is_dir() and run.name.startswith(("d1-", "d2-", "d3-")):
            shutil.copytree(run, ladder / "runs" / run.name)
    target = DATA / "curves" / "d4-wsd300" / "config.toml"
    argv = ["predict", "--from", str(ladder), "--config", str(target), "--set", "model.vocab_size=257"]
    assert main([*argv, "--bootstrap", "0", "--curves", str(FIT)]) == 0
    assert "prior: shape of tissue-rate fitted to 3 runs of" in capsys.readouterr().out
    prediction = read_prediction(ladder / "predictions" / "config" / "prediction.json")
    assert "mpl-25m-fit.csv" in prediction.source["prior"] and prediction.source["kind"] == "ladder"
