"""Asynchronous checkpoints: same bytes as a synchronous save, snapshot isolation, failures surface,
SIGKILL mid-save, retention (last K, every M-th, never the only verified checkpoint)."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tenx import checkpoint as ckpt
from tenx.errors import CheckpointError


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 8, generator=g)
    return {
        "model": {"w": w, "tied": w, "b": torch.randn(8, generator=g)},
        "optim": {
            "state": {"model.w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(16, 8, generator=g)}}
        },
    }


def leaves(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def loaded(path) -> dict[str, torch.Tensor]:
    target = state(999)
    ckpt.load_checkpoint(path, target)
    return leaves(target)


def wait_until_done(cp: ckpt.AsyncCheckpointer, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while cp.in_flight:
        assert time.monotonic() < deadline, "background save did not finish"
        time.sleep(0.01)


def test_snapshot_is_an_independent_copy_that_keeps_aliasing():
    live = state(1)
    snap = ckpt.snapshot_tensors({**live, "note": "x", "n": [1, (2, 3)]})
    assert snap["note"] == "x" and snap["n"] == [1, (2, 3)]
    assert snap["model"]["tied"] is snap["model"]["w"]
    assert snap["model"]["w"].data_ptr() != live["model"]["w"].data_ptr()
    before = snap["model"]["w"].clone()
    live["model"]["w"].add_(1.0)
    assert torch.equal(snap["model"]["w"], before)


def test_snapshot_reuses_earlier_buffers_but_never_merges_two_tensors():
    first = ckpt.snapshot_tensors(state(1))
    ptr = first["model"]["b"].data_ptr()
    live = state(2)
    live["model"]["tied"] = live["model"]["w"].clone().add_(1.0)  # no longer aliased with w
    live["model"]["b"] = live["model"]["b"].double()  # new dtype: the old buffer does not fit
    second = ckpt.snapshot_tensors(live, into=first)
    assert second["optim"]["state"]["model.w"]["exp_avg"] is first["optim"]["state"]["model.w"]["exp_avg"]
    assert second["model"]["tied"] is not second["model"]["w"]
    assert second["model"]["b"].dtype == torch.float64 and second["model"]["b"].data_ptr() != ptr
    for name, value in leaves(live).items():
        assert torch.equal(leaves(second)[name], value), name


def test_async_save_equals_sync_save_bit_for_bit(tmp_path):
    with ckpt.AsyncCheckpointer(tmp_path / "async", keep_last=0) as cp:
        cp.save(5, state(1), {"tokens": 40})
        cp.wait()
        assert cp.last_path == tmp_path / "async" / "step_00000005" and cp.saves == 1
    with ckpt.AsyncCheckpointer(tmp_path / "sync", keep_last=0, async_save=False) as cp:
        blocked = cp.save(5, state(1), {"tokens": 40})
        assert not cp.in_flight and blocked == cp.last_blocking_s > 0 and cp.last_write_s > 0
    a, s = loaded(tmp_path / "async" / "step_00000005"), loaded(tmp_path / "sync" / "step_00000005")
    assert a.keys() == s.keys() == leaves(state(1)).keys()
    for name in a:
        assert a[name].dtype == s[name].dtype and torch.equal(a[name], s[name]), name
        assert torch.equal(a[name], leaves(state(1))[name]), name
    meta_a = ckpt.verify_checkpoint(tmp_path / "async" / "step_00000005")
    meta_s = ckpt.verify_checkpoint(tmp_path / "sync" / "step_00000005")
    assert meta_a["tokens"] == meta_s["tokens"] == 40
    assert meta_a["files"]["__0_0.distcp"] == meta_s["files"]["__0_0.distcp"]


def test_changes_after_save_returns_do_not_reach_the_checkpoint(tmp_path):
    release = threading.Event()
    live, meta = state(1), {"loader": {"cursor": 7}}
    expected = {k: v.clone() for k, v in leaves(live).items()}
    with ckpt.AsyncCheckpointer(tmp_path) as cp:
        cp.save(1, live, meta, before_publish=lambda _: release.wait(30))
        assert cp.in_flight  # the writer is held before publishing: the updates below race with it
        live["model"]["w"].mul_(-1.0)
        live["model"]["b"].zero_()
        live["optim"]["state"]["model.w"]["exp_avg"].add_(5.0)
        live["optim"]["state"]["model.w"]["step"].add_(1.0)
        meta["loader"]["cursor"] = 99
        release.set()
        cp.wait()
    got = loaded(tmp_path / "step_00000001")
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert ckpt.read_checkpoint_meta(tmp_path / "step_00000001")["loader"]["cursor"] == 7


def test_next_save_waits_for_the_write_before_reusing_its_buffers(tmp_path):
    release = threading.Event()
    with ckpt.AsyncCheckpointer(tmp_path, keep_last=0) as cp:
        cp.save(1, state(1), {}, before_publish=lambda _: release.wait(30))
        second = threading.Thread(target=cp.save, args=(2, state(2), {}))
        second.start()
        second.join(0.5)
        assert second.is_alive()  # blocked on the held write, not overwriting its snapshot
        release.set()
        second.join(30)
        cp.wait()
        assert cp.last_blocking_s >= 0.4 and cp.saves == 2
    for step in (1, 2):
        got = loaded(tmp_path / f"step_{step:08d}")
        assert all(torch.equal(got[k], v) for k, v in leaves(state(step)).items()), step


def fail(_tmp) -> None:
    raise OSError(28, "No space left on device")


def test_background_failure_surfaces_from_wait_poll_and_next_save(tmp_path):
    with ckpt.AsyncCheckpointer(tmp_path) as cp:
        cp.save(7, state(1), {}, before_publish=fail)
        with pytest.raises(CheckpointError, match=r"step 7 in .* failed: no space left on device"):
            cp.wait()
        cp.wait()  # reported once
        assert not (tmp_path / "step_00000007").exists() and cp.saves == 0

        cp.save(8, state(1), {}, before_publish=fail)
        wait_until_done(cp)
        with pytest.raises(CheckpointError, match="step 8 in .* failed"):
            cp.poll()
        cp.poll()

        cp.save(9, state(1), {}, before_publish=fail)
        with pytest.raises(CheckpointError, match="step 9 in .* failed"):
            cp.save(10, state(2), {})
        assert not (tmp_path / "step_00000010").exists()  # the failed save stops the next one

        cp.save(10, state(2), {})
        cp.wait()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [10]
    assert not list(tmp_path.glob(".step_*"))  # the failed saves' temporary directories were pruned


@pytest.mark.parametrize("async_save", [False, True])
def test_failure_in_the_caller_names_the_step(tmp_path, async_save):
    with ckpt.AsyncCheckpointer(tmp_path, async_save=async_save) as cp:
        with pytest.raises(CheckpointError, match="step 4 failed: TypeError.*not JSON serializable"):
            cp.save(4, state(1), {"not json": object()})
        assert not cp.in_flight
    assert not (tmp_path / "step_00000004").exists()


def test_sync_failure_names_the_step(tmp_path):
    cp = ckpt.AsyncCheckpointer(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match="step 3 in .* failed: no space left on device"):
        cp.save(3, state(1), {}, before_publish=fail)
    assert not (tmp_path / "step_00000003").exists()


KILL_MID_SAVE = """
import os, signal, sys, torch
from tenx import checkpoint as ckpt

state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}}
cp = ckpt.AsyncCheckpointer(sys.argv[1], keep_last=3)
cp.save(10, state, {"tokens": 10})
cp.save(20, state, {"tokens": 20}, before_publish=lambda tmp: os.kill(os.getpid(), signal.SIGKILL))
cp.wait()
print("survived")
"""


def test_sigkill_mid_save_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, "-c", KILL_MID_SAVE, str(root)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "survived" not in proc.stdout
    leftovers = list(root.glob(".step_00000020.tmp-*"))
    assert len(leftovers) == 1 and (leftovers[0] / ckpt.MANIFEST).is_file()  # killed just before the rename
    assert not (root / "step_00000020").exists()
    assert ckpt.verify_checkpoint(root / "step_00000010")["tokens"] == 10
    assert ckpt.latest_verified(root) == (root / "step_00000010", [])
    with ckpt.AsyncCheckpointer(root, keep_last=3) as cp:
        cp.save(30, state(1), {})
    assert not leftovers[0].exists()
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [10, 30]


def test_resave_killed_between_its_renames_is_restored(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 5, state(1), {"tokens": 5})
    old = tmp_path / ".step_00000005.old-4242"  # step_5 renamed away, then the kill
    path.rename(old)
    ckpt.prune_checkpoints(tmp_path, keep_last=3)
    assert not old.exists() and ckpt.verify_checkpoint(path)["tokens"] == 5


def test_retention_keeps_last_k_and_every_mth(tmp_path):
    with ckpt.AsyncCheckpointer(tmp_path, keep_last=2, keep_every=30) as cp:
        for step in range(10, 111, 10):
            cp.save(step, state(step), {})
        cp.wait()
        assert cp.saves == 11
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [30, 60, 90, 100, 110]
    for step in (30, 100, 110):  # each save reused the previous snapshot's buffers
        got = loaded(tmp_path / f"step_{step:08d}")
        assert all(torch.equal(got[k], v) for k, v in leaves(state(step)).items()), step


def test_prune_verifies_newest_first_and_stops_at_the_first_good_one(tmp_path, monkeypatch):
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, state(step), {})
    verified = []
    real_verify = ckpt.verify_checkpoint
    monkeypatch.setattr(  # pruning lives in tenx.checkpoint.store: patch the name it calls
        ckpt.store, "verify_checkpoint", lambda p: verified.append(p.name) or real_verify(p)
    )
    assert ckpt.prune_checkpoints(tmp_path, keep_last=2) == [
        tmp_path / "step_00000001",
        tmp_path / "step_00000002",
    ]
    assert verified == ["step_00000004"]


def test_prune_never_deletes_the_only_verified_checkpoint(tmp_path):
    for step in (10, 20, 30, 40):
        ckpt.save_checkpoint(tmp_path, step, state(step), {})
    data = tmp_path / "step_00000040" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    (tmp_path / "step_00000030" / ckpt.MANIFEST).unlink()
    removed = ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert removed == [tmp_path / "step_00000010"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [20, 30, 40]
    assert ckpt.latest_verified(tmp_path)[0] == tmp_path / "step_00000020"
    assert json.loads((tmp_path / "step_00000020" / ckpt.MANIFEST).read_text())["step"] == 20

    # Nothing verifies at all: pruning goes ahead (there is nothing to protect).
    (tmp_path / "step_00000020" / ckpt.MANIFEST).unlink()
    assert ckpt.prune_checkpoints(tmp_path, keep_last=2) == [tmp_path / "step_00000020"]
