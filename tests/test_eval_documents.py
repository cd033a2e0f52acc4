"""`tenx eval` document by document: breakdowns, several runs compared, contamination and the clean part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tenx.cli import main
from tenx.eval.evaluate import evaluate
from tenx.train.run import train

SETTINGS = ("train.steps=8", "train.eval_every=0", "checkpoint.every=8", "train.threads=1")


@pytest.fixture(scope="module")
def runs(tiny_data, tiny_config, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("evaldocs")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        out[name] = root / name
        train(tiny_config(tiny_data, *SETTINGS, f"train.seed={seed}"), out[name])
    return out


def test_breakdown_by_directory_and_file_type_adds_up(runs, corpus_dir, tmp_path):
    report = evaluate(runs["a"], [str(corpus_dir)], tmp_path / "eval.json", breakdown=True)
    plain = evaluate(runs["a"], [str(corpus_dir)], tmp_path / "plain.json")
    r, p = report["datasets"][str(corpus_dir)], plain["datasets"][str(corpus_dir)]
    # document by document gives the same figures as the one-stream evaluation
    assert r["tokens"] == p["tokens"] and r["bytes"] == p["bytes"]
    assert r["nll_nats"] == pytest.approx(p["nll_nats"], rel=1e-9)
    by_dir = r["by_directory"]
    assert set(by_dir) == {"email", "json"}
    assert sum(g["bytes"] for g in by_dir.values()) == r["bytes"]
    assert sum(g["nll_nats"] for g in by_dir.values()) == pytest.approx(r["nll_nats"], rel=1e-9)
    assert set(r["by_file_type"]) == {".py"}
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert set(saved["datasets"][str(corpus_dir)]["by_directory"]) == {"email", "json"}


def test_several_runs_are_compared_on_the_same_data(runs, corpus_dir, capsys):
    assert main(["eval", str(runs["a"]), str(runs["b"]), "--split", str(corpus_dir / "json")]) == 0
    out = capsys.readouterr().out
    assert "lowest bits per byte" in out
    table = out[out.index("run ") :]
    assert str(runs["a"])[-20:] in table and str(runs["b"])[-20:] in table
    assert main(["eval", str(runs["a"]), str(runs["b"]), "--out", "x.json"]) == 2


def test_copies_of_training_files_are_contaminated_and_left_out_of_the_clean_score(
    runs, tiny_data, tmp_path, capsys, monkeypatch
):
    from tenx.eval.documents import split_documents

    monkeypatch.setenv("TENX_CACHE_DIR", str(tmp_path / "cache"))
    data_files = sorted(p.name for p in tiny_data.iterdir())  # the user's data directory is never written

    # a "private repository": two files copied from the training split, and the held-out documents
    repo = tmp_path / "repo"
    (repo / "copied").mkdir(parents=True)
    from tenx.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_data)
    train_docs = split_documents(tiny_data, "train")
    for i in (0, 5):
        (repo / "copied" / f"train_{i}.py").write_text(tok.decode(train_docs[i].tokens))
    heldout = split_documents(tiny_data, "heldout")
    (repo / "fresh").mkdir()
    for i, doc in enumerate(heldout[:6]):
        (repo / "fresh" / f"doc_{i}.py").write_text(tok.decode(doc.tokens))
    report = evaluate(runs["a"], [str(repo)], tmp_path / "eval.json", decontaminate=True, breakdown=True)
    r = report["datasets"][str(repo)]
    c = r["contamination"]
    assert c["n"] == 50  # tenx.data.ngrams.data_n of the byte-level tiny data
    assert set(c["contaminated_names"]) >= {"copied/train_0.py", "copied/train_5.py"}
    assert not any(name.startswith("fresh/") for name in c["contaminated_names"])
    assert r["clean"]["documents"] == r["by_directory"]["fresh"]["documents"]
    assert r["clean"]["bytes"] == r["by_directory"]["fresh"]["bytes"]
    assert sorted(p.name for p in tiny_data.iterdir()) == data_files
    assert "ngrams-50.npy" in data_files or list(
        (tmp_path / "cache" / "ngram-indexes").glob("*/ngrams-50.npy")
    )
    assert (
        main(
            [
                "eval",
                str(runs["a"]),
                "--split",
                "heldout",
                "--decontaminate",
                "--out",
                str(tmp_path / "h.json"),
            ]
        )
        == 0
    )
    # byte-level data: n-grams of 50 bytes, the n prepare decontaminated with (13 bytes match boilerplate)
    assert "contamination (50-gram" in capsys.readouterr().out
