"""Exact parameter counts and training FLOPs per token, as functions of a resolved ModelConfig."""

from __future__ import annotations

from dataclasses import dataclass

from tenx.model.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts by part; `total` counts a tied embedding once."""

    embedding: int
    position: int
    blocks: int
    final_norm: int
    lm_head: int

    @property
    def total(self) -> int:
        return self.embedding + self.position + self.blocks + self.final_norm + self.lm_head

    @property
    def non_embedding(self) -> int:
        """Parameters excluding token/position embeddings and an untied output head (Kaplan et al.)."""
        return self.blocks + self.final_norm


def _norm_params(cfg: ModelConfig, dim: int) -> int:
    return dim * (2 if cfg.bias else 1)


def count_params(cfg: ModelConfig) -> ParamCount:
    """Exact number of trainable parameters of `Transformer(cfg)`; cfg must be resolved."""
    d, V = cfg.d_model, cfg.vocab_size
    assert d and V and cfg.n_heads and cfg.n_kv_heads and cfg.d_ff
    E = d // cfg.n_heads
    b = 1 if cfg.bias else 0
    q = d * cfg.n_heads * E + b * cfg.n_heads * E
    kv = d * 2 * cfg.n_kv_heads * E + b * 2 * cfg.n_kv_heads * E
    out = cfg.n_heads * E * d + b * d
    qk_norm = 2 * _norm_params(cfg, E) if cfg.qk_norm else 0
    up_width = (2 if cfg.mlp == "swiglu" else 1) * cfg.d_ff
    mlp = d * up_width + b * up_width + cfg.d_ff * d + b * d
    block = q + kv + out + qk_norm + mlp + 2 * _norm_params(cfg, d)
    return ParamCount(
        embedding=V * d,
        position=cfg.seq_len * d if cfg.pos == "learned" else 0,
        blocks=cfg.depth * block,
        final_norm=_norm_params(cfg, d),
        lm_head=0 if cfg.tie_embeddings else V * d,
    )


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every linear layer plus the output head."""
    d, V = cfg.d_model, cfg.vocab_size
    assert d and V and cfg.n_heads and cfg.n_kv_heads and cfg.d_ff
    E = d // cfg.n_heads
    up_width = (2 if cfg.mlp == "swiglu" else 1) * cfg.d_ff
    per_block = (
        d * cfg.n_heads * E + d * 2 * cfg.n_kv_heads * E + cfg.n_heads * E * d + d * up_width + cfg.d_ff * d
    )
    return cfg.depth * per_block + d * V


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token (forward + backward = 3x forward), matmuls plus attention.

    Forward: 2 FLOPs per matmul weight, plus QK^T and attention-times-V, each 2*T*(H*E) per token per
    layer (counted over the full T x T square, as in PaLM's MFU definition). Norms, activations and the
    softmax are left out: they are small and not matmuls.
    """
    T = seq_len or cfg.seq_len
    assert cfg.d_model and cfg.n_heads
    attention_fwd = cfg.depth * 2 * 2 * T * cfg.d_model
    return 3 * (2 * matmul_params(cfg) + attention_fwd)
