"""Tests of the data stage: sources, cleaning, split, tokenizers, shards, manifest and verification."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from tenx.data.manifest import (
    INDEX_DTYPE,
    np_dtype,
    read_manifest,
    split_documents_text,
    verify_split,
)
from tenx.data.prepare.pipeline import (
    PrepareConfig,
    assign_split,
    format_prepare_summary,
    is_prepared,
    prepare,
)
from tenx.data.prepare.sources import iter_documents, stdlib_dir
from tenx.data.tokenizer import EOT_TEXT, ByteTokenizer, load_tokenizer, train_bpe
from tenx.errors import ConfigError, DataError

SPLITS = ("train", "val", "heldout")
TRICKY_TEXTS = [
    "hello world",
    "héllo wörld, ça va?",
    "日本語のテキスト 🎉 emoji",
    "replacement \ufffd char",
    f"a literal {EOT_TEXT} inside",
    "  leading spaces\r\nwindows line\ttab\x01",
    "",
]


def _write_files(root: Path, files: dict[str, bytes | str]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        else:
            path.write_bytes(content)
    return root


def _stdlib_corpus(root: Path, count: int = 20) -> Path:
    """Copy `count` small stdlib modules into `root` (a realistic code corpus of ~250 KB)."""
    root.mkdir(parents=True, exist_ok=True)
    small = [p for p in sorted(stdlib_dir().glob("*.py")) if p.stat().st_size < 40_000]
    for path in small[:count]:
        shutil.copy(path, root / path.name)
    return root


def _read_shards(data_dir: Path, manifest: dict[str, Any], split: str) -> list[np.ndarray]:
    """Every document's tokens (EOT included) of `split`, cut using the .idx files."""
    docs = []
    for shard in manifest["splits"][split]["shards"]:
        tokens = np.fromfile(data_dir / shard["file"], dtype=np_dtype(manifest))
        starts = np.fromfile(data_dir / shard["index_file"], dtype=INDEX_DTYPE)
        ends = [*starts[1:].tolist(), len(tokens)]
        docs += [tokens[s:e] for s, e in zip(starts.tolist(), ends)]
    return docs


@pytest.fixture(scope="module")
def bpe_prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[PrepareConfig, dict[str, Any]]:
    root = tmp_path_factory.mktemp("bpe")
    corpus = _stdlib_corpus(root / "corpus")
    cfg = PrepareConfig(
        source=str(corpus), out=str(root / "data"), vocab_size=400, val_ratio=0.15, heldout_ratio=0.2
    )
    return cfg, prepare(cfg, progress=False)


def test_prepare_is_deterministic(tmp_path: Path, bpe_prepared: tuple[PrepareConfig, dict[str, Any]]) -> None:
    cfg, manifest = bpe_prepared
    again = replace(cfg, out=str(tmp_path / "again"))
    assert prepare(again, progress=False) == manifest
    first = {p.name: p.read_bytes() for p in Path(cfg.out).iterdir()}
    second = {p.name: p.read_bytes() for p in Path(again.out).iterdir()}
    assert sorted(first) == sorted(
        ["manifest.json", "tokenizer.json", "ngrams-13.json", "ngrams-13.npy"]
        + [f"{s}_00000.{ext}" for s in SPLITS for ext in ("bin", "idx")]
    )
    assert first == second


def test_bpe_training_is_deterministic_and_vocab_as_requested() -> None:
    texts = [p.read_text(encoding="utf-8") for p in sorted(stdlib_dir().glob("*.py"))[:10]]
    a, b = train_bpe(texts, 500), train_bpe(texts, 500)
    assert a.to_json() == b.to_json()
    assert (a.vocab_size, a.eot_id) == (500, 0)


def test_split_is_by_document_and_disjoint(
    tmp_path: Path, bpe_prepared: tuple[PrepareConfig, dict[str, Any]]
) -> None:
    cfg, manifest = bpe_prepared
    lists = {name: manifest["splits"][name]["documents"] for name in SPLITS}
    kept = sorted(p.name for p in Path(cfg.source).iterdir())
    assert manifest["stats"]["documents_kept"] == len(kept) == 20
    assert sorted(itertools.chain(*lists.values())) == kept
    assert all(lists[name] == sorted(lists[name]) for name in SPLITS)
    for name, ids in lists.items():
        for doc_id in ids:
            u = xxhash.xxh64_intdigest(f"0:{doc_id}".encode()) / 2**64
            expected = "heldout" if u < 0.2 else "val" if u < 0.35 else "train"
            assert name == expected
        assert manifest["splits"][name]["num_documents"] == len(ids) > 0

    reseeded = replace(cfg, out=str(tmp_path / "seed1"), seed=1, tokenizer="bytes")
    other = prepare(reseeded, progress=False)
    assert {n: other["splits"][n]["documents"] for n in SPLITS} != lists
    assert sorted(itertools.chain(*(other["splits"][n]["documents"] for n in SPLITS))) == kept


def test_assign_split_fractions_follow_ratios() -> None:
    names = [assign_split(f"doc{i}", 0, 0.1, 0.3) for i in range(20_000)]
    assert abs(names.count("heldout") / 20_000 - 0.3) < 0.015
    assert abs(names.count("val") / 20_000 - 0.1) < 0.015
    assert [assign_split(f"doc{i}", 0, 0.1, 0.3) for i in range(50)] == names[:50]
    assert [assign_split(f"doc{i}", 7, 0.1, 0.3) for i in range(50)] != names[:50]


def test_cleaning_counts(tmp_path: Path) -> None:
    corpus = _write_files(
        tmp_path / "corpus",
        {
            "a.txt": "first document\n",
            "b.txt": "first document\n",
            "blank.txt": " \n\t\n",
            "empty.txt": "",
            "latin1.txt": "café au lait".encode("latin-1"),
            "nul.txt": b"MZ\x00\x01binary",
            "sub/c.md": "second document ✓",
            "skipped.rst": "not matched by the default patterns",
        },
    )
    cfg = PrepareConfig(
        source=str(corpus), out=str(tmp_path / "data"), tokenizer="bytes", val_ratio=0, heldout_ratio=0
    )
    manifest = prepare(cfg, progress=False)
    assert manifest["stats"] == {
        "documents_seen": 7,
        "decoded_with_replacement": 1,
        "empty_skipped": 2,
        "binary_skipped": 1,
        "duplicates_removed": 1,
        "documents_kept": 3,
    }
    train = manifest["splits"]["train"]
    assert train["documents"] == ["a.txt", "latin1.txt", "sub/c.md"]
    assert [d.id for d in iter_documents(str(corpus), patterns=["**/*.rst", "sub/*"])] == [
        "skipped.rst",
        "sub/c.md",
    ]
    texts = list(split_documents_text(cfg.out, manifest, "train", load_tokenizer(cfg.out)))
    assert texts == ["first document\n", "caf\ufffd au lait", "second document ✓"]
    assert train["bytes"] == sum(len(t.encode("utf-8")) for t in texts)
    assert train["tokens"] == train["bytes"] + 3


def test_bpe_round_trip_and_literal_eot() -> None:
    tokenizer = train_bpe(TRICKY_TEXTS * 3, 300)
    for text in TRICKY_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode_batch(TRICKY_TEXTS) == [tokenizer.encode(t) for t in TRICKY_TEXTS]
    literal = tokenizer.encode(f"x{EOT_TEXT}y")
    assert tokenizer.eot_id not in literal
    assert len(literal) > 1
    assert tokenizer.decode([*literal, tokenizer.eot_id]) == f"x{EOT_TEXT}y{EOT_TEXT}"
    unseen = "ŝ\U0001f600 Ω never in training"
    assert tokenizer.decode(tokenizer.encode(unseen)) == unseen


def test_byte_tokenizer() -> None:
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.eot_id) == (257, 256)
    assert tokenizer.encode("hé") == [104, 0xC3, 0xA9]
    for text in TRICKY_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([104, 105, 256, 104]) == f"hi{EOT_TEXT}h"
    assert tokenizer.decode([0xC3]) == "\ufffd"
    assert tokenizer.save(Path("unused")) == {
        "kind": "bytes",
        "vocab_size": 257,
        "eot_id": 256,
        "file": None,
        "xxhash": xxhash.xxh3_64_hexdigest(b"bytes"),
    }
    with pytest.raises(ValueError, match="0..256"):
        tokenizer.decode([257])


def test_manifest_counts_match_texts(bpe_prepared: tuple[PrepareConfig, dict[str, Any]]) -> None:
    cfg, manifest = bpe_prepared
    tokenizer = load_tokenizer(cfg.out)
    assert manifest["tokenizer"] == {
        "kind": "bpe",
        "vocab_size": 400,
        "eot_id": 0,
        "file": "tokenizer.json",
        "xxhash": xxhash.xxh3_64_hexdigest((Path(cfg.out) / "tokenizer.json").read_bytes()),
    }
    assert manifest["dtype"] == "uint16"
    for split in SPLITS:
        entry = manifest["splits"][split]
        texts = [(Path(cfg.source) / doc_id).read_text(encoding="utf-8") for doc_id in entry["documents"]]
        assert entry["bytes"] == sum(len(t.encode("utf-8")) for t in texts)
        assert entry["tokens"] == sum(len(tokenizer.encode(t)) + 1 for t in texts)
        decoded = list(split_documents_text(cfg.out, manifest, split, tokenizer))
        assert decoded == texts
        assert sum(len(t.encode("utf-8")) for t in decoded) == entry["bytes"]
        docs = _read_shards(Path(cfg.out), manifest, split)
        assert [d.tolist() for d in docs] == [tokenizer.encode(t) + [0] for t in texts]


def test_jsonl_source(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "one", "id": 7}\n\n{"text": "two", "id": "b"}\n{"text": "bad \\ud800"}\n')
    docs = list(iter_documents(str(path)))
    assert [(d.id, d.data) for d in docs] == [
        ("corpus.jsonl:1", "one"),
        ("corpus.jsonl:3", "two"),
        ("corpus.jsonl:4", "bad \ud800"),
    ]
    path.write_text('{"body": "one", "id": 7}\n{"body": "two", "id": "b"}\n')
    assert [(d.id, d.data) for d in iter_documents(str(path), text_field="body", id_field="id")] == [
        ("7", "one"),
        ("b", "two"),
    ]

    path.write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n')
    cfg = PrepareConfig(
        source=str(path), out=str(tmp_path / "data"), tokenizer="bytes", val_ratio=0, heldout_ratio=0
    )
    manifest = prepare(cfg, progress=False)
    assert manifest["stats"]["decoded_with_replacement"] == 1
    texts = list(split_documents_text(cfg.out, manifest, "train", ByteTokenizer()))
    assert texts == ["ok", "a\ufffd\ufffd\ufffdb"]


def test_jsonl_errors_name_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl, line 2: not valid JSON.*'text'"):
        list(iter_documents(str(path)))
    path.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl, line 2: missing field 'text'"):
        list(iter_documents(str(path)))
    path.write_text('{"text": 3}\n')
    with pytest.raises(DataError, match=r"line 1: field 'text' is int"):
        list(iter_documents(str(path)))
    path.write_text('{"text": "a", "id": 1}\n{"text": "b", "id": 1}\n')
    cfg = PrepareConfig(source=str(path), out=str(tmp_path / "d"), tokenizer="bytes", id_field="id")
    with pytest.raises(DataError, match="share the id '1'"):
        prepare(cfg, progress=False)


def test_txt_and_parquet_sources(tmp_path: Path) -> None:
    txt = tmp_path / "book.txt"
    txt.write_bytes(b"whole file\nis one document\n")
    assert [(d.id, d.data) for d in iter_documents(str(txt))] == [
        ("book.txt", b"whole file\nis one document\n")
    ]

    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"content": ["alpha", None, "gamma"], "n": [1, 2, 3]}), parquet)
    docs = list(iter_documents(str(parquet), column="content"))
    assert [(d.id, d.data) for d in docs] == [
        ("rows.parquet:0", "alpha"),
        ("rows.parquet:1", ""),
        ("rows.parquet:2", "gamma"),
    ]
    with pytest.raises(DataError, match=r"rows\.parquet: no column 'text'; available columns: content, n"):
        list(iter_documents(str(parquet)))
    with pytest.raises(DataError, match="column 'n' has type int64"):
        list(iter_documents(str(parquet), column="n"))

    cfg = PrepareConfig(
        source=str(parquet),
        out=str(tmp_path / "d"),
        tokenizer="bytes",
        column="content",
        heldout_ratio=0,
        val_ratio=0,
    )
    manifest = prepare(cfg, progress=False)
    assert manifest["stats"]["empty_skipped"] == 1
    assert manifest["splits"]["train"]["documents"] == ["rows.parquet:0", "rows.parquet:2"]


def test_hf_source_reads_local_parquet(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["alpha", "beta"]}), parquet)
    docs = list(iter_documents(f"hf:{parquet}"))
    assert [(d.id, d.data) for d in docs] == [("rows.parquet:0", "alpha"), ("rows.parquet:1", "beta")]


def test_bad_source_specs(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"'.*nowhere' does not exist; accepted forms: a directory"):
        list(iter_documents(str(tmp_path / "nowhere")))
    odd = tmp_path / "data.csv"
    odd.write_text("a,b\n")
    with pytest.raises(DataError, match=r"data\.csv' has an unknown suffix; accepted forms: .*stdlib"):
        list(iter_documents(str(odd)))
    txt = tmp_path / "a.txt"
    txt.write_text("x")
    with pytest.raises(DataError, match="patterns apply only to a directory"):
        list(iter_documents(str(txt), patterns=["*.py"]))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"gave no usable documents \(0 read, 0 empty, 0 binary\)"):
        prepare(PrepareConfig(source=str(empty), out=str(tmp_path / "d"), tokenizer="bytes"), progress=False)


def test_stdlib_source_ids_are_relative_py_paths() -> None:
    first = list(itertools.islice(iter_documents("stdlib"), 5))
    assert [d.id for d in first] == sorted(d.id for d in first)
    for doc in first:
        assert doc.id.endswith(".py") and not doc.id.startswith("/")
        assert doc.data == (stdlib_dir() / doc.id).read_bytes()


def test_train_split_empty_raises(tmp_path: Path) -> None:
    name = next(
        f"doc{i}.txt" for i in itertools.count() if assign_split(f"doc{i}.txt", 0, 0.0, 0.5) == "heldout"
    )
    corpus = _write_files(tmp_path / "corpus", {name: "only document"})
    cfg = PrepareConfig(
        source=str(corpus), out=str(tmp_path / "d"), tokenizer="bytes", val_ratio=0.0, heldout_ratio=0.5
    )
    with pytest.raises(DataError, match="add documents or lower val_ratio/heldout_ratio"):
        prepare(cfg, progress=False)
    assert not (tmp_path / "d").exists()


def test_multiple_shards_cut_at_document_boundaries(tmp_path: Path) -> None:
    texts = {f"d{i:02d}.txt": "x" * (10 + 15 * i) for i in range(12)}
    texts["d99.txt"] = "big " * 100
    corpus = _write_files(tmp_path / "corpus", texts)
    cfg = PrepareConfig(
        source=str(corpus),
        out=str(tmp_path / "d"),
        tokenizer="bytes",
        val_ratio=0,
        heldout_ratio=0,
        shard_tokens=200,
    )
    manifest = prepare(cfg, progress=False)
    train = manifest["splits"]["train"]
    shards = train["shards"]
    # Each shard holds as many whole documents as fit in 200 tokens; only a lone document may exceed it.
    sizes = [len(texts[name]) + 1 for name in train["documents"]]
    expected, current = [], []
    for size in sizes:
        if current and sum(current) + size > 200:
            expected.append(current)
            current = []
        current.append(size)
    expected.append(current)
    assert [s["documents"] for s in shards] == [len(group) for group in expected]
    assert [s["tokens"] for s in shards] == [sum(group) for group in expected]
    assert [s["file"] for s in shards] == [f"train_{i:05d}.bin" for i in range(len(shards))]
    assert max(s["tokens"] for s in shards) == 401
    for shard, group in zip(shards, expected):
        starts = np.fromfile(Path(cfg.out) / shard["index_file"], dtype="<i8")
        assert starts.tolist() == np.cumsum([0, *group[:-1]]).tolist()
    docs = _read_shards(Path(cfg.out), manifest, "train")
    assert [ByteTokenizer().decode(d[:-1]) for d in docs] == [texts[n] for n in train["documents"]]
    assert all(d[-1] == 256 for d in docs)

    # Re-preparing into the same directory with bigger shards removes the shards no longer listed.
    prepare(replace(cfg, shard_tokens=1 << 20), progress=False)
    assert sorted(p.name for p in Path(cfg.out).iterdir()) == [
        "manifest.json",
        "ngrams-50.json",  # the bytes tokenizer's n-grams: 50 bytes, about 13 BPE tokens
        "ngrams-50.npy",
        "train_00000.bin",
        "train_00000.idx",
    ]


def test_corrupt_shard_and_missing_dir_are_reported(
    tmp_path: Path, bpe_prepared: tuple[PrepareConfig, dict[str, Any]]
) -> None:
    cfg, manifest = bpe_prepared
    data = tmp_path / "copy"
    shutil.copytree(cfg.out, data)
    for split in SPLITS:
        verify_split(data, manifest, split)
    shard = data / "val_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    verify_split(data, manifest, "train")
    with pytest.raises(
        DataError, match=r"shard file .*val_00000\.bin is corrupt: expected xxhash \w+, got \w+; re-run"
    ):
        verify_split(data, manifest, "val")
    (data / "heldout_00000.idx").unlink()
    with pytest.raises(DataError, match=r"heldout_00000\.idx is missing"):
        verify_split(data, manifest, "heldout")

    with pytest.raises(
        DataError, match=f"data directory {re.escape(str(tmp_path / 'absent'))} does not exist"
    ):
        read_manifest(tmp_path / "absent")
    with pytest.raises(DataError, match=r"manifest\.json is missing; run `tenx data prepare"):
        read_manifest(tmp_path)
    (data / "manifest.json").write_text(json.dumps({**manifest, "format": "tenx-shards/0"}))
    with pytest.raises(DataError, match="format 'tenx-shards/0'"):
        read_manifest(data)


def test_is_prepared(tmp_path: Path, bpe_prepared: tuple[PrepareConfig, dict[str, Any]]) -> None:
    cfg, _ = bpe_prepared
    assert is_prepared(cfg)
    assert not is_prepared(replace(cfg, vocab_size=512))
    assert not is_prepared(replace(cfg, seed=3))
    assert not is_prepared(replace(cfg, out=str(tmp_path / "empty")))
    copy = tmp_path / "copy"
    shutil.copytree(cfg.out, copy)
    copied = replace(cfg, out=str(copy))
    assert is_prepared(copied)
    with open(copy / "train_00000.bin", "r+b") as f:
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 1]))
    assert not is_prepared(copied)


def test_format_summary(bpe_prepared: tuple[PrepareConfig, dict[str, Any]]) -> None:
    cfg, manifest = bpe_prepared
    summary = format_prepare_summary(manifest, cfg.out)
    train = manifest["splits"]["train"]
    row = next(line for line in summary.splitlines() if line.startswith("train"))
    assert row.split() == [
        "train",
        f"{train['num_documents']:,}",
        f"{train['bytes']:,}",
        f"{train['tokens']:,}",
        f"{train['bytes'] / train['tokens']:.2f}",
    ]
    assert "20 seen, 20 kept" in summary
    assert "bpe, vocab_size 400, eot_id 0" in summary
    assert summary.endswith(f"output: {cfg.out}")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"tokenizer": "wordpiece"}, "tokenizer must be one of bpe, bytes"),
        ({"vocab_size": 100}, r"vocab_size must be an integer in \[257"),
        ({"val_ratio": 1.5}, r"val_ratio must be a number in \[0, 1\)"),
        ({"val_ratio": 0.5, "heldout_ratio": 0.5}, "val_ratio \\+ heldout_ratio must be < 1"),
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"patterns": []}, "patterns must be null or a non-empty list"),
        ({"shard_tokens": 0}, "shard_tokens must be a positive integer"),
        ({"max_documents": 0}, "max_documents must be null or a positive integer"),
        ({"contamination_threshold": "0.5"}, "contamination_threshold must be a number"),
        ({"contamination_threshold": 1.5}, "contamination_threshold"),
        ({"source": ""}, "source must be a non-empty string"),
    ],
)
def test_config_validation(override: dict[str, Any], message: str) -> None:
    cfg = PrepareConfig(**{"source": "stdlib", "out": "d", **override})
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_max_documents_caps_reading(tmp_path: Path) -> None:
    corpus = _write_files(tmp_path / "c", {f"{i}.txt": f"document {i}" for i in range(10)})
    cfg = PrepareConfig(
        source=str(corpus),
        out=str(tmp_path / "d"),
        tokenizer="bytes",
        max_documents=4,
        val_ratio=0,
        heldout_ratio=0,
    )
    manifest = prepare(cfg, progress=False)
    assert manifest["stats"]["documents_seen"] == 4
    assert manifest["splits"]["train"]["documents"] == ["0.txt", "1.txt", "2.txt", "3.txt"]


def test_hf_source_without_datasets_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"pip install tenx\[hf\]"):
        list(iter_documents("hf:some/dataset:train"))
