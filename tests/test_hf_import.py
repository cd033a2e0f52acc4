"""`tenx train --init-from HF_DIR`: transformers' GPT-2, Llama and Qwen3 become tenx models with the same
logits, an export imported again is the identity, what tenx cannot compute is refused by field, a pickle never
runs, and `tenx data prepare --tokenizer-from` gives the data the model's tokenizer."""

from __future__ import annotations

import json
import pickle
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tenx.checkpoint.models import load_model  # noqa: E402
from tenx.cli import main  # noqa: E402
from tenx.data.manifest import read_manifest  # noqa: E402
from tenx.data.tokenizer import BPE_FILE, load_hf_tokenizer, load_tokenizer, train_bpe  # noqa: E402
from tenx.errors import TenxError  # noqa: E402
from tenx.export.hf import export_hf  # noqa: E402
from tenx.export.hf_import import (  # noqa: E402
    InitFromHF,
    import_hf,
    read_hf_config,
    tokenizer_digest,
)
from tenx.train.config import CONFIG_DIR  # noqa: E402
from tenx.train.run import train  # noqa: E402
from tenx.train.trainer import Trainer  # noqa: E402

TINY = CONFIG_DIR / "tiny.toml"
FAST = ("train.steps=2", "checkpoint.every=0", "train.eval_every=0", "train.threads=1")
TOKENIZER_TEXTS = ["def f(x):\n    return x + 1\n", "import json\nprint(json.dumps({'a': [1, 2]}))\n"] * 20


def _tiny_hf(arch: str, vocab: int, **extra):
    """A randomly initialised transformers model of `arch` (nothing is downloaded)."""
    torch.manual_seed(0)
    if arch == "GPT2LMHeadModel":
        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_embd=64, n_layer=2, n_head=2, n_positions=64, **extra
        )
    else:
        cls = transformers.Qwen3Config if arch == "Qwen3ForCausalLM" else transformers.LlamaConfig
        qwen = {"head_dim": 32} if arch == "Qwen3ForCausalLM" else {}
        cfg = cls(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5, **qwen, **extra,
        )  # fmt: skip
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():  # norms start at ones/zeros: move them, so a norm loaded from the wrong place shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _save(model, directory, tokenizer=None):
    model.save_pretrained(directory)
    if tokenizer is not None:
        (directory / BPE_FILE).write_text(tokenizer.to_json())
    return directory


def _logit_diff(hf_model, tenx_model) -> float:
    vocab = hf_model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (hf_model(input_ids=ids).logits - tenx_model(ids)[..., :vocab]).abs().max().item()


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(TOKENIZER_TEXTS, 300)


def _prepare_from(corpus_dir, out, tokenizer_dir) -> list[str]:
    """`tenx data prepare` of the corpus into `out` with the tokenizer.json of a model directory."""
    return [
        "data",
        "prepare",
        "--source",
        str(corpus_dir),
        "--out",
        str(out),
        "--tokenizer-from",
        str(tokenizer_dir),
    ]


@pytest.fixture(scope="module")
def hf_data(corpus_dir, tokenizer, tmp_path_factory):
    """The tiny corpus prepared through the CLI with --tokenizer-from a model directory's tokenizer.json."""
    tok_dir = tmp_path_factory.mktemp("hf-tok")
    (tok_dir / BPE_FILE).write_text(tokenizer.to_json())
    out = tmp_path_factory.mktemp("hf-data") / "data"
    argv = _prepare_from(corpus_dir, out, tok_dir)
    assert main([*argv, "--val-ratio", "0.1", "--heldout-ratio", "0.1", "--quiet"]) == 0
    return out


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel"])
@pytest.mark.parametrize("vocab", [128, 300])  # 300: tenx pads its vocabulary to 320 with zero rows
def test_import_gives_transformers_logits(arch, vocab, tmp_path):
    hf_model = _tiny_hf(arch, vocab)
    model = import_hf(_save(hf_model, tmp_path))
    assert model.cfg.family == ("gpt2" if arch == "GPT2LMHeadModel" else "llama")
    assert model.cfg.qk_norm == (arch == "Qwen3ForCausalLM")
    assert model.cfg.vocab_size == (128 if vocab == 128 else 320)
    assert _logit_diff(hf_model, model) <= 1e-5
    assert not model.tok_emb.weight[vocab:].any()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_export_then_import_is_identity(family, tiny_config, tiny_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(tiny_data, f'model.family="{family}"', *FAST), run)
    export_hf(run, tmp_path / "hf")
    ours = load_model(run, device="cpu").model.state_dict()
    again = import_hf(tmp_path / "hf").state_dict()
    assert sorted(again) == sorted(ours)
    assert all(torch.equal(again[k], ours[k]) for k in ours)


class _Payload:
    """Unpickling it would create a file: what a hostile pytorch_model.bin does (only more quietly)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickled_weights_are_refused_unread(tiny_config, hf_data, tmp_path):
    directory = _save(_tiny_hf("LlamaForCausalLM", 300), tmp_path / "hf")
    (directory / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": _Payload(marker)}))
    with pytest.raises(TenxError, match="pytorch_model.bin, which tenx does not read"):
        import_hf(directory)
    argv = ["train", "--config", str(TINY), "--run-dir", str(tmp_path / "run"), "--init-from"]
    assert main([*argv, str(directory), "--set", f'data.dir="{hf_data}"']) != 0
    assert not marker.exists()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "field, value, arch",
    [
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "LlamaForCausalLM"),
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, "LlamaForCausalLM"),
        ("architectures", ["MistralForCausalLM"], "LlamaForCausalLM"),
        ("auto_map", {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}, "LlamaForCausalLM"),
        ("hidden_act", "gelu", "LlamaForCausalLM"),
        ("head_dim", 64, "Qwen3ForCausalLM"),
        ("attention_bias", True, "Qwen3ForCausalLM"),
        ("sliding_window", 16, "Qwen3ForCausalLM"),
        ("activation_function", "relu", "GPT2LMHeadModel"),
        ("n_head", 3, "GPT2LMHeadModel"),
    ],
)
def test_unrepresentable_config_is_refused_by_field(field, value, arch, tmp_path):
    directory = _save(_tiny_hf(arch, 128), tmp_path)
    path = directory / "config.json"
    raw = json.loads(path.read_text()) | {field: value}
    if field == "sliding_window":
        raw["use_sliding_window"] = True
    path.write_text(json.dumps(raw))
    with pytest.raises(TenxError, match=re.escape(f"config.json: {field}={json.dumps(value)}")):
        import_hf(directory)


def test_weights_unlike_the_config_are_refused_by_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _save(_tiny_hf("LlamaForCausalLM", 128), tmp_path)
    tensors = load_file(directory / "model.safetensors")
    bad = dict(tensors, **{"model.norm.weight": torch.ones(32)})
    save_file(bad, directory / "model.safetensors")
    with pytest.raises(
        TenxError, match=r"tensor model.norm.weight has shape \[32\], config.json implies \[64\]"
    ):
        import_hf(directory)
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, directory / "model.safetensors")
    with pytest.raises(TenxError, match=r"missing \['model.norm.weight'\]"):
        import_hf(directory)
    index = {"weight_map": {k: "../elsewhere.safetensors" for k in tensors}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TenxError, match="not a .safetensors file of"):
        import_hf(directory)


def test_sharded_bf16_weights_load(tmp_path):
    hf_model = _tiny_hf("Qwen3ForCausalLM", 128).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = import_hf(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert _logit_diff(reference, model) <= 1e-5  # (the bf16 model's own RoPE tables are bf16)


def test_tokenizer_from_gives_the_models_ids(hf_data, tokenizer, corpus_dir):
    ours = load_tokenizer(hf_data)
    assert read_manifest(hf_data)["tokenizer"]["vocab_size"] == tokenizer.vocab_size
    text = (corpus_dir / "json" / "__init__.py").read_text()
    assert ours.encode(text) == tokenizer.encode(text)
    assert ours.eot_id == tokenizer.eot_id


def test_tokenizer_without_end_of_document_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / BPE_FILE))
    with pytest.raises(Exception, match="has no '<|endoftext|>' token"):
        load_hf_tokenizer(tmp_path)


def test_data_of_another_tokenizer_is_refused(tiny_data, tokenizer, tmp_path):
    directory = _save(_tiny_hf("GPT2LMHeadModel", 300), tmp_path / "hf", tokenizer)
    argv = ["train", "--config", str(TINY), "--run-dir", str(tmp_path / "run"), "--init-from"]
    assert main([*argv, str(directory), "--set", f'data.dir="{tiny_data}"']) != 0
    assert not (tmp_path / "run").exists()


def test_init_callback_loads_weights_only_at_step_zero(tiny_config, hf_data, tokenizer, tmp_path):
    hf_model = _tiny_hf("LlamaForCausalLM", 300)
    directory = _save(hf_model, tmp_path / "hf", tokenizer)
    from tenx.export.hf_import import init_from_hf, model_config

    init, sets = init_from_hf(directory, tiny_config(hf_data))
    cfg = tiny_config(hf_data, *sets, *FAST)
    assert cfg.model == model_config(read_hf_config(directory), tiny_config(hf_data).model)
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.step = 3  # a resumed run keeps its weights
    before = [p.clone() for p in trainer.raw_model.parameters()]
    init.on_train_start(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.raw_model.parameters(), strict=True))
    trainer.step = 0
    init.on_train_start(trainer)
    assert _logit_diff(hf_model, trainer.raw_model.eval()) <= 1e-5
    assert isinstance(init, InitFromHF)


def test_import_train_export_round_trip(hf_data, tokenizer, tmp_path, capsys):
    """Import -> train 20 steps -> export -> transformers loads it, with parity at each end."""
    hf_model = _tiny_hf("LlamaForCausalLM", 300)
    directory = _save(hf_model, tmp_path / "hf", tokenizer)
    assert tokenizer_digest(directory) == read_manifest(hf_data)["tokenizer"]["xxhash"]
    run = tmp_path / "run"
    sets = [
        f'data.dir="{hf_data}"',
        "train.steps=20",
        "train.threads=1",
        "optim.lr=1e-7",
        "log.progress=false",
    ]
    argv = ["train", "--config", str(TINY), "--run-dir", str(run), "--init-from", str(directory)]
    assert main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    trained = load_model(run, device="cpu").model
    assert trained.cfg.family == "llama" and trained.cfg.n_kv_heads == 1  # the HF config won over tiny.toml
    assert _logit_diff(hf_model, trained) <= 1e-3  # lr 1e-7: 20 steps move the imported weights by ~2e-6
    assert main(["export", str(run), "--format", "hf", "-o", str(tmp_path / "out")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert type(exported).__name__ == "LlamaForCausalLM"
    assert _logit_diff(exported, trained) <= 1e-5
    again = import_hf(tmp_path / "out").state_dict()
    assert all(torch.equal(again[k], v) for k, v in trained.state_dict().items())
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded("def f(x): pass")["input_ids"] == tokenizer.encode("def f(x): pass")
    reimported = load_hf_tokenizer(tmp_path / "out")  # the export's tokenizer.json, imported again
    assert reimported.token_bytes() == load_tokenizer(hf_data).token_bytes()  # <|endoftext|>: no bytes
    assert reimported.encode("x = '<|endoftext|>'") == tokenizer.encode("x = '<|endoftext|>'")


def test_prepare_refuses_a_directory_without_tokenizer_before_reading(corpus_dir, tmp_path, capsys):
    out = tmp_path / "data"
    argv = _prepare_from(corpus_dir, out, tmp_path)
    assert main(argv) != 0
    assert f"{tmp_path / BPE_FILE} is missing" in capsys.readouterr().err
    assert not out.exists()
