"""Issue 47, part C: crafted inputs that hung, ran away or misled now end in one `error:` line naming the flag,
field or pattern (or a WARNING where the input is legal but a figure would mislead)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tenx.cli import main
from tenx.data.tokenizer import BPE_FILE, BPETokenizer, train_bpe
from tenx.data.tokenizer_regex import backtracking_problem

# ----- item 6: a pre-tokenizer regex that backtracks ---------------------------------------------------------

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.mark.parametrize("pattern", [GPT2, LLAMA3, O200K, DEEPSEEK, r"\p{N}{1,3}", r"(?:ab)+", r"[]a]+x{2,}"])
def test_byte_level_bpe_patterns_pass(pattern):
    assert backtracking_problem(pattern) is None


@pytest.mark.parametrize(
    "pattern, why",
    [
        (r"(a+)+$", "repetition"),
        (r"(a|aa)*", "alternation"),
        (r"(?:a?){30}a{30}", "repetition"),
        (r"(?i:a|b)+", "alternation"),
        (r"((ab)*c)+", "repetition"),
        (r"(a)\1", "backreference"),
        ("a" * 5000, "characters long"),
    ],
)
def test_backtracking_patterns_are_named(pattern, why):
    assert why in backtracking_problem(pattern)


def _tokenizer_dir(tmp_path: Path, pattern: str | None) -> Path:
    """A model directory whose tokenizer.json splits on `pattern` before its byte-level step."""
    tree = json.loads(train_bpe(["hello world aaaa"] * 10, 300).to_json())
    if pattern is not None:
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        tree["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tree["pre_tokenizer"]]}
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / BPE_FILE).write_text(json.dumps(tree))
    return directory


@pytest.fixture
def aaa_source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"f{i}.txt").write_text(("a" * 40 + "b\n") * 3 + f"document {i}\n")
    return src


def _prepare(source: Path, out: Path, tokenizer_dir: Path) -> list[str]:
    return [
        "data", "prepare", "--source", str(source), "--out", str(out), "--tokenizer-from", str(tokenizer_dir),
        "--workers", "2", "--val-ratio", "0.1", "--heldout-ratio", "0.1", "--quiet",
    ]  # fmt: skip


def test_prepare_refuses_a_backtracking_pattern_before_reading(aaa_source, tmp_path, capsys):
    started = time.monotonic()
    assert main(_prepare(aaa_source, tmp_path / "out", _tokenizer_dir(tmp_path, r"(a+)+$"))) == 2
    err = capsys.readouterr().err
    assert "'(a+)+$'" in err and "pre_tokenizer" in err and err.count("error:") == 1
    assert not (tmp_path / "out").exists()  # refused before any worker started
    assert time.monotonic() - started < 30  # hang guard


class _Panic(BaseException):
    """Stands for pyo3's PanicException, which derives from BaseException and killed the pool's worker."""


_MAIN_PID = os.getpid()
_ENCODE = BPETokenizer.encode


def _panicking_encode_batch(self, texts):
    if os.getpid() != _MAIN_PID:  # in the prepare workers only
        raise _Panic("Onig: Regex search error: retry-limit-in-match over")
    return [_ENCODE(self, text) for text in texts]


def _panicking_encode(self, text):
    if os.getpid() != _MAIN_PID and "a" * 40 in text:
        raise _Panic("Onig: Regex search error: retry-limit-in-match over")
    return _ENCODE(self, text)


def test_a_worker_panic_ends_prepare_with_an_error(aaa_source, tmp_path, monkeypatch, capsys):
    """A pattern that passes the check and still reaches Oniguruma's retry limit ends in an error naming it
    and the document (the workers are forked, so they see the patched tokenizer)."""
    monkeypatch.setattr(BPETokenizer, "encode_batch", _panicking_encode_batch)
    monkeypatch.setattr(BPETokenizer, "encode", _panicking_encode)
    started = time.monotonic()
    assert main(_prepare(aaa_source, tmp_path / "out", _tokenizer_dir(tmp_path, r"a+b"))) == 2
    err = capsys.readouterr().err
    assert "retry-limit-in-match" in err and "'a+b'" in err and "document" in err
    assert time.monotonic() - started < 60  # hang guard: it waited for ever


def _dying_batch(batch):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_ends_prepare_with_an_error(aaa_source, tmp_path, monkeypatch, capsys):
    from tenx.data.prepare import stream

    monkeypatch.setattr(stream, "_tokenize_batch", _dying_batch)
    monkeypatch.setattr(stream, "_POLL_S", 0.2)
    started = time.monotonic()
    assert main(_prepare(aaa_source, tmp_path / "out", _tokenizer_dir(tmp_path, None))) == 2
    err = capsys.readouterr().err
    assert "worker process died (signal 9" in err
    assert time.monotonic() - started < 60  # hang guard
