"""The quickstart pipeline end to end on a tiny corpus (the full stdlib run is marked slow)."""

import json

import pytest

from tenx.cli import main
from tenx.quickstart import quickstart


def test_quickstart_pipeline_and_reuse(corpus_dir, tmp_path, capsys):
    out = tmp_path / "qs"
    overrides = [
        "model.depth=1",
        "model.seq_len=64",
        "train.micro_batch=4",
        "train.eval_every=0",
        "checkpoint.every=0",
        "log.progress=false",
        "log.tensorboard=false",
        "train.precision=fp32",
    ]
    summary = quickstart(out, steps=8, source=str(corpus_dir), tokenizer="bytes", overrides=overrides)
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["heldout_bits_per_byte"] == summary["heldout_bits_per_byte"]
    for key in (
        "heldout_bits_per_byte",
        "xz_bits_per_byte",
        "wall_seconds",
        "run_dir",
        "metrics",
        "loss_curve",
    ):
        assert key in on_disk
    assert 1.0 < on_disk["xz_bits_per_byte"] < 3.0  # Python source under xz -9e
    assert 0 < on_disk["heldout_bits_per_byte"] < 8.5
    assert on_disk["beats_xz"] == (on_disk["heldout_bits_per_byte"] < on_disk["xz_bits_per_byte"])
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert on_disk["heldout_bytes"] == manifest["splits"]["heldout"]["bytes"] > 0

    capsys.readouterr()
    again = quickstart(out, steps=8, source=str(corpus_dir), tokenizer="bytes", overrides=overrides)
    printed = capsys.readouterr().out
    assert "reusing prepared data" in printed and "reusing finished run" in printed
    assert again["heldout_bits_per_byte"] == summary["heldout_bits_per_byte"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_full_quickstart_beats_xz(tmp_path):
    """The README's main job on the whole standard library: held-out bits per byte below xz -9e."""
    assert main(["quickstart", "--out", str(tmp_path / "qs")]) == 0
    summary = json.loads((tmp_path / "qs" / "summary.json").read_text())
    assert summary["heldout_bits_per_byte"] < summary["xz_bits_per_byte"]


def test_quickstart_fits_its_steps_to_the_time_budget(corpus_dir, tmp_path, capsys, monkeypatch):
    """The step count comes from a measured training speed and the minutes left; a resumed quickstart
    keeps the plan it started with."""
    import tenx.quickstart as qs

    speeds = []

    def measure(cfg, micro_batch, steps=3):
        speeds.append((cfg.model.depth, micro_batch))
        return 2000.0  # tokens/s, as if this were a slow CPU

    monkeypatch.setattr(qs, "measure_tokens_per_s", measure)
    overrides = ["model.depth=1", "model.seq_len=64", "train.micro_batch=4", "log.progress=false"]
    overrides += ["log.tensorboard=false", "train.precision=fp32"]
    out = tmp_path / "qs"
    summary = quickstart(out, minutes=1.0, source=str(corpus_dir), tokenizer="bytes", overrides=overrides)
    plan = json.loads((out / "plan.json").read_text())
    heldout = json.loads((out / "data" / "manifest.json").read_text())["splits"]["heldout"]["tokens"]
    spent = plan["train_seconds_planned"]  # what the budget left for training, at 2000 tokens/s
    # before the seconds preparation took (a fraction of one here)
    expected = int(qs._LOOP_EFFICIENCY * (60 - 2 * heldout / 6000 - qs._RESERVE_S) * 2000 / 256)
    assert speeds == [(1, 4)] and plan["tokens_per_s"] == 2000.0
    assert 0.75 * expected <= plan["steps"] <= expected, (plan, expected)  # preparation took < 10 s
    assert summary["steps"] == plan["steps"] and spent == plan["steps"] * 256 / 2000
    assert (
        f"train.steps={plan['steps']}" in plan["settings"]
        and f"train.eval_every={plan['steps'] // 5}" in plan["settings"]
    )
    printed = capsys.readouterr().out
    assert f"training {plan['steps']} steps (what the budget allows)" in printed
    assert "wall time:" in printed and summary["budget_minutes"] == 1.0

    # a run interrupted half way resumes with the same plan, whatever the machine measures now
    monkeypatch.setattr(qs, "measure_tokens_per_s", lambda *a, **k: 1e9)
    again = quickstart(out, minutes=1.0, source=str(corpus_dir), tokenizer="bytes", overrides=overrides)
    assert again["steps"] == plan["steps"] and "reusing finished run" in capsys.readouterr().out


def test_a_cpu_too_slow_for_the_whole_schedule_trains_a_shallower_model(
    corpus_dir, tmp_path, capsys, monkeypatch
):
    """When the budget buys under 80% of the config's steps (an fp32-only CPU), the quickstart measures the
    next shallower depth and trains it for what the budget allows, up to twice the config's steps."""
    import tenx.quickstart as qs

    speeds = []

    def measure(cfg, micro_batch, steps=3):
        speeds.append(cfg.model.depth)
        return {3: 1500.0, 2: 3000.0}[cfg.model.depth]

    monkeypatch.setattr(qs, "measure_tokens_per_s", measure)
    overrides = ["model.aspect_ratio=16", "model.seq_len=64", "train.micro_batch=4", "log.progress=false"]
    overrides += ["log.tensorboard=false", "train.precision=fp32", "train.steps=400"]
    out = tmp_path / "qs"
    summary = quickstart(out, minutes=0.8, source=str(corpus_dir), tokenizer="bytes", overrides=overrides)
    plan = json.loads((out / "plan.json").read_text())
    assert speeds == [3, 2] and plan["depth"] == 2 and plan["tokens_per_s"] == 3000.0
    assert plan["settings"][0] == "model.depth=2" and 100 < plan["steps"] <= 800
    assert summary["steps"] == plan["steps"]
    printed = capsys.readouterr().out
    assert "allows only" in printed and "measuring depth 2, about twice as fast" in printed
    assert "depth = 2\n" in (out / "run" / "config.toml").read_text()


def test_quickstart_refuses_a_senseless_budget(tmp_path, capsys):
    assert main(["quickstart", "--out", str(tmp_path / "qs"), "--minutes", "nan"]) == 2
    assert "--minutes must be a finite number > 0" in capsys.readouterr().err
    assert not (tmp_path / "qs").exists()
