"""Issue 47, last small items: `ladder --emit` writes nothing when it refuses; forged but in-range adapt
settings of a .tenx file are refused naming the settings; a tokenizer's panic during the round-trip check is
an error naming the tokenizer, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenx.cli import main


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
