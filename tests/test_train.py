"""Training end to end on a tiny real corpus: it learns, resumes exactly, and fails clearly."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tenx import checkpoint as ckpt
from tenx.cli import main
from tenx.errors import CheckpointError, ConfigError, DataError, TenxError
from tenx.monitor.metrics_file import read_metrics
from tenx.train.run import train


def test_has_a_pulse(tiny_config, tiny_data, tmp_path):
    """A 2-layer model trains 60 steps on real code and its loss falls well below the uniform 5.77."""
    cfg = tiny_config(tiny_data, "train.steps=60", "checkpoint.every=0")
    trainer, last = train(cfg, tmp_path / "run")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 61))
    assert records[0]["loss"] > 5.0
    assert last["loss"] < 3.3, last  # from 5.8 (uniform over 320 ids); byte unigram entropy is ~3.2
    assert last["val_loss"] < 3.4
    for key in ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
        assert key in last and math.isfinite(last[key])
    assert last["tokens"] == 60 * 8 * 64
    assert 0 < last["mfu"] < 1
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["params"]["total"] == trainer.params.total and run["hardware"]["cpu_count"] >= 1
    assert "[model]" in (tmp_path / "run" / "config.toml").read_text()
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000060"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tenx.cli", *args]


def test_exact_resume_after_sigkill(tiny_data, tmp_path):
    """40 steps straight == 20 steps, SIGKILL, resume to 40: bitwise-identical losses at steps 21-40."""
    common = [
        "--config",
        "tiny",
        "--set",
        f'data.dir="{tiny_data}"',
        "--set",
        "train.steps=40",
        "--set",
        "checkpoint.every=20",
        "--set",
        "train.threads=1",
    ]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(
        _cli("train", *common, "--run-dir", str(straight)), check=True, capture_output=True, timeout=240
    )

    proc = subprocess.Popen(
        _cli("train", *common, "--run-dir", str(killed)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline:
        if (
            (killed / "checkpoints" / "step_00000020").exists()
            and metrics.exists()
            and len(metrics.read_text().splitlines()) >= 22
        ):
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    steps_before = len(read_metrics(metrics))
    assert 21 < steps_before < 40

    subprocess.run(
        _cli("train", *common, "--run-dir", str(killed), "--resume", "auto"),
        check=True,
        capture_output=True,
        timeout=240,
    )
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(metrics)
    assert [r["step"] for r in b] == list(range(1, 41))
    assert [r["loss"] for r in a[20:]] == [r["loss"] for r in b[20:]]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]


def test_gradient_accumulation_matches_bigger_batch(tiny_config, tiny_data, tmp_path):
    big = train(
        tiny_config(tiny_data, "train.steps=5", "train.micro_batch=8", "checkpoint.at_end=false"),
        tmp_path / "a",
    )[0]
    acc = train(
        tiny_config(
            tiny_data, "train.steps=5", "train.micro_batch=4", "train.grad_accum=2", "checkpoint.at_end=false"
        ),
        tmp_path / "b",
    )[0]
    la = [r["loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
    for p, q in zip(big.model.parameters(), acc.model.parameters()):
        assert (p - q).abs().max().item() < 1e-4


def test_resume_skips_a_truncated_checkpoint(tiny_config, tiny_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(tiny_data, "train.steps=20", "checkpoint.every=10", "checkpoint.at_end=false"), run)
    newest = run / "checkpoints" / "step_00000020"
    data_file = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"step_00000020: file __0_0\.distcp has 100 bytes.*truncated"):
        ckpt.verify_checkpoint(newest)
    with pytest.raises(CheckpointError, match="truncated"):  # named explicitly: an error, not a fallback
        train(tiny_config(tiny_data, "train.steps=20"), tmp_path / "other", resume=str(newest))
    trainer, _ = train(
        tiny_config(tiny_data, "train.steps=20", "checkpoint.every=10", "checkpoint.at_end=false"),
        run,
        resume="auto",
    )
    assert trainer.resumed_from == run / "checkpoints" / "step_00000010"
    assert ckpt.verify_checkpoint(newest)["step"] == 20  # re-saved whole by the resumed run


def test_fresh_run_refuses_to_overwrite_checkpoints(tiny_config, tiny_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(tiny_data, "train.steps=2"), run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(TenxError, match="already has checkpoints; pass --resume auto"):
        train(tiny_config(tiny_data, "train.steps=2"), run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_missing_data_dir_is_a_clear_cli_error(tmp_path, capsys):
    rc = main(
        [
            "train",
            "--config",
            "tiny",
            "--set",
            f'data.dir="{tmp_path / "nowhere"}"',
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "nowhere" in err and "tenx data prepare" in err
    assert not (tmp_path / "run").exists()


def test_corrupt_shard_is_named_and_left_alone(tiny_config, tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = data / "train_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[1000] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="train_00000.bin"):
        train(tiny_config(data, "train.steps=2"), tmp_path / "run")
    assert shard.read_bytes() == bytes(raw)


def test_eval_and_sample(tiny_config, tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny_config(tiny_data, "train.steps=30"), run)
    private_repo = tmp_path / "private_repo"
    private_repo.mkdir()
    text_file = private_repo / "module.py"
    text_file.write_text("def private_function(x):\n    return x * 2\n" * 20)
    assert main(["eval", str(run), "--split", "val", "--split", str(private_repo)]) == 0
    report = json.loads((run / "eval.json").read_text())
    private = report["datasets"][str(private_repo)]
    assert private["bytes"] == len(text_file.read_bytes()) and private["tokens"] == private["bytes"] + 1
    assert report["overall"]["bytes"] == private["bytes"] + report["datasets"]["val"]["bytes"]
    val = report["datasets"]["val"]
    manifest = json.loads((tiny_data / "manifest.json").read_text())
    assert val["bytes"] == manifest["splits"]["val"]["bytes"]
    assert val["tokens"] == manifest["splits"]["val"]["tokens"]  # every token scored once (EOT prepended)
    assert math.isclose(val["bits_per_byte"], val["nll_nats"] / math.log(2) / val["bytes"])
    # Byte tokenizer: tokens = bytes + one EOT per document, so bits/byte is close to bits/token.
    assert 0.9 * val["bits_per_token"] < val["bits_per_byte"] < 1.1 * val["bits_per_token"]
    assert val["bits_per_byte"] < 4.5  # well below 8 bits for raw bytes
    capsys.readouterr()
    assert main(["sample", str(run), "--prompt", "def ", "--max-new-tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out) > 5


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_exact_resume_in_process(tiny_config, tiny_data, tmp_path, precision, crash_at):
    """A crash after step 7 (checkpoint at 5) and a resume reproduce steps 6-10 bit for bit."""
    overrides = ("train.steps=10", "checkpoint.every=5", f"train.precision={precision}")
    train(tiny_config(tiny_data, *overrides), tmp_path / "straight")
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(tiny_data, *overrides), tmp_path / "crashed", extra_callbacks=[crash_at(7)])
    trainer, _ = train(tiny_config(tiny_data, *overrides), tmp_path / "crashed", resume="auto")
    assert trainer.resumed_from is not None and trainer.resumed_from.name == "step_00000005"
    a = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    b = read_metrics(tmp_path / "crashed" / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 11))
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]


@pytest.mark.slow
def test_torch_compile_trains_like_eager(tiny_config, tiny_data, tmp_path):
    eager = train(tiny_config(tiny_data, "train.steps=5", "checkpoint.at_end=false"), tmp_path / "eager")[1]
    compiled = train(
        tiny_config(tiny_data, "train.steps=5", "checkpoint.at_end=false", "train.compile=true"),
        tmp_path / "c",
    )[1]
    assert abs(eager["loss"] - compiled["loss"]) < 1e-3


def test_compile_without_a_cxx_compiler_names_the_field_before_training(
    tiny_config, tiny_data, tmp_path, monkeypatch
):
    from torch._inductor import cpp_builder, exc

    def missing() -> str:
        raise exc.InvalidCxxCompiler()

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"train\.compile: .*no C\+\+ compiler.*train\.compile=false"):
        train(tiny_config(tiny_data, "train.steps=2", "train.compile=true"), run)
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_each_compiled_run_starts_dynamo_afresh(tiny_config, tiny_data, tmp_path, monkeypatch):
    # a ladder's worker trains run after run in one process: past dynamo's recompile limit it would run a
    # later run's new model shape eagerly, silently, so every compiled run resets dynamo before compiling
    import torch
    from torch._inductor import cpp_builder

    calls = []
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "g++")
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("reset"))
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append("compile") or model)
    for depth in (1, 2):
        train(
            tiny_config(tiny_data, "train.steps=1", "train.compile=true", f"model.depth={depth}"),
            tmp_path / str(depth),
        )
    assert calls == ["reset", "compile", "reset", "compile"]


def test_resume_into_a_different_model_names_the_fields(tiny_config, tiny_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(tiny_data, "train.steps=2"), run)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints" / "step_00000002").iterdir()}
    with pytest.raises(
        CheckpointError, match=r"holds a different model \(.*family: 'gpt2' in the checkpoint, 'llama' here"
    ):
        train(tiny_config(tiny_data, "train.steps=4", "model.family=llama"), run, resume="auto")
    assert {p.name: p.read_bytes() for p in (run / "checkpoints" / "step_00000002").iterdir()} == before
