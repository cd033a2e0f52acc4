"""Distillation (train.distill_from): the loss, the teacher's checks, accounting, resume and replay."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tenx import checkpoint as ckpt
from tenx import rundir
from tenx.checkpoint.models import load_model
from tenx.errors import CheckpointError, ConfigError, TenxError
from tenx.model import transformer
from tenx.model.flops import count_params, flops_per_token
from tenx.model.soft_targets import SoftTargets
from tenx.monitor.metrics_file import read_metrics
from tenx.train.distill import load_teacher, teacher_forward_flops
from tenx.train.run import train
from tenx.triage.replay import replay

FAST = ("model.depth=1", "model.seq_len=32", "log.prequential_xz_mb=0", "train.eval_every=0")


@pytest.fixture(scope="module")
def teachers(tiny_config, tiny_data, tmp_path_factory):
    """Two tiny teachers (seeds 0 and 1, 40 steps) and an ensemble directory listing both."""
    root = tmp_path_factory.mktemp("teachers")
    for seed in (0, 1):
        cfg = tiny_config(tiny_data, *FAST, "train.steps=40", "checkpoint.every=0", f"train.seed={seed}")
        train(cfg, root / f"t{seed}")
    (root / "ens").mkdir()
    rundir.RunDir(root / "ens").ensemble.write_text(json.dumps({"members": ["../t0", "../t1"]}))
    return root


def _student(tiny_config, tiny_data, teacher, *overrides):
    distill = (f'train.distill_from="{teacher}"',) if teacher is not None else ()
    return tiny_config(tiny_data, *FAST, *distill, *overrides)


def _figures(run, *keys):
    return [tuple(r.get(k) for k in keys) for r in read_metrics(rundir.RunDir(run).metrics)]


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("weight", [0.0, 0.25, 1.0])
def test_loss_is_the_mix_of_data_and_teacher_cross_entropy(monkeypatch, chunked, weight):
    """(1 - w) * CE + w * H(teacher, student), its gradients, and the logged [H, KL], against a hand
    computation with an ensemble teacher of two members; in one chunk and in chunks of 2 tokens."""
    if chunked:
        monkeypatch.setattr(transformer, "CHUNK_ELEMENTS", 14)  # 7 classes: 2 tokens a chunk
    g = torch.Generator().manual_seed(0)
    N, D, V = 6, 4, 7
    x = torch.randn(N, D, dtype=torch.float64, generator=g, requires_grad=True)
    w_VD = torch.randn(V, D, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    hidden = [torch.randn(N, d, dtype=torch.float64, generator=g) for d in (3, 5)]
    heads = [torch.randn(V, d, dtype=torch.float64, generator=g) for d in (3, 5)]
    z = 1e-2

    logq = torch.log_softmax(x @ w_VD.t(), dim=-1)
    p = torch.stack([torch.softmax(h @ m.t(), dim=-1) for h, m in zip(hidden, heads)]).mean(0)
    ce = -logq[torch.arange(N), targets].mean()
    cross = -(p * logq).sum(-1).mean()
    kl = (p * (p.log() - logq)).sum(-1).mean()
    expected = (1 - weight) * ce + weight * cross + z * torch.logsumexp(x @ w_VD.t(), -1).square().mean()
    grads = torch.autograd.grad(expected, (x, w_VD))

    loss, got_ce, figures = transformer.linear_cross_entropy(
        x, w_VD, targets, z, torch.float64, SoftTargets(hidden, heads, weight)
    )
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert got_ce.item() == pytest.approx(ce.item(), abs=1e-12)
    assert figures.tolist() == pytest.approx([cross.item(), kl.item()], abs=1e-12)
    assert kl.item() > 0.1 and cross.item() > ce.item() / 10  # figures that a wrong formula would miss
    for got, want in zip(torch.autograd.grad(loss, (x, w_VD)), grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # what the teacher's log-probabilities are: the mixture Ensemble.forward computes
    torch.testing.assert_close(SoftTargets(hidden, heads, weight).log_probs(0, N, torch.float64), p.log())


def test_weight_zero_trains_bit_for_bit_as_without_teacher(tiny_config, tiny_data, teachers, tmp_path):
    """distill_weight=0: the same losses, gradient norms and weights as a plain run; the teacher is only
    logged, and recorded with its forward FLOPs (run.json, teacher_forward_flops)."""
    plain, zero = tmp_path / "plain", tmp_path / "zero"
    train(_student(tiny_config, tiny_data, None, "train.steps=6"), plain)
    train(_student(tiny_config, tiny_data, teachers / "t0", "train.steps=6", "train.distill_weight=0"), zero)
    assert _figures(plain, "loss", "grad_norm") == _figures(zero, "loss", "grad_norm")
    assert all(ce is None for (ce,) in _figures(plain, "distill_ce"))
    distilled = _figures(zero, "distill_ce", "distill_kl")
    assert all(ce > kl > 0 for ce, kl in distilled), distilled
    a, b = load_model(plain, "cpu").model.state_dict(), load_model(zero, "cpu").model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # accounting: the teacher's forward at the student's 32 tokens, a third of its training FLOPs
    run = json.loads(rundir.RunDir(zero).provenance.read_text())
    teacher_meta = ckpt.read_checkpoint_meta(rundir.RunDir(teachers / "t0").checkpoint(40))
    teacher_cfg = load_model(teachers / "t0", "cpu").model.cfg
    forward = flops_per_token(teacher_cfg, 32) // 3
    assert run["teacher"]["forward_flops_per_token"] == forward > 0
    assert run["teacher"]["params"] == count_params(teacher_cfg).total
    assert run["teacher"]["sources"] == [
        {
            "path": str(rundir.RunDir(teachers / "t0").checkpoint(40).resolve()),
            "manifest_xxhash": teacher_meta["manifest_xxhash"],
        }
    ]
    assert run["run_flops_per_token"] == run["flops_per_token"] + forward
    assert teacher_forward_flops(zero) == teacher_forward_flops(run) == float(forward)
    assert teacher_forward_flops(plain) == 0.0


def test_weight_one_pulls_the_student_to_the_teacher(tiny_config, tiny_data, teachers, tmp_path):
    """w=1: the student learns the teacher's distribution: its KL to the teacher falls well below where it
    started and well below that of a student of the data alone (w=0, the same steps); the logged loss stays
    the data cross-entropy, not the distillation term."""
    runs = {}
    for weight in (0, 1):
        run = tmp_path / f"w{weight}"
        overrides = ("train.steps=30", f"train.distill_weight={weight}")
        train(_student(tiny_config, tiny_data, teachers / "t0", *overrides), run)
        runs[weight] = _figures(run, "loss", "distill_ce", "distill_kl")
    start = runs[1][0][2]
    end, data_alone = (sum(kl for *_, kl in runs[w][-10:]) / 10 for w in (1, 0))  # each step's own batch
    assert end < 0.05 * start and end < 0.5 * data_alone, (start, end, data_alone)
    assert all(math.isfinite(loss) and abs(loss - ce) > 1e-3 for loss, ce, _ in runs[1])


def test_an_ensemble_teacher(tiny_config, tiny_data, teachers, tmp_path):
    """An ensemble directory as the teacher: its members' mixture is what the student sees, and its compute
    is the sum of its members'."""
    run = tmp_path / "student"
    trainer, last = train(_student(tiny_config, tiny_data, teachers / "ens", "train.steps=3"), run)
    teacher = trainer.teacher
    assert teacher is not None and len(teacher.members) == 2
    assert all(not p.requires_grad for p in teacher.model.parameters()) and not teacher.model.training
    tokens = torch.randint(0, 256, (2, 32))
    soft = teacher.soft_targets(tokens)
    with torch.no_grad():
        mixture = teacher.model(tokens).flatten(0, 1)
    torch.testing.assert_close(soft.log_probs(0, 64, torch.float32), mixture)
    record = json.loads(rundir.RunDir(run).provenance.read_text())["teacher"]
    single = json.loads(rundir.RunDir(teachers / "t0").provenance.read_text())
    assert record["members"] == len(record["sources"]) == 2
    assert record["forward_flops_per_token"] == 2 * (flops_per_token(teacher.members[0].cfg, 32) // 3)
    assert record["params"] == 2 * single["params"]["total"]
    assert last["distill_kl"] > 0 and math.isfinite(last["loss"])


def test_a_teacher_that_does_not_fit_is_refused_naming_the_field(tiny_config, tiny_data, teachers, tmp_path):
    """Another vocabulary, a shorter context, another tokenizer: each an error naming train.distill_from."""
    with pytest.raises(
        ConfigError, match=r"train\.distill_from=.*vocabulary has 320 entries, the student.s 512"
    ):
        train(
            _student(tiny_config, tiny_data, teachers / "t0", "train.steps=1", "model.vocab_size=512"),
            tmp_path / "a",
        )
    with pytest.raises(ConfigError, match=r"train\.distill_from=.*at most 32 tokens"):
        train(
            _student(tiny_config, tiny_data, teachers / "t0", "train.steps=1", "model.seq_len=64"),
            tmp_path / "b",
        )
    cfg = _student(tiny_config, tiny_data, teachers / "t0", "train.steps=1")
    tokenizer = json.loads((tiny_data / "manifest.json").read_text())["tokenizer"]
    model_cfg = cfg.model.resolved(int(tokenizer["vocab_size"]))
    assert load_teacher(cfg, model_cfg, tokenizer, torch.device("cpu")) is not None
    with pytest.raises(ConfigError, match=r"train\.distill_from=.*tokenizer whose xxhash"):
        load_teacher(cfg, model_cfg, {**tokenizer, "xxhash": "another"}, torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"train\.distill_from=.*cannot load the teacher"):
        train(_student(tiny_config, tiny_data, tmp_path / "nowhere", "train.steps=1"), tmp_path / "c")


def test_resume_and_replay_of_a_distilled_run(tiny_config, tiny_data, teachers, tmp_path, crash_at):
    """A crash after step 6 (checkpoint at 4) and a resume reproduce steps 5-8 bit for bit; a resume with
    another teacher is refused; replay re-executes a step with the recorded teacher, and refuses another."""
    overrides = ("train.steps=8", "checkpoint.every=4", "train.distill_weight=0.5")
    keys = ("loss", "grad_norm", "distill_ce", "distill_kl")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(_student(tiny_config, tiny_data, teachers / "t0", *overrides), straight)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(
            _student(tiny_config, tiny_data, teachers / "t0", *overrides),
            crashed,
            extra_callbacks=[crash_at(6)],
        )
    with pytest.raises(
        CheckpointError, match=r"step_00000004 was trained with the teacher .*train\.distill_from"
    ):
        train(_student(tiny_config, tiny_data, teachers / "t1", *overrides), crashed, resume="auto")
    trainer, _ = train(_student(tiny_config, tiny_data, teachers / "t0", *overrides), crashed, resume="auto")
    assert trainer.resumed_from is not None and trainer.resumed_from.name == "step_00000004"
    assert _figures(straight, *keys) == _figures(crashed, *keys)
    assert len(_figures(crashed, *keys)) == 8

    report = replay(straight, 6, repeat=1)
    assert report.verdict == "reproduces" and report.bitwise, report
    config = rundir.RunDir(straight).config
    config.write_text(config.read_text().replace(str(teachers / "t0"), str(teachers / "t1")))
    with pytest.raises(
        TenxError, match=r"cannot replay the run: it trained with the teacher .*train\.distill_from"
    ):
        replay(straight, 6, repeat=1)
