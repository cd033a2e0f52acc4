"""`tenx train --init-from DIR` never unpickles: a model directory whose weights are a pickle is refused
unread, with or without transformers installed (this file imports no transformers, and hides it)."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from tenx.cli import main
from tenx.errors import TenxError
from tenx.export.hf_import import import_hf
from tenx.train.config import CONFIG_DIR

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 257,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
"""A Llama directory's config.json as transformers writes it (tests/test_hf_import.py builds real ones)."""


class _Payload:
    """Unpickling it would create the marker file: proof that the pickle ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickled_weights_are_refused_unread_without_transformers(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA))
    marker = tmp_path / "pwned"
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": _Payload(marker)}))
    with pytest.raises(TenxError, match="pytorch_model.bin, which tenx does not read"):
        import_hf(directory)
    argv = ["train", "--config", str(CONFIG_DIR / "tiny.toml"), "--run-dir", str(tmp_path / "run")]
    assert main([*argv, "--init-from", str(directory), "--set", f'data.dir="{tiny_data}"']) == 2
    assert "pytorch_model.bin, which tenx does not read" in capsys.readouterr().err
    assert not marker.exists()
    assert not (tmp_path / "run").exists()
