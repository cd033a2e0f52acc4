"""prediction.json: written atomically, read back equal, versioned, and every defect named by file and field."""

from __future__ import annotations

import json

import pytest

from tenx.errors import TenxError
from tenx.monitor.loss_plot import plot_prediction
from tenx.monitor.prediction_file import FORMAT, VERSION, Prediction, read_prediction, write_prediction


def _prediction() -> Prediction:
    steps = [10, 20, 30, 40]
    loss = [4.0, 3.5, 3.2, 3.0]
    return Prediction(
        step=steps,
        tokens=[s * 4096 for s in steps],
        loss=loss,
        lower=[x - 0.1 for x in loss],
        upper=[x + 0.1 for x in loss],
        window=5,
        source={"kind": "ladder", "law": "test"},
        target={"steps": 40},
    )


def test_round_trip_and_interpolation(tmp_path):
    path = write_prediction(tmp_path / "prediction.json", _prediction())
    obj = json.loads(path.read_text())
    assert obj["format"] == FORMAT and obj["version"] == VERSION
    assert obj["final"] == {"step": 40, "loss": 3.0, "lower": 2.9, "upper": 3.1}
    back = read_prediction(path)
    assert back.to_json() == _prediction().to_json()
    assert back.at(20) == {"loss": 3.5, "lower": 3.4, "upper": 3.6}
    assert back.at(25)["loss"] == pytest.approx(3.35)
    assert back.at(5) is None and back.at(41) is None
    assert [p.name for p in tmp_path.iterdir()] == ["prediction.json"]  # no temporary file left


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda o: o.update(format="other"), "not a tenx prediction"),
        (lambda o: o.update(version=VERSION + 1), f"version {VERSION + 1} is newer"),
        (lambda o: o["curve"].pop("lower"), "'curve.lower' must be a list"),
        (lambda o: o["curve"]["loss"].append(1.0), "differ in length"),
        (lambda o: o["curve"]["loss"].__setitem__(2, "nan"), "'curve.loss[2]' must be a finite number"),
        (lambda o: o["curve"]["step"].__setitem__(1, 10), "'curve.step' must increase"),
        (lambda o: o["curve"]["step"].__setitem__(0, 1.5), "'curve.step[0]' must be a non-negative integer"),
        (lambda o: o["curve"]["upper"].__setitem__(3, 2.0), "(step 40) lower <= loss <= upper"),
        (lambda o: o.update(level=1.5), "'level' must be a number in (0, 1)"),
        (lambda o: o.update(window=0), "'window' must be an integer >= 1"),
    ],
)
def test_a_damaged_file_is_named_with_its_field(tmp_path, edit, words):
    path = write_prediction(tmp_path / "prediction.json", _prediction())
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))
    with pytest.raises(TenxError) as e:
        read_prediction(path)
    assert str(path) in str(e.value) and words in str(e.value)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(TenxError, match="no such prediction file; write one with `tenx predict`"):
        read_prediction(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_bytes(b"\xff{")
    with pytest.raises(TenxError, match="not a readable JSON prediction"):
        read_prediction(tmp_path / "bad.json")


def test_the_plot_is_a_png_with_the_actual_curve(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(
            json.dumps({"step": s, "tokens": s * 4096, "loss": 4.5 - s / 40}) + "\n" for s in range(1, 41)
        )
    )
    png = plot_prediction(_prediction(), tmp_path / "prediction.png", metrics, title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
