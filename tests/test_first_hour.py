"""A newcomer's bad inputs end in one clear error, and nothing of theirs is lost (issue 14, first part)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tenx.cli import build_parser, main
from tenx.data.prepare.pipeline import PrepareConfig, prepare


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusal of a flag's value
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "nan"], "argument --temperature: must be a number >= 0, got 'nan'"),
        (["--temperature", "-1"], "argument --temperature: must be a number >= 0, got '-1'"),
        (["--max-new-tokens", "-5"], "argument --max-new-tokens: must be an integer >= 0, got '-5'"),
        (["--top-k", "-2"], "argument --top-k: must be an integer >= 0, got '-2'"),
    ],
)
def test_sample_refuses_senseless_settings_before_loading_anything(tmp_path, capsys, flags, message):
    code, _, err = _run(["sample", str(tmp_path / "no-such-run"), *flags], capsys)
    assert code == 2 and err.splitlines()[-1].startswith("tenx sample: error: ") and message in err


def test_eval_names_the_splits_when_one_is_misspelt(tmp_path, capsys):
    code, _, err = _run(["eval", str(tmp_path / "no-such-run"), "--split", "heldot"], capsys)
    assert code == 2 and "--split 'heldot' is neither a prepared split (train, val, heldout)" in err


def test_fault_help_lists_every_kind():
    from tenx.train.callbacks.faults import KINDS

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    train = sub.choices["train"]
    train.format_help()  # subcommand flags are added when first used
    fault = next(a for a in train._actions if "--fault" in a.option_strings)
    assert all(kind in fault.help for kind in KINDS)


def test_eval_prints_its_results_when_eval_json_cannot_be_written(tiny_data, tiny_config, tmp_path, capsys):
    from tenx.train.run import train

    run = tmp_path / "run"
    train(tiny_config(tiny_data, "train.steps=3", "train.threads=1"), run)
    capsys.readouterr()
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    code, out, err = _run(["eval", str(run), "--out", str(blocker / "eval.json"), "--device", "cpu"], capsys)
    assert code == 2 and "heldout:" in out and "bits/byte" in out  # printed first
    assert "could not write" in err and "the results above were computed" in err
    assert blocker.read_text() == "mine"


def test_prepare_refuses_a_file_and_a_foreign_directory_and_changes_nothing(corpus_dir, tmp_path):
    from tenx.errors import DataError

    target = tmp_path / "notes.txt"
    target.write_text("mine")
    with pytest.raises(DataError, match="is a file, not a directory"):
        prepare(PrepareConfig(source=str(corpus_dir), out=str(target), tokenizer="bytes"), progress=False)
    assert target.read_text() == "mine"
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    (home / "train_00000.bin").write_bytes(b"also mine")
    with pytest.raises(DataError, match=r"holds files tenx did not write \(thesis\.tex\)"):
        prepare(PrepareConfig(source=str(corpus_dir), out=str(home), tokenizer="bytes"), progress=False)
    assert (home / "thesis.tex").read_text() == "years of work"
    assert (home / "train_00000.bin").read_bytes() == b"also mine"


def test_reprepare_removes_only_files_the_previous_manifest_listed(corpus_dir, tmp_path):
    out = tmp_path / "data"
    prepare(
        PrepareConfig(source=str(corpus_dir), out=str(out), tokenizer="bytes", shard_tokens=50_000),
        progress=False,
    )
    listed = json.loads((out / "manifest.json").read_text())
    user_file = out / "train_00099.bin"  # named like a shard, but no manifest ever listed it
    user_file.write_bytes(b"mine")
    prepare(PrepareConfig(source=str(corpus_dir), out=str(out), tokenizer="bytes"), progress=False)
    assert user_file.read_bytes() == b"mine"
    now = {
        s["file"]
        for e in json.loads((out / "manifest.json").read_text())["splits"].values()
        for s in e["shards"]
    }
    before = {s["file"] for e in listed["splits"].values() for s in e["shards"]}
    assert all(
        not (out / name).exists() for name in before - now
    )  # the stale shards of the first run are gone
    assert Path(out / "manifest.json").exists()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow)])  # the same path
def test_a_signal_during_training_saves_a_checkpoint_that_resumes_exactly(tiny_data, tmp_path, sig):
    import os
    import signal
    import subprocess
    import sys
    import time

    from tenx.checkpoint.models import load_model

    sets = [f'data.dir="{tiny_data}"', "train.steps=400", "train.threads=1", "log.progress=false"]
    sets += ["checkpoint.every=1000", "checkpoint.at_end=true", "train.eval_every=1000"]
    args = [x for s in sets for x in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tenx", "train", "--config", "tiny", "--run-dir", str(run), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 5):
        time.sleep(0.05)
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    line = next(x for x in out.splitlines() if x.startswith(f"tenx: {sig} at step"))
    step = int(line.split("at step ")[1].split(":")[0])
    saved = run / "checkpoints" / f"step_{step:08d}"
    assert str(saved) in line and saved.is_dir() and 5 <= step < 400
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert rows[-1]["step"] == step  # the checkpoint holds the last step trained
    # resume it to the end, and compare with an uninterrupted run of the same config
    subprocess.run([*cmd, "--resume", "auto"], check=True, capture_output=True, env=env, timeout=120)
    straight = tmp_path / "straight"
    subprocess.run(
        [sys.executable, "-m", "tenx", "train", "--config", "tiny", "--run-dir", str(straight), *args],
        check=True,
        capture_output=True,
        env=env,
        timeout=120,
    )
    a = load_model(run, "cpu").model.state_dict()
    b = load_model(straight, "cpu").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_eval_says_which_checkpoint_it_used_when_the_newest_does_not_verify(
    tiny_data, tiny_config, tmp_path, capsys
):
    from tenx.checkpoint.models import load_model
    from tenx.train.run import train

    run = tmp_path / "run"
    train(tiny_config(tiny_data, "train.steps=4", "checkpoint.every=2", "train.threads=1"), run)
    newest = run / "checkpoints" / "step_00000004" / "__0_0.distcp"
    raw = bytearray(newest.read_bytes())
    raw[-1] ^= 1
    newest.write_bytes(bytes(raw))
    capsys.readouterr()
    loaded = load_model(run, "cpu")
    err = capsys.readouterr().err
    assert loaded.checkpoint.name == "step_00000002"
    assert "skipping a newer checkpoint" in err and "step_00000004" in err and "fails its checksum" in err
    assert f"using {loaded.checkpoint} instead" in err


def test_eval_shows_progress_on_a_terminal(tiny_data, tiny_config, tmp_path):
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    from tenx.train.run import train

    run = tmp_path / "run"
    train(tiny_config(tiny_data, "train.steps=2", "train.threads=1"), run)
    main_fd, child_fd = pty.openpty()
    fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tenx", "eval", str(run), "--device", "cpu", "--batch-size", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=child_fd, env=env)
    os.close(child_fd)
    seen = b""
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=120) == 0
    os.close(main_fd)
    assert b"eval:" in seen and b"batch" in seen


def _parsers(parser, path=("tenx",)):
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_option_has_help_and_shows_its_default():
    import argparse

    lacking = []
    for path, parser in _parsers(build_parser()):
        parser.format_help()  # adds a subcommand's deferred flags
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help:
                lacking.append(f"{' '.join(path)} {action.option_strings or action.dest}: no help")
            elif action.option_strings and action.default not in (None, False, [], "", argparse.SUPPRESS):
                if "default" not in formatter._get_help_string(action).lower():
                    lacking.append(f"{' '.join(path)} {action.option_strings}: default not shown")
    assert not lacking, "\n".join(lacking)
    eval_help = next(p for path, p in _parsers(build_parser()) if path == ("tenx", "eval")).format_help()
    assert "(default: 8)" in eval_help and "sequences per forward pass" in eval_help


def test_a_repeated_sigterm_is_the_same_stop_request_and_a_second_ctrl_c_acts_at_once():
    """On Slurm a preemption reaches a rank from the scheduler and again through torchrun: the second SIGTERM
    must not kill the rank before the checkpoint the first asked for is written."""
    import os
    import signal

    from tenx.train.trainer import _StopRequest

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = _StopRequest()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the old handler restored here: the process would have died
        assert stop.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) is before[0]  # Ctrl-C now acts at once
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before[1]
