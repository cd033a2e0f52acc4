"""Shared fixtures: a tiny real corpus (a few standard-library packages) prepared once per session."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (pyproject's addopts: a worker per core), each worker and what it starts gets its share
# of the cores: threads of two workers sharing a core wait on each other (3x slower, not 2x).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

from tenx.data.prepare.pipeline import PrepareConfig, prepare  # noqa: E402
from tenx.data.prepare.sources import stdlib_dir  # noqa: E402
from tenx.train.config import CONFIG_DIR, load_run_config  # noqa: E402

TINY_PACKAGES = ("json", "email")
BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="session")
def load_bench():
    """`load_bench(name)`: bench/NAME.py imported as a module (registered in sys.modules while the session
    runs: a script's dataclasses look their module up there), each script once."""
    loaded: dict[str, ModuleType] = {}

    def load(name: str) -> ModuleType:
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
            assert spec and spec.loader
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    yield load
    for module in loaded.values():
        sys.modules.pop(module.__name__, None)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A small code corpus: the `json` and `email` packages of this interpreter's standard library."""
    root = tmp_path_factory.mktemp("corpus")
    for pkg in TINY_PACKAGES:
        for src in sorted((stdlib_dir() / pkg).rglob("*.py")):
            dst = root / pkg / src.relative_to(stdlib_dir() / pkg)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    return root


@pytest.fixture(scope="session")
def tiny_data(corpus_dir, tmp_path_factory) -> Path:
    """The tiny corpus prepared with the byte tokenizer (10% validation, 10% held out)."""
    out = tmp_path_factory.mktemp("data") / "bytes"
    prepare(
        PrepareConfig(
            source=str(corpus_dir), out=str(out), tokenizer="bytes", val_ratio=0.1, heldout_ratio=0.1
        ),
        progress=False,
    )
    return out


@pytest.fixture(scope="session")
def tiny_config():
    """A function: configs/tiny.toml pointed at a data directory, with overrides."""

    def make(data_dir: Path, *overrides: str):
        return load_run_config(
            CONFIG_DIR / "tiny.toml", [f'data.dir="{data_dir}"', "log.progress=false", *overrides]
        )

    return make


@pytest.fixture(scope="session")
def train_tiny(tiny_config, tmp_path_factory):
    """A function: `train_tiny(data_dir, *overrides)` trains configs/tiny.toml on `data_dir` quickly (no
    checkpoints, no evaluation, one thread) with `overrides`, in a new directory, and returns that run."""
    from tenx.train.run import train

    def make(data_dir: Path, *overrides: str) -> Path:
        run = tmp_path_factory.mktemp("tiny-run") / "run"
        train(
            tiny_config(data_dir, "checkpoint.every=0", "train.eval_every=0", "train.threads=1", *overrides),
            run,
        )
        return run

    return make


@pytest.fixture(scope="module")
def codec_run(train_tiny, tiny_data) -> Path:
    """A tiny byte-level model trained 20 steps, the one the compress tests code with (one per module)."""
    return train_tiny(tiny_data, "train.steps=20")


@pytest.fixture(scope="module")
def codec(codec_run):
    """The codec (tenx.compress.codec.load_codec) of `codec_run`."""
    from tenx.compress.codec import load_codec

    return load_codec(codec_run)


@pytest.fixture(scope="session")
def crash_at():
    """A class: `crash_at(step)` is a callback that fails the run after `step` (a crash to resume from)."""
    from tenx.train.hooks import Callback

    class CrashAt(Callback):
        name = "crash"

        def __init__(self, at: int) -> None:
            self.at = at

        def on_step_end(self, trainer, metrics) -> None:
            if trainer.step == self.at:
                raise RuntimeError("simulated crash")

    return CrashAt


@pytest.fixture(scope="session")
def small_ladder():
    """A function: the LadderConfig of a small isoflop ladder (two budgets, two sizes each, one seed) that
    trains on the tiny data in seconds, with `changes` to its fields."""
    from tenx.scaling.ladder.runner import LadderConfig

    def make(**changes):
        return LadderConfig(
            **{
                "budgets": [2e10, 5e10],
                "grid": "isoflop",
                "sizes": 2,
                "min_tokens_per_param": 0,
                "noise_seeds": 1,
                "min_steps": 20,
                **changes,
            }
        )

    return make


@pytest.fixture(scope="session")
def tiny_corpus_multishard(corpus_dir, tmp_path_factory) -> Path:
    """The tiny corpus with small shards, so the training split spans several files."""
    out = tmp_path_factory.mktemp("data") / "multishard"
    prepare(
        PrepareConfig(source=str(corpus_dir), out=str(out), tokenizer="bytes", shard_tokens=50_000),
        progress=False,
    )
    return out


@pytest.fixture(scope="session")
def two_source_data(tmp_path_factory) -> Path:
    """Two data sources, `digits/` and `letters/` (random words of each, seeded), prepared with the byte
    tokenizer so that the validation split holds documents of both."""
    import random

    root = tmp_path_factory.mktemp("two-sources")
    rng = random.Random(0)
    for source, alphabet in (("digits", "0123456789"), ("letters", "abcdefghijklmnopqrstuvwxyz")):
        (root / "corpus" / source).mkdir(parents=True)
        for i in range(16):
            words = ("".join(rng.choices(alphabet, k=rng.randint(3, 9))) for _ in range(400))
            (root / "corpus" / source / f"{i:02d}.txt").write_text(" ".join(words) + "\n")
    out = root / "data"
    prepare(
        PrepareConfig(
            source=str(root / "corpus"), out=str(out), tokenizer="bytes", val_ratio=0.3, heldout_ratio=0.1
        ),
        progress=False,
    )
    return out
