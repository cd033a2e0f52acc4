"""Hostile and careless outputs and numbers (issue 29): eval, sample, predict, compress and decompress refuse
to overwrite what they must not (their own input, a user's file, a run's watched prediction), refuse a
directory where a file goes, and turn any numeric flag into a result or a usage error (exit status 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenx.cli import main
from tenx.monitor.prediction_file import read_prediction
from tenx.scaling.predict import stored_indexes

CURVES = Path(__file__).parent / "data" / "curves"


@pytest.fixture(scope="module")
def run(train_tiny, tiny_data) -> Path:
    """A tiny byte-level model trained two steps."""
    return train_tiny(tiny_data, "train.steps=2")


def _exit_status(argv: list[str]) -> int:
    """What `tenx ARGV` exits with: main's return, or argparse's usage error (SystemExit)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


def _refused(capsys, argv: list[str], *words: str) -> str:
    assert _exit_status(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
    for word in words:
        assert word in err
    return err


def test_eval_out_keeps_a_users_file_and_refuses_a_directory(run, tmp_path, capsys):
    notes = tmp_path / "mynotes.json"
    notes.write_text("my notes")
    _refused(capsys, ["eval", str(run), "--out", str(notes), "--batch-size", "64"], "--force")
    assert notes.read_text() == "my notes"
    _refused(capsys, ["eval", str(run), "--out", str(tmp_path)], "--out", "is a directory")
    assert main(["eval", str(run), "--out", str(notes), "--force", "--batch-size", "64"]) == 0
    assert "bits_per_byte" in json.loads(notes.read_text())["datasets"]["heldout"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--threshold", "nan"], "--threshold"),
        (["--threshold", "2"], "--threshold"),
        (["--threshold", "-0.1"], "--threshold"),
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "-3"], "--batch-size"),
        (["--stride", "0"], "--stride"),
        (["--stride", "-1"], "--stride"),
        (["--ngram", "0"], "--ngram"),
        (["--ngram", "-2"], "--ngram"),
        (["--split", ""], "--split"),
    ],
)
def test_eval_numbers_out_of_range_name_the_flag(run, capsys, flags, words):
    _refused(capsys, ["eval", str(run), *flags], words)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--top-k", "-1"], "--top-k"),
        (["--max-new-tokens", "-5"], "--max-new-tokens"),
        (["--max-new-tokens", str(10**18)], "--max-new-tokens"),
        (["--seed", str(2**70)], "--seed"),
    ],
)
def test_sample_numbers_out_of_range_name_the_flag(run, capsys, flags, words):
    _refused(capsys, ["sample", str(run), *flags], words)


def test_sample_zero_tokens_and_greedy_work(run, capsys):
    assert main(["sample", str(run), "--prompt", "def", "--max-new-tokens", "0"]) == 0
    assert capsys.readouterr().out == "def\n"
    assert main(["sample", str(run), "--prompt", "def", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def")


def test_compress_never_writes_over_its_input_or_into_a_directory(run, tmp_path, capsys):
    src = tmp_path / "notes.txt"
    src.write_bytes(b"hello hello hello\n")
    _refused(capsys, ["compress", str(run), str(src), "-o", str(src), "--force"], "own input")
    assert src.read_bytes() == b"hello hello hello\n"
    _refused(capsys, ["compress", str(run), str(src), "-o", str(tmp_path), "--force"], "is a directory")
    packed = tmp_path / "notes.tenx"
    assert main(["compress", str(run), str(src), "-o", str(packed)]) == 0
    before = packed.read_bytes()
    _refused(capsys, ["decompress", str(run), str(packed), "-o", str(packed), "--force"], "own input")
    assert packed.read_bytes() == before
    _refused(capsys, ["decompress", str(run), str(packed), "-o", str(tmp_path), "--force"], "is a directory")
    out = tmp_path / "back.txt"
    assert main(["decompress", str(run), str(packed), "-o", str(out)]) == 0
    assert out.read_bytes() == src.read_bytes()


@pytest.fixture()
def partial_run(tmp_path) -> Path:
    """The first 900 steps of a stored 3000-step run, with a prediction it is watched against."""
    part = tmp_path / "partial"
    part.mkdir()
    for name in ("config.toml", "run.json"):
        shutil.copy(CURVES / "d1b16-cos3000" / name, part / name)
    lines = (CURVES / "d1b16-cos3000" / "metrics.jsonl").read_text().splitlines()
    (part / "metrics.jsonl").write_text("".join(x + "\n" for x in lines if json.loads(x)["step"] <= 900))
    (part / "prediction.json").write_text('{"watched": true}')
    return part


def test_predict_never_overwrites_a_runs_watched_prediction(partial_run, tmp_path, capsys):
    for out in (partial_run, f"{partial_run}/"):
        argv = ["predict", "--run", str(partial_run), "-o", str(out), "--force", "--bootstrap", "0"]
        _refused(capsys, argv, "watched against")
    assert (partial_run / "prediction.json").read_text() == '{"watched": true}'
    existing = tmp_path / "a-file"
    existing.write_text("mine")
    _refused(capsys, ["predict", "--run", str(partial_run), "-o", str(existing)], "not a directory")
    assert existing.read_text() == "mine"
    elsewhere = tmp_path / "elsewhere"
    argv = ["predict", "--run", str(partial_run), "-o", str(elsewhere), "--bootstrap", "0"]
    assert main(argv) == 0
    _refused(capsys, argv, "--force")
    assert main([*argv, "--force"]) == 0


def test_stored_indexes_sample_a_long_curve():
    assert stored_indexes(50).tolist() == list(range(50))
    keep = stored_indexes(10**9)
    assert len(keep) <= 2002 and keep[0] == 0 and keep[-1] == 10**9 - 1
    assert (keep[1:] > keep[:-1]).all()


def test_a_long_prediction_is_stored_sampled(tmp_path, capsys):
    ladder = tmp_path / "ladder"
    for name in ("d1-cos400", "d1-cos800", "d2-cos300", "d2-cos600", "d3-cos250", "d3-cos500"):
        shutil.copytree(CURVES / name, ladder / "runs" / name)
    target = str(CURVES / "d4-wsd300" / "config.toml")
    base = ["predict", "--from", str(ladder), "--config", target, "--set", "model.vocab_size=257"]
    argv = [*base, "--set", "train.steps=20000", "--bootstrap", "0", "-o", str(tmp_path / "p")]
    assert main(argv) == 0
    prediction = read_prediction(tmp_path / "p" / "prediction.json")
    assert len(prediction.step) <= 2002 and prediction.step[-1] == 20000
    assert prediction.target["steps"] == 20000
    missing = next(s for s in range(prediction.step[0], 20000) if s not in set(prediction.step))
    at = prediction.at(missing)
    assert at is not None and at["lower"] <= at["loss"] <= at["upper"]
    _refused(capsys, [*base, "--set", "train.steps=1000000000", "-o", str(tmp_path / "q")], "train.steps")


NUMBERS = st.sampled_from(["-1", "-7", "0", "nan", "inf", "-inf", "1e300", str(10**30), "3"])
BAD = {"-1", "-7", "nan", "inf", "-inf"}
FLAGS = {
    "eval": ["--batch-size", "--stride", "--ngram", "--threshold"],
    "sample": ["--max-new-tokens", "--temperature", "--top-k", "--seed"],
    "predict": ["--bootstrap", "--world-size"],
    "compress": ["--threads"],
    "decompress": ["--max-bytes"],
}


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(command_flag=st.sampled_from([(c, f) for c, flags in FLAGS.items() for f in flags]), value=NUMBERS)
def test_any_number_is_a_result_or_a_usage_error(run, tmp_path_factory, capsys, command_flag, value):
    command, flag = command_flag
    work = tmp_path_factory.mktemp("numbers")
    src = work / "in.txt"
    src.write_bytes(b"abc")
    argv = {
        "eval": ["eval", str(run), "--out", str(work / "eval.json"), "--split", "val"],
        "sample": ["sample", str(run), "--max-new-tokens", "2"],
        "predict": ["predict", "--run", str(CURVES / "d1-cos400"), "-o", str(work / "p"), "--bootstrap", "0"],
        "compress": ["compress", str(run), str(src), "-o", str(work / "in.tenx")],
        "decompress": ["decompress", str(run), str(work / "none.tenx"), "-o", str(work / "out")],
    }[command]
    code = _exit_status([*argv, f"{flag}={value}"])
    capsys.readouterr()
    assert code in (0, 2)
    if value in BAD:
        assert code == 2
