"""Replica consistency checks: the checksum, blame by majority and by self-check, and the bitflip drill.

Multi-process tests run 2 ranks over gloo on the CPU (one thread each) with a hard timeout.
"""

from __future__ import annotations

import copy
import gc
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tenx.errors import ConfigError, TenxError
from tenx.monitor.events import EventLog, read_events
from tenx.parallel.consistency import (
    ConsistencyConfig,
    find_divergent,
    gather_digests,
    gradient_digest,
    majority,
    parameter_digest,
    tensor_digest,
)
from tenx.train.callbacks.consistency import ConsistencyCheck
from tenx.train.callbacks.faults import FaultInjector, parse_fault
from tenx.train.config import CONFIG_DIR
from tenx.train.hooks import Callback

_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flip(t: torch.Tensor, index: int, bit: int) -> None:
    ints = t.view(-1).view(_INT[t.element_size()])
    width = 8 * t.element_size()
    ints[index] ^= (1 << bit) if bit < width - 1 else -(1 << bit)


def _mismatches(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if e["kind"] == "replica-mismatch"]


# ----- the checksum ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_single_bit_flip_changes_the_digest(dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(70_000, generator=gen).to(dtype), torch.randn(7, 5, generator=gen).to(dtype)]
    base = tensor_digest(tensors)
    assert base.shape == (2,) and base.dtype == torch.int64
    assert torch.equal(base, tensor_digest([t.clone() for t in tensors]))
    width = 8 * tensors[0].element_size()
    # first and last elements, both sides of a 65521-column boundary, the short tail, the second tensor
    for which, index in [(0, 0), (0, 65_520), (0, 65_521), (0, 69_999), (1, 0), (1, 34)]:
        for bit in range(width):  # mantissa, exponent and sign bits
            flipped = [t.clone() for t in tensors]
            _flip(flipped[which], index, bit)
            assert not torch.equal(tensor_digest(flipped), base), (which, index, bit)


def test_digest_sees_order_and_ignores_empty_tensors():
    a, b = torch.randn(100), torch.randn(50)
    base = tensor_digest([a, b])
    swapped = a.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert not torch.equal(tensor_digest([swapped, b]), base)  # same values, other positions
    assert not torch.equal(tensor_digest([b, a]), base)  # same tensors, other order
    assert torch.equal(tensor_digest([a, torch.empty(0), b]), base)
    assert torch.equal(tensor_digest(x.reshape(10, 10) for x in [a]), tensor_digest([a]))


# ----- gathering and blame ---------------------------------------------------------------------------
def test_majority_tie_and_absent_replicas():
    good, bad = (1, 2), (1, 3)
    assert find_divergent({0: good, 1: good, 2: good}) == []
    assert find_divergent({0: good, 1: bad, 2: good}) == [1]
    assert majority({0: good, 1: bad, 2: good}) == good
    assert find_divergent({0: good, 1: bad}) == [0, 1]  # a tie: no replica can be cleared
    assert majority({0: good, 1: bad}) is None
    assert find_divergent({0: good, 1: good, 2: bad, 3: bad}) == [0, 1, 2, 3]
    assert find_divergent({0: good, 2: bad, 3: good}) == [2]  # slot 1 took no part


def test_gather_digests_with_only_an_all_reduce():
    others = {0: [5, 6], 2: [7, 8]}  # slot 1 is absent (a healing group contributes zeros)

    def allreduce(rows: torch.Tensor) -> None:
        for slot, value in others.items():
            rows[slot] += torch.tensor([1, *value])

    rows = gather_digests(torch.tensor([0, 0]), 3, 4, allreduce)
    assert rows == {0: (5, 6), 2: (7, 8), 3: (0, 0)}  # an all-zero digest is still present
    with pytest.raises(TenxError, match="claimed by more than one"):
        gather_digests(torch.tensor([1, 2]), 0, 4, allreduce)


# ----- the bitflip fault -----------------------------------------------------------------------------
def test_bitflip_specs_parse_and_bad_ones_are_named(tmp_path):
    spec = parse_fault("bitflip@step=7,rank=1,param=head.weight,bit=31,index=3")
    assert (spec.kind, spec.step, spec.rank, spec.param, spec.bit, spec.index) == (
        "bitflip",
        7,
        1,
        "head.weight",
        31,
        3,
    )
    assert parse_fault("bitflip@step=2").bit == 20
    with pytest.raises(ConfigError, match="only for bitflip"):
        parse_fault("crash@step=2,bit=3")
    with pytest.raises(ConfigError, match="bit must be"):
        parse_fault("bitflip@step=2,bit=64")
    trainer, _ = _fake_trainer(tmp_path, torch.nn.Linear(3, 2))
    for text, message in [
        ("bitflip@step=1,param=nope", "parameters include weight, bias"),
        ("bitflip@step=1,param=bias,index=2", "has 2 elements"),
    ]:
        injector = FaultInjector([parse_fault(text)])
        injector.on_train_start(trainer)
        with pytest.raises(ConfigError, match=message):
            injector.on_step_start(trainer)


def test_bitflip_flips_exactly_one_bit_and_records_it(tmp_path):
    trainer, _ = _fake_trainer(tmp_path, torch.nn.Linear(64, 64))
    before = {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()}
    injector = FaultInjector([parse_fault("bitflip@step=1")], seed=3)
    injector.on_train_start(trainer)
    injector.on_step_start(trainer)
    (event,) = [e for e in read_events(tmp_path) if e["kind"] == "fault"]
    after = dict(trainer.raw_model.named_parameters())
    changed = {n: (before[n] != after[n].detach()).nonzero().flatten().tolist() for n in before}
    assert {n: i for n, i in changed.items() if i} == {event["param"]: [event["index"]]}
    old = before[event["param"]].view(-1)[event["index"]].view(torch.int32).item()
    new = after[event["param"]].detach().view(-1)[event["index"]].view(torch.int32).item()
    assert old ^ new == 1 << 20 and event["bit"] == 20 and event["rank"] == 0
    assert event["after"] == after[event["param"]].detach().view(-1)[event["index"]].item()


# ----- the callback, one process with fakes --------------------------------------------------------
def _fake_trainer(run_dir: Path, model: torch.nn.Module, **fields: Any) -> tuple[Any, torch.optim.Optimizer]:
    """The attributes of tenx.train.trainer.Trainer that the consistency check and the injector use."""
    optimizer = torch.optim.SGD(model.parameters(), lr=fields.pop("lr", 0.1))
    trainer = SimpleNamespace(
        rank=0,
        world_size=1,
        strategy="none",
        model=model,
        raw_model=model,
        optimizer=optimizer,
        events=EventLog(run_dir),
        run_dir=run_dir,
        step=0,
        state_generation=0,
        after_reduce=[],
        replicas=None,
    )
    for key, value in fields.items():
        setattr(trainer, key, value)
    return trainer, optimizer


def _drive(
    trainer: Any, callbacks: list[Any], steps: int, data: torch.Tensor, skip: frozenset[int] = frozenset()
) -> None:
    """The Trainer's loop reduced to its hook events; the optimizer step is left out at `skip` steps
    (the guard's verdict, in the step's metrics as the Trainer reports it)."""
    trainer.callbacks = callbacks
    for cb in callbacks:
        cb.on_train_start(trainer)
    for _ in range(steps):
        for cb in callbacks:
            cb.on_step_start(trainer)
        trainer.model(data).square().mean().backward()
        for cb in callbacks:
            cb.pre_optim_step(trainer)
        skipped = trainer.step + 1 in skip
        if not skipped:
            trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.step += 1
        for cb in callbacks:
            cb.on_step_end(trainer, {"skipped": "spike"} if skipped else {})
    for cb in callbacks:
        cb.on_train_end(trainer)


@pytest.mark.parametrize("world_size", [2, 1])
def test_self_check_names_a_flip_within_one_step_and_ignores_state_loads(tmp_path, world_size):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    # an FSDP rank: no comparison within the job (its peers hold other shards), the self-check alone
    trainer, _ = _fake_trainer(tmp_path, model, world_size=world_size, strategy="fsdp")

    class Reload:  # a resume or rollback: parameters replaced, post_state_loaded sent to every callback
        name = "reload"

        def on_step_start(self, trainer: Any) -> None:
            if trainer.step + 1 == 3:
                with torch.no_grad():
                    model.weight.mul_(0.5)
                for cb in trainer.callbacks:
                    cb.post_state_loaded(trainer, "rollback")

        def __getattr__(self, name: str) -> Any:
            return lambda *args: None

    faults = FaultInjector(
        [parse_fault("bitflip@step=5,param=weight,index=9"), parse_fault("bitflip@step=8,param=bias,index=1")]
    )
    check = ConsistencyCheck(ConsistencyConfig(every=100))
    _drive(trainer, [faults, Reload(), check], 10, torch.randn(4, 8), skip=frozenset({6, 8}))
    found = [(e["step"], e["check"], e["ranks"]) for e in _mismatches(tmp_path)]
    # step 5: before its optimizer step; step 8: a step the guard skipped (no optimizer step at all)
    assert found == ([(5, "self", [0]), (8, "self", [0])] if world_size == 2 else [])  # alone: nothing to do
    assert trainer.after_reduce == [] and not trainer.optimizer._optimizer_step_pre_hooks


def _three_groups(tmp_path: Path, mode: str, every: int, sync_every: int = 1, **cfg: Any):
    """This process as group 2 of 3; groups 0 and 1 report the initial parameters (lr=0: they never move)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    clean = parameter_digest(copy.deepcopy(model))
    calls: list[int] = []

    def allreduce_sum_(rows: torch.Tensor) -> None:
        calls.append(trainer.step + 1)
        peer = [0, *clean.tolist(), *(gradient_digest(model).tolist() if rows.shape[1] > 4 else [])]
        for group in (0, 1):
            rows[group] += torch.tensor([1, *peer])

    replicas = SimpleNamespace(
        group_id=2, num_groups=3, mode=mode, sync_every=sync_every, allreduce_sum_=allreduce_sum_
    )
    trainer, _ = _fake_trainer(tmp_path, model, lr=0.0, replicas=replicas)
    check = ConsistencyCheck(ConsistencyConfig(every=every, self_check=False, **cfg))
    return trainer, check, calls


def test_a_majority_of_groups_names_the_corrupt_one(tmp_path):
    trainer, check, calls = _three_groups(tmp_path, "sync", every=4)
    faults = FaultInjector([parse_fault("bitflip@step=6,param=0.weight,bit=30")])
    _drive(trainer, [faults, check], 9, torch.randn(4, 8))
    assert calls == [4, 8]
    (event,) = _mismatches(tmp_path)
    assert (event["step"], event["check"], event["groups"], event["undecided"]) == (
        8,
        "parameters",
        [2],
        False,
    )
    assert event["majority"] == event["digests"]["0"] != event["digests"]["2"]


def test_diloco_compares_parameters_right_after_outer_syncs_only(tmp_path):
    trainer, check, calls = _three_groups(tmp_path, "diloco", every=5, sync_every=3)
    _drive(trainer, [check], 14, torch.randn(4, 8))
    assert calls == [7, 13]  # after steps 6 and 12: every 5 rounded up to a multiple of sync_every 3
    trainer, check, calls = _three_groups(tmp_path / "s", "streaming-diloco", every=2)
    _drive(trainer, [check], 6, torch.randn(4, 8))
    assert calls == [] and _mismatches(tmp_path) == []


def test_on_mismatch_stop_raises_naming_the_group(tmp_path):
    trainer, check, _ = _three_groups(tmp_path, "sync", every=2, on_mismatch="stop")
    faults = FaultInjector([parse_fault("bitflip@step=1,param=2.bias,index=0")])
    with pytest.raises(TenxError, match="parameters of group 2 differ from the majority of 3 groups"):
        _drive(trainer, [faults, check], 4, torch.randn(4, 8))


# ----- two ranks over gloo ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flip_gradient_on_rank_1_at_step_5(trainer: Any) -> None:
    if trainer.rank == 1 and trainer.step + 1 == 5:
        _flip(trainer.raw_model[0].weight.grad, 0, 12)


class _PreOptimStep(Callback):
    """Runs `fn(trainer)` at the pre_optim_step event (gradients reduced, before the optimizer step)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def pre_optim_step(self, trainer: Any) -> None:
        self.fn(trainer)


def _ddp_worker(rank: int, port: int, root: str) -> None:
    """Four scenarios, each a fresh DDP model trained 12 steps with checks every 5."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        scenarios = {
            "witness": ({"self_check": True}, ["bitflip@step=7,rank=1"]),
            "tie": ({"self_check": False}, ["bitflip@step=7,rank=1"]),
            "stop": ({"self_check": False, "on_mismatch": "stop"}, ["bitflip@step=7,rank=1"]),
            "gradients": ({"self_check": True}, []),
        }
        for name, (cfg, faults) in scenarios.items():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            run_dir = Path(root) / name
            trainer, _ = _fake_trainer(run_dir, ddp, rank=rank, world_size=2, strategy="ddp", raw_model=model)
            trainer.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            flip = [_PreOptimStep(_flip_gradient_on_rank_1_at_step_5)] if name == "gradients" else []
            callbacks = [
                FaultInjector([parse_fault(f) for f in faults]),
                *flip,
                ConsistencyCheck(ConsistencyConfig(every=5, **cfg)),
            ]
            data = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
            try:
                _drive(trainer, callbacks, 12, data)
            except TenxError as e:
                (run_dir / f"stopped-rank{rank}").write_text(f"{trainer.step + 1}: {e}")
            del trainer, ddp, model, callbacks
            gc.collect()
            torch.distributed.barrier()  # no rank tears gloo down while its peer still sends
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ddp_ranks_name_the_flipped_rank(tmp_path):
    mp.spawn(_ddp_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)

    def summary(name: str) -> list[tuple[Any, ...]]:
        return [
            (e["step"], e["check"], e["reporter"], e["ranks"], e.get("undecided"), e.get("witness"))
            for e in _mismatches(tmp_path / name)
        ]

    # the flipped rank names itself before its next optimizer step; the cross-rank check at step 10 has
    # no majority of 2 and takes the self-check's word; later checks would still see the divergence
    assert summary("witness") == [
        (7, "self", 1, [1], None, None),
        (10, "parameters", 0, [1], False, "self-check"),
    ]
    # without the self-check two replicas that disagree cannot be told apart: both are named
    assert summary("tie") == [(10, "parameters", 0, [0, 1], True, None)]
    (event,) = _mismatches(tmp_path / "tie")
    assert event["majority"] is None and set(event["digests"]) == {"0", "1"}
    assert "cannot tell which" in event["message"]
    for rank in (0, 1):  # every rank stops at the same step, so none waits for a peer in a collective
        assert (tmp_path / "stop" / f"stopped-rank{rank}").read_text().startswith("10: ")
    # corrupt reduced gradients on rank 1 at step 5; its parameters then differ at step 10 (the
    # self-check cannot witness this: the optimizer step itself applied the bad gradient)
    assert summary("gradients") == [
        (5, "gradients", 0, [0, 1], True, None),
        (10, "parameters", 0, [0, 1], True, None),
    ]


# ----- end to end: torchrun, the real Trainer -------------------------------------------------------
@pytest.mark.timeout(180)
def test_torchrun_ddp_detects_a_bitflip_and_names_the_rank(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    sets = [
        f'data.dir="{tiny_data}"',
        "log.progress=false",
        "train.steps=12",
        "train.eval_every=0",
        "checkpoint.every=0",
        "checkpoint.at_end=false",
        "parallel.strategy=ddp",
        "parallel.consistency.every=5",
    ]
    args = [
        *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tenx", "train"),
        *("--config", str(CONFIG_DIR / "tiny.toml"), "--run-dir", str(run_dir)),
        *(x for s in sets for x in ("--set", s)),
        *("--fault", "bitflip@step=7,rank=1"),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [sys.executable, *args],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    events = read_events(run_dir)
    (fault,) = [e for e in events if e["kind"] == "fault"]
    assert (fault["step"], fault["rank"], fault["bit"]) == (7, 1, 20)
    found = [(e["step"], e["check"], e["ranks"]) for e in _mismatches(run_dir)]
    assert found == [(7, "self", [1]), (10, "parameters", [1])]
    assert "rank 1" in out.stdout
    assert out.stdout.count("goodput ") == 1 and out.stdout.count("run directory: ") == 1  # rank 0 only
