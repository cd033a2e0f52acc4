"""float8 training (train.precision = "fp8", tenx/train/float8.py): which linears convert, the refusals on
devices without fp8 tensor cores, a short emulated run against bf16, and fp8 checkpoints loading into the
plain model. fp8 is emulated on the CPU (torchao's Float8LinearConfig(emulate=True)): the numbers are fp8's.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from test_cuda_contracts import A100, H100, FakeGpus
from torch import nn

import tenx.train.parts as parts
from tenx.checkpoint.models import load_model
from tenx.cli import main
from tenx.errors import ConfigError
from tenx.hardware import resolve_precision
from tenx.model.config import ModelConfig
from tenx.model.transformer import Transformer
from tenx.train.config import CONFIG_DIR, load_run_config
from tenx.train.float8 import (
    check_float8_support,
    convert_linears_to_float8,
    is_float8_candidate,
    restore_plain_linears,
)
from tenx.train.run import train

pytest.importorskip("torchao.float8")

CPU = torch.device("cpu")
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture
def gpus(monkeypatch):
    """A function: install torch.cuda stubs of these (name, capability) GPUs (tests/test_cuda_contracts.py)."""
    return lambda *found: FakeGpus(list(found)).install(monkeypatch)


def _model(**fields: object) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(depth=2, head_dim=32, seq_len=32, **fields).resolved(256))  # type: ignore[arg-type]


def _kinds(model: nn.Module) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_block_linear_converts_and_the_output_projection_does_not(family):
    model = _model(family=family, d_model=64)
    converted = convert_linears_to_float8(model, CPU, emulate=True)
    assert converted == [f"blocks.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS]
    kinds = _kinds(model)
    assert kinds.pop("lm_head") == "Linear"
    assert kinds == {name: "Float8Linear" for name in converted}
    if family == "gpt2":  # the tied output projection still shares the embedding's weight
        assert model.lm_head.weight is model.tok_emb.weight


def test_linears_whose_dimensions_are_not_multiples_of_16_stay_in_bf16():
    # gpt2, d_ff 72: the MLP's 64 -> 72 and 72 -> 64; llama, d_ff 40: up 64 -> 80 converts, down 40 -> 64 not
    gpt2 = _model(family="gpt2", d_model=64, d_ff=72)
    assert convert_linears_to_float8(gpt2, CPU, emulate=True) == [
        f"blocks.{i}.attn.{name}" for i in range(2) for name in ("qkv_proj", "out_proj")
    ]
    llama = _model(family="llama", d_model=64, d_ff=40)
    assert convert_linears_to_float8(llama, CPU, emulate=True) == [
        f"blocks.{i}.{name}" for i in range(2) for name in ("attn.qkv_proj", "attn.out_proj", "mlp.up_proj")
    ]
    assert _kinds(llama)["blocks.1.mlp.down_proj"] == "Linear"


def test_the_size_rule_skips_linears_below_torchaos_thresholds():
    meta = torch.device("meta")
    fits = {
        (in_f, out_f): is_float8_candidate(
            nn.Linear(in_f, out_f, device=meta), "blocks.0.mlp.up_proj", skip_small=True
        )
        for in_f, out_f in [(4096, 1024), (4112, 1024), (4096, 1040), (768, 3072), (3072, 768), (64, 64)]
    }
    assert fits == {
        (4096, 1024): False,  # both at the thresholds: slower in fp8
        (4112, 1024): True,
        (4096, 1040): True,
        (768, 3072): True,  # gpt2-d12's MLP up projection
        (3072, 768): False,  # and its down projection
        (64, 64): False,
    }
    assert is_float8_candidate(nn.Linear(64, 64, device=meta), "blocks.0.mlp.up_proj")  # the rule is opt-in
    assert not is_float8_candidate(nn.Linear(8192, 8192, device=meta), "lm_head")
    assert not is_float8_candidate(nn.Embedding(64, 64, device=meta), "tok_emb")


def test_fp8_autocasts_to_bf16():
    assert resolve_precision("fp8", CPU) == torch.bfloat16
    assert resolve_precision("fp8", torch.device("cuda", 0)) == torch.bfloat16  # no GPU question needed


def _cfg(*overrides: str):
    return load_run_config(CONFIG_DIR / "tiny.toml", ["data.dir='unused'", *overrides])


def test_the_cpu_is_refused_through_the_model_builder():
    cfg = _cfg("train.precision='fp8'")
    with pytest.raises(
        ConfigError, match=r"train.precision='fp8' needs an NVIDIA GPU .* device is cpu: use "
    ):
        parts.build_model_parts(cfg, cfg.model.resolved(256), CPU)


def test_a_gpu_without_fp8_tensor_cores_is_refused_by_name(gpus):
    fake = gpus(H100, A100)  # the job's GPU is cuda:1, an A100; the current GPU (cuda:0) could do fp8
    with pytest.raises(ConfigError, match=r"NVIDIA A100-SXM4-80GB \(cuda:1\) has compute capability 8\.0"):
        check_float8_support(torch.device("cuda", 1))
    assert fake.calls == [("get_device_capability", 1), ("get_device_name", 1)]


def test_an_fp8_gpu_passes_and_a_missing_torchao_is_named(gpus, monkeypatch):
    fake = gpus(A100, H100)
    check_float8_support(torch.device("cuda", 1))
    assert fake.calls == [("get_device_capability", 1)]
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao...` now raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"train.precision='fp8' needs torchao: pip install torchao"):
        check_float8_support(torch.device("cuda", 1))


def test_rocm_is_refused(gpus, monkeypatch):
    gpus(H100)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(ConfigError, match="NVIDIA GPUs only, not ROCm"):
        check_float8_support(torch.device("cuda", 0))


@pytest.fixture
def emulated(monkeypatch):
    """build_parts and build_model_parts convert as on a GPU, with fp8 emulated so that the CPU runs it
    (build_parts' early device check, which refuses the CPU, is what emulation stands in for)."""
    monkeypatch.setattr(
        parts, "convert_linears_to_float8", functools.partial(convert_linears_to_float8, emulate=True)
    )
    monkeypatch.setattr(parts, "check_float8_support", lambda device: None)


def _text_batches(steps: int, batch: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Byte windows of two standard-library sources: text whose loss falls in a few dozen steps."""
    data = torch.tensor(list(Path(json.__file__).read_bytes() + Path(functools.__file__).read_bytes()))
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g).tolist()
        x = torch.stack([data[s : s + seq_len + 1] for s in starts])
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _train_losses(precision: str, steps: int = 30, compile: bool = False) -> tuple[list[float], nn.Module]:
    cfg = _cfg(f"train.precision='{precision}'", "optim.lr=3e-3")
    built = parts.build_model_parts(cfg, cfg.model.resolved(256), CPU, compile=compile)
    amp = resolve_precision(precision, CPU)
    losses = []
    for x, y in _text_batches(steps, 8, cfg.model.seq_len):
        with torch.autocast("cpu", dtype=amp):
            loss, ce = built.forward(x, y)
        loss.backward()
        built.optimizer.step()
        built.optimizer.zero_grad(set_to_none=True)
        losses.append(ce.item())
    return losses, built.raw_model


def test_emulated_fp8_training_follows_bf16(emulated):
    bf16, _ = _train_losses("bf16")
    fp8, model = _train_losses("fp8")
    assert sum(isinstance(m, nn.Linear) and type(m) is not nn.Linear for m in model.modules()) == 8
    assert fp8[0] == pytest.approx(bf16[0], rel=1e-3)  # the same initial weights and data
    assert max(abs(a - b) for a, b in zip(fp8, bf16)) > 1e-3  # and the matmuls were fp8's
    late_bf16, late_fp8 = sum(bf16[-10:]) / 10, sum(fp8[-10:]) / 10
    assert late_bf16 < bf16[0] - 1.5  # it learned, so the comparison says something
    assert late_fp8 == pytest.approx(late_bf16, rel=0.05)


@pytest.mark.slow
def test_compiled_fp8_matches_eager_fp8(emulated):
    eager, _ = _train_losses("fp8", steps=3)
    compiled, _ = _train_losses("fp8", steps=3, compile=True)
    assert compiled == pytest.approx(eager, rel=1e-2)


def test_an_fp8_state_dict_loads_into_a_plain_transformer(emulated):
    _, fp8_model = _train_losses("fp8", steps=3)
    plain = Transformer(fp8_model.cfg)
    assert list(plain.state_dict()) == list(fp8_model.state_dict())
    plain.load_state_dict(fp8_model.state_dict(), strict=True)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), fp8_model.parameters()))


def test_an_fp8_runs_checkpoint_evaluates_as_a_plain_model(emulated, tiny_config, tiny_data, tmp_path):
    trainer, summary = train(
        tiny_config(tiny_data, "train.precision='fp8'", "train.steps=4"), tmp_path / "run"
    )
    assert any(type(m).__name__ == "Float8Linear" for m in trainer.raw_model.modules())
    loaded = load_model(tmp_path / "run", device="cpu").model
    assert type(loaded.blocks[0].mlp.up_proj) is nn.Linear
    trained = trainer.raw_model.state_dict()
    assert all(torch.equal(t, trained[k]) for k, t in loaded.state_dict().items())


def test_tenx_train_in_fp8_on_a_cpu_stops_with_the_error(tiny_data, tmp_path, capsys):
    args = ["--config", str(CONFIG_DIR / "tiny.toml"), "--set", f'data.dir="{tiny_data}"']
    assert main(["train", *args, "--set", "train.precision='fp8'", "--run-dir", str(tmp_path / "run")]) == 2
    assert "tenx: error: train.precision='fp8' needs an NVIDIA GPU" in capsys.readouterr().err


def test_restoring_plain_linears_keeps_the_parameters_and_gives_the_plain_models_float64_output():
    """Triage's reference path: an fp8 model back to plain linears, the same Parameter objects (the optimizer
    over them stays valid), and in float64 the output of a plain model with the same weights."""
    model, plain = _model(family="llama"), _model(family="llama")
    converted = convert_linears_to_float8(model, CPU, emulate=True)
    params = {name: id(p) for name, p in model.named_parameters()}
    assert sorted(restore_plain_linears(model)) == sorted(converted)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert {name: id(p) for name, p in model.named_parameters()} == params
    tokens = torch.randint(0, 256, (2, 16))
    out = model.to(torch.float64)(tokens)
    assert torch.equal(out, plain.to(torch.float64)(tokens))
    assert restore_plain_linears(model) == []
