"""`tenx compress` / `tenx decompress`: exact round trips of any bytes, and refusals of the wrong model or a
damaged file."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tenx.cli import main
from tenx.compress import codec as codec_mod
from tenx.compress import mixture as mixture_mod
from tenx.compress.codec import compress_bytes, decompress_bytes, load_codec, read_header
from tenx.compress.container import HEADER_BYTES
from tenx.compress.files import compress_file, decompress_file
from tenx.compress.fixed import FixedStepper, FixedWeights, GridLinear, det_exp, det_log, det_sin_cos
from tenx.compress.float32 import FloatStepper
from tenx.compress.model import to_ids
from tenx.data.loader import TokenStream
from tenx.data.prepare.pipeline import PrepareConfig, prepare
from tenx.errors import TenxError
from tenx.model.config import ModelConfig
from tenx.model.transformer import Transformer

RNG = np.random.default_rng(0)
ADVERSARIAL = {
    "empty": b"",
    "one byte": b"\xff",
    "all 256 byte values": bytes(range(256)),
    "random binary": RNG.bytes(2000),
    "invalid utf-8": b"caf\xc3 \xff\xfe ok \xed\xa0\x80 \xc3\xa9 <|endoftext|> \x80",
    "long run": b"z" * 5000,
    "text with NUL": "d\u00e9j\u00e0 vu\x00\x00 \u20ac\ttab\r\n".encode() * 20,
}


@pytest.fixture(scope="module")
def bpe_codec(train_tiny, corpus_dir, tmp_path_factory):
    """A tiny model over a byte-level BPE of 300 tokens (text and raw bytes take different paths)."""
    data = tmp_path_factory.mktemp("data") / "bpe"
    prepare(
        PrepareConfig(source=str(corpus_dir), out=str(data), tokenizer="bpe", vocab_size=300), progress=False
    )
    return load_codec(train_tiny(data, "train.steps=2"))


def _heldout_documents(data_dir) -> list[bytes]:
    stream = TokenStream(data_dir, "heldout", verify=True)
    eot = int(stream.manifest["tokenizer"]["eot_id"])
    tokens = stream.read(0, len(stream))
    ends = np.flatnonzero(tokens == eot)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e].astype(np.uint8).tobytes() for s, e in zip(starts, ends)]


def test_every_heldout_document_round_trips_and_compresses(codec, tiny_data):
    documents = _heldout_documents(tiny_data)
    assert documents
    packed = 0
    for doc in documents:
        blob = compress_bytes(codec, doc)
        assert decompress_bytes(codec, blob) == doc
        assert not read_header(blob).stored
        packed += len(blob)
    assert 8 * packed / sum(map(len, documents)) < 6.0  # a model trained 20 steps, vs 8 for raw bytes


@pytest.mark.parametrize("name", ADVERSARIAL)
@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_adversarial_inputs_round_trip(name, which, codec, bpe_codec):
    model = codec if which == "bytes" else bpe_codec
    data = ADVERSARIAL[name]
    blob = compress_bytes(model, data)
    assert decompress_bytes(model, blob) == data
    assert len(blob) <= HEADER_BYTES + len(data)  # stored verbatim when the model's code is longer


def test_bpe_codes_text_as_text_and_other_bytes_as_byte_tokens(bpe_codec):
    text = b"def compress(data):\n    return data\n"
    ids = to_ids(bpe_codec, text)
    assert len(ids) < len(text)  # merged tokens, not one per byte
    raw = to_ids(bpe_codec, b"\xff\xfe")
    assert raw.tolist() == bpe_codec.byte_ids[[0xFF, 0xFE]].tolist()
    assert bpe_codec.tokenizer.eot_id not in to_ids(bpe_codec, b"<|endoftext|>").tolist()


@pytest.mark.parametrize(
    "overrides", [{"family": "llama", "n_kv_heads": 1}, {"family": "gpt2"}], ids=["rope-gqa", "learned"]
)
def test_cached_steps_compute_the_models_logits(overrides):
    torch.manual_seed(0)
    cfg = ModelConfig(depth=2, d_model=64, head_dim=16, seq_len=32, **overrides).resolved(100)
    model = Transformer(cfg).eval()
    tokens_BT = torch.randint(0, 100, (3, cfg.seq_len))
    with torch.inference_mode():
        step = FloatStepper(model, 3)
        cached = torch.stack([step(tokens_BT[:, t], t) for t in range(cfg.seq_len)], dim=1)
        torch.testing.assert_close(cached, model(tokens_BT), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [{"family": "llama", "n_kv_heads": 1}, {"family": "llama", "qk_norm": True}, {"family": "gpt2"}],
    ids=["rope-gqa", "qk-norm", "learned"],
)
@pytest.mark.parametrize("bits", [15, 7], ids=["v2-grid", "v4-int8"])
def test_the_fixed_point_steps_compute_the_models_logits(overrides, bits):
    torch.manual_seed(0)
    cfg = ModelConfig(depth=2, d_model=64, head_dim=16, seq_len=32, **overrides).resolved(100)
    model = Transformer(cfg).eval()
    for p in model.parameters():  # a trained model's spread of weights, not the initial one's
        p.data.add_(torch.randn_like(p) * 0.05)
    tokens_BT = torch.randint(0, 100, (3, cfg.seq_len))
    with torch.inference_mode():
        weights = FixedWeights(model, torch.device("cpu"), bits)
        step = FixedStepper(weights, 3)
        fixed = torch.stack([step(tokens_BT[:, t], t) for t in range(cfg.seq_len)], dim=1)
        tolerance = 2e-3 if bits == 15 else 0.1  # 7-bit linear layers: ~1% of each product's scale
        torch.testing.assert_close(fixed, model(tokens_BT).double(), atol=tolerance, rtol=tolerance)
        # The encoder's one pass over every position gives the same bits as stepping (and a chunk shorter
        # than seq_len too): that is what lets it skip the decoder's loop.
        for length in (cfg.seq_len, 7):
            stepped = torch.stack([step.hidden(tokens_BT[:, t], t) for t in range(length)], dim=1)
            at_once = FixedStepper(weights, 3).hidden_all(tokens_BT[:, :length])
            assert torch.equal(at_once, stepped)
            for block in (1, 5, 8):  # blocks of positions, each attending to the ones before it: same bits
                assert torch.equal(FixedStepper(weights, 3).hidden_all(tokens_BT[:, :length], block), stepped)


def test_int8_products_are_the_float64_products_of_the_same_integers():
    """Format 4's linear layers: `torch._int_mm` on int8 gives exactly the float64 product of the clamped
    7-bit grid integers (what a GPU or a torch without int8 kernels computes), for any rows, including a
    row whose peak rounds to 128 (clamped to 127) and a layer with a bias; the grid stays within int8."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 40)
    with torch.no_grad():
        layer.weight[3, 5] = 0.25 * 0.999  # the row's peak: 127.87 on the 7-bit grid, rounds to 128
    fast = GridLinear.of(layer, torch.device("cpu"), 7)
    assert fast.q8_IO is not None, "this torch has no CPU int8 products"
    slow = GridLinear(fast.q_IO, fast.scale_O, fast.bias_O, 7)
    assert float(fast.q_IO.abs().max()) == 127.0 and int(fast.q8_IO.abs().max()) == 127
    x = torch.randn(5, 7, 96, dtype=torch.float64) * 3
    x[0, 0] = x[0, 0].clamp(-3.9, 3.9)
    x[0, 0, 0] = 4 * 0.9995  # a peak at 127.94 of the grid
    for rows in (x, x[:1, :1], x[0]):
        assert torch.equal(fast(rows), slow(rows))
    torch.testing.assert_close(fast(x), layer(x.float()).double(), atol=0.1, rtol=0.05)  # outputs ~1.7


def test_deterministic_functions_are_accurate():
    x = torch.linspace(-60, 60, 20001, dtype=torch.float64)
    assert float(((det_exp(x) - torch.exp(x)) / torch.exp(x)).abs().max()) < 1e-12
    sin, cos = det_sin_cos(x * 5)
    assert (
        float((sin - (x * 5).sin()).abs().max()) < 1e-12 and float((cos - (x * 5).cos()).abs().max()) < 1e-12
    )
    assert all(
        abs(det_log(v) - math.log(v)) < 1e-14 * max(1, abs(math.log(v))) for v in (1e-9, 0.5, 1, 3, 1e4)
    )


ENCODE = """
import sys
from tenx.compress.files import compress_file, decompress_file
import torch
print(torch.backends.cpu.get_cpu_capability(), flush=True)
run, src, dst, threads, mode = sys.argv[1:]
if mode == "compress":
    compress_file(run, src, dst, threads=int(threads))
else:
    torch.set_num_threads(int(threads))
    decompress_file(run, src, dst)
"""


def test_a_file_decodes_under_other_kernels_and_thread_counts(codec_run, tmp_path):
    """Compressed under ATEN_CPU_CAPABILITY=default (plain C++ kernels, 1 thread) and decoded under this
    machine's best (AVX2 or AVX-512, 2 threads), and the reverse: the fixed-point rules give the same bits."""
    import os
    import subprocess
    import sys

    src = tmp_path / "doc.py"
    src.write_bytes(b"import email\nprint(email.message_from_string('x'))\n" * 20 + bytes(range(40)))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(Path(__file__).parents[1])}

    def child(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", ENCODE, str(codec_run), *args], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    assert child(str(src), str(tmp_path / "a.tenx"), "1", "compress") == "DEFAULT"
    assert read_header((tmp_path / "a.tenx").read_bytes()).version == 4  # int8 products under default kernels
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        decompress_file(codec_run, tmp_path / "a.tenx", tmp_path / "a.out")
    finally:
        torch.set_num_threads(before)
    assert (tmp_path / "a.out").read_bytes() == src.read_bytes()
    compress_file(codec_run, src, tmp_path / "b.tenx", threads=2)
    child(str(tmp_path / "b.tenx"), str(tmp_path / "b.out"), "1", "decompress")
    assert (tmp_path / "b.out").read_bytes() == src.read_bytes()


def test_version_1_files_still_decode(codec, tiny_data):
    data = b"".join(_heldout_documents(tiny_data))[:600]
    blob = compress_bytes(codec, data, version=1)
    assert read_header(blob).version == 1 and decompress_bytes(codec, blob) == data


def test_round_trip_across_torch_thread_counts(codec, tiny_data):
    data = b"".join(_heldout_documents(tiny_data))[:400]  # small: 2 threads crawl on a busy 2-core machine
    before = torch.get_num_threads()
    try:
        for coding_threads, encode_outer, decode_outer in [(1, 1, 2), (2, 2, 1)]:
            torch.set_num_threads(encode_outer)
            blob = compress_bytes(codec, data, threads=coding_threads)
            assert torch.get_num_threads() == encode_outer  # restored after coding
            assert read_header(blob).threads == coding_threads
            torch.set_num_threads(decode_outer)
            assert decompress_bytes(codec, blob) == data
    finally:
        torch.set_num_threads(before)


def test_a_files_chunks_are_coded_in_equal_groups(codec, tiny_data, monkeypatch):
    """Chunks split into as few groups of at most MAX_GROUP as possible, of nearly equal size (no short
    last group stepping through every position for a few rows); the header says the size, and a file
    with groups of any size (64 + 64 + 6 from before) still decodes."""
    assert [codec_mod._balanced(n, 64) for n in (1, 64, 65, 134, 200)] == [1, 64, 33, 45, 50]
    assert codec_mod._balanced(134, 256) == 134
    data = b"".join(_heldout_documents(tiny_data))[:3000]
    chunks = -(-len(codec_mod.to_ids(codec, data)) // codec.model.cfg.seq_len)
    assert chunks >= 7
    monkeypatch.setattr(codec_mod, "MAX_GROUP", chunks - 2)  # two groups: half and half
    blob = compress_bytes(codec, data)
    assert read_header(blob).group == -(-chunks // 2) and decompress_bytes(codec, blob) == data
    monkeypatch.setattr(codec_mod, "_balanced", lambda n, group: group)  # the old split: a short last group
    blob = compress_bytes(codec, data)
    assert read_header(blob).group == chunks - 2 and decompress_bytes(codec, blob) == data


@pytest.fixture(scope="module")
def blob(codec, tiny_data):
    return compress_bytes(codec, _heldout_documents(tiny_data)[0][:2000])


def test_another_model_is_refused_naming_both(blob, codec, train_tiny, tiny_data):
    other = load_codec(train_tiny(tiny_data, "train.steps=2", "train.seed=1"))
    with pytest.raises(TenxError, match="another model") as caught:
        decompress_bytes(other, blob)
    assert codec.model_hash in str(caught.value) and other.model_hash in str(caught.value)


def test_truncated_or_corrupt_files_are_refused(blob, codec):
    for cut in (0, 3, 10, HEADER_BYTES - 1, HEADER_BYTES, len(blob) // 2, len(blob) - 1):
        with pytest.raises(TenxError, match="truncated|not a tenx"):
            decompress_bytes(codec, blob[:cut])
    with pytest.raises(TenxError, match="longer than"):
        decompress_bytes(codec, blob + b"\0")
    for at in (0, 4, 20, 60, HEADER_BYTES - 1, HEADER_BYTES, len(blob) - 1):
        damaged = bytearray(blob)
        damaged[at] ^= 0x10
        with pytest.raises(TenxError, match="corrupt|not a tenx|version"):
            decompress_bytes(codec, bytes(damaged))


def _forged(blob: bytes, tokens: int, body: bytes) -> bytes:
    """`blob` with a header rewritten to claim `tokens` tokens (and as many bytes) over `body`, its
    checksums recomputed as anyone can."""
    header = read_header(blob)
    header.tokens = header.length = tokens
    header.words, header.code_hash = len(body) // 4, codec_mod._digest(body)
    return header.pack() + body


@pytest.mark.parametrize("tokens", [1 << 30, 7_000_000, 200_000, 5_000, 300])
@pytest.mark.parametrize(
    "body", [b"\0" * 4, b"\xff" * 4, bytes(RNG.integers(0, 256, 4, dtype=np.uint8)), b"\x5a" * 8]
)
def test_a_forged_header_is_refused_in_under_a_second(blob, codec, tokens, body):
    """A header that claims far more tokens than its body can hold (the checksums are recomputable) is
    refused before decoding, or decoding stops once the body's information is spent."""
    forged = _forged(blob, tokens, body)
    started = time.perf_counter()
    with pytest.raises(TenxError, match="corrupt or forged|do not match the original") as caught:
        decompress_bytes(codec, forged, max_bytes=1 << 31)
    assert time.perf_counter() - started < 1.0, caught.value
    if tokens >= 1 << 30:
        assert "claims 1,073,741,824 tokens" in str(caught.value)


def test_the_bound_holds_for_tokens_as_likely_as_the_coder_allows(codec, monkeypatch):
    """The information bound never refuses a real file: tokens the model gives the largest probability the
    coder can code (50,000 of them in one 32-bit word) still round-trip."""
    real = mixture_mod.fixed_frequencies  # the frequencies format 4 codes with
    z = int(codec.byte_ids[ord("z")])

    def certain(logits, vocab, eot):
        freqs = real(logits, vocab, eot)
        freqs[:, z] += 2.0**40
        return freqs

    monkeypatch.setattr(mixture_mod, "fixed_frequencies", certain)
    for data in (b"z" * 50_000, b"z" * 3000 + b"a" + b"z" * 3000):
        packed = compress_bytes(codec, data)
        assert read_header(packed).words <= 2
        assert decompress_bytes(codec, packed) == data


def test_a_claimed_original_above_the_limit_is_refused(blob, codec):
    with pytest.raises(TenxError, match="above the limit of 10; pass --max-bytes"):
        decompress_bytes(codec, blob, max_bytes=10)


def test_output_is_verified_before_it_is_written(codec, tmp_path, monkeypatch):
    src, packed, out = tmp_path / "a.txt", tmp_path / "a.tenx", tmp_path / "out.txt"
    src.write_bytes(b"import json\n" * 50)
    compress_file(codec, src, packed)
    real = mixture_mod.fixed_frequencies  # the frequencies format 4 codes with

    def skewed(logits, vocab, eot):  # what another CPU's rounding could do to the decoder's side
        freqs = real(logits, vocab, eot)
        freqs[:, 0] += 1e6
        return freqs

    monkeypatch.setattr(mixture_mod, "fixed_frequencies", skewed)
    with pytest.raises(TenxError, match="do not match the original's xxhash"):
        decompress_file(codec, packed, out)
    assert not out.exists()


def test_outputs_are_not_overwritten_without_force(codec, tmp_path):
    src, packed, out = tmp_path / "a.bin", tmp_path / "a.tenx", tmp_path / "out.bin"
    src.write_bytes(b"\x00\x01 hello")
    for path in (packed, out):
        path.write_bytes(b"keep me")
    with pytest.raises(TenxError, match="--force"):
        compress_file(codec, src, packed)
    assert packed.read_bytes() == b"keep me"
    report = compress_file(codec, src, packed, force=True)
    assert report["bytes"] == 8 and report["compressed_bytes"] == packed.stat().st_size
    with pytest.raises(TenxError, match="--force"):
        decompress_file(codec, packed, out)
    assert out.read_bytes() == b"keep me"
    decompress_file(codec, packed, out, force=True)
    assert out.read_bytes() == src.read_bytes()


def test_cli_round_trip_and_refusals(codec_run, tmp_path, capsys):
    src = tmp_path / "doc.py"
    src.write_bytes(b"import email\nprint(email.message_from_string('x'))\n" * 20)
    assert main(["compress", str(codec_run), str(src)]) == 0
    assert "bits per byte" in capsys.readouterr().out and (tmp_path / "doc.py.tenx").exists()
    assert main(["compress", str(codec_run), str(src)]) == 2
    assert "--force" in capsys.readouterr().err
    src.rename(tmp_path / "original.py")
    assert main(["decompress", str(codec_run), str(tmp_path / "doc.py.tenx")]) == 0
    assert src.read_bytes() == (tmp_path / "original.py").read_bytes()
    damaged = bytearray((tmp_path / "doc.py.tenx").read_bytes())
    damaged[-1] ^= 1
    (tmp_path / "bad.tenx").write_bytes(damaged)
    assert main(["decompress", str(codec_run), str(tmp_path / "bad.tenx"), "-o", str(tmp_path / "x")]) == 2
    assert "corrupt" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_fuzz_random_bytes_round_trip(bpe_codec):
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=12, deadline=None, database=None)
    @hypothesis.given(st.binary(max_size=200) | st.text(max_size=80).map(str.encode))
    def round_trip(data: bytes) -> None:
        assert decompress_bytes(bpe_codec, compress_bytes(bpe_codec, data)) == data

    round_trip()


def test_many_files_decode_together_as_each_does_alone(codec, tiny_data, monkeypatch):
    """decompress_many gives each file's original, whatever shares its model steps: files of one short
    chunk, of several groups (decoded in order, never two of one file at once), stored, empty, format 1
    and 3, and a damaged file among them, which fails alone, named, while the others still decode."""
    docs = _heldout_documents(tiny_data)
    data = b"".join(docs)
    chunks = -(-len(codec_mod.to_ids(codec, data[:3000])) // codec.model.cfg.seq_len)
    monkeypatch.setattr(codec_mod, "MAX_GROUP", chunks // 3)  # 3000 bytes: three groups or more
    originals = [data[:3000], docs[0][:40], b"", RNG.bytes(300), docs[1][:700], *docs[2:5]]
    blobs = [compress_bytes(codec, d) for d in originals]
    assert read_header(blobs[0]).tokens > 2 * read_header(blobs[0]).group * read_header(blobs[0]).chunk
    originals.append(docs[0][:500])
    blobs.append(compress_bytes(codec, originals[-1], version=1))
    originals.append(docs[1][:500])
    blobs.append(compress_bytes(codec, originals[-1], adapt=codec_mod.CodecAdaptation()))
    damaged = bytearray(compress_bytes(codec, docs[1][:900]))
    damaged[-5] ^= 0x10
    results = codec_mod.decompress_many(codec, [*blobs, bytes(damaged)], names=[*map(str, blobs), "bad.tenx"])
    assert results[:-1] == originals
    assert isinstance(results[-1], TenxError) and "bad.tenx" in str(results[-1])
    assert [decompress_bytes(codec, b) for b in blobs] == originals
    monkeypatch.setattr(codec_mod, "_group", lambda model: 1)  # one chunk a step: every file in turn
    assert codec_mod.decompress_many(codec, blobs[:2]) == originals[:2]


def test_cli_decompresses_several_files_and_writes_the_good_ones(codec_run, tmp_path, capsys):
    sources = {
        name: f"print({i})\n".encode() * (5 + 40 * i) for i, name in enumerate(("a.py", "b.py", "c.py"))
    }
    for name, data in sources.items():
        (tmp_path / name).write_bytes(data)
    paths = [str(tmp_path / name) for name in sources]
    assert main(["compress", str(codec_run), *paths]) == 0
    assert capsys.readouterr().out.count("compressed ") == 3
    assert main(["compress", str(codec_run), *paths, "-o", str(tmp_path / "x")]) == 2
    assert "-o names one output" in capsys.readouterr().err
    for name in sources:
        (tmp_path / name).unlink()
    damaged = bytearray((tmp_path / "b.py.tenx").read_bytes())
    damaged[-1] ^= 1
    (tmp_path / "b.py.tenx").write_bytes(damaged)
    assert main(["decompress", str(codec_run), *(p + ".tenx" for p in paths)]) == 2
    captured = capsys.readouterr()
    assert "2 of 3 files decompressed together" in captured.out and "b.py.tenx" in captured.err
    assert not (tmp_path / "b.py").exists()
    for name in ("a.py", "c.py"):
        assert (tmp_path / name).read_bytes() == sources[name]
