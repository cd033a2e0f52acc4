"""The fixed-point forward of portable `.tenx` files (tenx/compress/fixed.py) implements ModelConfig's
components by name and refuses a model with any other, naming it, instead of coding a file with a model it
computes wrongly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tenx.cli import main
from tenx.compress.fixed import COMPONENTS, READ_AS_GIVEN, FixedWeights, check_components
from tenx.errors import TenxError
from tenx.model import transformer
from tenx.model.config import ModelConfig
from tenx.model.transformer import Transformer
from tenx.train.run import train


class ScaleNorm(transformer.RMSNorm):
    """A norm the fixed-point forward does not implement: x / ||x|| times one learned scalar per feature (a
    subclass of RMSNorm, so the check must compare classes exactly, not by isinstance)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x / (x.norm(dim=-1, keepdim=True) + self.eps) * self.weight
        return out + self.bias if self.bias is not None else out


def _model(**overrides) -> Transformer:
    return Transformer(ModelConfig(depth=1, d_model=64, head_dim=16, seq_len=16, **overrides).resolved(100))


@pytest.mark.parametrize(
    "overrides", [{"family": "gpt2"}, {"family": "llama", "qk_norm": True, "n_kv_heads": 1}]
)
def test_both_families_are_implemented(overrides):
    check_components(_model(**overrides))


def test_every_model_config_field_is_known_to_the_fixed_point_forward():
    """A field added to ModelConfig must be taught to fixed.py (COMPONENTS or READ_AS_GIVEN) or refused."""
    assert {f.name for f in dataclasses.fields(ModelConfig)} == set(COMPONENTS) | READ_AS_GIVEN


def test_an_unknown_norm_module_is_refused_naming_it():
    model = _model(family="llama")
    model.blocks[0].attn_norm = ScaleNorm(64, 1e-5)
    with pytest.raises(TenxError, match=r"blocks\.0\.attn_norm of class ScaleNorm.*implements RMSNorm"):
        FixedWeights(model, torch.device("cpu"))


def test_an_unknown_component_value_is_refused_naming_the_field():
    model = _model(family="gpt2")
    model.cfg = dataclasses.replace(model.cfg, norm="scalenorm")  # type: ignore[arg-type]
    with pytest.raises(TenxError, match=r"model\.norm='scalenorm'.*'layernorm', 'rmsnorm'"):
        FixedWeights(model, torch.device("cpu"))


def test_an_unknown_config_field_is_refused_naming_it():
    @dataclasses.dataclass
    class WithParallelBlocks(ModelConfig):
        parallel_blocks: bool = True

    model = _model(family="gpt2")
    model.cfg = WithParallelBlocks(**dataclasses.asdict(model.cfg))
    with pytest.raises(TenxError, match=r"model\.parallel_blocks=True"):
        FixedWeights(model, torch.device("cpu"))


def test_tenx_compress_refuses_a_model_with_a_norm_it_lacks(
    tiny_config, tiny_data, tmp_path, monkeypatch, capsys
):
    """A model whose every norm is a class fixed.py lacks (built by tenx/model/ itself, as a component added
    there would be) trains, but `tenx compress` refuses it and writes nothing."""
    monkeypatch.setattr(
        transformer, "make_norm", lambda cfg, dim: ScaleNorm(dim, cfg.norm_eps, bool(cfg.bias))
    )
    run = tmp_path / "run"
    train(tiny_config(tiny_data, "train.steps=1", "checkpoint.every=0", "train.eval_every=0"), run)
    src = tmp_path / "doc.txt"
    src.write_bytes(b"print('hello')\n" * 10)
    assert main(["compress", str(run), str(src)]) == 2
    err = capsys.readouterr().err
    assert "ScaleNorm" in err and "tenx/compress/fixed.py" in err
    assert not (tmp_path / "doc.txt.tenx").exists()
