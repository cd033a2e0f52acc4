""".tenx files written on another machine, by the code of an earlier commit, decode here and are written again
byte for byte.

`tests/fixtures/codec_golden/` holds files that `tenx compress` (format 4, and format 2 before it) and
`tenx compress --adapt` (format 3) wrote of `_original()` with the model of tests/fixtures/old_main_checkpoint (a depth-1 byte
model; its data is regenerated as tests/test_resume_old_checkpoint.py does), on one thread of an AMD EPYC
with AVX-512 (see `cpu_kind.txt`). Where CI runs on another CPU kind (AVX2, Intel), this is the issue's
"compressed on one machine, decoded on another" for real, beside test_codec.py's emulation of other kernels
(ATEN_CPU_CAPABILITY) on one machine; on any machine it catches a change to the fixed-point rules that
would make earlier files unreadable (a float64 operation reordered, a polynomial changed, the grid moved).
Regenerate only when the format's version changes: `python tests/test_codec_golden.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_behaviour_unchanged import _cpu_kind
from test_resume_old_checkpoint import CHECKPOINT_DIR, prepare_old_checkpoint_data

from tenx.checkpoint.models import LoadedModel, load_model
from tenx.compress.codec import CodecModel, compress_bytes, decompress_bytes, load_codec
from tenx.compress.container import CodecAdaptation, read_header

GOLDEN = Path(__file__).parent / "fixtures" / "codec_golden"
ADAPT = CodecAdaptation(lr=1e-3, every=8)


def _original() -> bytes:
    """About 12 KB: code-like lines (several groups of 32-token chunks), UTF-8 beyond ASCII, every byte."""
    lines = [f"def f{i}(x):\n    return x * {i * i % 97} + {i % 7}  # step {i}\n" for i in range(260)]
    return "".join(lines).encode() + "naïve café — ünïcödé ✓\n".encode() + bytes(range(256))


def _codec(tmp: Path) -> CodecModel:
    data = prepare_old_checkpoint_data(tmp)
    loaded = load_model(CHECKPOINT_DIR, "cpu")
    return load_codec(
        LoadedModel(loaded.model, loaded.checkpoint, {**loaded.meta, "data_dir": str(data)}, None)
    )


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> CodecModel:
    return _codec(tmp_path_factory.mktemp("golden"))


FILES = {"plain.tenx": (2, {"version": 2}), "adapt.tenx": (3, {"adapt": ADAPT}), "int8.tenx": (4, {})}
"""Each golden file: its format version and how `compress_bytes` writes it."""


@pytest.mark.parametrize("name", FILES)
def test_files_from_another_machine_decode_and_are_written_again_bit_for_bit(codec, name):
    blob = (GOLDEN / name).read_bytes()
    original = _original()
    header = read_header(blob)
    version, how = FILES[name]
    assert header.version == version
    assert header.length == len(original) and header.threads == 1
    assert decompress_bytes(codec, blob) == original
    again = compress_bytes(codec, original, **how)
    recorded = (GOLDEN / "cpu_kind.txt").read_text().strip()
    assert again == blob, (
        f"written on {recorded!r}, this machine is {_cpu_kind()!r}: the encoder's bits moved"
    )


def test_the_golden_files_compress():
    """They hold code, not a stored copy: the model's code is shorter than the input."""
    original = _original()
    for name in FILES:
        assert len((GOLDEN / name).read_bytes()) < 0.95 * len(original)


if __name__ == "__main__":  # regenerate the fixtures (only when the format's version changes)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model = _codec(Path(tmp))
        GOLDEN.mkdir(exist_ok=True)
        for name, (_, how) in FILES.items():
            (GOLDEN / name).write_bytes(compress_bytes(model, _original(), **how))
        (GOLDEN / "cpu_kind.txt").write_text(_cpu_kind() + "\n")
    sys.exit(0)
