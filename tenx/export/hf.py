"""Export a checkpoint as a Hugging Face `transformers` model directory (`tenx export RUN --format hf -o DIR`).

The model is rebuilt as a standard class whose forward pass is the same math as tenx's, so evaluation and
serving tools that read `transformers` models run it unchanged:

    gpt2-style (LayerNorm, learned positions, GELU)          -> GPT2LMHeadModel
    llama-style (RMSNorm, RoPE, SwiGLU, no biases)            -> LlamaForCausalLM
    llama-style with qk_norm                                  -> Qwen3ForCausalLM

A combination no standard class represents exactly is refused with an error naming the field, never
approximated. Every export is checked before it is published: the written directory is loaded back with
`transformers` and its logits are compared with tenx's on the same token ids. The tokenizer of the run's data
directory is written beside the model and checked the same way (same ids as tenx on sample texts).

The directory is built in a temporary sibling and renamed into place; `-o DIR` must be new, empty, or a
previous tenx export (marked by `tenx_export.json`) holding nothing but what that export wrote.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch

import tenx
from tenx import checkpoint as ckpt
from tenx import config as cfglib
from tenx import rundir
from tenx.checkpoint.models import ensemble_member, load_model, resolve_checkpoint
from tenx.data.tokenizer import EOT_TEXT, BPETokenizer, Tokenizer, load_tokenizer
from tenx.errors import ConfigError, DataError, TenxError
from tenx.model.config import ModelConfig
from tenx.model.transformer import Block, Transformer
from tenx.utils.io import FILE_MODE, atomic_write_json, publish_dir, staging_dir

MARKER = "tenx_export.json"
"""The file that marks a directory as a tenx export (and so safe to replace with a newer one)."""
MARKER_KIND = "tenx-export"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
FORMATS = ("hf",)
INSTALL_HINT = 'pip install -e ".[hf]"'

CHECK_TOKENS = 64
"""Tokens per row of the logit check run on every export (RoPE tables agree best at short positions)."""
CHECK_RTOL = 1e-4
"""An export is refused when max |logits_hf - logits_tenx| > CHECK_RTOL * max(1, max |logits_tenx|)."""
TOKENIZER_SAMPLES = (
    "def parse_args(argv=None):\n    return {'x': 1, \"y\": [2.5, -3]}\n",
    "  leading spaces,\ttabs\tand\r\nnewlines\n\n\nend",
    "Unicode: café, naïve, 東京, emoji 🚀, math ∑ x² ≤ ∞",
    f"a literal {EOT_TEXT} inside a document stays text",
    "",
)


def hf_architecture(cfg: ModelConfig) -> str:
    """The `transformers` class that computes exactly what a model of `cfg` computes; TenxError if none does.

    `cfg` must be resolved. The message names the first field whose value no standard class represents.
    """

    def refuse(name: str, why: str) -> TenxError:
        value = json.dumps(getattr(cfg, name))
        return TenxError(
            f"model.{name}={value}: no standard transformers class computes this model exactly: {why}. "
            "Refusing to write a model whose logits would differ from tenx's (docs/export.md lists the "
            "combinations that export)"
        )

    if cfg.pos == "learned":  # GPT2LMHeadModel: LayerNorm, learned positions, GELU (tanh), fused QKV
        if cfg.norm != "layernorm":
            raise refuse("norm", "GPT2LMHeadModel, the class with learned positions, uses LayerNorm")
        if cfg.mlp != "gelu":
            raise refuse("mlp", "GPT2LMHeadModel, the class with learned positions, has a GELU MLP")
        if cfg.qk_norm:
            raise refuse("qk_norm", "GPT2LMHeadModel has no query/key norm")
        if cfg.n_kv_heads != cfg.n_heads:
            raise refuse(
                "n_kv_heads", f"GPT2LMHeadModel has no grouped-query attention (n_heads={cfg.n_heads})"
            )
        return "GPT2LMHeadModel"
    if cfg.norm != "rmsnorm":
        raise refuse("norm", "the RoPE classes (Llama, Qwen3) use RMSNorm without a bias")
    if cfg.mlp != "swiglu":
        raise refuse("mlp", "the RoPE classes (Llama, Qwen3) have a SwiGLU MLP")
    if cfg.bias:
        raise refuse(
            "bias",
            "tenx's RMSNorm layers then carry learned biases, which the RMSNorm of Llama and Qwen3 cannot "
            "hold; their attention_bias and mlp_bias cover only the linear layers",
        )
    return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"


def export_hf(
    target: str | Path, out: str | Path, checkpoint: str | Path | None = None, member: int | None = None
) -> dict[str, Any]:
    """Write the model of `target` (a run directory's newest verified checkpoint, or a checkpoint directory;
    `checkpoint` picks another; `member` K: member K of the ensemble `target`, which is refused without
    one) as a `transformers` model directory `out`; returns a summary.

    The summary holds `out`, `architecture`, `checkpoint`, `step`, `params`, `max_abs_logit_diff` (exported
    model against tenx's, measured on the written files), `tokenizer` ("bpe", "bytes" or None) and
    `tokenizer_note` (why no tokenizer was written, or None), `files`.
    """
    transformers = _import_transformers()
    out = Path(out)
    check_output_dir(out)  # before any work: a refusal costs nothing (checked again before publishing)
    path, run_dir = _pick_checkpoint(ensemble_member(target, member), checkpoint)
    meta = ckpt.read_checkpoint_meta(path, require=("model",))
    try:
        recorded = cfglib.from_dict(ModelConfig, meta["model"], "model")
        recorded = recorded.resolved(recorded.vocab_size or 64)  # family defaults filled in
    except ConfigError as e:
        raise TenxError(f"checkpoint {path}: its model config is invalid: {e}") from None
    arch = hf_architecture(recorded)  # refuse before the weights are read
    if not hasattr(transformers, arch):
        raise TenxError(
            f"the installed transformers {transformers.__version__} has no {arch}; upgrade it "
            f'(pip install -U "transformers>=4.51") to export this model'
        )
    loaded = load_model(path, device="cpu")
    model, cfg = cast(Transformer, loaded.model.float()), loaded.model.cfg  # one member (ensemble_member)
    padded = cfg.vocab_size or 0  # resolved: never 0
    tokenizer, note = _find_tokenizer(loaded.meta, run_dir, path)
    real_vocab = (
        tokenizer.vocab_size if tokenizer else int(meta.get("data_tokenizer", {}).get("vocab_size", 0))
    )
    eot_id = tokenizer.eot_id if tokenizer else meta.get("data_tokenizer", {}).get("eot_id")

    hf_config = _hf_config(transformers, arch, cfg, eot_id)
    state = hf_state_dict(model, arch)
    tmp = staging_dir(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise TenxError(
            f"cannot create {tmp} beside {out}: {e}; choose an -o in a writable directory"
        ) from None
    quiet = _progress_bars_off(transformers)
    try:
        hf_model = getattr(transformers, arch)(hf_config)
        _load_exact(hf_model, state, arch)
        del state
        if real_vocab and real_vocab < padded:  # generate() never samples a padding id, as in tenx
            hf_model.generation_config.suppress_tokens = list(range(real_vocab, padded))
        hf_model.eval().save_pretrained(tmp)
        del hf_model
        _patch_config_json(tmp)
        if not any(p.suffix == ".safetensors" for p in tmp.iterdir()):
            raise TenxError(f"transformers {transformers.__version__} wrote no .safetensors file in {tmp}")
        try:
            diff, scale = _check_logits(transformers, tmp, model, real_vocab or padded)
        except Exception as e:  # noqa: BLE001 - whatever stops transformers reading it, it is not shipped
            raise TenxError(
                f"transformers {transformers.__version__} cannot load the {arch} it has just written "
                f"({type(e).__name__}: {e}); nothing was written to {out}"
            ) from None
        if not diff <= CHECK_RTOL * max(1.0, scale):
            raise TenxError(
                f"the exported {arch} gives logits up to {diff:.3g} away from tenx's (largest logit "
                f"{scale:.3g}); nothing was written to {out}: please report this as a tenx bug"
            )
        if tokenizer is not None:
            note = _write_tokenizer(transformers, tokenizer, tmp, cfg.seq_len)
        kind = tokenizer.kind if tokenizer is not None and note is None else None
        files = sorted(p.name for p in tmp.iterdir())
        summary: dict[str, Any] = {
            "kind": MARKER_KIND,
            "format": "hf",
            "architecture": arch,
            "model_type": hf_config.model_type,
            "source_run": str(run_dir.resolve()) if run_dir else None,
            "checkpoint": str(path.resolve()),
            "step": meta.get("step"),
            "tokens": meta.get("tokens"),
            "params": sum(p.numel() for p in model.parameters()),
            "vocab_size": cfg.vocab_size,
            "tokenizer_vocab_size": real_vocab or None,
            "tokenizer": kind,
            "tokenizer_note": note,
            "max_abs_logit_diff": diff,
            "tenx_version": tenx.__version__,
            "checkpoint_tenx_version": meta.get("tenx_version"),
            "transformers_version": transformers.__version__,
            "files": files,
        }
        atomic_write_json(tmp / MARKER, summary)
        _publish(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TenxError(
            f"writing the export failed ({e}); nothing was written to {out}: free space or choose another -o"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        quiet()
    return {**summary, "out": str(out)}


def format_export_summary(summary: dict[str, Any]) -> str:
    """Lines the CLI prints after an export."""
    lines = [
        f"exported {summary['checkpoint']} (step {summary['step']})",
        f"as {summary['architecture']} ({summary['params']:,} parameters, vocabulary {summary['vocab_size']}) "
        f"to {summary['out']}",
        f"max |logits - tenx logits| = {summary['max_abs_logit_diff']:.2e} (checked on the written files)",
    ]
    if summary["tokenizer"]:
        lines.append(f"tokenizer: {summary['tokenizer']} (same ids as tenx on sample texts)")
    else:
        lines.append(f"tokenizer: not written: {summary['tokenizer_note']}")
    return "\n".join(lines)


def check_output_dir(out: Path) -> dict[str, Any] | None:
    """None if `out` is free (missing or empty), the marker of a previous export to replace, else TenxError."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise TenxError(f"output {out} exists and is not a directory; choose another -o")
    if not out.exists() or not any(out.iterdir()):
        return None
    marker = out / MARKER
    try:
        previous = json.loads(marker.read_text())
    except (OSError, ValueError):
        previous = None
    if type(previous) is not dict or previous.get("kind") != MARKER_KIND:
        raise TenxError(
            f"output directory {out} is not empty and is not a tenx export (no valid {MARKER}); "
            "refusing to overwrite it: choose a new or empty directory with -o"
        )
    listed = previous.get("files")
    ours = set(listed) | {MARKER} if isinstance(listed, list) else set()
    extra = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if extra:
        raise TenxError(
            f"output directory {out} is a previous tenx export but also holds files it did not write "
            f"({', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}); refusing to delete them: move "
            "them out or choose another -o"
        )
    return previous


def hf_state_dict(model: Transformer, arch: str) -> dict[str, torch.Tensor]:
    """tenx's weights under the names and layouts of `arch` (fused QKV and gate/up split, Conv1D transposed)."""
    cfg = model.cfg
    assert cfg.n_heads and cfg.n_kv_heads and cfg.d_model and cfg.d_ff
    E = cfg.d_model // cfg.n_heads
    q_rows, kv_rows = cfg.n_heads * E, cfg.n_kv_heads * E
    sd: dict[str, torch.Tensor] = {}
    blocks = cast(list[Block], list(model.blocks))

    def put(name: str, t: Any) -> None:  # Any: a norm's weight is typed Tensor | Module
        sd[name] = t.detach().to(torch.float32).contiguous()  # copied into the transformers model

    if arch == "GPT2LMHeadModel":

        def zeros_if_none(b: torch.Tensor | None, n: int) -> torch.Tensor:
            return torch.zeros(n) if b is None else b  # a zero bias is no bias, exactly

        def norm(name: str, m: Any) -> None:
            put(f"{name}.weight", m.weight)
            put(f"{name}.bias", zeros_if_none(m.bias, m.weight.shape[0]))

        def conv1d(name: str, m: torch.nn.Linear) -> None:  # Conv1D stores (in, out)
            put(f"{name}.weight", m.weight.t())
            put(f"{name}.bias", zeros_if_none(m.bias, m.weight.shape[0]))

        assert model.pos_emb is not None
        put("transformer.wte.weight", model.tok_emb.weight)
        put("transformer.wpe.weight", model.pos_emb.weight)
        for i, b in enumerate(blocks):
            p = f"transformer.h.{i}"
            norm(f"{p}.ln_1", b.attn_norm)
            conv1d(f"{p}.attn.c_attn", b.attn.qkv_proj)  # [q | k | v], head-major: GPT-2's own layout
            conv1d(f"{p}.attn.c_proj", b.attn.out_proj)
            norm(f"{p}.ln_2", b.mlp_norm)
            conv1d(f"{p}.mlp.c_fc", b.mlp.up_proj)
            conv1d(f"{p}.mlp.c_proj", b.mlp.down_proj)
        norm("transformer.ln_f", model.final_norm)
        put("lm_head.weight", model.lm_head.weight)
        return sd

    # Llama / Qwen3. tenx's RoPE rotates halves (x1, x2) -> (-x2, x1) within each head, the same layout as
    # transformers' rotate_half, so q/k rows need no permutation; only the fused projections are split.
    put("model.embed_tokens.weight", model.tok_emb.weight)
    for i, b in enumerate(blocks):
        p = f"model.layers.{i}"
        put(f"{p}.input_layernorm.weight", b.attn_norm.weight)
        qkv = b.attn.qkv_proj.weight
        put(f"{p}.self_attn.q_proj.weight", qkv[:q_rows])
        put(f"{p}.self_attn.k_proj.weight", qkv[q_rows : q_rows + kv_rows])
        put(f"{p}.self_attn.v_proj.weight", qkv[q_rows + kv_rows :])
        put(f"{p}.self_attn.o_proj.weight", b.attn.out_proj.weight)
        if b.attn.q_norm is not None and b.attn.k_norm is not None:
            put(f"{p}.self_attn.q_norm.weight", b.attn.q_norm.weight)
            put(f"{p}.self_attn.k_norm.weight", b.attn.k_norm.weight)
        put(f"{p}.post_attention_layernorm.weight", b.mlp_norm.weight)
        gate_up = b.mlp.up_proj.weight  # silu(first half) * second half
        put(f"{p}.mlp.gate_proj.weight", gate_up[: cfg.d_ff])
        put(f"{p}.mlp.up_proj.weight", gate_up[cfg.d_ff :])
        put(f"{p}.mlp.down_proj.weight", b.mlp.down_proj.weight)
    put("model.norm.weight", model.final_norm.weight)
    put("lm_head.weight", model.lm_head.weight)
    return sd


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise TenxError(
            f"tenx export --format hf needs the transformers package, which is not installed: {INSTALL_HINT}"
        ) from None
    return transformers


QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
"""Libraries that transformers imports as it loads a model class and that log warnings about themselves
(torchao: kernels built for another Python; torch: a deprecated registration torchao makes), not the export."""


@contextlib.contextmanager
def quiet_library_logs() -> Iterator[None]:
    """Hold QUIET_LOGGERS' warnings back (errors still show) while `tenx export` runs, so that its summary
    is all it prints."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _progress_bars_off(transformers: Any) -> Any:
    """Hide transformers' loading/saving progress bars; returns the function that restores them."""
    logging = transformers.utils.logging
    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    return logging.enable_progress_bar if was_on else lambda: None


def _pick_checkpoint(target: str | Path, checkpoint: str | Path | None) -> tuple[Path, Path | None]:
    """(checkpoint dir, run dir or None). `checkpoint` may also name a step directory of the run."""
    if checkpoint is None:
        return resolve_checkpoint(target)
    chosen = Path(checkpoint)
    inside = rundir.RunDir(target).checkpoints / chosen
    if not chosen.exists() and not chosen.is_absolute() and inside.exists():
        chosen = inside
    if not chosen.is_dir():
        raise TenxError(f"checkpoint {chosen} does not exist; give a checkpoint directory (step_XXXXXXXX)")
    path, run_dir = resolve_checkpoint(chosen)
    return path, run_dir or (Path(target) if Path(target).is_dir() else None)


def _find_tokenizer(
    meta: dict[str, Any], run_dir: Path | None, path: Path
) -> tuple[Tokenizer | None, str | None]:
    """The tokenizer the model was trained with, from the run's data directory, or (None, why not)."""
    candidates: list[Path] = []
    if isinstance(meta.get("data_dir"), str) and meta["data_dir"]:
        candidates.append(Path(meta["data_dir"]))
    recorded = [meta.get("config", {}).get("data", {}).get("dir")]
    if run_dir is not None and rundir.RunDir(run_dir).config.is_file():
        try:
            recorded.insert(0, cfglib.read_toml(rundir.RunDir(run_dir).config).get("data", {}).get("dir"))
        except ConfigError:
            pass
    candidates += [Path(d) for d in recorded if isinstance(d, str) and d]
    if not candidates:
        return None, f"checkpoint {path} records no data directory (data.dir)"
    found = next((d for d in candidates if d.is_dir()), None)
    if found is None:
        where = " or ".join(str(d) for d in dict.fromkeys(candidates))
        return None, (
            f"the run's data directory {where} does not exist; re-run `tenx export` where it is present to "
            "include the tokenizer"
        )
    entry = meta.get("data_tokenizer") if isinstance(meta.get("data_tokenizer"), dict) else None
    try:
        return load_tokenizer(found, entry), None
    except (DataError, OSError, ValueError, KeyError) as e:
        return None, f"the tokenizer in {found} cannot be used: {e}"


def _hf_config(transformers: Any, arch: str, cfg: ModelConfig, eot_id: int | None) -> Any:
    """The `transformers` config of `arch` for the resolved tenx config `cfg`."""
    assert cfg.n_heads and cfg.d_model
    ids = {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": None}
    if arch == "GPT2LMHeadModel":
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.seq_len,
            n_embd=cfg.d_model,
            n_layer=cfg.depth,
            n_head=cfg.n_heads,
            n_inner=cfg.d_ff,
            activation_function="gelu_pytorch_tanh",  # F.gelu(approximate="tanh"), tenx's own kernel
            layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            initializer_range=cfg.init_std,
            scale_attn_weights=True,
            tie_word_embeddings=bool(cfg.tie_embeddings),
            architectures=[arch],
            **ids,
        )
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.depth,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.d_model // cfg.n_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        attention_bias=False,
        initializer_range=cfg.init_std,
        tie_word_embeddings=bool(cfg.tie_embeddings),
        architectures=[arch],
        **ids,
    )
    if arch == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(
            **common, use_sliding_window=False, sliding_window=None, max_window_layers=cfg.depth
        )
    return transformers.LlamaConfig(**common, mlp_bias=False)


def _load_exact(hf_model: Any, state: dict[str, torch.Tensor], arch: str) -> None:
    """Load `state` into `hf_model`, which must hold exactly those parameters (no more, no fewer)."""
    expected = set(hf_model.state_dict())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise TenxError(
            f"{arch} of the installed transformers has other parameters than tenx maps (missing "
            f"{missing[:4]}, unexpected {extra[:4]}); nothing was written: please report this as a tenx bug"
        )
    hf_model.load_state_dict(state, strict=True)


@torch.no_grad()
def _check_logits(transformers: Any, directory: Path, model: Transformer, vocab: int) -> tuple[float, float]:
    """(max |logits_hf - logits_tenx|, max |logits_tenx|) of the model written in `directory`, in fp32."""
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, min(CHECK_TOKENS, model.cfg.seq_len)), generator=generator)
    ours = model.eval()(ids).float()
    theirs = reloaded(input_ids=ids).logits.float()
    if theirs.shape != ours.shape:
        return float("inf"), float(ours.abs().max())
    return float((theirs - ours).abs().max()), float(ours.abs().max())


def _byte_backend() -> Any:
    """A `tokenizers` tokenizer that maps text to its UTF-8 bytes (ids 0..255) and EOT_TEXT to 256.

    A byte-level BPE with no merges: the ByteLevel pre-tokenizer spells each byte as one printable
    character (GPT-2's table), and the vocabulary gives that character the byte's value as its id.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shift)
            shift += 1
    vocab = {chars[b]: b for b in range(256)} | {EOT_TEXT: 256}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _write_tokenizer(transformers: Any, tokenizer: Tokenizer, directory: Path, seq_len: int) -> str | None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; None, or why they were not.

    The files are written directly (not by the installed transformers' tokenizer classes), in the form every
    transformers release since 4.40 reads as a PreTrainedTokenizerFast. They are read back with AutoTokenizer
    and must give tenx's ids on TOKENIZER_SAMPLES and the end-of-document token its id; otherwise they are
    removed and the reason returned.
    """
    if isinstance(tokenizer, BPETokenizer):
        spec = json.loads(tokenizer.to_json())
    else:
        spec = json.loads(_byte_backend().to_str())
    # EOT_TEXT stays in the model's vocabulary (so it has its id and decodes) but is no added token: an added
    # token would be matched inside text, and not every transformers release honours split_special_tokens.
    # The byte-level pre-tokenizer and merges never produce it from text, so text encodes as in tenx.
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t.get("content") != EOT_TEXT]
    if spec.get("model", {}).get("vocab", {}).get(EOT_TEXT) != tokenizer.eot_id:
        return (
            f"the {tokenizer.kind} tokenizer's vocabulary does not give {EOT_TEXT} the id {tokenizer.eot_id}"
        )
    files = {
        TOKENIZER_FILES[0]: json.dumps(spec, ensure_ascii=False, indent=2),
        TOKENIZER_FILES[1]: json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOT_TEXT,
                "eos_token": EOT_TEXT,
                "model_max_length": seq_len,
                "clean_up_tokenization_spaces": False,
                # tenx encodes a literal EOT_TEXT inside a document as ordinary text
                "split_special_tokens": True,
            },
            indent=2,
        ),
        TOKENIZER_FILES[2]: json.dumps({"bos_token": EOT_TEXT, "eos_token": EOT_TEXT}, indent=2),
    }
    for name, text in files.items():
        (directory / name).write_text(text + "\n", encoding="utf-8")
    why = None
    try:
        reloaded = transformers.AutoTokenizer.from_pretrained(directory)
        bad = [s for s in TOKENIZER_SAMPLES if list(reloaded(s)["input_ids"]) != tokenizer.encode(s)]
        if bad:
            why = f"transformers encodes {bad[0]!r} to other ids than tenx does"
            if EOT_TEXT in bad[0] and _version(transformers.__version__) < (4, 42):
                why += (
                    f" (transformers {transformers.__version__} matches {EOT_TEXT} inside text: upgrade "
                    'it, pip install -U "transformers>=4.42", and export again)'
                )
        elif reloaded.convert_tokens_to_ids(EOT_TEXT) != tokenizer.eot_id:
            why = f"transformers gives {EOT_TEXT} another id than tenx's {tokenizer.eot_id}"
    except Exception as e:  # noqa: BLE001 - any failure to read it back means it must not be shipped
        why = f"transformers cannot read it back ({type(e).__name__}: {e})"
    if why is not None:
        for name in files:
            (directory / name).unlink()
        return f"the {tokenizer.kind} tokenizer could not be represented exactly: {why}"
    return None


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "4.40.2" or "5.0.0.dev0"."""
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in text.split(".")[:2]]
    return tuple(parts)


def _patch_config_json(directory: Path) -> None:
    """Also spell `rope_theta` and `torch_dtype` the way transformers 4.x reads them (5.x writes
    `rope_parameters` and `dtype`), so the export opens with either major version."""
    path = directory / "config.json"
    data = json.loads(path.read_text())
    rope = data.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in data:
        data["rope_theta"] = rope["rope_theta"]
    if "dtype" in data and "torch_dtype" not in data:
        data["torch_dtype"] = data["dtype"]
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished export `tmp` to `out`, replacing an empty directory or a previous export."""
    for p in tmp.iterdir():
        os.chmod(p, FILE_MODE)  # as a plain open() would create them (some are written 0600)
    free = True

    def still_ours() -> None:  # still free, or a previous export? (raises if someone wrote into it meanwhile)
        nonlocal free
        free = check_output_dir(out) is None

    try:
        publish_dir(tmp, out, before_rename=still_ours)
    except OSError as e:
        if not free:
            raise  # the previous export was put back
        raise TenxError(f"cannot create {out}: {e}; choose a new or empty directory with -o") from None
