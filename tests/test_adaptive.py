"""Adaptive (prequential) evaluation: each chunk is scored before the model trains on it, the model learns
what repeats, and the run's own model is never changed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tenx.checkpoint.models import load_model
from tenx.cli import main
from tenx.data.manifest import read_manifest
from tenx.data.tokenizer import load_tokenizer
from tenx.eval.adaptive import AdaptConfig, adaptive_token_nll
from tenx.train.run import train


@pytest.fixture(scope="module")
def run(tiny_config, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapt") / "run"
    train(tiny_config(tiny_data, "train.steps=20", "checkpoint.every=0", "train.eval_every=0"), out)
    return out


def _tokens(run, text: str) -> tuple[np.ndarray, int, object]:
    loaded = load_model(run, "cpu")
    tok = load_tokenizer(loaded.data_dir, read_manifest(loaded.data_dir)["tokenizer"])
    return np.asarray(tok.encode(text), dtype=np.int64), tok.eot_id, loaded.model


def test_a_model_that_learns_as_it_reads_codes_repeats_in_fewer_bits(run):
    text = "def transmogrify(zork, quux):\n    return {'zork': zork * 7, 'quux': quux[::-1]}\n" * 30
    tokens, eot, model = _tokens(run, text)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = AdaptConfig(lr=3e-3, steps=2, batch=2)
    adaptive, static = adaptive_token_nll(model, tokens, eot, cfg)
    first = model.cfg.seq_len * cfg.batch  # the first chunk is coded before any step: the same figures
    assert np.array_equal(adaptive[:first], static[:first])
    assert adaptive.sum() < 0.8 * static.sum()  # the repeats are learnt: measured 0.71
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # a copy adapted, not the run's model


@pytest.mark.parametrize("params", ["norms", "head", "last"])
def test_each_parameter_choice_adapts(run, params):
    tokens, eot, model = _tokens(run, "while True:\n    counter += 1\n" * 60)
    adaptive, static = adaptive_token_nll(
        model, tokens, eot, AdaptConfig(lr=3e-3, steps=1, batch=2, params=params)
    )
    assert adaptive.sum() < static.sum()


def test_eval_adapt_reports_adaptive_static_and_xz(run, tmp_path, capsys):
    code = tmp_path / "code"
    code.mkdir()
    for i in range(4):
        (code / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 25)
    out = tmp_path / "eval.json"
    argv = ["eval", str(run), "--split", str(code), "--adapt", "--adapt-lr", "3e-3", "--out", str(out)]
    assert main(argv) == 0
    a = json.loads(out.read_text())["datasets"][str(code)]["adaptive"]
    assert a["adaptive_bits_per_byte"] < a["static_bits_per_byte"]
    assert a["bytes"] == sum(f.stat().st_size for f in code.iterdir())
    assert a["xz_bits_per_byte"] > 0 and a["settings"] == {
        "lr": 3e-3,
        "steps": 1,
        "batch": 8,
        "params": "all",
    }
    assert "adaptive (learning as it reads" in capsys.readouterr().out
