"""Checkpoints: round trip, verification, crash mid-save, pruning, and no arbitrary unpickling."""

import io
import os
import pickle

import pytest
import torch

from tenx import checkpoint as ckpt
from tenx.errors import CheckpointError
from tenx.utils.io import file_xxhash


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
        "n": {"t": torch.tensor(seed)},
    }


def test_round_trip_is_exact(tmp_path):
    saved = state(1)
    path = ckpt.save_checkpoint(tmp_path, 7, saved, {"tokens": 123, "loader": {"epoch": 0, "cursor": 5}})
    assert path.name == "step_00000007"
    target = state(2)
    meta = ckpt.load_checkpoint(path, target)
    assert meta["step"] == 7 and meta["tokens"] == 123 and meta["loader"]["cursor"] == 5
    assert torch.equal(target["model"]["w"], saved["model"]["w"]) and target["n"]["t"].item() == 1


def test_crash_mid_save_leaves_previous_checkpoint_and_is_ignored(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, state(1), {})
    # A crash after DCP wrote its files but before the manifest/rename leaves only a temporary directory.
    partial = tmp_path / ".step_00000002.tmp-999"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    latest, skipped = ckpt.latest_verified(tmp_path)
    assert latest == tmp_path / "step_00000001" and skipped == []
    ckpt.prune_checkpoints(tmp_path, keep_last=3)
    assert not partial.exists()


def test_missing_manifest_and_corruption_are_named(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 3, state(1), {})
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp fails its checksum"):
        ckpt.verify_checkpoint(path)
    (path / ckpt.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="incomplete: tenx_checkpoint.json is missing"):
        ckpt.load_checkpoint(path, state(2))


def test_latest_verified_falls_back(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, state(1), {})
    bad = ckpt.save_checkpoint(tmp_path, 2, state(2), {})
    (bad / ".metadata").write_bytes(b"")
    latest, skipped = ckpt.latest_verified(tmp_path)
    assert latest == tmp_path / "step_00000001"
    assert len(skipped) == 1 and ".metadata has 0 bytes" in skipped[0]


def test_prune_keeps_last_k(tmp_path):
    for step in range(1, 6):
        ckpt.save_checkpoint(tmp_path, step, state(step), {})
    ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 5]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > evil_marker",))


def test_metadata_cannot_run_pickled_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = ckpt.save_checkpoint(tmp_path / "ck", 1, state(1), {})
    meta_file = path / ".metadata"
    meta_file.write_bytes(pickle.dumps(_Evil()))
    # Forge the checksum too, as an attacker who can write the directory could.
    manifest = (path / ckpt.MANIFEST).read_text()
    import json

    m = json.loads(manifest)
    m["files"][".metadata"] = {"bytes": meta_file.stat().st_size, "xxhash": file_xxhash(meta_file)}
    m["manifest_xxhash"] = ckpt.manifest_digest(m)  # the manifest's own checksum is not signed either
    (path / ckpt.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="posix.system, which tenx does not load|os.system"):
        ckpt.load_checkpoint(path, state(2))
    assert not (tmp_path / "evil_marker").exists()


def test_safe_unpickler_accepts_dcp_metadata(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, state(1), {})
    meta = ckpt._SafeUnpickler(io.BytesIO((path / ".metadata").read_bytes())).load()
    assert "model.w" in meta.state_dict_metadata


def test_prune_never_deletes_the_protected_checkpoint(tmp_path):
    for step in (1, 2, 5):
        ckpt.save_checkpoint(tmp_path, step, state(step), {})
    just_saved = ckpt.save_checkpoint(tmp_path, 3, state(3), {})  # after resuming below a damaged step 5
    ckpt.prune_checkpoints(tmp_path, keep_last=1, protect=just_saved)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 5]
