"""The prequential code length of the training stream (tenx/train/callbacks/prequential.py)."""

from __future__ import annotations

import json
import lzma
import math

import numpy as np
import pytest

from tenx.data.loader import TokenStream
from tenx.data.tokenizer import load_tokenizer, train_bpe
from tenx.monitor.status import format_status
from tenx.rundir import RunDir
from tenx.train.callbacks.record import read_steps
from tenx.train.run import train

SETTINGS = ("train.steps=12", "checkpoint.every=6", "train.eval_every=0", "train.threads=1")


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_token_bytes_spell_the_stream(tiny_data, kind):
    text = "def f(x):\n    return x  # héllo wörld ✓ 日本\t\r\n<|endoftext|> stays text\n"
    tokenizer = load_tokenizer(tiny_data) if kind == "bytes" else train_bpe([text * 20], 300)
    pieces = tokenizer.token_bytes()
    assert len(pieces) == tokenizer.vocab_size and pieces[tokenizer.eot_id] == b""
    assert b"".join(pieces[i] for i in tokenizer.encode(text)) == text.encode("utf-8")


def test_prequential_code_length_is_the_first_epoch_loss_before_each_update(tiny_data, tiny_config, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_config(tiny_data, *SETTINGS), run_dir)
    result = json.loads(RunDir(run_dir).prequential.read_text())
    # recomputed independently: each step's loss (before its update) times its target tokens, over their bytes
    stream = TokenStream(tiny_data, "train")
    losses = {
        m["step"]: m["loss"]
        for m in map(json.loads, RunDir(run_dir).metrics.read_text().splitlines())
        if "loss" in m
    }
    nats, n_bytes, data = 0.0, 0, b""
    for record in read_steps(RunDir(run_dir).steps):
        targets = [stream.read(w * 64, 65)[1:] for ids in record["windows"] for w in ids]
        nats += losses[record["step"]] * sum(len(t) for t in targets)
        chunk = b"".join(
            bytes(t[t < 256].astype(np.uint8)) for t in targets
        )  # the end-of-document id is no byte
        n_bytes += len(chunk)
        data += chunk
    assert result["steps"] == 12 and result["tokens"] == 12 * 8 * 64
    assert result["bytes"] == n_bytes
    assert result["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-12)
    same = result["same_bytes"]
    xz = 8 * len(lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)) / len(data)
    assert same["bytes"] == len(data) and same["xz_bits_per_byte"] == pytest.approx(xz, rel=1e-12)
    assert not result["first_epoch_complete"]
    metrics = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    assert metrics[-1]["prequential_bpb"] == pytest.approx(result["bits_per_byte"], rel=1e-12)
    status = format_status(run_dir)
    assert "prequential" in status and "xz -9e" in status


def test_a_resumed_run_continues_the_sums_exactly(tiny_data, tiny_config, tmp_path):
    whole = tmp_path / "whole"
    train(tiny_config(tiny_data, *SETTINGS), whole)
    broken = tmp_path / "broken"
    with pytest.raises(RuntimeError, match="injected crash"):
        train(tiny_config(tiny_data, *SETTINGS, "faults.inject=['crash@step=9']"), broken)
    train(tiny_config(tiny_data, *SETTINGS, "faults.inject=['crash@step=9']"), broken, resume="auto")
    a = json.loads(RunDir(whole).prequential.read_text())
    b = json.loads(RunDir(broken).prequential.read_text())
    assert (a["bits"], a["bytes"], a["tokens"], a["steps"]) == (
        b["bits"],
        b["bytes"],
        b["tokens"],
        b["steps"],
    )
