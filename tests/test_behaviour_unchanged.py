"""Behaviour pinned before the restructuring of issue 13: the first 30 per-step losses of the `tiny` config.

The corpus is generated from a seeded RNG (not the interpreter's standard library, which differs between
Python versions), prepared with the byte tokenizer, and trained fp32 with seed 0 on one thread. The losses
were recorded on the tree before the restructuring (`tests/fixtures/tiny_losses.json`). On a CPU of the
kind that recorded them they must match bitwise; another CPU kind may round fp32 matmuls differently
(AVX-512 against AVX2 kernels), so there they must match to 1e-5 relative.

Regenerate (only when a change is *meant* to alter training): `python tests/test_behaviour_unchanged.py`.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_losses.json"
STEPS = 30
WORDS = "def class return import self value index data model token loss step for in if else".split()


def _cpu_kind() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    kind = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2") if f" {f}" in flags]
    return f"{torch.__version__}|{'+'.join(kind) or 'unknown'}"


def _corpus(root: Path) -> None:
    rng = random.Random(0)
    for i in range(40):
        lines = []
        for _ in range(60):
            depth = rng.randrange(3)
            lines.append("    " * depth + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 9))))
        (root / f"doc{i:02d}.py").write_text("\n".join(lines) + "\n")


def tiny_losses(tmp: Path) -> list[float]:
    """Train the tiny config for STEPS steps on the generated corpus; the per-step losses."""
    from tenx.data.prepare.pipeline import PrepareConfig, prepare
    from tenx.train.config import CONFIG_DIR, load_run_config
    from tenx.train.run import train

    corpus, data = tmp / "corpus", tmp / "data"
    corpus.mkdir(parents=True)
    _corpus(corpus)
    # the split as recorded: before near-duplicate grouping and held-out decontamination moved documents
    prepare(
        PrepareConfig(
            source=str(corpus),
            out=str(data),
            tokenizer="bytes",
            near_dup_threshold=0,
            contamination_threshold=1,
        ),
        progress=False,
    )
    cfg = load_run_config(
        CONFIG_DIR / "tiny.toml",
        [
            f'data.dir="{data}"',
            f"train.steps={STEPS}",
            "train.seed=0",
            "train.precision=fp32",
            "train.threads=1",
            "train.eval_every=1000",
            "checkpoint.every=1000",
            "log.progress=false",
            "log.tensorboard=false",
        ],
    )
    train(cfg, tmp / "run")
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "skipped" not in r][:STEPS]


def test_first_30_losses_of_tiny_are_unchanged(tmp_path):
    recorded = json.loads(FIXTURE.read_text())
    threads = torch.get_num_threads()
    try:
        losses = tiny_losses(tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(losses) == STEPS
    if recorded["cpu_kind"] == _cpu_kind():
        assert losses == recorded["losses"], "training changed: the losses differ from the recorded ones"
    else:
        for got, want in zip(losses, recorded["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (got, want)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        values = tiny_losses(Path(d))
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps({"cpu_kind": _cpu_kind(), "losses": values}, indent=1) + "\n")
    print(f"wrote {FIXTURE}: {len(values)} losses", file=sys.stderr)
