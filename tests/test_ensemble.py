"""Ensembles (model.ensemble = K, `tenx ensemble`): the mixture averages probabilities (exact against a hand
computation), member k is the single run of seed + k bit for bit, an interrupted ensemble resumes bit for
bit, eval/sample read the mixture, compress codes with it, one member exports, and hostile manifests are
refused by file and field."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tenx.checkpoint.models import MAX_MEMBERS, assemble_ensemble, ensemble_members, load_model
from tenx.cli import main
from tenx.compress.codec import compress_bytes, decompress_bytes
from tenx.compress.container import ENSEMBLE_VERSION, read_header
from tenx.compress.model import load_codec
from tenx.errors import ConfigError, TenxError
from tenx.eval.bpb import eval_split
from tenx.eval.evaluate import evaluate
from tenx.eval.sample import generate
from tenx.model.ensemble import Ensemble
from tenx.rundir import RunDir
from tenx.train.hooks import Callback
from tenx.train.run import train

TINY = (
    "model.depth=1",
    "model.seq_len=32",
    "train.micro_batch=4",
    "train.steps=4",
    "checkpoint.every=2",
    "train.eval_every=0",
    "train.threads=1",
)


class _Fixed(nn.Module):
    """A stand-in member whose logits are given: the same row at every position."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.cfg = SimpleNamespace(vocab_size=len(logits), seq_len=4)
        self.register_buffer("logits", torch.tensor(logits))

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*tokens_BT.shape, -1)


def _softmax(row: list[float]) -> list[float]:
    total = sum(math.exp(x) for x in row)
    return [math.exp(x) / total for x in row]


def test_mixture_averages_probabilities_not_logits():
    a, b = [2.0, 0.0, 0.0], [0.0, 0.0, 2.0]
    out = Ensemble([_Fixed(a), _Fixed(b)])(torch.zeros(1, 2, dtype=torch.long))  # type: ignore[list-item]
    assert out.dtype == torch.float32 and out.shape == (1, 2, 3)
    mixture = [(p + q) / 2 for p, q in zip(_softmax(a), _softmax(b))]  # 0.4467, 0.1065, 0.4467
    assert torch.allclose(out[0, 1].double(), torch.tensor(mixture).log().double(), atol=1e-6)
    averaged_logits = _softmax([(x + y) / 2 for x, y in zip(a, b)])  # 0.4223, 0.1554, 0.4223: not this
    assert abs(math.exp(out[0, 0, 0]) - averaged_logits[0]) > 0.02
    assert abs(math.exp(out[0, 0, 0]) - 0.4467465) < 1e-6  # (e^2 / (e^2 + 2) + 1 / (e^2 + 2)) / 2


def test_the_member_count_is_bounded(tiny_config, tiny_data):
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match=r"model\.ensemble"):
            tiny_config(tiny_data, f"model.ensemble={bad}")


@pytest.fixture(scope="module")
def runs(tiny_config, tiny_data, tmp_path_factory):
    """An ensemble of 2 (its metrics) and the single run of seed 1, trained once."""
    root = tmp_path_factory.mktemp("ensemble")
    _, metrics = train(tiny_config(tiny_data, *TINY, "model.ensemble=2"), root / "ens")
    _, single = train(tiny_config(tiny_data, *TINY, "train.seed=1"), root / "seed1")
    return SimpleNamespace(root=root, ens=root / "ens", seed1=root / "seed1", metrics=metrics, single=single)


def _weights(target: Path) -> dict[str, torch.Tensor]:
    return load_model(target, "cpu").model.state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_member_k_is_the_single_run_of_seed_plus_k(runs):
    run = RunDir(runs.ens)
    assert json.loads(run.ensemble.read_text()) == {"members": ["members/0", "members/1"]}
    assert runs.metrics["members"][1]["loss"] == runs.single["loss"]
    assert runs.metrics["members"][0]["loss"] != runs.single["loss"]
    assert _same(_weights(run.member(1)), _weights(runs.seed1))
    member = (RunDir(run.member(1)).config).read_text()
    assert "ensemble = 1" in member and "seed = 1" in member
    top, one = (json.loads(RunDir(d).provenance.read_text()) for d in (runs.ens, run.member(0)))
    assert top["params"]["total"] == 2 * one["params"]["total"]
    assert top["flops_per_token"] == 2 * one["flops_per_token"] and top["model"]["ensemble"] == 2


def test_an_interrupted_ensemble_resumes_bit_for_bit(runs, tiny_config, tiny_data, tmp_path):
    class CrashInMember1(Callback):
        def on_step_end(self, trainer, metrics) -> None:
            if trainer.rundir.root.name == "1" and trainer.step == 3:
                raise RuntimeError("simulated crash in member 1")

    cfg = tiny_config(tiny_data, *TINY, "model.ensemble=2")
    with pytest.raises(RuntimeError, match="member 1"):
        train(cfg, tmp_path / "ens", extra_callbacks=[CrashInMember1()])
    assert not RunDir(tmp_path / "ens").ensemble.exists()  # written only once every member has finished
    with pytest.raises(TenxError, match="already has an ensemble's members; pass --resume auto"):
        train(cfg, tmp_path / "ens")
    with pytest.raises(TenxError, match="holds an ensemble's members"):
        train(tiny_config(tiny_data, *TINY), tmp_path / "ens")
    _, metrics = train(cfg, tmp_path / "ens", resume="auto")
    assert metrics["members"][0] == {}  # finished before: skipped
    assert metrics["members"][1]["step"] == 4
    for k in range(2):
        assert _same(_weights(RunDir(tmp_path / "ens").member(k)), _weights(RunDir(runs.ens).member(k)))


def test_the_cli_refuses_a_fresh_run_and_resumes_a_finished_one(runs, tiny_data, capsys):
    args = ["train", "--config", "tiny", "--run-dir", str(runs.ens), "--set", f'data.dir="{tiny_data}"']
    args += [a for s in (*TINY, "model.ensemble=2", "log.progress=false") for a in ("--set", s)]
    assert main(args) == 2
    assert "already has an ensemble's members" in capsys.readouterr().err
    assert main([*args, "--supervise"]) == 2
    assert "--supervise with model.ensemble=2" in capsys.readouterr().err
    assert main([*args, "--resume", "auto"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[-3]) == {"member": 0, "finished": "before this resume"}
    assert lines[-1].startswith(f"ensemble: {RunDir(runs.ens).ensemble}")


class _HandMixture(nn.Module):
    """The mixture by hand, in float64: log of the mean of the members' softmax."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.cfg = members[0].cfg

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        probs = [torch.softmax(m(tokens_BT).double(), dim=-1) for m in self.members]
        return (sum(probs) / len(probs)).log()  # type: ignore[union-attr]


def test_eval_and_sample_read_the_mixture(runs, tiny_data):
    ensemble = load_model(runs.ens, "cpu").model
    assert isinstance(ensemble, Ensemble) and len(ensemble.members) == 2
    members = [load_model(RunDir(runs.ens).member(k), "cpu").model for k in range(2)]
    mixed = eval_split(ensemble, tiny_data, "heldout", 16)["bits_per_byte"]
    alone = [eval_split(m, tiny_data, "heldout", 16)["bits_per_byte"] for m in members]
    assert mixed <= sum(alone) / 2  # Jensen: the mixture never codes worse than its members on average
    assert mixed == pytest.approx(
        eval_split(_HandMixture(members), tiny_data, "heldout", 16)["bits_per_byte"], rel=1e-6
    )
    report = evaluate(runs.ens, ["heldout"], device="cpu", precision="fp32", batch_size=16)  # `tenx eval`
    assert report["datasets"]["heldout"]["bits_per_byte"] == pytest.approx(mixed, rel=1e-9)
    assert RunDir(runs.ens).eval_report.exists()
    prompt = [0, 40, 41, 42]
    greedy = generate(ensemble, prompt, 6, temperature=0, vocab_size=256)
    ids = torch.tensor([prompt])
    hand = _HandMixture(members)
    for token in greedy:  # each greedy token is the hand mixture's most likely one
        assert int(hand(ids)[0, -1, :256].argmax()) == token
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert (
        main(["sample", str(runs.ens), "--prompt", "def ", "--max-new-tokens", "8", "--device", "cpu"]) == 0
    )


def test_compress_codes_with_the_mixture_and_names_each_member(runs):
    codec = load_codec(load_model(runs.ens, "cpu"))  # loaded first, or from the directory: the same
    assert [m.checkpoint for m in codec.members] == [m.checkpoint for m in load_codec(runs.ens).members]
    assert [m.step for m in codec.members] == [4, 4] and codec.checkpoint == runs.ens
    data = b"def f(x):\n    return x\n" * 4
    blob = compress_bytes(codec, data)
    assert read_header(blob).version == ENSEMBLE_VERSION and decompress_bytes(runs.ens, blob) == data
    with pytest.raises(TenxError, match="compressed with an ensemble of 2 members .* is one model"):
        decompress_bytes(RunDir(runs.ens).member(0), blob)  # tests/test_compress_ensemble.py has the rest


def test_export_of_one_member_equals_that_member(runs, tmp_path):
    pytest.importorskip("transformers")
    from tenx.export.hf import export_hf, hf_architecture, hf_state_dict

    with pytest.raises(TenxError, match=r"is an ensemble of 2 members.*--member K \(0 to 1\).*members/0"):
        export_hf(runs.ens, tmp_path / "none")
    with pytest.raises(TenxError, match="--member 2: .* has members 0 to 1"):
        export_hf(runs.ens, tmp_path / "none", member=2)
    with pytest.raises(TenxError, match="--member 0: .* is not an ensemble"):
        export_hf(runs.seed1, tmp_path / "none", member=0)
    summary = export_hf(runs.ens, tmp_path / "hf", member=1)
    member = load_model(RunDir(runs.ens).member(1), "cpu")
    assert summary["checkpoint"] == str(member.checkpoint.resolve())
    from safetensors.torch import load_file

    written = load_file(next((tmp_path / "hf").glob("*.safetensors")))
    expected = hf_state_dict(member.model, hf_architecture(member.model.cfg))
    assert all(torch.equal(written[k], expected[k]) for k in written if k in expected)
    assert len(set(written) & set(expected)) >= len(written) - 1  # the tied head is written once


def test_assemble_writes_relative_and_absolute_members_and_refuses(runs, tiny_config, tiny_data, tmp_path):
    members = [RunDir(runs.ens).member(0), runs.seed1]
    manifest = assemble_ensemble(members, runs.root)  # member 0 inside --out, seed1 too: relative
    assert json.loads(manifest.read_text()) == {"members": ["ens/members/0", "seed1"]}
    outside = assemble_ensemble(members, tmp_path / "out")
    assert json.loads(outside.read_text())["members"] == [str(p.resolve()) for p in members]
    assert _same(_weights(runs.root), _weights(runs.ens))  # members 0 and 1 (seed 1) again
    with pytest.raises(TenxError, match="exists; choose another --out"):
        assemble_ensemble(members, tmp_path / "out")
    (tmp_path / "fifo-out").mkdir()
    os.mkfifo(RunDir(tmp_path / "fifo-out").ensemble)
    with pytest.raises(TenxError, match="exists"):
        assemble_ensemble(members, tmp_path / "fifo-out")
    with pytest.raises(TenxError, match=f"{runs.ens} is an ensemble itself"):
        assemble_ensemble([runs.ens], tmp_path / "nested")
    train(tiny_config(tiny_data, *TINY, "model.seq_len=16"), tmp_path / "short")
    with pytest.raises(TenxError, match=f"{tmp_path / 'short'}: its seq_len \\(16\\) is not"):
        assemble_ensemble([runs.seed1, tmp_path / "short"], tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()
    assert (
        main(["ensemble", str(runs.seed1), str(RunDir(runs.ens).member(1)), "--out", str(tmp_path / "c")])
        == 0
    )
    assert len(ensemble_members(tmp_path / "c")) == 2


def _manifest(tmp_path: Path, content: object) -> Path:
    root = tmp_path / "bad"
    root.mkdir(exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content)
    RunDir(root).ensemble.write_text(text)
    return root


@pytest.mark.parametrize(
    "content, field",
    [
        ("{not json", "not valid JSON"),
        (["members/0"], "field 'members'"),
        ({"members": "seed1"}, "field 'members'"),
        ({"members": []}, "field 'members'"),
        ({"members": [7]}, r"members\[0\] is not a path"),
        ({"members": ["missing"]}, r"members\[0\] .*missing is not a directory"),
        ({"members": ["ens"]}, r"members\[0\] .*ens is an ensemble itself"),
        ({"members": ["seed1", "./seed1"]}, r"members\[1\] .*seed1 is listed twice"),
        ({"members": ["seed1"] * (MAX_MEMBERS + 1)}, f"field 'members' must be a list of 1 to {MAX_MEMBERS}"),
    ],
)
def test_hostile_manifests_are_refused_by_file_and_field(runs, tmp_path, content, field):
    if isinstance(content, dict) and isinstance(content.get("members"), list):
        content = {"members": [str(runs.root / m) if isinstance(m, str) else m for m in content["members"]]}
    root = _manifest(tmp_path, content)
    with pytest.raises(TenxError, match=field) as error:
        load_model(root, "cpu")
    assert str(RunDir(root).ensemble) in str(error.value)


def test_a_fifo_for_a_manifest_is_refused_unopened(tmp_path):
    os.mkfifo(RunDir(tmp_path).ensemble)
    with pytest.raises(TenxError, match=f"{RunDir(tmp_path).ensemble}: is a (FIFO|fifo)"):
        ensemble_members(tmp_path)
