"""Issue 47, last small items: `ladder --emit` writes nothing when it refuses; forged but in-range adapt
settings of a .tenx file are refused naming the settings; a tokenizer's panic during the round-trip check is
an error naming the tokenizer, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenx.cli import main
from tenx.compress.container import HEADER, CodecAdaptation, _digest, header_bytes, read_header
from tenx.data.tokenizer import BPE_FILE, BPETokenizer, check_round_trip, train_bpe
from tenx.errors import DataError


def _ladder(tiny_data, lad: Path, how: str, *extra: str) -> int:
    args = ["ladder", "--config", "tiny", "--set", f'data.dir="{tiny_data}"', "--budgets", "3e10,1e11"]
    return main([*args, "--grid", "ratio", "--max-depth", "1", "--out", str(lad), "--emit", how, *extra])


@pytest.mark.parametrize(
    "name, how, extra, says",
    [
        ("lad", "torchrun", ["--nproc", "3"], "cannot be split over 3 ranks"),
        ("my ladder", "slurm", [], "--out"),  # a space cannot go into an #SBATCH line
    ],
)
def test_ladder_emit_refusal_writes_nothing(tiny_data, tmp_path, capsys, name, how, extra, says):
    lad = tmp_path / name
    assert _ladder(tiny_data, lad, how, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("tenx: error:") and err.count("\n") == 1 and says in err and "Traceback" not in err
    assert not lad.exists()  # no plan.json, no runs/*/config.toml, no launch/
    lad.mkdir()
    (lad / "keep.txt").write_text("mine")
    assert _ladder(tiny_data, lad, how, *extra) == 2
    assert sorted(p.name for p in lad.iterdir()) == ["keep.txt"]


# ----- forged but in-range adaptation settings of a .tenx file ----------------------------------------------


@pytest.fixture(scope="module")
def run(train_tiny, tiny_data):
    """A tiny byte-level model trained two steps (what compress and decompress need)."""
    return train_tiny(tiny_data, "train.steps=2")


def forge_settings(blob: bytes, settings: CodecAdaptation) -> bytes:
    """`blob` (format 3) with its header's adaptation settings replaced and the header checksum recomputed
    (what a forger does)."""
    size = header_bytes(blob[4])
    head = bytearray(blob[: size - 8])
    head[HEADER.size :] = settings.pack()
    return bytes(head) + _digest(bytes(head)) + blob[size:]


@pytest.mark.parametrize("lr, every", [(3e-3, 2), (2e-3, 3), (1.0, 4096)])
def test_forged_in_range_adaptation_settings_are_named(run, tmp_path, capsys, lr, every):
    src = tmp_path / "f.py"
    src.write_bytes(b"def f(x):\n    return x + 1\n" * 60)
    assert main(["compress", str(run), str(src), "--adapt", "--adapt-lr", "0.002", "--adapt-every", "2"]) == 0
    packed = Path(str(src) + ".tenx")
    assert read_header(packed.read_bytes()).adapt == CodecAdaptation(2e-3, 2)
    packed.write_bytes(forge_settings(packed.read_bytes(), CodecAdaptation(lr, every)))
    assert read_header(packed.read_bytes()).adapt == CodecAdaptation(lr, every)  # in range: the header reads
    out = tmp_path / "back.py"
    capsys.readouterr()
    assert main(["decompress", str(run), str(packed), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tenx: error:") and err.count("\n") == 1 and "Traceback" not in err
    assert str(packed) in err
    assert f"adaptation settings (learning rate {lr!r}, every {every} positions)" in err
    assert not out.exists()


# ----- a tokenizer's panic is an error naming the tokenizer, not a traceback ----------------------------------

PANIC_TEXT = "a" * 40 + "b"  # `(a+)+$` backtracks on it past Oniguruma's retry limit: `tokenizers` panics


def _panicking_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer.json whose pre-tokenizer splits on `(a+)+$` (refused on loading since
    issue 47 item 6; here it stands for any pattern that makes `tokenizers` panic)."""
    from tokenizers import Regex, pre_tokenizers

    hf = train_bpe(["def f(x):\n    return x\n"] * 20, 300)._hf
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex("(a+)+$"), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / BPE_FILE))
    return directory / BPE_FILE


def test_a_tokenizer_panic_in_the_round_trip_check_names_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    path = _panicking_tokenizer(tmp_path / "tok")
    tokenizer = BPETokenizer(HFTokenizer.from_file(str(path)), path)
    assert tokenizer.decode(tokenizer.encode("def f(x): pass")) == "def f(x): pass"  # ordinary text encodes
    with pytest.raises(DataError) as caught:
        check_round_trip(tokenizer, [("m.py", PANIC_TEXT, None)], "--tokenizer-from tok")
    message = str(caught.value)
    assert message.startswith(f"{path}: the tokenizer panicked while encoding (PanicException: ")
    assert "retry-limit-in-match over" in message and "'(a+)+$'" in message
    with pytest.raises(DataError, match=r"panicked while encoding .*'\(a\+\)\+\$'"):
        tokenizer.encode_batch(["x", PANIC_TEXT])


def test_prepare_with_a_panicking_tokenizer_ends_in_one_error_line(tmp_path, capsys, monkeypatch):
    from tenx.data import tokenizer_regex

    path = _panicking_tokenizer(tmp_path / "tok")
    monkeypatch.setattr(tokenizer_regex, "backtracking_problem", lambda pattern: None)  # a pattern it misses
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "a.py").write_text(f"x = '{PANIC_TEXT}'\n")
    (source / "b.py").write_text("def f(x):\n    return x\n" * 5)
    argv = ["data", "prepare", "--source", str(source), "--out", str(tmp_path / "data"), "--tokenizer-from"]
    assert main([*argv, str(path.parent), "--val-ratio", "0.1", "--heldout-ratio", "0.1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"tenx: error: {path}: the tokenizer panicked while encoding (PanicException: ")
    assert "'(a+)+$'" in err
