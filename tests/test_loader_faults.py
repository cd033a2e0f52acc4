"""Loader fault tolerance: lazy shard verification, skipping corrupt shards and skipped position ranges."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tenx.data.loader as loader_module
from tenx.config import from_dict
from tenx.data.loader import DataConfig, TokenLoader, TokenStream
from tenx.data.manifest import np_dtype, read_manifest
from tenx.errors import ConfigError, DataError

SEQ = 256


def copy_data(src: Path, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(src, data)
    return data


def flip_byte(path: Path, offset: int = 1000) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def overlaps_shard(stream: TokenStream, window: int, shard: int) -> bool:
    start, end = window * SEQ, window * SEQ + SEQ + 1
    return start < stream.starts[shard + 1] and end > stream.starts[shard]


def served(loader: TokenLoader, batches: int) -> list[int]:
    ids: list[int] = []
    for _ in range(batches):
        loader.next_batch()
        ids.extend(loader.last_windows)
    return ids


def test_corrupt_shard_is_caught_at_first_read_not_at_open(tiny_corpus_multishard, tmp_path):
    data = copy_data(tiny_corpus_multishard, tmp_path)
    flip_byte(data / "train_00002.bin")
    stream = TokenStream(data, "train")  # opening no longer hashes every shard
    assert stream.window_ok(0, 100) and len(stream.read(0, 100)) == 100
    with pytest.raises(DataError) as err:
        stream.read(stream.starts[2] + 10, 5)
    message = str(err.value)
    assert str(data / "train_00002.bin") in message and "is corrupt" in message
    assert "tenx data prepare" in message and 'data.on_corrupt_shard = "skip"' in message
    with pytest.raises(DataError, match=r"train_00002\.bin is corrupt"):
        stream.window_ok(stream.starts[3] - 3, 10)  # a window that only starts in the shard before
    assert stream.bad_shards == {}  # error mode raises, it does not mark


def test_each_shard_is_hashed_once_however_often_it_is_read(tiny_corpus_multishard, monkeypatch):
    hashed: list[str] = []
    real = loader_module.verify_shard
    monkeypatch.setattr(loader_module, "verify_shard", lambda d, s: (hashed.append(s["file"]), real(d, s)))
    stream = TokenStream(tiny_corpus_multishard, "train")
    assert hashed == []
    loader = TokenLoader(stream, SEQ, 64, seed=0)
    for _ in range(loader.num_windows // 64 + 2):  # more than an epoch
        loader.next_batch()
    assert sorted(hashed) == sorted(shard["file"] for shard in stream.entries)
    stream.reopen()
    stream.read(0, 10)
    assert hashed[-1] == "train_00000.bin" and len(hashed) == len(stream.entries) + 1


def test_skip_mode_never_serves_a_corrupt_shard(tiny_corpus_multishard, tmp_path):
    data = copy_data(tiny_corpus_multishard, tmp_path)
    bad_path = data / "train_00002.bin"
    flip_byte(bad_path)
    stream = TokenStream(data, "train", on_corrupt="skip")
    reports: list[tuple[str, str]] = []
    stream.on_bad_shard = lambda path, message: reports.append((path, message))
    loader = TokenLoader(stream, SEQ, 16, seed=5)
    order = np.random.default_rng([5, 0]).permutation(loader.num_windows).tolist()
    good = [w for w in order if not overlaps_shard(stream, w, 2)]
    assert 0 < len(good) < len(order)
    ids = served(loader, len(good) // 16)
    assert ids == good[: len(ids)]  # the epoch's order with the bad shard's windows left out, nothing else
    assert len(reports) == 1 and reports[0][0] == str(bad_path) and "is corrupt" in reports[0][1]
    assert list(stream.bad_shards) == [2]
    with pytest.raises(DataError, match="touches a corrupt shard"):
        stream.read(stream.starts[2], 4)

    # Every rank walks the global order, so the ranks still partition the single-process batch.
    r0 = TokenLoader(stream, SEQ, 8, seed=5, rank=0, world_size=2)
    r1 = TokenLoader(stream, SEQ, 8, seed=5, rank=1, world_size=2)
    assert served(r0, 20) == [w for i in range(20) for w in ids[16 * i : 16 * i + 8]]
    assert served(r1, 20) == [w for i in range(20) for w in ids[16 * i + 8 : 16 * i + 16]]


def test_short_shard_is_an_error_at_open_or_skipped(tiny_corpus_multishard, tmp_path):
    data = copy_data(tiny_corpus_multishard, tmp_path)
    short = data / "train_00003.bin"
    short.write_bytes(short.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"train_00003\.bin holds \d+ tokens, manifest says \d+"):
        TokenStream(data, "train")
    stream = TokenStream(data, "train", on_corrupt="skip")
    assert not stream.window_ok(stream.starts[3], 1) and stream.window_ok(stream.starts[4], 1)
    assert list(stream.bad_shards) == [3]


def test_reopen_catches_damage_done_after_verification(tiny_data, tmp_path):
    data = copy_data(tiny_data, tmp_path)
    stream = TokenStream(data, "train")
    before = stream.read(0, 2000)
    shard = data / "train_00000.bin"
    flip_byte(shard, 1000 * np_dtype(stream.manifest).itemsize)
    stream.read(0, 2000)  # already verified: not hashed again, so the damage goes unseen...
    stream.reopen()
    with pytest.raises(DataError, match=r"train_00000\.bin is corrupt"):  # ...until the shard is reopened
        stream.read(0, 10)
    flip_byte(shard, 1000 * np_dtype(stream.manifest).itemsize)  # repaired
    stream.reopen()
    assert np.array_equal(stream.read(0, 2000), before)


def test_every_window_corrupt_is_a_clear_error(tiny_data, tmp_path):
    data = copy_data(tiny_data, tmp_path)
    flip_byte(data / "train_00000.bin")
    loader = TokenLoader(TokenStream(data, "train", on_corrupt="skip"), 32, 4)
    with pytest.raises(
        DataError, match=r"every window of split 'train' overlaps a corrupt shard .*train_00000"
    ):
        loader.next_batch()


def test_skip_range_serves_the_order_minus_those_positions(tiny_data):
    stream = TokenStream(tiny_data, "train")
    reference = served(TokenLoader(stream, 32, 4, seed=2), 30)
    loader = TokenLoader(stream, 32, 4, seed=2)
    loader.add_skip(10, 25)
    assert served(loader, 20) == reference[:10] + reference[25:95]
    assert loader.position == 95

    # A skip across an epoch boundary: epoch 0 positions 0..9, epoch 1 positions 10..19.
    small = TokenStream(tiny_data, "train", max_tokens=32 * 10 + 1)
    plain = TokenLoader(small, 32, 2, seed=0)
    order = served(plain, 10)
    assert (plain.epoch, plain.cursor) == (2, 0)
    skipping = TokenLoader(small, 32, 2, seed=0)
    skipping.add_skip(7, 13)
    assert served(skipping, 5) == order[:7] + order[13:16]
    assert (skipping.epoch, skipping.cursor, skipping.position) == (1, 6, 16)


def test_skips_merge_and_a_skip_behind_the_position_changes_nothing(tiny_data):
    stream = TokenStream(tiny_data, "train")
    reference = served(TokenLoader(stream, 32, 4, seed=0), 10)
    loader = TokenLoader(stream, 32, 4, seed=0)
    assert served(loader, 5) == reference[:20]
    loader.add_skip(4, 8)
    loader.add_skip(30, 31)
    loader.add_skip(6, 12)
    loader.add_skip(12, 13)
    assert loader.state_dict()["skips"] == [[4, 13], [30, 31]]
    assert served(loader, 4) == reference[20:30] + reference[31:37]
    with pytest.raises(ValueError, match="0 <= start < end"):
        loader.add_skip(5, 5)


def test_skips_survive_state_dict_and_resume_identically(tiny_data):
    stream = TokenStream(tiny_data, "train")
    loader = TokenLoader(stream, 32, 4, seed=1)
    served(loader, 3)
    loader.add_skip(loader.position + 2, loader.position + 7)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["skips"] == [[14, 19]]
    expected = [loader.next_batch()[0] for _ in range(4)]
    expected_ids = loader.last_windows
    fresh = TokenLoader(stream, 32, 4, seed=1)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, fresh.next_batch()[0]) for a in expected)
    assert fresh.last_windows == expected_ids and fresh.position == loader.position == 12 + 16 + 5


def test_state_without_skips_still_loads(tiny_data):
    stream = TokenStream(tiny_data, "train")
    loader = TokenLoader(stream, 32, 4, seed=0)
    served(loader, 2)
    old = {key: value for key, value in loader.state_dict().items() if key != "skips"}
    fresh = TokenLoader(stream, 32, 4, seed=0)
    fresh.add_skip(0, 100)  # the loaded state replaces the skips, and an old one has none
    fresh.load_state_dict(old)
    assert fresh.state_dict()["skips"] == [] and fresh.position == 8
    assert served(fresh, 3) == served(loader, 3)


def test_locate_and_describe_windows_point_at_the_tokens_read(tiny_corpus_multishard):
    data = tiny_corpus_multishard
    stream = TokenStream(data, "train")
    first = int(read_manifest(data)["splits"]["train"]["shards"][0]["tokens"])
    assert stream.locate(first - 1) == ("train_00000.bin", first - 1)
    assert stream.locate(first) == ("train_00001.bin", 0)
    with pytest.raises(IndexError):
        stream.locate(len(stream))

    loader = TokenLoader(stream, SEQ, 16, seed=3)
    inputs, _ = loader.next_batch()
    described = loader.describe_windows(loader.last_windows)
    assert [d["window"] for d in described] == loader.last_windows
    dtype = np_dtype(stream.manifest)
    for row, d in zip(inputs.numpy(), described):
        shard = np.fromfile(data / d["shard"], dtype=dtype)
        n = min(SEQ, len(shard) - d["offset"])
        assert n > 0 and np.array_equal(row[:n], shard[d["offset"] : d["offset"] + n])
    # the document index: documents of earlier shards, then the last start at or before the offset
    shards = read_manifest(data)["splits"]["train"]["shards"]
    assert stream.document_of(0) == 0
    assert stream.document_of(first) == int(shards[0]["documents"])  # shard 1 starts with a document
    for d in described:
        k = next(i for i, s in enumerate(shards) if s["file"] == d["shard"])
        starts = np.fromfile(data / shards[k]["index_file"], dtype="<i8")
        local = int(np.searchsorted(starts, d["offset"], side="right")) - 1
        assert d["document"] == sum(int(s["documents"]) for s in shards[:k]) + local


def test_on_corrupt_shard_config_field():
    assert DataConfig().on_corrupt_shard == "error"
    assert from_dict(DataConfig, {"on_corrupt_shard": "skip"}, "data").on_corrupt_shard == "skip"
    with pytest.raises(ConfigError, match="data.on_corrupt_shard: 'ignore' is not allowed"):
        from_dict(DataConfig, {"on_corrupt_shard": "ignore"}, "data")
