"""A checkpoint written by tenx before the issue-13 restructuring (commit 3d99e8d) still resumes, bit for bit.

`tests/fixtures/old_main_checkpoint/` was written by that tree's code: the `tiny` config shrunk (see
expected.json) trained on the generated corpus of tests/test_behaviour_unchanged.py, checkpoint at step 6,
and the losses that tree then trained at steps 7-10. Today's code resumes from the checkpoint and must
train the same losses (bitwise on the CPU kind that recorded them, 1e-5 relative on another). The
checkpoint predates the manifest's self-checksum, so this also covers that old checkpoints still load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from test_behaviour_unchanged import _corpus, _cpu_kind

FIXTURE = Path(__file__).parent / "fixtures" / "old_main_checkpoint"
CHECKPOINT_DIR = FIXTURE / "step_00000006"
"""The checkpoint itself (step 6)."""


def prepare_old_checkpoint_data(tmp: Path) -> Path:
    """TMP/data: the data the fixture checkpoint was trained on (byte tokens of the generated corpus, no
    near-duplicate or contamination moves), regenerated."""
    from tenx.data.prepare.pipeline import PrepareConfig, prepare

    (tmp / "corpus").mkdir()
    _corpus(tmp / "corpus")
    prepare(
        PrepareConfig(
            source=str(tmp / "corpus"),
            out=str(tmp / "data"),
            tokenizer="bytes",
            near_dup_threshold=0,
            contamination_threshold=1,
        ),
        progress=False,
    )
    return tmp / "data"


def test_checkpoint_from_before_the_restructuring_resumes_to_the_same_losses(tmp_path):
    from tenx.train.config import CONFIG_DIR, load_run_config
    from tenx.train.run import train

    expected = json.loads((FIXTURE / "expected.json").read_text())
    prepare_old_checkpoint_data(tmp_path)
    cfg = load_run_config(
        CONFIG_DIR / "tiny.toml",
        [f'data.dir="{tmp_path / "data"}"', "train.steps=10", *expected["overrides"]],
    )
    run = tmp_path / "run"
    saved = run / "checkpoints" / "step_00000006"
    shutil.copytree(CHECKPOINT_DIR, saved)
    threads = torch.get_num_threads()
    try:
        trainer, _ = train(cfg, run, resume=str(saved))
    finally:
        torch.set_num_threads(threads)
    assert trainer.resumed_from == saved and trainer.step == 10
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r and "skipped" not in r]
    assert len(losses) == 4
    if expected["cpu_kind"] == _cpu_kind():
        assert losses == expected["losses_after"]
    else:
        for got, want in zip(losses, expected["losses_after"]):
            assert abs(got - want) <= 1e-5 * abs(want), (got, want)
