"""Start a run from a Hugging Face `transformers` model directory (`tenx train --init-from HF_DIR`).

The inverse of tenx/export/hf.py: a local directory holding GPT2LMHeadModel, LlamaForCausalLM or
Qwen3ForCausalLM becomes a tenx ModelConfig and the weights of a tenx Transformer. Nothing is downloaded and
no code of the directory runs: config.json is read as JSON and checked field by field (a model that tenx
cannot compute exactly is refused with the field and its value), the weights are read from safetensors only
(a pickle such as pytorch_model.bin is refused unread), `auto_map` (trust_remote_code) is refused, and the
tokenizer is its tokenizer.json read by `tokenizers`. The names and layouts are the export's
(tenx.export.hf.hf_state_dict, hf_architecture): every import is checked by exporting the loaded model again
in memory and comparing it with the directory's tensors, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import torch

from tenx.data.tokenizer import BPE_FILE, load_hf_tokenizer
from tenx.errors import TenxError
from tenx.export.hf import hf_architecture, hf_state_dict
from tenx.model.config import ModelConfig
from tenx.model.transformer import Transformer
from tenx.train.hooks import Callback, TrainerView
from tenx.utils.io import bytes_xxhash, file_xxhash, read_regular_file

ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM")
MODEL_TYPES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
"""The `model_type` of each architecture: what transformers builds the model from (AutoConfig)."""
CONFIG_LIMIT, INDEX_LIMIT = 1 << 20, 64 << 20
"""The most bytes tenx reads of config.json and of model.safetensors.index.json (published ones: a few KB,
and under 1 MB for the largest sharded models)."""
MAX_POSITIONS = 1 << 21
"""The longest context tenx imports (its RoPE tables are computed for the whole of it by import_hf)."""
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""GPT-2's tanh-approximated GELU (tenx's); plain "gelu" is the exact erf form, which tenx does not have."""
MODEL_FIELDS = (
    "family depth d_model n_heads n_kv_heads head_dim d_ff vocab_size norm pos mlp bias qk_norm "
    "tie_embeddings rope_theta norm_eps"
).split()
"""The ModelConfig fields an import sets (the HF config wins over a run config's); the others (seq_len of a
RoPE model, z_loss, init_std, dropout) stay the run's."""


@dataclasses.dataclass
class HFModel:
    """What config.json says, as tenx: the architecture, the ModelConfig fields and the context it allows."""

    directory: Path
    architecture: str
    fields: dict[str, Any]
    """ModelConfig values for MODEL_FIELDS (and seq_len for GPT-2, whose positions are learned)."""
    max_positions: int
    vocab_size: int
    """The HF vocabulary (tenx pads its own to a multiple of 64 with rows that are zero here)."""


def read_hf_config(hf_dir: str | Path) -> HFModel:
    """The tenx view of `hf_dir/config.json`; TenxError naming the field of anything tenx cannot represent."""
    directory = Path(hf_dir)
    path = directory / "config.json"
    if not directory.is_dir():
        raise TenxError(f"--init-from {directory}: not a directory (a local transformers model directory)")
    raw = _read_json(path, CONFIG_LIMIT)
    if not isinstance(raw, dict):
        raise TenxError(f"{path}: must hold a JSON object")

    def refuse(name: str, why: str) -> TenxError:
        return TenxError(f"{path}: {name}={json.dumps(raw.get(name))}: {why}; tenx refuses to import it")

    def get(name: str, kind: type, default: Any = ..., *, positive: bool = False) -> Any:
        value = raw.get(name, default)
        if value is ...:
            raise refuse(name, "missing")
        if value is None and default is None:  # optional, and null: the default applies
            return None
        ok = (
            isinstance(value, kind) and not isinstance(value, bool)
            if kind is not bool
            else type(value) is bool
        )
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok or (positive and not value > 0):
            raise refuse(name, f"must be a {'positive ' if positive else ''}{kind.__name__}")
        return value

    if "auto_map" in raw:
        raise refuse("auto_map", "it names Python code to run (trust_remote_code), which tenx never runs")
    arch = raw.get("architectures")
    if not (isinstance(arch, list) and len(arch) == 1 and arch[0] in ARCHITECTURES):
        raise refuse("architectures", f"tenx imports exactly one of {', '.join(ARCHITECTURES)}")
    arch = arch[0]
    if raw.get("model_type") != MODEL_TYPES[arch]:
        raise refuse(
            "model_type",
            f'transformers builds the model from model_type, and architectures=["{arch}"] is model_type '
            f"{json.dumps(MODEL_TYPES[arch])}: the directory does not say which model it is",
        )
    for name in ("rope_scaling", "sliding_window"):
        if raw.get(name) not in (None, False) and (name != "sliding_window" or raw.get("use_sliding_window")):
            raise refuse(name, "tenx computes plain RoPE over full causal attention only")
    if arch == "GPT2LMHeadModel":
        d, heads = get("n_embd", int, positive=True), get("n_head", int, positive=True)
        if get("activation_function", str, "gelu_new") not in GPT2_ACTIVATIONS:
            raise refuse("activation_function", f"tenx's GPT-2 MLP computes {' = '.join(GPT2_ACTIVATIONS)}")
        for name, wanted in (
            ("scale_attn_weights", True),
            ("scale_attn_by_inverse_layer_idx", False),
            ("add_cross_attention", False),
        ):
            if raw.get(name, wanted) is not wanted:
                raise refuse(name, f"tenx's attention is GPT-2's with {name}={json.dumps(wanted)}")
        inner = get("n_inner", int, None, positive=True)
        positions = get("n_positions", int, positive=True)
        fields: dict[str, Any] = dict(
            family="gpt2", depth=get("n_layer", int, positive=True), d_model=d, n_heads=heads,
            n_kv_heads=heads, d_ff=inner or 4 * d, norm="layernorm", pos="learned", mlp="gelu", bias=True,
            qk_norm=False, tie_embeddings=get("tie_word_embeddings", bool, True),
            norm_eps=get("layer_norm_epsilon", float, 1e-5, positive=True), seq_len=positions,
        )  # fmt: skip
    else:
        d, heads = get("hidden_size", int, positive=True), get("num_attention_heads", int, positive=True)
        if get("hidden_act", str, "silu") != "silu":
            raise refuse("hidden_act", "tenx's SwiGLU MLP gates with silu")
        for name in ("attention_bias", "mlp_bias"):
            if raw.get(name, False) is not False:
                raise refuse(name, "tenx's RoPE family has no biases in its linear layers")
        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
            raise refuse("rope_parameters", "tenx computes the default RoPE only (no scaling)")
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise refuse("rope_parameters", "rope_theta must be a positive number")
        if arch == "Qwen3ForCausalLM" and raw.get("layer_types") not in (
            None,
            ["full_attention"] * len(raw.get("layer_types") or []),
        ):
            raise refuse("layer_types", "tenx computes full attention in every layer")
        positions = get("max_position_embeddings", int, positive=True)
        fields = dict(
            family="llama", depth=get("num_hidden_layers", int, positive=True), d_model=d, n_heads=heads,
            n_kv_heads=get("num_key_value_heads", int, heads, positive=True),
            d_ff=get("intermediate_size", int, positive=True), norm="rmsnorm", pos="rope", mlp="swiglu",
            bias=False, qk_norm=arch == "Qwen3ForCausalLM",
            tie_embeddings=get("tie_word_embeddings", bool, False),
            norm_eps=get("rms_norm_eps", float, 1e-6, positive=True), rope_theta=float(theta),
        )  # fmt: skip
        if heads and d % heads == 0 and get("head_dim", int, d // heads, positive=True) != d // heads:
            raise refuse(
                "head_dim", f"tenx's heads are hidden_size / num_attention_heads = {d // heads} wide"
            )
    if d % heads or (d // heads) % 2:
        raise refuse("num_attention_heads" if arch != "GPT2LMHeadModel" else "n_head",
                     f"the width {d} must split into heads of an even width")  # fmt: skip
    if fields["n_heads"] % fields["n_kv_heads"]:
        raise refuse("num_key_value_heads", f"must divide num_attention_heads={heads}")
    vocab = get("vocab_size", int, positive=True)
    window = raw.get("sliding_window")
    if arch != "Qwen3ForCausalLM" and isinstance(window, int) and not isinstance(window, bool):
        if window < positions:  # Qwen3 has the field (use_sliding_window, above); these never did
            raise refuse("sliding_window", f"{arch} attends over the whole context, {positions} positions")
    if positions > MAX_POSITIONS:
        name = "n_positions" if arch == "GPT2LMHeadModel" else "max_position_embeddings"
        raise refuse(name, f"more than the {MAX_POSITIONS:,} positions tenx imports")
    fields.update(head_dim=d // heads, vocab_size=vocab)
    fields.setdefault("rope_theta", 10000.0)
    hf = HFModel(directory, arch, fields, positions, vocab)
    _check_sizes(hf, refuse)
    return hf


def _read_json(path: Path, limit: int) -> Any:
    """A small JSON file of a model directory: a regular file of at most `limit` bytes (a FIFO or a link to
    /dev/zero is refused unread), plain JSON (no NaN or Infinity, nesting Python can parse); TenxError else."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    data = read_regular_file(path, limit)
    try:
        return json.loads(data.decode("utf-8"), parse_constant=constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; RecursionError: nesting
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise TenxError(f"{path}: cannot be read as JSON ({reason})") from None


def _check_sizes(hf: HFModel, refuse: Any) -> None:
    """Refuse, naming the config.json field, sizes that the weights do not have, before anything of the
    model's size is allocated: the embedding's rows and width (vocab_size, hidden_size), the number of layers,
    the MLP's width and GPT-2's positions, read from the safetensors headers (no tensor is read)."""
    shapes = _hf_names(read_hf_shapes(hf.directory), hf.architecture)
    f, gpt2 = hf.fields, hf.architecture == "GPT2LMHeadModel"
    prefix = "transformer.h." if gpt2 else "model.layers."
    embedding = shapes.get("transformer.wte.weight" if gpt2 else "model.embed_tokens.weight")
    layers = {int(n[len(prefix) :].split(".")[0]) for n in shapes if n.startswith(prefix)
              and n[len(prefix) :].split(".")[0].isdigit()}  # fmt: skip
    mlp = shapes.get(f"{prefix}0.mlp.c_fc.weight" if gpt2 else f"{prefix}0.mlp.gate_proj.weight")
    d_ff = mlp and (mlp[-1] if gpt2 else mlp[0])
    checks = [
        ("vocab_size", hf.vocab_size, embedding and embedding[0], "rows of the token embedding"),
        ("n_embd" if gpt2 else "hidden_size", f["d_model"], embedding and embedding[-1], "embedding width"),
        ("n_layer" if gpt2 else "num_hidden_layers", f["depth"], len(layers), "layers"),
        ("n_inner" if gpt2 else "intermediate_size", f["d_ff"], d_ff, "MLP width"),
    ]
    if gpt2:
        positions = shapes.get("transformer.wpe.weight")
        checks.append(("n_positions", hf.max_positions, positions and positions[0], "position embeddings"))
    for name, wanted, held, what in checks:
        if held is None:
            continue  # a tensor that is missing: load_hf_weights names it
        if wanted != held:
            raise refuse(name, f"it makes {wanted:,} {what} but the weights have {held:,}")


def model_config(hf: HFModel, base: ModelConfig | None = None) -> ModelConfig:
    """`base` (a run's model section; default: ModelConfig() over the model's whole context) with the
    imported fields; TenxError if its seq_len is above the model's max_position_embeddings."""
    cfg = dataclasses.replace(base or ModelConfig(seq_len=hf.max_positions), **hf.fields)
    if cfg.seq_len > hf.max_positions:
        raise TenxError(
            f"model.seq_len={cfg.seq_len} is longer than {hf.directory / 'config.json'}'s "
            f"max_position_embeddings={hf.max_positions}; set model.seq_len <= {hf.max_positions}"
        )
    cfg.validate()
    arch = hf_architecture(cfg.resolved())
    assert arch == hf.architecture, (arch, hf.architecture)
    return cfg


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Each tensor's safetensors file (from the index when sharded); refuses pickles, names outside the
    directory and files that are links to outside it."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = _read_json(index, INDEX_LIMIT)["weight_map"]
            assert isinstance(weight_map, dict)
        except (KeyError, TypeError, AssertionError) as e:
            raise TenxError(f"{index}: no readable weight_map ({type(e).__name__}: {e})") from None
        files: dict[str, Path] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or "/" in file or "\\" in file or not file.endswith(".safetensors"):
                raise TenxError(
                    f"{index}: weight_map[{name!r}]={file!r}: not a .safetensors file of {directory}"
                )
            files[name] = directory / file
        for path in set(files.values()):
            _check_inside(directory, path)
        return files
    if (directory / SAFETENSORS).is_file():
        _check_inside(directory, directory / SAFETENSORS)
        return {}  # one file: names read from it
    found = [p for p in PICKLES if (directory / p).exists()]
    raise TenxError(
        f"{directory} holds no {SAFETENSORS} (nor {SAFETENSORS_INDEX})"
        + (f" but {', '.join(found)}, which tenx does not read: unpickling can run any code" if found else "")
        + "; save the model with save_pretrained(..., safe_serialization=True) or convert it to safetensors"
    )


def _check_inside(directory: Path, path: Path) -> None:
    """TenxError unless the weight file `path` (links followed) lies in `directory`, or is the blob that a
    Hugging Face cache snapshot (models--ORG--NAME/snapshots/REV/FILE) links to (models--ORG--NAME/blobs/)."""
    target, root = path.resolve(), directory.resolve()
    cache = root.parent.name == "snapshots" and target.parent == root.parent.parent / "blobs"
    if not (target.is_relative_to(root) or cache):
        raise TenxError(
            f"{path}: a link to {target}, outside {directory}: tenx reads a model directory's own weight files "
            "only; copy the file into the directory"
        )


def _weight_paths(directory: Path) -> tuple[dict[str, Path] | None, list[Path]]:
    """The index's tensor -> file map (None for one model.safetensors) and the files to read, checked."""
    files = _tensor_files(directory) or None
    return files, sorted(set(files.values())) if files else [directory / SAFETENSORS]


def read_hf_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, read from the safetensors headers only (nothing of the tensors is read)."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, tuple[int, ...]] = {}
    for path in _weight_paths(directory)[1]:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is no dict
                    out[name] = tuple(f.get_slice(name).get_shape())
        except (OSError, SafetensorError) as e:
            raise TenxError(f"{path}: not a readable safetensors file ({e})") from None
    return out


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors file(s), as fp32, with the file checked for each."""
    from safetensors import SafetensorError, safe_open

    files, paths = _weight_paths(directory)
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is no dict
                    if files is not None and files.get(name) != path:
                        raise TenxError(f"{path}: tensor {name} is not listed for it in {SAFETENSORS_INDEX}")
                    dtype = f.get_slice(name).get_dtype()
                    if dtype not in DTYPES:
                        raise TenxError(
                            f"{path}: tensor {name} has dtype {dtype}; tenx imports {', '.join(DTYPES)}"
                        )
                    out[name] = f.get_tensor(name).to(torch.float32)
        except (OSError, SafetensorError) as e:
            raise TenxError(f"{path}: not a readable safetensors file ({e})") from None
    if files is not None and set(files) - set(out):
        raise TenxError(
            f"{directory / SAFETENSORS_INDEX} lists tensors that no file holds: "
            f"{sorted(set(files) - set(out))[:4]}"
        )
    return out


def _check_finite(path: Path, name: str, tensor: torch.Tensor) -> None:
    """TenxError naming the tensor, its first non-finite value and how many it holds."""
    bad = ~torch.isfinite(tensor)
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise TenxError(
            f"{path}: tensor {name} holds {int(bad.sum()):,} non-finite values (the first, at {list(at)}, "
            f"is {float(tensor[at])}): the weights are damaged; tenx refuses to train from them"
        )


def _hf_names(tensors: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """GPT-2 files saved without the `transformer.` prefix (the hub's gpt2) get it; its causal-mask buffers
    (attn.bias, attn.masked_bias: no weights) are dropped."""
    if arch != "GPT2LMHeadModel":
        return tensors
    return {
        n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}": t
        for n, t in tensors.items()
        if not n.endswith((".attn.bias", ".attn.masked_bias"))
    }


@torch.no_grad()
def load_hf_weights(model: Transformer, hf: HFModel, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Fill `model` (built from model_config(hf)) with the directory's weights, in place.

    Every tensor must be one the export names for this model, of its shape (the vocabulary rows excepted: tenx
    pads them with zeros to a multiple of 64); none may be missing. Checked afterwards by exporting `model`
    again (tenx.export.hf.hf_state_dict) and comparing with the directory's tensors bit for bit.
    """
    arch, cfg, where = hf.architecture, model.cfg, hf.directory
    found = _hf_names(read_hf_tensors(where) if tensors is None else dict(tensors), arch)
    for name, t in found.items():  # a run from them would skip every step
        _check_finite(where, name, t)
    expected = {n: tuple(t.shape) for n, t in hf_state_dict(model, arch).items()}
    vocab_rows = {"transformer.wte.weight", "model.embed_tokens.weight", "lm_head.weight"}
    padded = cfg.vocab_size or 0
    if cfg.tie_embeddings:
        head = found.pop("lm_head.weight", None)
        embedding = found.get("transformer.wte.weight", found.get("model.embed_tokens.weight"))
        if head is not None and (embedding is None or not torch.equal(head, embedding)):
            raise TenxError(
                f"{where}: tie_word_embeddings is true but lm_head.weight differs from the embedding"
            )
        expected.pop("lm_head.weight")
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        raise TenxError(
            f"{where}: the weights are not those of its config.json's {arch} (missing {missing[:4]}, "
            f"unexpected {extra[:4]})"
        )
    for name, shape in expected.items():
        want = (hf.vocab_size, *shape[1:]) if name in vocab_rows else shape
        if tuple(found[name].shape) != want:
            raise TenxError(
                f"{where}: tensor {name} has shape {list(found[name].shape)}, "
                f"config.json implies {list(want)}"
            )

    def rows(name: str) -> torch.Tensor:  # the vocabulary padded with zero rows, as tenx's is
        t = found[name]
        return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])

    def put(param: Any, value: torch.Tensor) -> None:
        param.copy_(value)

    blocks: list[Any] = list(model.blocks)
    if arch == "GPT2LMHeadModel":

        def norm(m: Any, name: str) -> None:
            put(m.weight, found[f"{name}.weight"])
            put(m.bias, found[f"{name}.bias"])

        def conv1d(m: torch.nn.Linear, name: str) -> None:  # Conv1D stores (in, out)
            put(m.weight, found[f"{name}.weight"].t())
            put(m.bias, found[f"{name}.bias"])

        put(model.tok_emb.weight, rows("transformer.wte.weight"))
        assert model.pos_emb is not None
        put(model.pos_emb.weight, found["transformer.wpe.weight"])
        for i, b in enumerate(blocks):
            p = f"transformer.h.{i}"
            norm(b.attn_norm, f"{p}.ln_1")
            conv1d(b.attn.qkv_proj, f"{p}.attn.c_attn")
            conv1d(b.attn.out_proj, f"{p}.attn.c_proj")
            norm(b.mlp_norm, f"{p}.ln_2")
            conv1d(b.mlp.up_proj, f"{p}.mlp.c_fc")
            conv1d(b.mlp.down_proj, f"{p}.mlp.c_proj")
        norm(model.final_norm, "transformer.ln_f")
    else:
        put(model.tok_emb.weight, rows("model.embed_tokens.weight"))
        for i, b in enumerate(blocks):
            p = f"model.layers.{i}"
            put(b.attn_norm.weight, found[f"{p}.input_layernorm.weight"])
            qkv = [found[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"]
            put(b.attn.qkv_proj.weight, torch.cat(qkv))
            put(b.attn.out_proj.weight, found[f"{p}.self_attn.o_proj.weight"])
            if b.attn.q_norm is not None:
                put(b.attn.q_norm.weight, found[f"{p}.self_attn.q_norm.weight"])
                put(b.attn.k_norm.weight, found[f"{p}.self_attn.k_norm.weight"])
            put(b.mlp_norm.weight, found[f"{p}.post_attention_layernorm.weight"])
            gate_up = [found[f"{p}.mlp.{x}_proj.weight"] for x in ("gate", "up")]
            put(b.mlp.up_proj.weight, torch.cat(gate_up))
            put(b.mlp.down_proj.weight, found[f"{p}.mlp.down_proj.weight"])
        put(model.final_norm.weight, found["model.norm.weight"])
    if not cfg.tie_embeddings:
        put(model.lm_head.weight, rows("lm_head.weight"))
    again = hf_state_dict(model, arch)
    for name, t in found.items():
        if not torch.equal(again[name][: t.shape[0]], t):
            raise TenxError(
                f"{where}: tensor {name} does not survive the export mapping: "
                "please report this as a tenx bug"
            )


def import_hf(hf_dir: str | Path, base: ModelConfig | None = None) -> Transformer:
    """A tenx Transformer (fp32, CPU, eval mode) with the weights of `hf_dir`: the import's Python API."""
    hf = read_hf_config(hf_dir)
    model = Transformer(model_config(hf, base).resolved())
    load_hf_weights(model, hf)
    return model.eval()


def tokenizer_digest(hf_dir: str | Path) -> str:
    """The xxhash a data directory prepared with `--tokenizer-from hf_dir` records for its tokenizer."""
    return bytes_xxhash(load_hf_tokenizer(hf_dir).to_json().encode("utf-8"))


class InitFromHF(Callback):
    """Loads a model directory's weights into the run's model before step 1 (a resumed run keeps its own)."""

    name = "init-from-hf"

    def __init__(self, hf: HFModel) -> None:
        self.hf = hf
        self._provenance: dict[str, Any] | None = None

    def provenance(self) -> dict[str, Any]:
        """run.json's `init_from`: the directory, its architecture and the xxhash of each file the run's
        weights and tokenizer came from (computed once, by the rank that writes run.json)."""
        if self._provenance is None:
            where = self.hf.directory
            files = [where / "config.json", *_weight_paths(where)[1], where / BPE_FILE]
            files += [where / SAFETENSORS_INDEX] if (where / SAFETENSORS_INDEX).is_file() else []
            self._provenance = {
                "init_from": {
                    "path": str(where.resolve()),
                    "architecture": self.hf.architecture,
                    "xxhash": {p.name: file_xxhash(p) for p in sorted(files) if p.is_file()},
                }
            }
        return self._provenance

    def on_train_start(self, trainer: TrainerView) -> None:
        if trainer.step:  # resumed from a checkpoint: the weights are the run's own by now
            return
        if trainer.replicas is not None:  # they took their reference copy of the weights when attached
            raise TenxError("--init-from: not with replica groups (parallel.replicas) yet")
        raw: torch.nn.Module = trainer.raw_model
        source = Transformer(raw.cfg)  # type: ignore[arg-type]
        load_hf_weights(source, self.hf)
        full = dict(source.named_parameters())
        with torch.no_grad():
            for name, param in raw.named_parameters():
                value = full[name].to(param.device)
                if hasattr(param, "device_mesh"):  # an FSDP2 shard (DTensor): this rank's part of it
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value, param.device_mesh, param.placements)
                param.copy_(value)
        trainer.state_replaced(self.name)  # what callbacks recorded of the weights (digests) is stale


def init_from_hf(hf_dir: str | Path, cfg: Any) -> tuple[InitFromHF, list[str]]:
    """For `tenx train --init-from`: the callback that loads the weights and the `model.*` overrides that make
    the run config `cfg` (a RunConfig) the directory's model. The run's data must be tokenized by the
    directory's tokenizer (prepared with `--tokenizer-from`); a mismatch is a TenxError naming both."""
    from tenx.data.manifest import read_manifest

    hf = read_hf_config(hf_dir)
    model = model_config(hf, cfg.model)
    entry = read_manifest(cfg.data.dir)["tokenizer"]
    data = f"the data in {cfg.data.dir} ({entry.get('kind')}, vocabulary {entry.get('vocab_size')})"
    tokenizer = hf.directory / BPE_FILE
    if not tokenizer.exists() and not tokenizer.is_symlink():
        raise TenxError(
            f"{hf.directory} has no {BPE_FILE}, so nothing shows that {data} was tokenized the way the model "
            f"was trained: put the model's {BPE_FILE} in {hf.directory} and prepare the data with "
            f"`tenx data prepare ... --tokenizer-from {shlex.quote(str(hf.directory))}`"
        )
    if entry.get("xxhash") != tokenizer_digest(hf.directory):
        raise TenxError(
            f"{data} was not tokenized with {tokenizer}: prepare it again with "
            f"`tenx data prepare ... --tokenizer-from {shlex.quote(str(hf.directory))}`"
        )
    fields = [*MODEL_FIELDS, "seq_len"]
    return InitFromHF(hf), [f"model.{k}={json.dumps(getattr(model, k))}" for k in fields]
