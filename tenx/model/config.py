"""Model configuration: two named families whose every component is one field away.

`gpt2` is the known-good baseline (LayerNorm, learned positions, GELU, biases, tied embeddings);
`llama` swaps in RMSNorm, RoPE, SwiGLU, no biases and untied embeddings. Any field left unset takes the
family's value, so a derisking experiment is the baseline plus one line.

Size derives from one knob, `depth`: d_model = depth * aspect_ratio rounded up to a multiple of 64, heads
of `head_dim`, MLP width 4*d (GELU) or 8/3*d rounded up to a multiple of 64 (SwiGLU), and the vocabulary
padded to a multiple of 64, so every matmul has hardware-friendly shapes. Explicit d_model / d_ff values are
taken as given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

from tenx.config import check_bounds, field
from tenx.errors import ConfigError

FAMILIES: dict[str, dict[str, object]] = {
    "gpt2": {"norm": "layernorm", "pos": "learned", "mlp": "gelu", "bias": True, "tie_embeddings": True},
    "llama": {"norm": "rmsnorm", "pos": "rope", "mlp": "swiglu", "bias": False, "tie_embeddings": False},
}

MULTIPLE = 64


def round_up(x: int, multiple: int = MULTIPLE) -> int:
    """Smallest multiple of `multiple` that is >= x."""
    return -(-x // multiple) * multiple


@dataclass
class ModelConfig:
    """A decoder-only transformer. Unset (None) fields take the family's or the derived value."""

    SECTION: ClassVar[str] = "model"
    """Where its fields sit in the config tree (errors name `model.FIELD`)."""

    family: Literal["gpt2", "llama"] = field("gpt2", help="named family supplying component defaults")
    depth: int = field(4, ge=1, help="number of transformer blocks; also sets the width")
    aspect_ratio: int = field(64, ge=1, help="d_model = depth * aspect_ratio, rounded up to a multiple of 64")
    d_model: int | None = field(None, ge=1, help="residual width (overrides the depth-derived width)")
    head_dim: int = field(64, help="width of one attention head")
    n_heads: int | None = field(None, ge=1, help="query heads; default d_model // head_dim")
    n_kv_heads: int | None = field(
        None, ge=1, help="key/value heads for grouped-query attention; default n_heads"
    )
    d_ff: int | None = field(
        None, ge=1, help="MLP hidden width; default 4*d (gelu) or 8/3*d rounded up to 64 (swiglu)"
    )
    vocab_size: int | None = field(
        None, ge=1, help="vocabulary size; default: the data's tokenizer, padded to 64"
    )
    seq_len: int = field(256, ge=2, help="context length in tokens")
    norm: Literal["layernorm", "rmsnorm"] | None = field(None, help="normalisation layer")
    pos: Literal["learned", "rope"] | None = field(None, help="position encoding")
    mlp: Literal["gelu", "swiglu"] | None = field(None, help="MLP type")
    bias: bool | None = field(None, help="biases in linear layers and norms")
    qk_norm: bool = field(False, help="normalise queries and keys per head before attention")
    tie_embeddings: bool | None = field(None, help="share the input embedding with the output projection")
    z_loss: float = field(0.0, ge=0, help="coefficient of the z-loss (logsumexp(logits)^2) added to the loss")
    rope_theta: float = field(10000.0, help="RoPE base frequency")
    norm_eps: float = field(1e-5, help="epsilon of the normalisation layers")
    init_std: float = field(0.02, help="standard deviation of weight initialisation")
    dropout: float = field(
        0.0,
        ge=0,
        lt=1,
        help="dropout probability on the embeddings and on each attention and MLP output while training "
        "(a regulariser when data repeats for several epochs; 0: none)",
    )
    ensemble: int = field(
        1,
        ge=1,
        le=64,
        help="members of an ensemble, trained with seeds train.seed + K into RUN/members/K one after "
        "another; eval and sample read the average of their probabilities (1: one model)",
    )

    def validate(self) -> None:
        """Check bounds and divisibility; names the offending field."""
        check_bounds(self)
        if self.init_std < 0:  # torch's normal_ refuses a negative standard deviation
            raise ConfigError(f"model.init_std: must be >= 0 (a standard deviation), got {self.init_std}")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"model.head_dim: must be an even number >= 2, got {self.head_dim}")
        r = self.resolved(self.vocab_size or 256)
        assert r.d_model is not None and r.n_heads is not None and r.n_kv_heads is not None
        if r.d_model % r.n_heads:
            raise ConfigError(f"model.n_heads: d_model={r.d_model} is not divisible by n_heads={r.n_heads}")
        if r.n_heads % r.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads: n_heads={r.n_heads} must be a multiple of n_kv_heads={r.n_kv_heads}"
            )
        if (r.d_model // r.n_heads) % 2:
            raise ConfigError(
                f"model.n_heads: head width d_model/n_heads={r.d_model // r.n_heads} must be even"
            )

    def resolved(self, vocab_size: int | None = None) -> ModelConfig:
        """A copy with every derived field filled in; `vocab_size` is the data's (unpadded) vocabulary."""
        values = dataclasses.asdict(self)
        for key, default in FAMILIES[self.family].items():
            if values[key] is None:
                values[key] = default
        d_model = self.d_model or round_up(self.depth * self.aspect_ratio)
        n_heads = self.n_heads or max(1, d_model // self.head_dim)
        n_kv_heads = self.n_kv_heads or n_heads
        if self.d_ff is not None:
            d_ff = self.d_ff
        elif values["mlp"] == "swiglu":
            d_ff = round_up(8 * d_model // 3)
        else:
            d_ff = 4 * d_model
        vocab = self.vocab_size or vocab_size
        if vocab is None:
            raise ConfigError("model.vocab_size: unknown; set it or train on a prepared data directory")
        values.update(
            d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff, vocab_size=round_up(vocab)
        )
        return ModelConfig(**values)
