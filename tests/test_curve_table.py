"""Curve tables (tenx.scaling.curve.curve_table) and the converters that write them
(tenx.scaling.curve.convert): every bad row named by file, line and field; the schedule a table gives;
real TensorBoard logs and W&B exports written here, the stored ladder and runs; `tenx curves` end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tenx.cli import main
from tenx.errors import ConfigError, DataError
from tenx.scaling.curve.convert import (
    rows_from_ladder,
    rows_from_run,
    rows_from_tensorboard,
    rows_from_wandb_csv,
)
from tenx.scaling.curve.curve_table import (
    read_curve_table,
    read_curve_tables,
    write_curve_table,
)
from tenx.utils.io import read_jsonl

DATA = Path(__file__).parent / "data"
LADDER = DATA / "ladder-val"
RUN = DATA / "curves" / "d2-cos300"

HEADER = "run,params,tokens_per_step,step,lr,loss,split"
GOOD_CSV = f"""{HEADER}
a,1000,512,10,0.001,3.0,val
a,1000,512,20,0.002,2.5,val
a,1000,512,40,0.001,2.0,val
a,1000,512,60,0.0005,,val
b,4000,512,10,0.001,2.8,
b,4000,512,30,0.0005,2.1,
b,4000,512,30,0.0005,2.9,train
b,4000,512,50,0.0001,2.4,train
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _jsonl(*rows: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _row(step: int, **changes) -> dict:
    row = {"run": "a", "params": 1000, "tokens_per_step": 512, "step": step, "lr": 0.001, "loss": 3.0}
    row.update(changes)
    return {k: v for k, v in row.items() if v is not ...}  # `...` drops the key


BAD_TABLES = {
    "csv lr cell empty": (
        "t.csv",
        f"{HEADER}\na,1000,512,10,0.001,3.0,val\na,1000,512,20,,2.5,val\n",
        3,
        "lr",
    ),
    "jsonl lr key absent": ("t.jsonl", _jsonl(_row(10), _row(20, lr=...)), 2, "lr"),
    "step goes back": ("t.csv", f"{HEADER}\na,1000,512,20,0.001,3,\na,1000,512,10,0.001,2.5,\n", 3, "step"),
    "step repeated": ("t.jsonl", _jsonl(_row(10), _row(20), _row(20, loss=2.0)), 3, "step"),
    "csv loss nan": ("t.csv", f"{HEADER}\na,1000,512,10,0.001,3,\na,1000,512,20,0.001,nan,\n", 3, "loss"),
    "csv loss inf": ("t.csv", f"{HEADER}\na,1000,512,10,0.001,inf,\na,1000,512,20,0.001,2,\n", 2, "loss"),
    "jsonl loss NaN": ("t.jsonl", _jsonl(_row(10), _row(20)).replace("3.0}\n", "NaN}\n", 1), 1, "loss"),
    "one point": ("t.jsonl", _jsonl(_row(10), _row(20), _row(5, run="b")), 3, "run"),
    "not a number": ("t.csv", f"{HEADER}\na,1000,512,10,fast,3,\na,1000,512,20,0.001,2,\n", 2, "lr"),
    "unknown split": ("t.jsonl", _jsonl(_row(10), _row(20, split="test")), 2, "split"),
    "params change": ("t.csv", f"{HEADER}\na,1000,512,10,0.001,3,\na,2000,512,20,0.001,2,\n", 3, "params"),
    "header lacks lr": ("t.csv", "run,params,tokens_per_step,step,loss\na,1000,512,10,3\n", 1, "lr"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_a_bad_row_names_the_file_the_line_and_the_field(tmp_path, case):
    name, text, line, field = BAD_TABLES[case]
    path = _write(tmp_path, name, text)
    with pytest.raises(DataError) as e:
        read_curve_table(path)
    assert f"{path}: line {line}: field {field!r}" in str(e.value), str(e.value)


def test_the_learning_rate_between_and_before_rows(tmp_path):
    table = read_curve_table(_write(tmp_path, "t.csv", GOOD_CSV))
    (a,) = [r for r in table.runs if r.run == "a"]
    lr = a.schedule().lr  # lr[s - 1] is step s's
    assert len(lr) == 60
    # before the first row: a linear warmup from 0 to the first row's rate
    assert lr[[0, 4, 9]] == pytest.approx([0.0001, 0.0005, 0.001])
    # between rows: linear
    assert lr[[14, 19, 29, 49, 59]] == pytest.approx([0.0015, 0.002, 0.0015, 0.00075, 0.0005])
    # after the last row: held
    assert a.schedule(80).lr[79] == pytest.approx(0.0005)


def test_an_empty_loss_is_a_step_to_predict(tmp_path):
    table = read_curve_table(_write(tmp_path, "t.csv", GOOD_CSV))
    (a,) = [r for r in table.runs if r.run == "a"]
    assert a.steps.tolist() == [10, 20, 40, 60]
    assert a.observed.tolist() == [True, True, True, False]
    curve = a.curve()
    assert curve.steps.tolist() == [10, 20, 40] and curve.loss.tolist() == [3.0, 2.5, 2.0]
    assert curve.schedule.steps == 60 and curve.quantity == "val_loss"
    assert [(r.run, r.split, len(r.steps)) for r in table.runs] == [
        ("a", "val", 4),
        ("b", "val", 2),
        ("b", "train", 2),
    ]
    assert table.pick_split() == "val" and [c.name for c in table.curves("train")] == ["b"]


def test_csv_and_jsonl_give_the_same_runs_and_a_table_round_trips(tmp_path):
    csv_table = read_curve_table(_write(tmp_path, "t.csv", GOOD_CSV))
    lines = GOOD_CSV.splitlines()
    keys = lines[0].split(",")
    rows = []
    for line in lines[1:]:
        row = dict(zip(keys, line.split(",")))
        rows.append(
            {
                "run": row["run"],
                "params": int(row["params"]),
                "tokens_per_step": int(row["tokens_per_step"]),
                "step": int(row["step"]),
                "lr": float(row["lr"]),
                "loss": float(row["loss"]) if row["loss"] else None,
                **({"split": row["split"]} if row["split"] else {}),
            }
        )
    jsonl_table = read_curve_table(_write(tmp_path, "t.jsonl", _jsonl(*rows)))

    def runs(table):
        return [
            (
                r.run,
                r.split,
                r.params,
                r.tokens_per_step,
                r.steps.tolist(),
                r.lr.tolist(),
                np.nan_to_num(r.loss).tolist(),
            )
            for r in table.runs
        ]

    assert runs(csv_table) == runs(jsonl_table)
    for suffix in ("csv", "jsonl"):
        path = write_curve_table(tmp_path / f"back.{suffix}", rows)
        assert runs(read_curve_table(path)) == runs(csv_table)


def test_writing_bad_rows_writes_nothing(tmp_path):
    out = tmp_path / "t.csv"
    with pytest.raises(DataError, match=rf"{out}: line 3: field 'step'"):
        write_curve_table(out, [_row(10), _row(5)])
    assert not out.exists()
    with pytest.raises(ConfigError, match="jsonl or .csv"):
        write_curve_table(tmp_path / "t.txt", [_row(10), _row(20)])


def test_two_tables_read_as_one_but_a_run_only_once(tmp_path):
    first = _write(tmp_path, "a.csv", GOOD_CSV)
    second = _write(tmp_path, "b.jsonl", _jsonl(_row(10, run="c"), _row(20, run="c", lr=0.0005)))
    assert [r.run for r in read_curve_tables([first, second]).runs] == ["a", "b", "b", "c"]
    with pytest.raises(DataError, match="run 'a' \\(val\\) is also in"):
        read_curve_tables([first, _write(tmp_path, "c.jsonl", _jsonl(_row(10), _row(20)))])


# --- TensorBoard -----------------------------------------------------------------------------------------


def _lr(step: float) -> float:
    return 1e-3 - 2e-6 * step  # linear: its interpolation at any step is exact


@pytest.fixture(scope="module")
def tb_logs(tmp_path_factory):
    """A log directory of two runs: `torch` (torch's SummaryWriter: summary scalars) and `tf2`
    (tensorboard's own writer: TF2 scalar tensors), the learning rate logged at other steps than the loss."""
    from tensorboard.summary import Writer
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path_factory.mktemp("tb")
    w = SummaryWriter(str(root / "torch"))
    for step in range(0, 421, 30):
        w.add_scalar("train/lr", _lr(step), step)
    for step in range(0, 401, 100):  # step 0: an evaluation before training
        w.add_scalar("val/loss", 4.0 - step / 200, step)
    for step in range(10, 401, 10):
        w.add_scalar("train/loss", 5.0 - step / 100, step)
    w.close()
    w = Writer(str(root / "tf2"))
    for step in (1, 50, 250, 500):
        w.add_scalar("learning_rate", _lr(step), step=step)
    for step in (100, 200, 300):
        w.add_scalar("eval/loss", 3.0 - step / 1000, step=step)
    w.close()
    return root


def test_tensorboard_runs_read_back_from_the_table(tb_logs, tmp_path):
    rows = rows_from_tensorboard(tb_logs, params=2e6, tokens_per_step=4096)
    table = read_curve_table(write_curve_table(tmp_path / "tb.csv", rows))
    runs = {r.run: r for r in table.runs}
    assert sorted(runs) == ["tf2", "torch"] and {r.split for r in table.runs} == {"val"}
    torch_run, tf2 = runs["torch"], runs["tf2"]
    assert torch_run.params == 2e6 and torch_run.tokens_per_step == 4096
    assert torch_run.steps.tolist() == [100, 200, 300, 400]  # step 0 is left out
    assert torch_run.loss == pytest.approx([3.5, 3.0, 2.5, 2.0])
    assert torch_run.lr == pytest.approx([_lr(s) for s in (100, 200, 300, 400)], rel=1e-6)
    assert tf2.steps.tolist() == [100, 200, 300] and tf2.loss == pytest.approx([2.9, 2.8, 2.7])
    assert tf2.lr == pytest.approx([_lr(s) for s in (100, 200, 300)], rel=1e-6)


def test_tensorboard_one_run_its_name_and_its_training_loss(tb_logs):
    rows = rows_from_tensorboard(
        tb_logs / "torch", params=1000, tokens_per_step=64, split="train", run="mine"
    )
    assert {r["run"] for r in rows} == {"mine"} and {r["split"] for r in rows} == {"train"}
    assert [r["step"] for r in rows] == list(range(10, 401, 10))
    assert rows[-1]["loss"] == pytest.approx(1.0) and rows[-1]["lr"] == pytest.approx(_lr(400), rel=1e-6)
    prefixed = rows_from_tensorboard(tb_logs, params=1000, tokens_per_step=64, run="exp")
    assert sorted({r["run"] for r in prefixed}) == ["exp/tf2", "exp/torch"]


def test_tensorboard_errors_name_the_directory_and_the_tags(tb_logs, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with pytest.raises(DataError) as e:
        rows_from_tensorboard(tb_logs / "tf2", params=1000, tokens_per_step=64, split="train")
    message = str(e.value)
    assert (
        str(tb_logs / "tf2") in message
        and "'eval/loss', 'learning_rate'" in message
        and "--loss-tag" in message
    )
    with pytest.raises(DataError, match="no tag 'nope'"):
        rows_from_tensorboard(tb_logs / "torch", params=1000, tokens_per_step=64, loss_tag="nope")
    late = tmp_path / "late"
    w = SummaryWriter(str(late))
    for step in (150, 300):
        w.add_scalar("lr", 1e-3, step)
    for step in (100, 200, 300):
        w.add_scalar("val_loss", 3.0, step)
    w.close()
    with pytest.raises(
        DataError, match=r"tag 'val_loss': the loss at step 100 comes before the first logged"
    ):
        rows_from_tensorboard(late, params=1000, tokens_per_step=64)
    with pytest.raises(ConfigError, match="params: must be a positive number"):
        rows_from_tensorboard(late, params=0, tokens_per_step=64)


# --- W&B -------------------------------------------------------------------------------------------------


def _wandb_export(path: Path) -> Path:
    """A chart export in W&B's layout: `Step`, then `RUN - METRIC` with __MIN/__MAX companions, empty
    cells where a run did not log; run `gpt-c` logged only the training loss."""
    runs = {"gpt-a": 3.0, "gpt-b": 2.5}
    header = ["Step"]
    for run in runs:
        for metric in ("val/loss", "lr"):
            header += [f"{run} - {metric}", f"{run} - {metric}__MIN", f"{run} - {metric}__MAX"]
    header += ["gpt-c - train/loss", "gpt-c - train/loss__MIN", "gpt-c - train/loss__MAX"]
    lines = [",".join(f'"{h}"' for h in header)]
    for step in range(0, 401, 50):
        cells = [str(step)]
        for base in runs.values():
            loss = f"{base - step / 1000:.4f}" if step % 100 == 0 and step else ""
            lr = f"{_lr(step) * (2 if base < 3 else 1):.8g}" if step % 100 != 0 or step == 0 else ""
            cells += [loss, loss, loss, lr, lr, lr]
        cells += ["4.0", "4.0", "4.0"]
        lines.append(",".join(cells))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_wandb_export_of_several_runs(tmp_path):
    export = _wandb_export(tmp_path / "export.csv")
    rows = rows_from_wandb_csv(export, params=3e6, tokens_per_step=8192)
    table = read_curve_table(write_curve_table(tmp_path / "wandb.jsonl", rows))
    runs = {r.run: r for r in table.runs}
    assert sorted(runs) == ["gpt-a", "gpt-b"]  # gpt-c has no validation loss
    steps = [100, 200, 300, 400]
    for name, base, scale in (("gpt-a", 3.0, 1), ("gpt-b", 2.5, 2)):
        run = runs[name]
        assert run.steps.tolist() == steps and run.params == 3e6 and run.tokens_per_step == 8192
        assert run.loss == pytest.approx([base - s / 1000 for s in steps])
        # the lr is logged only between the loss's steps: interpolated, and held after step 350
        assert run.lr == pytest.approx([scale * _lr(s) for s in (100, 200, 300, 350)], rel=1e-6)
    with pytest.raises(DataError, match=r"run 'gpt-c': no learning-rate column"):
        rows_from_wandb_csv(export, params=1, tokens_per_step=1, split="train")
    with pytest.raises(DataError, match=r"line 1: no 'eval/loss'; name one with loss_column"):
        rows_from_wandb_csv(export, params=1, tokens_per_step=1, loss_column="eval/loss")
    picked = rows_from_wandb_csv(
        export, params=1, tokens_per_step=1, loss_column="gpt-b - val/loss", lr_column="lr", run="x"
    )
    assert {r["run"] for r in picked} == {"x"} and [r["step"] for r in picked] == steps


def test_a_wandb_history_export_of_one_run(tmp_path):
    text = "_step,train/loss,val/loss,lr,_runtime\n1,5.0,,0.0001,1\n2,4.5,,0.0002,2\n3,4.0,3.9,0.0003,3\n4,3.5,,,4\n"
    export = _write(tmp_path, "my-run.csv", text)
    train = rows_from_wandb_csv(export, params=100, tokens_per_step=10, split="train")
    assert [(r["run"], r["step"], r["loss"], r["lr"]) for r in train] == [
        ("my-run", 1, 5.0, 0.0001),
        ("my-run", 2, 4.5, 0.0002),
        ("my-run", 3, 4.0, 0.0003),
        ("my-run", 4, 3.5, 0.0003),
    ]
    with pytest.raises(DataError, match="column 'val/loss': 1 logged point"):
        rows_from_wandb_csv(export, params=100, tokens_per_step=10)


@pytest.mark.parametrize(
    "cells, line, column, what",
    [
        ("3,4.0,fast", 4, "lr", "expected a number, got 'fast'"),
        ("3,NaN,0.0003", 4, "val/loss", "'NaN' at step 3"),
        ("3.5,4.0,0.0003", 4, "Step", "not a whole step"),
        ("inf,4.0,0.0003", 4, "Step", "not a whole step"),
    ],
)
def test_wandb_errors_name_the_file_the_line_and_the_column(tmp_path, cells, line, column, what):
    export = _write(tmp_path, "e.csv", f"Step,val/loss,lr\n1,5.0,0.0001\n2,4.5,0.0002\n{cells}\n")
    with pytest.raises(DataError) as e:
        rows_from_wandb_csv(export, params=100, tokens_per_step=10)
    assert f"{export}: line {line}: column {column!r}" in str(e.value) and what in str(e.value)


def test_wandb_export_without_a_learning_rate(tmp_path):
    export = _write(tmp_path, "e.csv", '"Step","r1 - val/loss","r1 - val/loss__MIN"\n1,5.0,5.0\n2,4.5,4.5\n')
    with pytest.raises(
        DataError, match=r"run 'r1': no learning-rate column .* its columns: 'val/loss'; name one"
    ):
        rows_from_wandb_csv(export, params=100, tokens_per_step=10)


# --- tenx runs and ladders -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ladder_rows():
    return rows_from_ladder(LADDER)


def test_the_stored_ladder_converts_to_both_splits(ladder_rows, tmp_path):
    table = read_curve_table(write_curve_table(tmp_path / "ladder.csv", ladder_rows))
    names = sorted(p.name for p in (LADDER / "runs").iterdir())
    assert len(names) == 16 and sorted({r.run for r in table.runs}) == names
    assert {r.split for r in table.runs} == {"val", "train"} and len(table.runs) == 32
    records = read_jsonl(LADDER / "runs" / "base-C2.70e13-d2" / "metrics.jsonl")
    by_split = {r.split: r for r in table.runs if r.run == "base-C2.70e13-d2"}
    for split, key in (("val", "val_loss"), ("train", "loss")):
        run = by_split[split]
        assert run.steps.tolist() == [r["step"] for r in records]
        assert run.loss.tolist() == [r[key] for r in records]
        assert run.lr == pytest.approx([r["lr"] for r in records], rel=1e-5)
        assert (run.params, run.tokens_per_step, run.seed) == (508544, 4096, 0)
    assert {r.seed for r in table.runs if r.run.endswith("-s2")} == {2}
    assert len(table.curves("val")) == 16


def test_a_tenx_run_without_validation_and_one_stopped_early(tmp_path):
    rows = rows_from_run(RUN)
    records = read_jsonl(RUN / "metrics.jsonl")
    assert {r["split"] for r in rows} == {"train"} and len(rows) == 300
    assert [r["loss"] for r in rows] == [r["loss"] for r in records]
    assert [r["lr"] for r in rows] == pytest.approx([r["lr"] for r in records], rel=1e-5)
    assert rows[0]["params"] == 508544 and rows[0]["tokens_per_step"] == 4096
    with pytest.raises(DataError, match="holds no validation loss"):
        rows_from_run(RUN, split="val")
    stopped = tmp_path / "stopped"
    shutil.copytree(RUN, stopped)
    (stopped / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:150]))
    rows = rows_from_run(stopped, name="cut")
    assert [r["step"] for r in rows[-2:]] == [150, 300] and rows[-1]["loss"] is None
    assert rows[-1]["lr"] == pytest.approx(records[-1]["lr"], rel=1e-5) and rows[-1]["run"] == "cut"
    (run,) = read_curve_table(write_curve_table(tmp_path / "cut.jsonl", rows)).runs
    assert run.observed.sum() == 150 and run.last_step == 300


# --- the command line ------------------------------------------------------------------------------------


def test_tenx_curves_convert_then_check(tmp_path, capsys, tb_logs):
    out = tmp_path / "ladder.jsonl"
    assert main(["curves", "convert", "--from-ladder", str(LADDER), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 16 runs, 638 rows (train, val) to {out}"
    assert main(["curves", "check", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "val: 16 runs, 319 rows (0 to predict)" in printed and "train: 16 runs, 319 rows" in printed
    assert main(["curves", "convert", "--from-ladder", str(LADDER), "--out", str(out)]) == 2
    assert f"tenx: error: --out: {out} exists; pass --force" in capsys.readouterr().err
    assert main(["curves", "convert", "--from-run", str(RUN), "--out", str(out), "--force"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 1 run, 300 rows (train) to {out}"
    tb = tmp_path / "tb.csv"
    argv = ["curves", "convert", "--tensorboard", str(tb_logs), "--out", str(tb)]
    assert main(argv) == 2
    assert "--params and --tokens-per-step: required with --tensorboard" in capsys.readouterr().err
    assert main([*argv, "--params", "2e6", "--tokens-per-step", "4096", "--run", "x"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 2 runs, 7 rows (val) to {tb}"
    assert main(["curves", "check", str(tb), str(out), "--runs"]) == 0
    printed = capsys.readouterr().out
    assert "3 runs, 307 rows" in printed and "x/torch: params 2,000,000, 4 rows" in printed


def test_tenx_curves_check_a_bad_table(tmp_path, capsys):
    name, text, line, field = BAD_TABLES["csv lr cell empty"]
    path = _write(tmp_path, name, text)
    assert main(["curves", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tenx: error: {path}: line {line}: field {field!r}: missing") and "\n" not in err
