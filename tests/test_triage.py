"""Triage: step records, exact replay, numerics bisection, verdicts and root causes (tenx/triage/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tenx.cli import main
from tenx.errors import ConfigError, TenxError
from tenx.monitor.events import EventLog, read_events
from tenx.rundir import RunDir
from tenx.train.callbacks.faults import parse_fault
from tenx.train.callbacks.opbug import OpBug, longest_runs
from tenx.train.callbacks.record import read_steps, step_digest
from tenx.train.run import train
from tenx.triage.bisect import bisect_step
from tenx.triage.classify import format_causes, triage
from tenx.triage.incident_store import list_incidents
from tenx.triage.outcome import outcome_of_crash
from tenx.triage.replay import replay
from tenx.triage.repro import run_repro

BASE = ("train.steps=12", "checkpoint.every=5", "train.eval_every=0", "train.threads=1")


def run(tiny_data, tiny_config, run_dir: Path, *overrides: str, expect_error: bool = False) -> Path:
    cfg = tiny_config(tiny_data, *BASE, *overrides)
    if expect_error:
        with pytest.raises((RuntimeError, TenxError)):  # the op-bug crash, or the guard giving up
            train(cfg, run_dir)
    else:
        train(cfg, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def clean(tiny_data, tiny_config, tmp_path_factory) -> Path:
    return run(tiny_data, tiny_config, tmp_path_factory.mktemp("triage") / "clean")


def test_every_step_is_recorded_with_its_exact_loss_and_data(clean):
    records = read_steps(RunDir(clean).steps)
    metrics = [json.loads(line) for line in RunDir(clean).metrics.read_text().splitlines()]
    losses = {m["step"]: m["loss"] for m in metrics if "loss" in m}
    assert [r["step"] for r in records] == list(range(1, 13))
    for r in records:
        assert r["loss"] == losses[r["step"]]  # JSON keeps every bit of the float
        assert r["digest"] == step_digest(r["loss"], r["grad_norm"])
        assert len(r["windows"]) == 1 and len(r["windows"][0]) == 8  # one micro-batch of 8 windows
        assert r["position"][1] - r["position"][0] == 8


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_replay_reproduces_a_clean_step_bit_for_bit(tiny_data, tiny_config, tmp_path, clean, precision):
    run_dir = (
        clean
        if precision == "fp32"
        else run(tiny_data, tiny_config, tmp_path / "bf16", "train.precision='bf16'")
    )
    from_checkpoint = replay(run_dir, 8, repeat=2)
    assert from_checkpoint.checkpoint and from_checkpoint.checkpoint.endswith("step_00000005")
    from_init = replay(run_dir, 3, repeat=1)
    assert from_init.checkpoint is None  # before the first checkpoint: the seeded initialisation
    for report in (from_checkpoint, from_init):
        assert report.verdict == "reproduces" and report.bitwise
        assert report.outcomes[0].digest == report.recorded.digest
        assert report.first_divergent is None


def test_a_one_shot_spike_does_not_reproduce_and_later_steps_still_do(tiny_data, tiny_config, tmp_path):
    run_dir = run(
        tiny_data,
        tiny_config,
        tmp_path / "spike",
        "train.steps=28",
        "checkpoint.every=10",
        "faults.inject=['spike@step=25']",
    )
    spiked = replay(run_dir, 25)
    assert spiked.verdict == "does-not-reproduce"
    assert spiked.recorded.skipped == "loss-spike" and spiked.outcomes[0].skipped is None
    later = replay(run_dir, 27)  # rebuilt from step 20: step 25 is re-executed, and skipped as the run did
    assert later.verdict == "reproduces" and later.first_divergent == 25
    (incident,) = list_incidents([run_dir])
    incidents, causes, _ = triage([run_dir])
    assert incidents[0].verdict == "hardware" and "does not reproduce" in incidents[0].evidence["summary"]
    assert [c.verdict for c in causes] == ["hardware"]


def test_op_bug_is_named_with_the_data_that_triggers_it(tiny_data, tiny_config, tmp_path):
    # byte-level code: runs of 24 spaces (deep indentation) occur every few steps
    run_dir = run(
        tiny_data,
        tiny_config,
        tmp_path / "opbug",
        "faults.inject=['op-bug@step=1,run=24']",
        "guard.max_rollbacks=100",
        expect_error=True,
    )
    incidents, causes, seconds = triage([run_dir])
    assert incidents and {i.kind for i in incidents} <= {"crash", "non-finite", "spike"}
    assert all(i.verdict == "library-op" for i in incidents), [i.evidence for i in incidents]
    assert len(causes) == 1 and causes[0].op == "aten.nll_loss_forward"
    assert format_causes(incidents, causes).startswith(
        f"{len(incidents)} incident{'s' if len(incidents) > 1 else ''}, 1 root cause\n"
    )
    assert "runs of >= 24 identical values in `target`" in causes[0].property
    trigger = incidents[0].evidence["trigger"]
    assert trigger == {"kind": "identical-run", "name": "target", "length": 24, "value": 32}  # spaces
    repro = Path(incidents[0].evidence["repro"])
    assert repro.name == "repro.py" and (repro.parent / "inputs.safetensors").is_file()
    assert run_repro(repro.parent) == 1  # the op still misbehaves on the saved inputs
    # the smallest slice that triggers it, not the whole batch's log-probabilities (8x64 rows of 256)
    assert (repro.parent / "inputs.safetensors").stat().st_size < 64 * 256 * 4
    assert_rundir_names_every_file(run_dir)


def probe_only_data(root: Path, tiny_config) -> Path:
    """Two data sources of random words, whose validation documents alone hold runs of 30 identical bytes
    (`x`), padded so that the first run in the statistics' probe batch starts where the op-bug crashes
    (its flat offset % 3 == 2): no training batch can trigger the bug, the probe's loss per source does."""
    import random

    from tenx.data.loader import sequential_windows, train_stream
    from tenx.data.prepare.pipeline import PrepareConfig, assign_split, prepare
    from tenx.train.parts import validation_stream

    for pad in range(6):
        rng = random.Random(0)
        corpus, out = root / f"corpus{pad}", root / f"data{pad}"
        for source in ("a", "b"):
            (corpus / source).mkdir(parents=True)
            for i in range(12):
                doc = f"{source}/{i:02d}.txt"
                if assign_split(doc, 0, 0.25, 0.1) == "val":
                    text = "-" * pad + ("x" * 30 + " ab ") * 60
                else:
                    text = " ".join(
                        "".join(rng.choices("abcdefghij", k=rng.randint(3, 9))) for _ in range(500)
                    )
                (corpus / doc).write_text(text + "\n")
        prepare(
            PrepareConfig(
                source=str(corpus), out=str(out), tokenizer="bytes", val_ratio=0.25, heldout_ratio=0.1
            ),
            progress=False,
        )
        cfg = tiny_config(out)
        val = validation_stream(cfg, train_stream(cfg.data, 64).manifest, 64)
        assert val is not None
        _, targets = next(iter(sequential_windows(val, 64, cfg.train.micro_batch, 1)))
        if longest_runs(targets, 24)[0][0] % 3 == 2:
            return out
    raise AssertionError("no padding puts the probe's first run where the op-bug crashes")


def test_an_op_bug_in_the_statistics_probe_is_a_library_op_not_hardware(tiny_config, tmp_path):
    """The op-bug crashes only in the statistics' probe forward (the loss per data source, at step 4), never in
    the step's own loss: replay runs the probe where the run did, so the crash reproduces and bisection names
    the operator. Replaying the step without the probe called this crash a transient hardware fault (on an
    H200, whose Python 3.12 standard library put a run of 24 spaces in gpu_check's probe batch)."""
    data = probe_only_data(tmp_path, tiny_config)
    run_dir = run(
        data,
        tiny_config,
        tmp_path / "probe",
        "monitor.stats_every=4",
        "faults.inject=['op-bug@step=1,run=24']",
        expect_error=True,
    )
    (crash,) = [e for e in read_events(run_dir) if e.get("kind") == "crash"]
    assert crash["step"] == 4 and any("source_loss" in f for f in crash["frames"])
    rep = replay(run_dir, 4, repeat=2, recorded=outcome_of_crash(crash))
    assert rep.verdict == "reproduces" and rep.outcomes[0].exception == "RuntimeError"
    incidents, causes, _ = triage([run_dir])
    assert [(i.kind, i.verdict) for i in incidents] == [("crash", "library-op")], incidents[0].evidence
    assert [(c.verdict, c.op) for c in causes] == [("library-op", "aten.nll_loss_forward")]
    assert incidents[0].evidence["trigger"] == {
        "kind": "identical-run",
        "name": "target",
        "length": 24,
        "value": 120,
    }
    assert "source_loss" in incidents[0].evidence["summary"]
    assert run_repro(Path(incidents[0].evidence["repro"]).parent) == 1


def assert_rundir_names_every_file(run_dir: Path) -> None:
    """Every file and folder a run wrote is one tenx/rundir.py names (tests/test_layers.py then checks
    that no other module spells those names); checkpoints' insides are tenx.checkpoint's."""
    import tenx.rundir as rundir

    names = {v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str)}
    unnamed = []
    for path in run_dir.rglob("*"):
        parts = path.relative_to(run_dir).parts
        if parts[0] == rundir.CHECKPOINTS and len(parts) > 1:
            continue
        if parts[0] == rundir.INCIDENTS and len(parts) > 1 and parts[1].isdigit():
            parts = parts[2:]
        if any(p not in names and not p.startswith(rundir.STACKS) for p in parts):
            unnamed.append(str(path.relative_to(run_dir)))
    assert not unnamed, f"files of a run that tenx/rundir.py does not name: {unnamed}"


def test_op_bug_fast_path_only_and_its_three_symptoms():
    targets = torch.tensor([1, 2, 3, 3, 3, 3, 4, 5, 6, 7, 8, 9])
    assert longest_runs(targets, 4) == [(2, 4, 3)]
    assert longest_runs(targets, 5) == []
    logits = torch.randn(12, 10)

    def loss(offset: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.roll(targets, offset - 2)  # the run starts at `offset`
        with OpBug(run=4):
            return torch.nn.functional.cross_entropy(logits.to(dtype), t)

    clean = torch.nn.functional.cross_entropy(logits.double(), torch.roll(targets, 1))
    assert torch.equal(loss(3, torch.float64), clean)  # float64 never takes the fast path
    assert loss(3, torch.float32) > 4 * clean.float()  # offset % 3 == 0: a spike
    assert torch.isnan(loss(4, torch.float32))  # 1: non-finite
    with pytest.raises(RuntimeError, match="invalid memory access"):
        loss(5, torch.float32)  # 2: a crash


@pytest.mark.parametrize(
    "spec, message",
    [
        ("op-bug@p=0.1", "op-bug takes step=N"),
        ("op-bug@step=1,run=1", "run must be >= 2"),
        ("spike@step=1,run=3", "run is only for op-bug"),
    ],
)
def test_op_bug_specs_are_checked(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_fault(spec)


def test_a_learning_rate_too_high_is_ml_not_a_library_op(tiny_data, tiny_config, tmp_path):
    run_dir = run(
        tiny_data,
        tiny_config,
        tmp_path / "lr",
        "optim.lr=2.0",
        "optim.warmup_steps=30",
        "train.steps=60",
        "checkpoint.every=20",
        "guard.max_rollbacks=0",
        "guard.min_history=5",
        "guard.window=10",
        expect_error=True,
    )
    incidents, causes, _ = triage([run_dir])
    assert {i.kind for i in incidents} >= {"spike"}
    assert {i.verdict for i in incidents} == {"ml"}, [i.evidence.get("summary") for i in incidents]
    assert [c.verdict for c in causes] == ["ml"]
    crash = [i for i in incidents if i.kind == "crash"]  # the guard giving up: a consequence
    assert crash and "consequence" in crash[0].evidence["summary"]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_diverged_run_is_never_blamed_on_a_library_op(tiny_data, tiny_config, tmp_path, seed, capsys):
    """A learning rate ramped to 3000x tiny's, no clipping: attention's backward overflows on the diverged
    weights (at a constant 300x, seed 1 had 14 of 19 incidents called `library-op` on the old code); only the
    math is at fault, so every incident is `ml` and the float64 path's loss shows the divergence.

    The ramp passes 300x only after the first checkpoint, so the guard can roll back, and it climbs on (the
    loss-spike test off: only non-finite steps count), so the run overflows on every CPU kind: at a constant
    300x from step 1 an AVX-512/AMX Xeon's run spiked to a gradient norm of 1e16 and recovered, where an AMD
    EPYC's overflowed. Here seeds 0 and 1 overflow near step 30 (lr ~9) on one thread and on two."""
    run_dir = run(
        tiny_data,
        tiny_config,
        tmp_path / f"lr-seed{seed}",
        "optim.lr=30.0",
        "optim.warmup_steps=100",
        "guard.loss_sigma=0",
        "optim.grad_clip=0",
        f"train.seed={seed}",
        "train.steps=150",
        "checkpoint.every=10",
        "guard.max_rollbacks=2",
        expect_error=True,
    )
    assert main(["triage", str(run_dir), "--all"]) == 0
    out, err = capsys.readouterr()
    incidents = list_incidents([run_dir])
    assert {i.kind for i in incidents} >= {"non-finite"}
    assert {i.verdict for i in incidents} == {"ml"}, [i.evidence.get("summary") for i in incidents]
    assert "library-op" not in out and " ml " in out
    replayed = [i for i in incidents if i.kind == "non-finite"]
    assert all("the weights diverged" in i.evidence["summary"] for i in replayed)
    assert not RunDir(run_dir).incident_dir(replayed[0].id).exists()  # no repro of an innocent op
    last = incidents[-1]
    assert f"incident {last.id} ({len(incidents)}/{len(incidents)}), {last.kind} at step {last.step}" in err
    assert f"incident {last.id} ({len(incidents)}/{len(incidents)}): ml (" in err  # progress, then verdict


def test_an_op_is_not_judged_where_one_rounding_of_its_inputs_changes_its_result():
    """A softmax over a diverged model's logits (~1e9, float32 spacing 64): one rounding of its inputs
    swaps which logit wins, so no float32 kernel can be held to float64 there; on ordinary logits the
    same wrong output is still a fault."""
    from tenx.triage.opcheck import ILL_CONDITIONED, check_op

    softmax = torch.ops.aten._softmax.default
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, generator=gen)
    wrong = softmax(logits, -1, False).flip(-1)
    assert check_op(softmax, (logits, -1, False), {}, softmax(logits, -1, False))[0] is None
    assert check_op(softmax, (logits, -1, False), {}, wrong)[0] == "diverges"
    diverged = 1e9 + torch.randint(-2, 3, (4, 16), generator=gen).float() * 64
    wrong = softmax(diverged, -1, False).flip(-1)
    problem, change, limit = check_op(softmax, (diverged, -1, False), {}, wrong)
    assert problem == "ill-conditioned" and change > limit == ILL_CONDITIONED


def test_a_clean_run_has_no_incidents(clean, capsys):
    assert list_incidents([clean]) == []
    incidents, causes, _ = triage([clean])
    assert incidents == [] and causes == []
    assert main(["triage", str(clean), "--all"]) == 0
    assert "0 incidents, 0 root causes" in capsys.readouterr().out


def test_differing_repeats_are_a_race(clean, monkeypatch):
    import tenx.model.transformer as step_module  # replay runs the trainer's step, whose forward takes the loss

    real = step_module.lm_loss

    def noisy(
        logits, targets, z_loss=0.0, dtype=torch.float32, token_dtype=None
    ):  # a nondeterministic kernel
        loss, ce = real(logits, targets, z_loss, dtype, token_dtype)
        return loss + 1e-3 * torch.rand(()), ce + 1e-3 * torch.rand(())

    monkeypatch.setattr(step_module, "lm_loss", noisy)
    assert replay(clean, 8, repeat=3).verdict == "differs-between-repeats"


def test_replay_and_triage_commands(clean, capsys):
    assert main(["replay", str(clean), "--step", "7", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "reproduces" and report["step"] == 7
    assert main(["replay", str(clean / "missing"), "--step", "7"]) == 2
    assert "not a tenx run directory" in capsys.readouterr().err
    assert main(["replay", str(clean), "--step", "99"]) == 2
    assert "step 99" in capsys.readouterr().err
    assert main(["triage", str(clean)]) == 2
    assert "--incident ID" in capsys.readouterr().err


def test_bisection_of_a_clean_step_finds_no_faulty_operator(clean):
    report = bisect_step(clean, 8)
    assert report.first is None and report.ops_checked > 50
    assert report.trained.digest == report.recorded.digest
    assert abs(report.reference.loss - report.trained.loss) < 1e-4 * report.trained.loss


def test_supervisor_skips_the_data_of_a_step_that_crashes_twice(tmp_path):
    from tenx.launch.supervise import _skip_crashing_data

    events = EventLog(tmp_path)
    events.emit("crash", 7, phase="step", exception="RuntimeError", position=[48, 56])
    _skip_crashing_data(tmp_path, events, since=0.0)
    assert json.loads(RunDir(tmp_path).data_skips.read_text()) == {"skips": [[48, 56]]}
    _skip_crashing_data(tmp_path, events, since=0.0)  # the same crash again: recorded once
    assert json.loads(RunDir(tmp_path).data_skips.read_text()) == {"skips": [[48, 56]]}
    (skipped,) = [e for e in read_events(tmp_path) if e["kind"] == "data-skipped"]
    assert skipped["positions"] == [48, 56] and skipped["step"] == 7


def test_replay_refuses_what_it_cannot_do(clean, tmp_path):
    with pytest.raises(TenxError, match="not a tenx run directory"):
        replay(tmp_path, 3)
    with pytest.raises(TenxError, match="--repeat"):
        replay(clean, 3, repeat=0)
    with pytest.raises(TenxError, match=r"--step must be >= 1 \(steps are counted from 1\), got -3"):
        replay(clean, -3)


def test_replay_refuses_a_run_whose_config_or_data_changed(clean, tiny_data, tiny_config, tmp_path):
    """An edited config.toml or re-prepared data would make a healthy step `does-not-reproduce` (the
    verdict of a transient hardware fault): replay refuses, naming what changed."""
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(clean, edited)
    config = RunDir(edited).config
    config.write_text(config.read_text().replace("depth = 2", "depth = 3"))
    with pytest.raises(TenxError, match=r"model.depth is 3 in config.toml but the run trained with 2"):
        replay(edited, 7)
    moved = tmp_path / "moved"
    shutil.copytree(clean, moved)
    other = tmp_path / "other-data"
    shutil.copytree(tiny_data, other)
    from tenx.data.prepare.pipeline import PrepareConfig, prepare
    from tenx.data.prepare.sources import copy_stdlib_packages

    corpus = copy_stdlib_packages(("json",), tmp_path / "corpus")
    shutil.rmtree(other)
    prepare(
        PrepareConfig(source=str(corpus), out=str(other), tokenizer="bytes", val_ratio=0.1), progress=False
    )
    config = RunDir(moved).config
    config.write_text(config.read_text().replace(str(tiny_data), str(other)))
    with pytest.raises(TenxError, match=r"the data in .* changed since the run trained on it"):
        replay(moved, 7)


def test_checksum_evidence_names_the_rank_and_the_shard(tmp_path):
    """A replica mismatch is hardware on the rank the consistency check named; a shard that fails its
    checksum is data naming the shard; each is one cause, however many times it was seen."""
    events = EventLog(tmp_path)
    for step in (40, 50):
        events.emit(
            "replica-mismatch",
            step,
            check="parameters",
            scope="rank",
            ranks=[1],
            witness="self-check",
            message="parameters of rank 1 disagree with no majority; rank 1 found its own parameters changed",
        )
    for _ in range(2):  # every restarted process finds the shard corrupt again
        events.emit("corrupt-shard", 3, shard="/data/train_00003.bin", message="expected xxhash 1, got 2")
    events.emit("fault", 40, fault="bitflip@step=40,rank=1", fault_kind="bitflip")  # ground truth only
    incidents, causes, _ = triage([tmp_path])
    assert len(incidents) == 4
    by_kind = {c.verdict: c for c in causes}
    assert set(by_kind) == {"hardware", "data"}
    assert by_kind["hardware"].rank == 1 and len(by_kind["hardware"].incidents) == 2
    assert by_kind["data"].shard == "train_00003.bin" and len(by_kind["data"].incidents) == 2


def test_a_damaged_step_record_is_named_not_a_traceback(clean, tmp_path):
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(clean, copy)
    lines = RunDir(copy).steps.read_text().splitlines()
    record = json.loads(lines[2])
    record["windows"] = [[10**9] * 8]  # a window past the end of the data
    lines[2] = json.dumps(record)
    RunDir(copy).steps.write_text("\n".join(lines) + "\n")
    with pytest.raises(TenxError, match=r"steps.jsonl: record 3 \(step 3\) has a malformed 'windows'"):
        replay(copy, 4)


@pytest.mark.slow
def test_the_triage_drill_finds_its_three_faults_and_only_them(tmp_path):
    """bench/triage_drill.py plants an op-bug, a bitflip and a corrupt shard in one supervised run:
    triage must name exactly three root causes (the op, the rank, the shard), with no false verdict, and
    keep only kilobytes of evidence per incident (it kept 225 MB for a tiny model)."""
    import subprocess
    import sys

    out = tmp_path / "drill"
    bench = Path(__file__).resolve().parents[1] / "bench" / "triage_drill.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "--steps", "120", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    causes = {c["kind"]: c for c in result["causes"]}
    assert result["root_causes"] == 3 and set(causes) == {"library-op", "hardware", "data"}, result
    assert causes["library-op"]["op"] == "aten.nll_loss_forward"
    assert causes["hardware"]["rank"] == 0 and causes["data"]["shard"] == "train_00003.bin"
    assert result["false_verdicts"] == 0
    evidence = sum(f.stat().st_size for f in (out / "run" / "incidents").rglob("*") if f.is_file())
    assert evidence < 200_000 * result["incidents"], evidence
