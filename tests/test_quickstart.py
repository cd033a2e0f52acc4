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
