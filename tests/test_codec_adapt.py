"""`tenx compress --adapt`: the output layer learns as it codes, and the decoder repeats every update bit for
bit (tenx/compress/adapt.py, format version 3 of tenx/compress/container.py)."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tenx.cli import main
from tenx.compress import codec as codec_mod
from tenx.compress.adapt import E_BITS, AdaptiveHead
from tenx.compress.codec import compress_bytes, decompress_bytes
from tenx.compress.container import HEADER, HEADER_BYTES, SETTINGS, CodecAdaptation, read_header
from tenx.compress.files import decompress_file
from tenx.compress.fixed import FixedStepper, fixed_frequencies, to_grid
from tenx.data.prepare.sources import stdlib_dir
from tenx.errors import TenxError


@pytest.fixture(scope="module")
def unseen() -> bytes:
    """Over 100 KB of Python the model never saw: the standard library's `logging` package."""
    data = b"".join(p.read_bytes() for p in sorted((stdlib_dir() / "logging").glob("*.py")))
    assert len(data) > 100_000
    return data[:110_000]


def test_adaptive_files_round_trip_and_beat_plain_ones_over_100_kb(codec, unseen):
    plain = compress_bytes(codec, unseen)
    adaptive = compress_bytes(codec, unseen, adapt=CodecAdaptation())
    header = read_header(adaptive)
    assert header.version == 3 and header.adapt == CodecAdaptation() and not header.stored
    assert decompress_bytes(codec, adaptive) == unseen
    # Measured 0.956 of the plain file's size with this 20-step model (the quickstart model on 120 KB of
    # hypothesis's sources: 0.83).
    assert len(adaptive) < 0.97 * len(plain), (len(adaptive), len(plain))


def test_before_its_first_update_the_adaptive_head_gives_the_plain_logits(codec):
    weights = codec.fixed_weights()
    tokens = torch.tensor([10, 200, 33], dtype=torch.long)
    step = FixedStepper(weights, 3)
    head = AdaptiveHead(weights, CodecAdaptation())
    hidden = step.hidden(tokens, 0)
    assert torch.equal(head.logits(hidden), weights.head(hidden))


def test_the_exact_gradient_is_the_cross_entropy_gradient(codec):
    """One update from a zero state moves each weight by -lr * sign(gradient) (Adam's first step), where the
    gradient is the float64 cross-entropy gradient; and two heads fed the same tokens agree bit for bit."""
    weights = codec.fixed_weights()
    rows, vocab, eot = 16, codec.tokenizer.vocab_size, codec.tokenizer.eot_id
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(0, 256, rows))
    heads = [AdaptiveHead(weights, CodecAdaptation(lr=1e-3)) for _ in range(2)]
    hidden = FixedStepper(weights, rows).hidden(tokens, 0)
    freqs = fixed_frequencies(heads[0].logits(hidden), vocab, eot)
    targets = rng.integers(0, 256, rows)
    for head in heads:
        head.record(hidden, freqs, targets)
        head.update()
    assert torch.equal(heads[0].master_IO, heads[1].master_IO)
    assert torch.equal(heads[0].linear.q_IO, heads[1].linear.q_IO)
    p = torch.from_numpy(freqs / freqs.sum(axis=1, keepdims=True))
    p[torch.arange(rows), torch.from_numpy(targets)] -= 1.0
    grad = hidden.t() @ p / rows  # (D, V): the logits past the vocabulary have no gradient
    start = weights.head.q_IO * weights.head.scale_O
    moved = (start - heads[0].master_IO)[:, :vocab]
    assert torch.equal(start[:, vocab:], heads[0].master_IO[:, vocab:])
    clear = grad.abs() > 1e-3 * grad.abs().max()  # where rounding to 2**-20 cannot flip the sign
    assert torch.allclose(moved[clear], 1e-3 * grad[clear].sign(), rtol=1e-3)  # epsilon 1e-8 against |g|


def test_an_update_over_too_many_tokens_is_refused(codec):
    head = AdaptiveHead(codec.fixed_weights(), CodecAdaptation())
    d = int(codec.fixed_weights().head.q_IO.shape[0])
    head._hidden = [torch.zeros(1 << 17, d, dtype=torch.float64)]
    head._errors = [np.zeros((1 << 17, 1))]
    with pytest.raises(TenxError, match="would not be exact"):
        head.update()
    assert 2**E_BITS * 2**15 * (1 << 16) < 2**52  # what is allowed stays exact


ENCODE = """
import sys
from tenx.compress.files import compress_file
from tenx.compress.container import CodecAdaptation
import torch
print(torch.backends.cpu.get_cpu_capability(), flush=True)
compress_file(sys.argv[1], sys.argv[2], sys.argv[3], threads=1, adapt=CodecAdaptation(2e-3, 2))
"""


def test_an_adaptive_file_decodes_under_other_kernels_and_thread_counts(codec_run, unseen, tmp_path):
    """Compressed with adaptation under ATEN_CPU_CAPABILITY=default (plain C++ kernels, 1 thread), decoded
    under this machine's best kernels (AVX2 or AVX-512) with 2 threads: every update came out the same."""
    src = tmp_path / "logging.py"
    src.write_bytes(unseen[:30_000])
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", ENCODE, str(codec_run), str(src), str(tmp_path / "a.tenx")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "DEFAULT"
    assert read_header((tmp_path / "a.tenx").read_bytes()).adapt == CodecAdaptation(2e-3, 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        report = decompress_file(codec_run, tmp_path / "a.tenx", tmp_path / "a.out")
    finally:
        torch.set_num_threads(before)
    assert (tmp_path / "a.out").read_bytes() == src.read_bytes()
    assert report["adapt"] == {"lr": 2e-3, "every": 2}


def _with_settings(blob: bytes, raw: bytes) -> bytes:
    """`blob` (version 3) with its settings bytes replaced and its header checksum recomputed."""
    size = HEADER.size + SETTINGS.size
    packed = blob[: HEADER.size] + raw
    return packed + codec_mod._digest(packed) + blob[size + 8 :]


@pytest.mark.parametrize("lr, every", [(math.nan, 4), (-1e-3, 4), (math.inf, 4), (2.0, 4), (1e-3, 0)])
def test_forged_adaptation_settings_are_refused_by_name(codec, lr, every):
    blob = compress_bytes(codec, b"import os\n" * 30, adapt=CodecAdaptation())
    forged = _with_settings(blob, struct.pack("<dI", lr, every))
    with pytest.raises(TenxError, match="corrupt: its adaptation settings"):
        decompress_bytes(codec, forged)
    damaged = bytearray(blob)
    damaged[HEADER.size + 2] ^= 0x01
    with pytest.raises(TenxError, match="does not match its checksum"):
        decompress_bytes(codec, bytes(damaged))
    with pytest.raises(TenxError, match="truncated"):
        decompress_bytes(codec, blob[: HEADER_BYTES + 3])


def test_another_learning_rate_decodes_wrong_and_nothing_is_written(codec, unseen, tmp_path):
    """The settings are part of the code: a file rewritten to claim another rate fails its xxhash."""
    blob = compress_bytes(codec, unseen[:8_000], adapt=CodecAdaptation(2e-3, 2))
    forged = _with_settings(blob, CodecAdaptation(3e-3, 2).pack())
    with pytest.raises(TenxError, match="do not match|cannot be decoded|ran out"):
        decompress_bytes(codec, forged)


def test_cli_adapt_flags(codec_run, tmp_path, capsys):
    src = tmp_path / "f.py"
    src.write_bytes(b"def f(x):\n    return x + 1\n" * 40)
    main(["compress", str(codec_run), str(src), "--adapt", "--adapt-lr", "0.002", "--adapt-every", "2"])
    assert "output layer learning (lr 0.002, every 2)" in capsys.readouterr().out
    main(["decompress", str(codec_run), str(src) + ".tenx", "-o", str(tmp_path / "back.py")])
    assert (tmp_path / "back.py").read_bytes() == src.read_bytes()
    for flag, value in [("--adapt-every", "0"), ("--adapt-lr", "0"), ("--adapt-lr", "nan")]:
        with pytest.raises(SystemExit) as exit_:
            main(["compress", str(codec_run), str(src), "--adapt", flag, value, "--force"])
        assert exit_.value.code == 2
        assert flag in capsys.readouterr().err


def test_to_grid_of_the_whole_batch_is_one_power_of_two():
    x = torch.tensor([[3.0, -0.5], [100.0, 7.25]], dtype=torch.float64)
    q, scale = to_grid(x.flatten()[None])
    assert scale.numel() == 1 and float(q.abs().max()) == 2.0**15 * 100 / 128
