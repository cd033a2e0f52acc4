"""Near-duplicates kept in one split; the n-gram index of the train split, checked against plain Python."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from tenx.cli import main
from tenx.data.manifest import INDEX_DTYPE, SPLITS, np_dtype, read_manifest
from tenx.data.ngrams import (
    BYTES_N,
    DEFAULT_CONTAMINATION_THRESHOLD,
    DEFAULT_N,
    Decontamination,
    contamination,
    decontaminate,
    fmix64,
    index_paths,
    load_index,
    ngram_hashes,
)
from tenx.data.prepare.dedup import find_near_duplicates
from tenx.data.prepare.pipeline import (
    PrepareConfig,
    assign_split,
    format_prepare_summary,
    is_prepared,
    prepare,
)
from tenx.errors import DataError
from tenx.utils.io import file_xxhash

N = BYTES_N  # the bytes tokenizer's default n-gram length: every corpus here is byte-level
BYTES_EOT = 256


def _documents(data_dir: Path, split: str) -> list[np.ndarray]:
    """Each document of `split` as its token ids, without the end-of-document id."""
    manifest = read_manifest(data_dir)
    docs = []
    for shard in manifest["splits"][split]["shards"]:
        tokens = np.fromfile(data_dir / shard["file"], dtype=np_dtype(manifest))
        starts = np.fromfile(data_dir / shard["index_file"], dtype=INDEX_DTYPE).tolist()
        for start, end in zip(starts, [*starts[1:], len(tokens)]):
            assert tokens[end - 1] == BYTES_EOT
            docs.append(tokens[start : end - 1])
    return docs


def _grams(doc: np.ndarray) -> list[bytes]:
    """The reference: a byte-token document's N-grams as byte strings, no hashing involved."""
    raw = doc.astype(np.uint8).tobytes()
    return [raw[i : i + N] for i in range(len(raw) - N + 1)]


def _reference_fractions(data_dir: Path, split: str = "heldout") -> dict[str, float]:
    """Per document of `split`, the fraction of its N-grams that occur in some train document."""
    train = {gram for doc in _documents(data_dir, "train") for gram in _grams(doc)}
    ids = read_manifest(data_dir)["splits"][split]["documents"]
    fractions = {}
    for doc_id, doc in zip(ids, _documents(data_dir, split)):
        grams = _grams(doc)
        fractions[doc_id] = sum(g in train for g in grams) / len(grams) if grams else 0.0
    return fractions


def test_ngram_hashes_follow_the_documented_chain() -> None:
    rng = np.random.default_rng(0)
    for n, length in ((1, 5), (3, 40), (13, 60), (13, 12)):
        tokens = rng.integers(0, 70_000, length).astype(np.uint32)
        expected = []
        for i in range(len(tokens) - n + 1):
            h = fmix64(np.array([n], dtype=np.uint64))
            for t in tokens[i : i + n]:
                h = fmix64(h ^ np.uint64(t))
            expected.append(int(h[0]))
        assert ngram_hashes(tokens, n).tolist() == expected
        assert ngram_hashes(tokens.astype(np.uint16) % 65_000, n).dtype == np.uint64


def test_index_agrees_with_a_plain_python_reference(tiny_data: Path) -> None:
    index = load_index(tiny_data, N)
    train_grams = {gram for doc in _documents(tiny_data, "train") for gram in _grams(doc)}
    assert len(index.hashes) == len(train_grams)  # with every train gram found below: the same set
    seen: dict[int, bytes] = {}
    shared_any = 0
    for split in SPLITS:
        for doc in _documents(tiny_data, split):
            grams = _grams(doc)
            hashes = ngram_hashes(doc, N)
            assert len(hashes) == len(grams)
            for gram, h in zip(grams, hashes.tolist()):
                assert seen.setdefault(h, gram) == gram, "hash collision on the test corpus"
            reference = np.array([g in train_grams for g in grams], dtype=bool)
            assert np.array_equal(index.contains(hashes), reference)
            found, total = index.overlap(np.append(doc, BYTES_EOT))  # a trailing EOT changes nothing
            assert (found, total) == (int(reference.sum()), len(grams))
            shared_any += split != "train" and 0 < found < total
    assert shared_any > 0  # the held-out side shares some, not all, of its n-grams: the check has teeth


def test_contamination_counts(tiny_data: Path) -> None:
    index = load_index(tiny_data, N)
    train_doc = _documents(tiny_data, "train")[0]
    novel = np.frombuffer(b"zq" * 40 + b"#" * 20, dtype=np.uint8).astype(np.uint16)
    short = train_doc[: N - 1]
    half = np.concatenate([train_doc[:200], novel])
    report = contamination(index, [train_doc, novel, short, half], 0.5, document_bytes=[10, 20, 30, 40])
    assert report["overlap"][:3] == [1.0, 0.0, 0.0]
    assert 0.5 < report["overlap"][3] < 1.0
    assert report["contaminated"] == [True, False, False, True]
    assert (report["documents"], report["documents_contaminated"]) == (4, 2)
    assert report["tokens_contaminated"] == len(train_doc) + len(half)
    assert (report["bytes"], report["bytes_contaminated"]) == (100, 50)
    assert contamination(index, [novel, short], 0.0)["documents_contaminated"] == 0
    with pytest.raises(ValueError, match="threshold"):
        contamination(index, [novel], 1.5)


@pytest.mark.parametrize(("threshold", "groups"), [(1.0, [[0, 1]]), (0.8, [[0, 1]]), (0.5, [[0, 1, 3]])])
def test_near_duplicate_groups_at_any_threshold(threshold: float, groups: list[list[int]]) -> None:
    # Jaccard of the 5-word shingle sets: 0 and 1 (whitespace only) 1.0, 0 and 3 (last word) 3/5, 2 shares none.
    texts = ["a b c d e f g h", "a  b c\td e f g h", "x y z", "a b c d e f g q"]
    assert find_near_duplicates(texts, threshold) == groups


def _corpus(tmp_path: Path, seed: int, **options) -> tuple[random.Random, list[str], PrepareConfig]:
    """A seeded random generator, its vocabulary of 3000 random words, and the config that prepares
    tmp_path/corpus into tmp_path/data (bytes; 10% validation, 30% held out; `options` besides)."""
    rng = random.Random(seed)
    vocabulary = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(3000)
    ]
    cfg = PrepareConfig(
        source=str(tmp_path / "corpus"),
        out=str(tmp_path / "data"),
        tokenizer="bytes",
        val_ratio=0.1,
        heldout_ratio=0.3,
        **options,
    )
    return rng, vocabulary, cfg


def _words(rng: random.Random, vocabulary: list[str], lines: int) -> str:
    return "".join(" ".join(rng.choices(vocabulary, k=8)) + "\n" for _ in range(lines))


def _split_apart_dirs(name: str, cfg: PrepareConfig) -> tuple[str, str]:
    """Two folder names that put `<folder>/name` in train and held-out by the plain hash split."""

    def first_in(split: str) -> str:
        return next(
            folder
            for folder in (f"pkg{i}" for i in range(1000))
            if assign_split(f"{folder}/{name}", cfg.seed, cfg.val_ratio, cfg.heldout_ratio) == split
        )

    return first_in("train"), first_in("heldout")


def test_near_duplicates_share_a_split(tmp_path: Path) -> None:
    rng, vocabulary, cfg = _corpus(tmp_path, 0)
    files = {f"solo/doc{i}.py": _words(rng, vocabulary, 40) for i in range(24)}
    pairs = []
    for k, edit in enumerate(("header", "whitespace")):
        name = f"mod{k}.py"
        a, b = _split_apart_dirs(name, cfg)
        text = f"# version {k}.0\n" + _words(rng, vocabulary, 40)
        copy = (
            f"# version {k}.1, vendored\n" + text.split("\n", 1)[1]
            if edit == "header"
            else text.replace(" ", "  ").replace("\n", " \n")
        )
        files[f"{a}/{name}"], files[f"{b}/{name}"] = text, copy
        pairs.append((f"{a}/{name}", f"{b}/{name}"))
    files["solo/doc0_copy.py"] = files["solo/doc0.py"]  # read after doc0.py, so removed
    for name, text in files.items():
        (Path(cfg.source) / name).parent.mkdir(parents=True, exist_ok=True)
        (Path(cfg.source) / name).write_text(text)

    manifest = prepare(cfg, progress=False)
    where = {doc: split for split in SPLITS for doc in manifest["splits"][split]["documents"]}
    for first, second in pairs:
        assert (
            where[first] == where[second] == assign_split(first, cfg.seed, cfg.val_ratio, cfg.heldout_ratio)
        )
    assert manifest["stats"]["duplicates_removed"] == 1 and "solo/doc0_copy.py" not in where
    assert manifest["dedup"] == {
        "near_duplicate_groups": 2,
        "near_duplicate_documents": 4,
        "moved_to_group_split": 2,
        "largest_group": 2,
        "moved_for_contamination": {
            "n": N,
            "threshold": DEFAULT_CONTAMINATION_THRESHOLD,
            "count": 0,
            "from_val": 0,
            "from_heldout": 0,
            "documents": [],
            "rounds": 1,
            "converged": True,
        },
    }
    assert "1 exact duplicates removed; 2 near-duplicate groups (4 documents)" in format_prepare_summary(
        manifest
    )
    fractions = _reference_fractions(Path(cfg.out))
    assert fractions and max(fractions.values()) <= DEFAULT_CONTAMINATION_THRESHOLD
    assert is_prepared(cfg)

    # Without the check (nor decontamination), each pair straddles a split boundary, and the held-out copy
    # is mostly in training.
    off = PrepareConfig(
        **{
            **cfg.__dict__,
            "out": str(tmp_path / "off"),
            "near_dup_threshold": 0.0,
            "contamination_threshold": 1.0,
        }
    )
    manifest = prepare(off, progress=False)
    where = {doc: split for split in SPLITS for doc in manifest["splits"][split]["documents"]}
    assert all(where[first] != where[second] for first, second in pairs)
    assert manifest["dedup"]["near_duplicate_groups"] == 0
    assert max(_reference_fractions(Path(off.out)).values()) > 0.9


def test_stale_and_corrupt_index_errors_name_the_file(tmp_path: Path, tiny_data: Path, capsys) -> None:
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    npy, sidecar = index_paths(data, N)
    old = {p: p.read_bytes() for p in (npy, sidecar)}
    cfg = PrepareConfig(source="unused", out=str(data))

    npy.write_bytes(old[npy][:-8] + bytes(8))
    with pytest.raises(DataError, match=rf"{npy}.*corrupt.*`tenx data index {data} --n {N}` rebuilds it"):
        load_index(data, N)
    pickled = data / "pickled.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    npy.write_bytes(pickled.read_bytes())
    pickled.unlink()
    meta = json.loads(old[sidecar])
    sidecar.write_text(json.dumps({**meta, "xxhash": file_xxhash(npy)}))
    with pytest.raises(DataError, match=rf"{npy} is corrupt"):  # never unpickled
        load_index(data, N)
    sidecar.write_text("{not json")
    with pytest.raises(DataError, match=rf"{sidecar} cannot be read"):
        load_index(data, N)
    sidecar.unlink()
    with pytest.raises(DataError, match=rf"{sidecar} is missing"):
        load_index(data, N)

    # Re-preparing with another seed moves documents: the old index is removed, and if put back, refused.
    source = read_manifest(data)["source"]["spec"]
    cfg = PrepareConfig(
        source=source,
        out=str(data),
        tokenizer="bytes",
        val_ratio=0.1,
        heldout_ratio=0.1,
        seed=1,
        ngram_index=0,
    )
    prepare(cfg, progress=False)
    assert not npy.exists() and not sidecar.exists()
    for path, raw in old.items():
        path.write_bytes(raw)
    with pytest.raises(DataError, match=rf"{sidecar} is stale: its shards differ.*tenx data index {data}"):
        load_index(data, N)
    assert is_prepared(cfg)
    cfg = PrepareConfig(**{**cfg.__dict__, "ngram_index": None})  # the bytes tokenizer's default: N
    prepare(cfg, progress=False)
    assert is_prepared(cfg)
    for path, raw in old.items():
        path.write_bytes(raw)
    assert not is_prepared(cfg)
    assert main(["data", "index", str(data)]) == 0
    assert f"{npy}: " in capsys.readouterr().out
    assert is_prepared(cfg)
    # `tenx data index` without --n rebuilds the index of the n the directory was prepared with.
    cfg = PrepareConfig(**{**cfg.__dict__, "ngram_index": DEFAULT_N})  # explicit: 13 bytes
    prepare(cfg, progress=False)
    assert read_manifest(data)["prepare"]["ngram_index"] == DEFAULT_N and not npy.exists()
    for path in index_paths(data, DEFAULT_N):
        path.unlink()
    assert not is_prepared(cfg)
    assert main(["data", "index", str(data)]) == 0
    assert f"{index_paths(data, DEFAULT_N)[0]}: " in capsys.readouterr().out
    assert is_prepared(cfg)
    assert main(["data", "index", str(data), "--n", "5"]) == 0
    assert load_index(data, 5).n == 5 and len(load_index(data, 5).hashes) < len(
        load_index(data, DEFAULT_N).hashes
    )
    assert main(["data", "index", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_decontamination_moves_partial_copies_until_none_exceeds(tmp_path: Path) -> None:
    rng, vocabulary, cfg = _corpus(tmp_path, 1, near_dup_threshold=0.9)
    original = _words(rng, vocabulary, 40).splitlines(keepends=True)
    extra = _words(rng, vocabulary, 40).splitlines(keepends=True)
    train_dir, held_dir = _split_apart_dirs("partial.py", cfg)
    # `partial`: 28 of its 40 lines are the training file's, about 0.7 of its N-grams; `chained`: 12 lines
    # of the training file (0.3) and 12 of `partial`'s own, so 0.6 once `partial` moves into train.
    partial = f"{held_dir}/partial.py"
    chained = next(
        f"{held_dir}/chained{i}.py"
        for i in range(1000)
        if assign_split(f"{held_dir}/chained{i}.py", cfg.seed, cfg.val_ratio, cfg.heldout_ratio) == "heldout"
    )
    files = {f"solo/doc{i}.py": _words(rng, vocabulary, 40) for i in range(24)}
    files[f"{train_dir}/partial.py"] = "".join(original)
    files[partial] = "".join(original[:28] + extra[:12])
    files[chained] = "".join(original[28:] + extra[:12] + extra[24:])
    for name, text in files.items():
        (Path(cfg.source) / name).parent.mkdir(parents=True, exist_ok=True)
        (Path(cfg.source) / name).write_text(text)

    # Without decontamination, near-duplicate grouping (Jaccard about 0.5 here) leaves the copy held out.
    off = PrepareConfig(**{**cfg.__dict__, "out": str(tmp_path / "off"), "contamination_threshold": 1.0})
    manifest = prepare(off, progress=False)
    assert manifest["dedup"]["near_duplicate_groups"] == 0
    assert manifest["dedup"]["moved_for_contamination"]["count"] == 0
    fractions = _reference_fractions(Path(off.out))
    assert 0.6 < fractions[partial] < 0.8 and 0.25 < fractions[chained] < 0.35
    assert sum(f > DEFAULT_CONTAMINATION_THRESHOLD for f in fractions.values()) == 1

    manifest = prepare(cfg, progress=False)
    where = {doc: split for split in SPLITS for doc in manifest["splits"][split]["documents"]}
    assert where[partial] == where[chained] == "train"
    assert manifest["dedup"]["moved_for_contamination"] == {
        "n": N,
        "threshold": DEFAULT_CONTAMINATION_THRESHOLD,
        "count": 2,
        "from_val": 0,
        "from_heldout": 2,
        "documents": sorted([partial, chained]),
        "rounds": 3,  # the copy, then the document it pushed over, then none
        "converged": True,
    }
    assert manifest["splits"]["train"]["documents"] == sorted(manifest["splits"]["train"]["documents"])
    assert (
        f"decontamination: 2 moved into train (2 held-out, 0 val) for sharing > 0.5 of their {N}-grams"
        in (format_prepare_summary(manifest))
    )
    for split in ("heldout", "val"):
        fractions = _reference_fractions(Path(cfg.out), split)
        assert fractions and max(fractions.values()) <= DEFAULT_CONTAMINATION_THRESHOLD
    train_grams = {gram for doc in _documents(Path(cfg.out), "train") for gram in _grams(doc)}
    assert len(load_index(cfg.out, N).hashes) == len(train_grams)  # the index is the final train split's
    assert is_prepared(cfg) and not is_prepared(
        PrepareConfig(**{**cfg.__dict__, "contamination_threshold": 0.4})
    )

    # Capped at one pass, the copy moves but the document it pushes over stays, and the result says so.
    capped = decontaminate(
        [_tokens(files[f"{train_dir}/partial.py"])],
        [_tokens(files[chained]), _tokens(""), _tokens(files[partial])],
        N,
        BYTES_EOT,
        max_rounds=1,
    )
    assert capped == Decontamination(moved=[2], rounds=1, converged=False)
    assert decontaminate(
        [_tokens(files[f"{train_dir}/partial.py"])],
        [_tokens(files[chained]), _tokens(""), _tokens(files[partial])],
        N,
        BYTES_EOT,
    ) == Decontamination(moved=[0, 2], rounds=3, converged=True)


def _tokens(text: str) -> np.ndarray:
    return np.append(np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16), BYTES_EOT)


def test_byte_level_decontamination_keeps_held_out_with_shared_boilerplate(tmp_path: Path, capsys) -> None:
    """Byte-level n-grams are counted in bytes of about 13 BPE tokens (BYTES_N), not 13 bytes: documents
    written in the same small vocabulary share nearly every 13-byte run with training but no 50-byte one,
    and stay held out; a held-out document made of two training files is still moved."""
    rng = random.Random(0)
    vocabulary = ["self", "value", "return", "assert", "None", "index", "data", "name", "test", "list"]
    cfg = PrepareConfig(
        source=str(tmp_path / "corpus"),
        out=str(tmp_path / "data"),
        tokenizer="bytes",
        val_ratio=0.1,
        heldout_ratio=0.2,
    )
    files = {f"pkg/doc{i}.py": _words(rng, vocabulary, 40) for i in range(80)}
    split_of = {name: assign_split(name, cfg.seed, cfg.val_ratio, cfg.heldout_ratio) for name in files}
    first, second = [name for name in files if split_of[name] == "train"][:2]
    copy = next(
        f"vendored/copy{i}.py"
        for i in range(1000)
        if assign_split(f"vendored/copy{i}.py", cfg.seed, cfg.val_ratio, cfg.heldout_ratio) == "heldout"
    )
    files[copy] = files[first] + files[second]
    for name, text in files.items():
        (Path(cfg.source) / name).parent.mkdir(parents=True, exist_ok=True)
        (Path(cfg.source) / name).write_text(text)
    held_out = sorted(name for name in files if split_of.get(name) == "heldout")
    assert len(held_out) >= 10

    manifest = prepare(cfg, progress=False)
    moved = manifest["dedup"]["moved_for_contamination"]
    assert manifest["prepare"]["ngram_index"] == moved["n"] == BYTES_N == 50
    assert (moved["documents"], moved["from_heldout"], moved["from_val"]) == ([copy], 1, 0)
    assert manifest["splits"]["heldout"]["documents"] == held_out  # every other held-out document stays
    assert copy in manifest["splits"]["train"]["documents"]
    assert (Path(cfg.out) / f"ngrams-{BYTES_N}.npy").is_file()
    assert "warning" not in capsys.readouterr().err

    # 13-byte n-grams (the BPE convention applied to bytes) empty the held-out split, and prepare says so.
    short = PrepareConfig(**{**cfg.__dict__, "out": str(tmp_path / "short"), "ngram_index": DEFAULT_N})
    manifest = prepare(short, progress=False)
    assert manifest["dedup"]["moved_for_contamination"]["from_heldout"] == len(held_out) + 1
    assert manifest["splits"]["heldout"]["documents"] == []
    err = capsys.readouterr().err
    assert f"warning: decontamination moved {len(held_out) + 1} of {len(held_out) + 1} heldout" in err
    assert f"longer --ngram-index (default: {BYTES_N})" in err
