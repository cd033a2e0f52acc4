"""One step for training and replay (tenx/train/step.py): a replayed step is the trained step, bit for bit.

Short real runs of the `tiny` config (fp32; bf16 autocast; 2 micro-batches per step; 2 DDP processes over
gloo with 2 micro-batches each) are re-executed step by step from the seeded initialisation by
tenx.triage.replay.Replayer, and every step's loss and gradient norm must equal the trainer's record in every
bit. Clipping is active in these runs (the gradient norm exceeds optim.grad_clip), so a change of the clip,
of the loss scaling or of the reductions made on one side only shows here; the controls at the end check
that the comparison does catch such a one-sided change.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tenx.rundir import RunDir
from tenx.train.callbacks.record import read_steps
from tenx.train.config import CONFIG_DIR
from tenx.train.run import train
from tenx.triage.replay import Replayer

STEPS = 4
BASE = (f"train.steps={STEPS}", "train.eval_every=0", "checkpoint.every=100", "train.threads=1")
RUNS = {
    "fp32": (),
    "bf16": ("train.precision='bf16'",),
    "accum": ("train.global_batch=8", "train.micro_batch=4"),
}


@pytest.fixture(scope="module")
def runs(tiny_data, tiny_config, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("step-shared")
    for name, overrides in RUNS.items():
        train(tiny_config(tiny_data, *BASE, *overrides), root / name)
    return {name: root / name for name in RUNS}


def replay_each_step(run_dir: Path, replayer: Replayer | None = None) -> list[tuple[dict[str, Any], Any]]:
    """(record, replayed outcome) for every recorded step, re-executed in order from the seeded init."""
    replayer = replayer or Replayer(run_dir)
    records = read_steps(RunDir(run_dir).steps)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    _, _, source, _ = replayer.prepare(1, None, None)
    assert source is None and replayer.step == 0  # the seeded initialisation, built as build_parts builds it
    return [(r, replayer.run_step(r["step"], r["windows"], apply=r["skipped"] is None)) for r in records]


def assert_bitwise(pairs: list[tuple[dict[str, Any], Any]]) -> None:
    for record, outcome in pairs:
        assert outcome.exception is None, outcome.describe()
        got = (outcome.loss.hex(), outcome.grad_norm.hex())
        want = (float(record["loss"]).hex(), float(record["grad_norm"]).hex())
        assert got == want, f"step {record['step']}: replayed {got}, trained {want}"
    assert any(r["grad_norm"] > 1.0 for r, _ in pairs)  # optim.grad_clip=1.0 clipped some update


@pytest.mark.parametrize("name", list(RUNS))
def test_replayed_steps_equal_the_trained_ones_bitwise(runs, name):
    replayer = Replayer(runs[name])
    assert replayer.bitwise
    assert replayer.amp_dtype == (torch.bfloat16 if name == "bf16" else torch.float32)
    assert replayer.grad_accum == (2 if name == "accum" else 1)
    assert_bitwise(replay_each_step(runs[name], replayer))


def test_two_ddp_processes_replayed_in_one_equal_the_trained_steps_bitwise(tiny_data, tmp_path):
    """2 ranks over gloo, 2 micro-batches each (DDP's no_sync on the first): replay runs both ranks in turn
    and averages their gradients as the all-reduce does."""
    run_dir = tmp_path / "ddp"
    args = ["--config", str(CONFIG_DIR / "tiny.toml"), "--run-dir", str(run_dir)]
    for setting in (
        f'data.dir="{tiny_data}"',
        "log.progress=false",
        *BASE,
        "train.global_batch=16",
        "train.micro_batch=4",
        "parallel.strategy=ddp",
        "checkpoint.async_save=false",
    ):
        args += ["--set", setting]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [*launcher, "-m", "tenx", "train", *args],
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    replayer = Replayer(run_dir)
    assert (replayer.world_size, replayer.strategy, replayer.grad_accum) == (2, "ddp", 2)
    assert replayer.bitwise
    assert_bitwise(replay_each_step(run_dir, replayer))


@pytest.mark.parametrize("change", ["clip", "loss-scaling"])
def test_a_change_on_one_side_only_is_caught(runs, change):
    """Controls: replay with its clip or its loss scaling changed no longer equals the trained steps."""
    replayer = Replayer(runs["accum"])
    if change == "clip":
        replayer.cfg.optim.grad_clip = 2.0
    else:
        # each micro-batch's loss no longer divided by the 2 micro-batches
        replayer.shape = dataclasses.replace(replayer.shape, grad_accum=1)
    with pytest.raises(AssertionError, match="replayed"):
        assert_bitwise(replay_each_step(runs["accum"], replayer))
