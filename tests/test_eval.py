"""Bits per byte: every token scored once, whatever the stride; the xz baseline."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tenx.eval.bpb import Scoring, stream_nll, summarize, window_plan
from tenx.model import ModelConfig, Transformer
from tenx.utils.xz import xz_bits_per_byte


@pytest.mark.parametrize(
    "n,T,stride", [(10, 4, 4), (10, 4, 2), (3, 4, 4), (9, 4, 1), (8, 4, 4), (1000, 64, 32)]
)
def test_window_plan_scores_each_target_once(n, T, stride):
    length, plan = window_plan(n, T, stride)
    covered = [j for start, first in plan for j in range(start + first, start + length)]
    assert covered == list(range(n))
    # every target after the first window has at least T - stride tokens of context
    assert all(first >= min(T - stride, start + first) for start, first in plan[1:])


def test_stream_nll_matches_manual_non_overlapping():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(family="llama", depth=1, head_dim=32, seq_len=8).resolved(50)).eval()
    tokens = np.random.default_rng(0).integers(1, 50, size=21)
    nll, n = stream_nll(model, tokens, 0, Scoring(batch_size=3))
    stream = torch.tensor(np.concatenate([[0], tokens]))
    manual = 0.0
    for s in range(0, 21, 8):
        x = stream[s : min(s + 8, 21)]
        y = stream[s + 1 : min(s + 9, 22)]
        # the last window is moved back to full length; score only its new targets
        if len(x) < 8:
            x, y, skip = stream[13:21], stream[14:22], 8 - (21 - s)
        else:
            skip = 0
        with torch.no_grad():
            losses = F.cross_entropy(model(x[None])[0], y, reduction="none")
        manual += losses[skip:].sum().item()
    assert n == 21 and math.isclose(nll, manual, rel_tol=1e-5)
    nll_half, n_half = stream_nll(model, tokens, 0, Scoring(batch_size=3, stride=4))
    assert n_half == 21 and nll_half != nll


def test_summarize_bits_per_byte_and_empty():
    r = summarize(nll=1000 * math.log(2), tokens=500, num_bytes=2000)
    assert r["bits_per_byte"] == pytest.approx(0.5) and r["bits_per_token"] == pytest.approx(2.0)
    assert summarize(0.0, 0, 0)["bits_per_byte"] is None


def test_xz_baseline_orders_data():
    rng = np.random.default_rng(0)
    assert xz_bits_per_byte(bytes(rng.integers(0, 256, 20000, dtype=np.uint8))) > 7.9
    assert xz_bits_per_byte(b"def f(x):\n    return x\n" * 1000) < 0.1
