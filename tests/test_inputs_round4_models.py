"""Issue 47, models and tokenizers (items 3, 4, 5, 11, 14 and five of 15): a tokenizer that does not give back
the text, a config.json that says another model or sizes its weights do not have, a config.json that is no
small regular file, damaged weights, a shard linked from elsewhere, a model directory without its tokenizer,
added tokens' bytes, where an imported run's weights came from, and `tenx export`'s library warnings."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tenx.cli import main  # noqa: E402
from tenx.data.tokenizer import (  # noqa: E402
    BPE_FILE,
    BPETokenizer,
    check_round_trip,
    load_hf_tokenizer,
    train_bpe,
)
from tenx.errors import DataError, TenxError  # noqa: E402
from tenx.eval.documents import source_documents  # noqa: E402
from tenx.export.hf_import import import_hf, init_from_hf, read_hf_config  # noqa: E402
from tenx.train.config import CONFIG_DIR  # noqa: E402
from tenx.utils.io import file_xxhash  # noqa: E402

TINY = CONFIG_DIR / "tiny.toml"
FAST = ("train.steps=2", "checkpoint.every=0", "train.eval_every=0", "train.threads=1")
TEXTS = ["def F(x):\n    return X + 1  # ﬁne\n", "import json\nprint(json.dumps({'A': [1, 2]}))\n"] * 20


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXTS, 300)


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i, text in enumerate(TEXTS[:2]):
        (root / f"m{i}.py").write_text(text * 3)
    return root


def _tokenizer_dir(path, bpe, normalizer=None):
    spec = json.loads(bpe.to_json())
    if normalizer is not None:
        spec["normalizer"] = normalizer
    path.mkdir(parents=True, exist_ok=True)
    (path / BPE_FILE).write_text(json.dumps(spec))
    return path


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0], err
    return err[0]


def _prepare(source, out, tokenizer_dir):
    argv = ["data", "prepare", "--source", str(source), "--out", str(out), "--tokenizer-from"]
    return main([*argv, str(tokenizer_dir), "--val-ratio", "0.1", "--heldout-ratio", "0.1", "--quiet"])


# ----- item 3: a tokenizer that does not keep the text -----------------------------------------------------
@pytest.mark.parametrize(
    "normalizer, expected, got",
    [
        ({"type": "Lowercase"}, b"F(x):", b"f(x):"),
        ({"type": "NFKC"}, "ﬁne".encode(), b"fine"),
        ({"type": "Replace", "pattern": {"Regex": "[\\s\\S]"}, "content": ""}, b"def F", b""),
    ],
)
def test_prepare_refuses_a_tokenizer_that_changes_the_text(
    normalizer, expected, got, bpe, corpus, tmp_path, capsys
):
    tok = _tokenizer_dir(tmp_path / "tok", bpe, normalizer)
    out = tmp_path / "data"
    assert _prepare(corpus, out, tok) != 0
    line = _error_line(capsys)
    assert "does not give back the text" in line and "m0.py, byte " in line
    at = int(line.split("m0.py, byte ")[1].split(":")[0].replace(",", ""))
    text = (corpus / "m0.py").read_bytes()
    assert text[at:].startswith(expected)  # the offset is that of the first difference
    assert f"expected {text[at : at + 16]!r}, got {got!r}"[:-1] in line  # what the tokens gave back there
    assert not out.exists()  # refused before anything was written


def test_prepare_keeps_an_earlier_preparation_when_it_refuses(bpe, corpus, tmp_path, capsys):
    out = tmp_path / "data"
    assert _prepare(corpus, out, _tokenizer_dir(tmp_path / "good", bpe)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert _prepare(corpus, out, _tokenizer_dir(tmp_path / "lossy", bpe, {"type": "Lowercase"})) != 0
    assert "does not give back the text" in _error_line(capsys)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before


def test_eval_refuses_a_tokenizer_that_changes_the_text(bpe, corpus, tmp_path):
    lossy = load_hf_tokenizer(_tokenizer_dir(tmp_path / "tok", bpe, {"type": "Lowercase"}))
    with pytest.raises(DataError, match=r"m0.py, byte 4: expected b'F\(x\):") as e:
        source_documents(str(corpus), lossy)
    assert str(corpus) in str(e.value)
    docs = source_documents(str(corpus), load_hf_tokenizer(_tokenizer_dir(tmp_path / "good", bpe)))
    assert sum(d.num_bytes for d in docs) == sum(len(p.read_bytes()) for p in corpus.iterdir())


def test_round_trip_names_the_first_difference(bpe):
    with pytest.raises(DataError, match=r"doc, byte 3: expected b'D', got b'd'"):
        check_round_trip(bpe, [("doc", "abcD", bpe.encode("abcd"))], "here")
    check_round_trip(bpe, [("doc", text, None) for text in TEXTS], "here")  # tenx's own BPE keeps the text


# ----- item 15: WordLevel, Unigram and WordPiece are refused before anything is written ----------------------
@pytest.mark.parametrize("kind", ["WordLevel", "Unigram", "WordPiece"])
def test_non_bpe_tokenizers_are_refused_up_front(kind, corpus, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "a": 2}
    model = {
        "WordLevel": lambda: models.WordLevel(vocab=vocab, unk_token="[UNK]"),
        "Unigram": lambda: models.Unigram([(t, -1.0) for t in vocab], unk_id=1),
        "WordPiece": lambda: models.WordPiece(vocab=vocab, unk_token="[UNK]"),
    }[kind]()
    (tmp_path / "tok").mkdir()
    Tokenizer(model).save(str(tmp_path / "tok" / BPE_FILE))
    out = tmp_path / "data"
    assert _prepare(corpus, out, tmp_path / "tok") != 0
    assert f"model.type={kind}: tenx imports byte-level BPE tokenizers only" in _error_line(capsys)
    assert not out.exists()


# ----- item 15: added tokens that are not special count their bytes ------------------------------------------
def test_added_tokens_count_their_bytes(bpe, tmp_path):
    from tokenizers import AddedToken

    hf = load_hf_tokenizer(_tokenizer_dir(tmp_path / "tok", bpe))._hf
    hf.add_tokens(["<tag>", AddedToken(" two wörds", normalized=False)])
    tokenizer = BPETokenizer(hf)
    text = "a <tag> b two wörds c"
    ids = tokenizer.encode(text)
    pieces = tokenizer.token_bytes()
    assert b"".join(pieces[i] for i in ids) == text.encode()
    assert pieces[tokenizer.eot_id] == b""


# ----- HF directories ----------------------------------------------------------------------------------------
def _tiny_hf(arch: str, vocab: int = 128):
    torch.manual_seed(0)
    if arch == "GPT2LMHeadModel":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=2, n_positions=64)
    else:
        cls = transformers.Qwen3Config if arch == "Qwen3ForCausalLM" else transformers.LlamaConfig
        cfg = cls(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
            **({"head_dim": 32} if arch == "Qwen3ForCausalLM" else {}),
        )  # fmt: skip
    return getattr(transformers, arch)(cfg).eval()


def _hf_dir(path, arch="LlamaForCausalLM", vocab=128, tokenizer=None, **config):
    _tiny_hf(arch, vocab).save_pretrained(path)
    if config:
        raw = json.loads((path / "config.json").read_text()) | config
        (path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not ...}))
    if tokenizer is not None:
        (path / BPE_FILE).write_text(tokenizer.to_json())
    return path


# ----- item 4: model_type is what transformers builds -------------------------------------------------------
@pytest.mark.parametrize(
    "arch, config, field",
    [
        ("LlamaForCausalLM", {"model_type": "mistral", "sliding_window": 16}, "model_type"),
        ("Qwen3ForCausalLM", {"model_type": "llama"}, "model_type"),
        ("LlamaForCausalLM", {"model_type": ...}, "model_type"),
        ("LlamaForCausalLM", {"sliding_window": 16}, "sliding_window"),
        ("GPT2LMHeadModel", {"sliding_window": 8}, "sliding_window"),
    ],
)
def test_model_type_and_fields_must_be_the_architectures(arch, config, field, tmp_path):
    directory = _hf_dir(tmp_path, arch, **config)
    value = config.get(field)
    with pytest.raises(TenxError) as e:
        import_hf(directory)
    assert f"config.json: {field}={json.dumps(None if value is ... else value)}:" in str(e.value)


def test_a_window_as_long_as_the_context_is_full_attention(tmp_path):
    assert import_hf(_hf_dir(tmp_path, sliding_window=64)).cfg.family == "llama"


# ----- item 5: config.json a small regular file, its sizes the weights' ---------------------------------------
def test_config_json_must_be_a_small_regular_file(tmp_path):
    directory = _hf_dir(tmp_path / "hf")
    config = directory / "config.json"
    original = config.read_bytes()
    config.unlink()
    os.mkfifo(config)
    start = time.monotonic()
    with pytest.raises(TenxError, match="config.json: is a FIFO, not a regular file"):
        read_hf_config(directory)
    config.unlink()
    config.symlink_to("/dev/zero")
    with pytest.raises(TenxError, match="config.json: is a character device"):
        read_hf_config(directory)
    config.unlink()
    config.write_bytes(original[:-1] + b" " * (1 << 20) + b"}")
    with pytest.raises(TenxError, match="config.json: 1.0 MB, more than the 1.0 MB tenx reads"):
        read_hf_config(directory)
    config.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TenxError, match="cannot be read as JSON \\(nested too deeply\\)"):
        read_hf_config(directory)
    config.write_bytes(original.replace(b"1e-06", b"NaN"))
    with pytest.raises(TenxError, match="NaN is not a JSON number"):
        read_hf_config(directory)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    "arch, field, value, held",
    [
        ("LlamaForCausalLM", "hidden_size", 10**9, "64"),
        ("LlamaForCausalLM", "vocab_size", 10**9, "128"),
        ("LlamaForCausalLM", "num_hidden_layers", 10**6, "2"),
        ("LlamaForCausalLM", "intermediate_size", 10**9, "96"),
        ("GPT2LMHeadModel", "n_embd", 2**30, "64"),
        ("GPT2LMHeadModel", "n_layer", 10**6, "2"),
        ("GPT2LMHeadModel", "n_positions", 2**20, "64"),
    ],
)
def test_sizes_the_weights_do_not_have_are_refused_before_allocating(arch, field, value, held, tmp_path):
    directory = _hf_dir(tmp_path, arch, **{field: value, "head_dim": ...})
    start = time.monotonic()
    with pytest.raises(TenxError, match=f"config.json: {field}={value}: .* the weights have {held}"):
        import_hf(directory)
    assert time.monotonic() - start < 10


# ----- item 11 and item 15: damaged weights, a shard from elsewhere ----------------------------------------
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused_by_tensor(bad, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _hf_dir(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = bad
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TenxError) as e:
        import_hf(directory)
    message = str(e.value)
    assert "tensor model.layers.1.mlp.down_proj.weight holds 1 non-finite values" in message
    assert f"at [3, 5], is {bad}" in message and "tenx bug" not in message


def test_inf_weights_stop_an_init_from_run(bpe, corpus, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    data = tmp_path / "data"
    assert _prepare(corpus, data, _tokenizer_dir(tmp_path / "tok", bpe)) == 0
    directory = _hf_dir(tmp_path / "hf", vocab=300, tokenizer=load_hf_tokenizer(tmp_path / "tok"))
    tensors = load_file(directory / "model.safetensors")
    tensors["model.norm.weight"][0] = math.inf
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    argv = ["train", "--config", str(TINY), "--run-dir", str(tmp_path / "run"), "--init-from", str(directory)]
    assert main([*argv, "--set", f'data.dir="{data}"', *[x for s in FAST for x in ("--set", s)]]) != 0
    assert "tensor model.norm.weight holds 1 non-finite values" in capsys.readouterr().err


def test_a_shard_linked_from_outside_is_refused(tmp_path):
    directory = _hf_dir(tmp_path / "hf")
    elsewhere = tmp_path / "elsewhere.safetensors"
    (directory / "model.safetensors").rename(elsewhere)
    (directory / "model.safetensors").symlink_to(elsewhere)
    with pytest.raises(TenxError, match=f"a link to {elsewhere}, outside {directory}"):
        import_hf(directory)
    # a Hugging Face cache snapshot links to its blobs: that is the model's own file
    cache = tmp_path / "models--org--tiny"
    (cache / "blobs").mkdir(parents=True)
    snapshot = cache / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for p in directory.iterdir():
        blob = cache / "blobs" / p.name
        blob.write_bytes(p.read_bytes())
        (snapshot / p.name).symlink_to(blob)
    assert import_hf(snapshot).cfg.depth == 2


# ----- item 14 and item 15: the tokenizer must be the model's; where the weights came from ------------------
def test_a_model_directory_without_its_tokenizer_is_refused(tiny_config, tiny_data, tmp_path):
    directory = _hf_dir(tmp_path / "hf", vocab=300)
    with pytest.raises(TenxError, match=f"{directory} has no tokenizer.json"):
        init_from_hf(directory, tiny_config(tiny_data))
    argv = ["train", "--config", str(TINY), "--run-dir", str(tmp_path / "run"), "--init-from"]
    assert main([*argv, str(directory), "--set", f'data.dir="{tiny_data}"']) != 0
    assert not (tmp_path / "run").exists()


def test_run_json_records_where_the_weights_came_from(bpe, corpus, tmp_path):
    data = tmp_path / "data"
    assert _prepare(corpus, data, _tokenizer_dir(tmp_path / "tok", bpe)) == 0
    directory = _hf_dir(tmp_path / "hf", vocab=300, tokenizer=load_hf_tokenizer(tmp_path / "tok"))
    run = tmp_path / "run"
    argv = ["train", "--config", str(TINY), "--run-dir", str(run), "--init-from", str(directory)]
    assert main([*argv, "--set", f'data.dir="{data}"', *[x for s in FAST for x in ("--set", s)]]) == 0
    record = json.loads((run / "run.json").read_text())["init_from"]
    assert record["path"] == str(directory.resolve())
    assert record["architecture"] == "LlamaForCausalLM"
    names = ("config.json", "model.safetensors", BPE_FILE)
    assert record["xxhash"] == {n: file_xxhash(directory / n) for n in names}


# ----- item 15: `tenx export` prints its summary only --------------------------------------------------------
def test_export_prints_only_its_summary(tiny_config, tiny_data, tmp_path, capfd):
    from tenx.train.run import train

    run = tmp_path / "run"
    train(tiny_config(tiny_data, *FAST), run)
    capfd.readouterr()
    assert main(["export", str(run), "-o", str(tmp_path / "hf")]) == 0
    out, err = capfd.readouterr()
    assert err == "" and out.startswith("exported ")
