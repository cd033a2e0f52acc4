"""`tenx export --format hf`: the exported transformers model gives tenx's logits, its tokenizer tenx's ids,
unrepresentable models are refused by field, and an export never overwrites a user's files."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tenx.checkpoint.models import load_model  # noqa: E402
from tenx.data.prepare.pipeline import PrepareConfig, prepare  # noqa: E402
from tenx.data.tokenizer import EOT_TEXT, load_tokenizer  # noqa: E402
from tenx.errors import TenxError  # noqa: E402
from tenx.eval.sample import generate  # noqa: E402
from tenx.export.hf import MARKER, export_hf, format_export_summary, hf_architecture  # noqa: E402
from tenx.model import ModelConfig  # noqa: E402
from tenx.train.run import train  # noqa: E402

TEXTS = [
    "def parse_args(argv=None):\n    return {'x': 1}\n",
    "  tabs\tand\r\nnewlines, café, 東京 🚀",
    f"a literal {EOT_TEXT} stays text",
]
OLD_FAST_TOKENIZERS = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (4, 42)
FAST = ("train.steps=2", "checkpoint.every=0", "train.eval_every=0", "train.threads=1")


@pytest.fixture(scope="module")
def bpe_data(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export-data") / "bpe"
    prepare(
        PrepareConfig(source=str(corpus_dir), out=str(out), tokenizer="bpe", vocab_size=300), progress=False
    )
    return out


@pytest.fixture(scope="module")
def make_run(tiny_config, tmp_path_factory):
    """A function: a tiny run trained for two steps (cached by its arguments)."""
    made: dict[tuple, object] = {}

    def make(data_dir, family: str, *overrides: str):
        key = (str(data_dir), family, overrides)
        if key not in made:
            run = tmp_path_factory.mktemp("export-run") / "run"
            train(tiny_config(data_dir, f'model.family="{family}"', *FAST, *overrides), run)
            made[key] = run
        return made[key]

    return make


def _max_logit_diff(run, out) -> float:
    model = load_model(run, device="cpu").model
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    vocab = model.cfg.vocab_size or 0  # the padded vocabulary: padding ids' logits must match too
    ids = torch.randint(0, vocab, (3, model.cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (hf(input_ids=ids).logits - model(ids)).abs().max().item()


def _same_greedy_continuation(run, out, prompt, ours) -> None:
    model = load_model(run, device="cpu").model
    expected = generate(model, prompt, 20, temperature=0, stop_id=ours.eot_id, vocab_size=ours.vocab_size)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert hf.generation_config.suppress_tokens == list(range(ours.vocab_size, model.cfg.vocab_size or 0))
    got = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt) :].tolist()
    assert [t for t in got if t != ours.eot_id] == expected


VARIANTS = [
    ("gpt2", (), "GPT2LMHeadModel"),
    ("llama", (), "LlamaForCausalLM"),
    ("gpt2", ("model.bias=false", "model.tie_embeddings=false"), "GPT2LMHeadModel"),
    (
        "llama",
        ("model.n_kv_heads=1", "model.tie_embeddings=true", "model.rope_theta=500.0"),
        "LlamaForCausalLM",
    ),
    ("llama", ("model.qk_norm=true", "model.n_kv_heads=1"), "Qwen3ForCausalLM"),
]


@pytest.mark.parametrize(
    "family,overrides,arch", VARIANTS, ids=lambda v: "-".join(v) if isinstance(v, tuple) else v
)
def test_export_matches_tenx_logits_and_ids(family, overrides, arch, make_run, tiny_data, bpe_data, tmp_path):
    if not hasattr(transformers, arch):
        pytest.skip(f"transformers {transformers.__version__} has no {arch}")
    data = bpe_data if family == "llama" else tiny_data  # both tokenizer kinds
    run = make_run(data, family, *overrides)
    out = tmp_path / "hf"
    summary = export_hf(run, out)
    assert summary["architecture"] == arch, summary
    assert (out / "model.safetensors").is_file() and "(step 2)" in format_export_summary(summary)

    diff = _max_logit_diff(run, out)
    print(f"{arch} {overrides}: max |logits_hf - logits_tenx| = {diff:.3g}")
    assert diff <= 1e-5

    cfg = load_model(run, device="cpu").model.cfg
    hc = transformers.AutoConfig.from_pretrained(out)
    assert hc.architectures == [arch] and hc.vocab_size == cfg.vocab_size
    assert hc.tie_word_embeddings == cfg.tie_embeddings
    if arch == "GPT2LMHeadModel":
        assert (hc.n_embd, hc.n_layer, hc.n_head, hc.n_inner) == (
            cfg.d_model,
            cfg.depth,
            cfg.n_heads,
            cfg.d_ff,
        )
        assert (hc.n_positions, hc.layer_norm_epsilon) == (cfg.seq_len, cfg.norm_eps)
    else:
        assert (hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers) == (
            cfg.d_model,
            cfg.d_ff,
            cfg.depth,
        )
        assert (hc.num_attention_heads, hc.num_key_value_heads) == (cfg.n_heads, cfg.n_kv_heads)
        assert (hc.rms_norm_eps, hc.max_position_embeddings) == (cfg.norm_eps, cfg.seq_len)
        theta = getattr(hc, "rope_theta", None) or hc.rope_parameters["rope_theta"]
        assert theta == cfg.rope_theta
        assert json.loads((out / "config.json").read_text())["rope_theta"] == cfg.rope_theta

    marker = json.loads((out / MARKER).read_text())
    assert marker["step"] == 2 and marker["source_run"] == str(run.resolve())
    assert marker["checkpoint"].endswith("step_00000002") and marker["tenx_version"]

    if OLD_FAST_TOKENIZERS:  # they match a literal EOT_TEXT inside text: the tokenizer is left out, and why
        assert summary["tokenizer"] is None and "transformers>=4.42" in summary["tokenizer_note"]
        return
    assert summary["tokenizer"] == ("bpe" if data == bpe_data else "bytes"), summary
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(data)
    if arch == "GPT2LMHeadModel":  # greedy generation, padding ids suppressed, stops at EOT: as `tenx sample`
        _same_greedy_continuation(run, out, [ours.eot_id, *ours.encode("def ")], ours)
    for text in TEXTS:
        assert tok(text)["input_ids"] == ours.encode(text)
        assert tok.decode(ours.encode(text)) == text
    assert tok.eos_token == EOT_TEXT and tok.eos_token_id == ours.eot_id == hc.eos_token_id


def test_refusals_name_the_field():
    def refusal(**fields) -> str:
        with pytest.raises(TenxError) as e:
            hf_architecture(ModelConfig(depth=1, **fields).resolved(300))
        return str(e.value)

    assert "model.bias=true" in refusal(family="llama", bias=True)
    assert 'model.norm="layernorm"' in refusal(family="llama", norm="layernorm")
    assert 'model.mlp="gelu"' in refusal(family="llama", mlp="gelu")
    assert 'model.norm="rmsnorm"' in refusal(family="gpt2", norm="rmsnorm")
    assert 'model.mlp="swiglu"' in refusal(family="gpt2", mlp="swiglu")
    assert "model.qk_norm=true" in refusal(family="gpt2", qk_norm=True)
    assert "model.n_kv_heads=1" in refusal(family="gpt2", d_model=128, n_kv_heads=1)
    assert hf_architecture(ModelConfig(family="llama", z_loss=1e-4).resolved(300)) == "LlamaForCausalLM"


def test_unrepresentable_run_is_refused_and_writes_nothing(make_run, tiny_data, tmp_path):
    run = make_run(tiny_data, "llama", "model.bias=true")
    with pytest.raises(TenxError, match="model.bias=true"):
        export_hf(run, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_foreign_dir_is_refused_and_unchanged_previous_export_replaced(make_run, tiny_data, tmp_path):
    run = make_run(tiny_data, "gpt2")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(TenxError, match="not a tenx export") as e:
        export_hf(run, foreign)
    assert str(foreign) in str(e.value)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and (
        foreign / "notes.txt"
    ).read_text() == "keep me"

    out = tmp_path / "hf"
    export_hf(run, out)
    (out / "model.safetensors").write_bytes(b"stale")  # the second export replaces every file
    export_hf(run, out)
    assert _max_logit_diff(run, out) <= 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]  # no temporary dirs left

    (out / "README.md").write_text("my notes")  # a file the export did not write: not ours to delete
    with pytest.raises(TenxError, match="README.md"):
        export_hf(run, out)
    assert (out / "README.md").read_text() == "my notes"


def test_missing_data_dir_exports_model_without_tokenizer(tiny_config, tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    train(tiny_config(data, *FAST), tmp_path / "run")
    shutil.rmtree(data)
    summary = export_hf(tmp_path / "run", tmp_path / "hf")
    assert summary["tokenizer"] is None and str(data) in summary["tokenizer_note"]
    assert "tokenizer: not written" in format_export_summary(summary)
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert _max_logit_diff(tmp_path / "run", tmp_path / "hf") <= 1e-5


def test_checkpoint_option_picks_an_older_step(tiny_config, tiny_data, tmp_path):
    train(tiny_config(tiny_data, *FAST, "checkpoint.every=1"), tmp_path / "run")
    summary = export_hf(tmp_path / "run", tmp_path / "hf", checkpoint="step_00000001")
    assert summary["step"] == 1 and summary["checkpoint"].endswith("step_00000001")
    with pytest.raises(TenxError, match="step_00000009"):
        export_hf(tmp_path / "run", tmp_path / "hf2", checkpoint="step_00000009")


def test_missing_transformers_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(TenxError, match=r'pip install -e "\.\[hf\]"'):
        export_hf(tmp_path, tmp_path / "hf")


def test_cli_export(make_run, tiny_data, tmp_path, capsys):
    from tenx.cli import build_parser, main

    if "export" not in build_parser().format_help():
        pytest.skip("tenx/cli.py has no `export` subcommand yet")
    run = make_run(tiny_data, "gpt2")
    assert main(["export", str(run), "--format", "hf", "-o", str(tmp_path / "hf")]) == 0
    assert "GPT2LMHeadModel" in capsys.readouterr().out
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("x")
    assert main(["export", str(run), "--format", "hf", "-o", str(tmp_path / "mine")]) == 2
    assert "tenx: error:" in capsys.readouterr().err
