"""A decoder-only transformer, pure math: no training, logging or parallelism code lives here.

Shape suffixes on tensor names: B batch, T sequence position, D model width, H query heads,
K key/value heads, E head width, F MLP width, V (padded) vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from tenx.model.config import ModelConfig
from tenx.model.soft_targets import SoftTargets, soft_cross_entropy_sums


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned scale (and optional bias)."""

    def __init__(self, dim: int, eps: float, bias: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return out + self.bias if self.bias is not None else out


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The configured normalisation layer over the last dimension."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps, bias=bool(cfg.bias))
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=bool(cfg.bias))


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (T, E) for rotary position embedding (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles_TE2 = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles_TE = torch.cat([angles_TE2, angles_TE2], dim=-1)
    return angles_TE.cos().float(), angles_TE.sin().float()


def apply_rope(x_BHTE: torch.Tensor, cos_TE: torch.Tensor, sin_TE: torch.Tensor) -> torch.Tensor:
    """Rotate query/key pairs by position-dependent angles."""
    half = x_BHTE.shape[-1] // 2
    x1, x2 = x_BHTE[..., :half], x_BHTE[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHTE * cos_TE + rotated * sin_TE).to(x_BHTE.dtype)


def max_attention_logit(
    q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, max_elements: int = 1 << 24
) -> torch.Tensor:
    """The largest causal pre-softmax logit q·k/sqrt(E) over batch, heads and positions, in fp32.

    Computed a block of query rows at a time, so at most about `max_elements` logits exist at once; key
    head K serves query heads [K*H/K', (K+1)*H/K') as in grouped-query attention.
    """
    B, H, T, E = q_BHTE.shape
    k_BHTE = k_BKTE.repeat_interleave(H // k_BKTE.shape[1], dim=1).float()
    q_BHTE = q_BHTE.float() * E**-0.5
    rows = max(1, min(T, max_elements // max(1, B * H * T)))
    pos_T = torch.arange(T, device=q_BHTE.device)
    best = torch.full((), -math.inf, device=q_BHTE.device)
    for start in range(0, T, rows):
        end = min(T, start + rows)
        logits_BHRS = q_BHTE[:, :, start:end] @ k_BHTE[:, :, :end].transpose(-1, -2)
        future_RS = pos_T[None, :end] > pos_T[start:end, None]
        best = torch.maximum(best, logits_BHRS.masked_fill(future_RS, -math.inf).amax())
    return best


class Attention(nn.Module):
    """Causal multi-head attention with optional grouped KV heads, QK-norm and RoPE."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.d_model and cfg.n_heads and cfg.n_kv_heads
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        bias = bool(cfg.bias)
        # One fused projection for queries, keys and values: a single larger matmul is faster.
        self.qkv_proj = nn.Linear(
            cfg.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=bias
        )
        self.out_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=bias)
        self.q_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else None
        self.record_logit_max = False
        """When set (by a monitoring probe, not in training), forward also stores `logit_max`."""
        self.logit_max: torch.Tensor | None = None
        """The largest pre-softmax logit of the last forward with `record_logit_max` set."""

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        qkv = self.qkv_proj(x_BTD).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q_BTHE, k_BTKE, v_BTKE = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        q_BHTE, k_BKTE, v_BKTE = q_BTHE.transpose(1, 2), k_BTKE.transpose(1, 2), v_BTKE.transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q_BHTE, k_BKTE = self.q_norm(q_BHTE), self.k_norm(k_BKTE)
        if rope is not None:
            cos_TE, sin_TE = rope[0][:T], rope[1][:T]
            q_BHTE, k_BKTE = apply_rope(q_BHTE, cos_TE, sin_TE), apply_rope(k_BKTE, cos_TE, sin_TE)
        if self.record_logit_max:
            self.logit_max = max_attention_logit(q_BHTE, k_BKTE)
        y_BHTE = F.scaled_dot_product_attention(
            q_BHTE, k_BKTE, v_BKTE, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.out_proj(y_BHTE.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """GELU MLP or SwiGLU gated MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.d_model and cfg.d_ff
        self.gated = cfg.mlp == "swiglu"
        bias = bool(cfg.bias)
        self.up_proj = nn.Linear(cfg.d_model, (2 if self.gated else 1) * cfg.d_ff, bias=bias)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        h_BTF = self.up_proj(x_BTD)
        if self.gated:
            gate_BTF, up_BTF = h_BTF.chunk(2, dim=-1)
            h_BTF = F.silu(gate_BTF) * up_BTF
        else:
            h_BTF = F.gelu(h_BTF, approximate="tanh")
        return self.down_proj(h_BTF)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.d_model
        self.attn_norm = make_norm(cfg, cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg)
        self.dropout = cfg.dropout

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x_BTD = x_BTD + _dropout(self.attn(self.attn_norm(x_BTD), rope), self.dropout, self.training)
        return x_BTD + _dropout(self.mlp(self.mlp_norm(x_BTD)), self.dropout, self.training)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout while training with p > 0; otherwise x itself (no random numbers drawn: runs without dropout
    keep their exact bits and random streams)."""
    return F.dropout(x, p, True) if training and p > 0 else x


class Transformer(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model is None or cfg.vocab_size is None:
            raise ValueError("Transformer needs a resolved ModelConfig (call cfg.resolved(vocab_size))")
        self.cfg = cfg
        self.checkpoint_blocks = False
        """Recompute each block's activations in backward instead of storing them (activation checkpointing)."""
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.final_norm = make_norm(cfg, cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if cfg.pos == "rope":
            cos, sin = rope_tables(cfg.seq_len, cfg.d_model // (cfg.n_heads or 1), cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, std), residual output projections scaled by 1/sqrt(2*depth)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norms and biases keep their constructor values (ones / zeros)
            scale = (
                1.0 / math.sqrt(2 * self.cfg.depth)
                if name.endswith(("out_proj.weight", "down_proj.weight"))
                else 1.0
            )
            nn.init.normal_(p, mean=0.0, std=std * scale)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(
        self,
        tokens_BT: torch.Tensor,
        targets_BT: torch.Tensor | None = None,
        on_block_output: Callable[[int, torch.Tensor], None] | None = None,
        loss_dtype: torch.dtype = torch.float32,
        teacher: SoftTargets | None = None,
        token_loss_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Logits (B, T, V); with `targets_BT`, (loss, mean cross-entropy) instead, from
        `linear_cross_entropy`: the output layer and the loss in chunks, never the whole logits tensor.

        `on_block_output(i, x_BTD)`, when given, sees each block's output (monitoring). `loss_dtype`: the
        dtype of the loss arithmetic (fp32; float64 on triage's reference path); `token_loss_dtype`: see
        `lm_loss`'s `token_dtype`. `teacher`: distil from its
        distribution on these tokens; the result is then (loss, mean cross-entropy, distillation figures)
        (see `linear_cross_entropy`)."""
        x_BTD = self.features(tokens_BT, on_block_output)
        if targets_BT is None:
            return self.lm_head(x_BTD)
        return linear_cross_entropy(
            x_BTD.flatten(0, 1),
            self.lm_head.weight,
            targets_BT.flatten(),
            self.cfg.z_loss,
            loss_dtype,
            teacher,
            token_loss_dtype,
        )

    def features(
        self, tokens_BT: torch.Tensor, on_block_output: Callable[[int, torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """The output layer's input (B, T, D): the last block's output, normalised."""
        T = tokens_BT.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds model.seq_len={self.cfg.seq_len}")
        x_BTD = self.tok_emb(tokens_BT)
        if self.pos_emb is not None:
            x_BTD = x_BTD + self.pos_emb.weight[:T]
        x_BTD = _dropout(x_BTD, self.cfg.dropout, self.training)
        rope = (self.rope_cos, self.rope_sin) if self.cfg.pos == "rope" else None
        for i, block in enumerate(self.blocks):
            if self.checkpoint_blocks and self.training and torch.is_grad_enabled():
                x_BTD = torch.utils.checkpoint.checkpoint(block, x_BTD, rope, use_reentrant=False)
            else:
                x_BTD = block(x_BTD, rope)
            if on_block_output is not None:
                on_block_output(i, x_BTD)
        return self.final_norm(x_BTD)


def lm_loss(
    logits_BTV: torch.Tensor,
    targets_BT: torch.Tensor,
    z_loss: float = 0.0,
    dtype: torch.dtype = torch.float32,
    token_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total loss to optimise, mean cross-entropy in nats/token), computed in `dtype` (fp32; float64 on
    triage's reference path).

    `token_dtype` (`train.loss_precision = "bf16"`): when the logits are in it (bf16 autocast), each
    token's cross-entropy (and log-sum-exp) is taken from them as they are and only the mean is in `dtype`:
    no fp32 copy of the (N, V) logits and a log-softmax at half the bytes (on one CPU thread, 70 against 130
    ms for 4,096 tokens over 4,096 classes; the loss within 3e-5 of fp32's, relative). Otherwise, or None:
    all in `dtype`."""
    if token_dtype is not None and logits_BTV.dtype == token_dtype:
        # each token's cross-entropy from the logits as they are (no fp32 copy), summed in `dtype`
        logits_NV = logits_BTV.flatten(0, 1)
        ce = F.cross_entropy(logits_NV, targets_BT.flatten(), reduction="none").to(dtype).mean()
    else:
        logits_NV = logits_BTV.to(dtype).flatten(0, 1)
        ce = F.cross_entropy(logits_NV, targets_BT.flatten())
    if z_loss == 0.0:
        return ce, ce
    lse_N = torch.logsumexp(logits_NV, dim=-1).to(dtype)
    return ce + z_loss * lse_N.square().mean(), ce


CHUNK_ELEMENTS = 1 << 26
"""Logits per chunk of `linear_cross_entropy` (64M: 256 MB in fp32), so a chunk's temporaries stay small."""


class _LinearCrossEntropy(torch.autograd.Function):
    """Output projection and cross-entropy (plus z-loss) in chunks of tokens; gradients made in the forward.

    Each chunk's logits are computed, turned into its loss and its gradient with respect to the logits
    (softmax minus the one-hot target, scaled), and that gradient into the chunk's share of the input's and
    the weight's gradients, then dropped. What backward keeps is those two gradients, (N, D) and (V, D),
    instead of the (N, V) logits and their log-softmax that the plain loss keeps. The matmuls run in
    `compute_dtype` (the autocast dtype, as the plain linear under autocast would), the loss arithmetic in
    `loss_dtype`. Only the loss carries a gradient: the cross-entropy output is for logging.

    With a `teacher`, each chunk's teacher log-probabilities are made beside it (tenx.model.soft_targets),
    the loss is (1 - w) * CE + w * H(teacher, student) (+ z-loss), whose gradient with respect to the logits
    is softmax - (1 - w) * onehot - w * teacher probabilities, and a third output holds the distillation
    figures (see `linear_cross_entropy`).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x_ND: torch.Tensor,
        weight_VD: torch.Tensor,
        targets_N: torch.Tensor,
        z_loss: float,
        loss_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        teacher: SoftTargets | None = None,
    ) -> tuple[torch.Tensor, ...]:
        N, V = x_ND.shape[0], weight_VD.shape[0]
        w = teacher.weight if teacher is not None else 0.0
        teacher = teacher.cast(compute_dtype) if teacher is not None else None
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        w_VD = weight_VD.to(compute_dtype)
        grad_x_ND = torch.empty_like(x_ND) if needs_grad else None
        grad_w_VD = (
            torch.zeros(weight_VD.shape, dtype=loss_dtype, device=weight_VD.device) if needs_grad else None
        )
        ce_sum = torch.zeros((), dtype=loss_dtype, device=x_ND.device)
        z_sum = torch.zeros((), dtype=loss_dtype, device=x_ND.device)
        distill_sums = torch.zeros(2, dtype=loss_dtype, device=x_ND.device)  # H(teacher, student), H(teacher)
        chunk = max(1, min(N, CHUNK_ELEMENTS // max(V, 1)))
        for start in range(0, N, chunk):
            end = min(N, start + chunk)
            x_CD = x_ND[start:end].to(compute_dtype)
            logits_CV = (x_CD @ w_VD.t()).to(loss_dtype)
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            target_C = targets_N[start:end]
            ce_sum += (lse_C - logits_CV.gather(1, target_C[:, None]).squeeze(1)).sum()
            if z_loss:
                z_sum += lse_C.square().sum()
            if teacher is not None:
                teacher_logp_CV = teacher.log_probs(start, end, loss_dtype)
                p_CV, cross, entropy = soft_cross_entropy_sums(teacher_logp_CV, logits_CV - lse_C[:, None])
                distill_sums += torch.stack([cross, entropy])
            if not needs_grad:
                continue
            # d(loss)/d(logits): (softmax - onehot) / N, and z * 2 * lse * softmax / N from the z-loss
            grad_CV = logits_CV.sub_(lse_C[:, None]).exp_()
            if z_loss:
                grad_CV.mul_((1.0 + 2.0 * z_loss * lse_C)[:, None])
            grad_CV[torch.arange(end - start, device=grad_CV.device), target_C] -= 1.0 - w
            if w:
                grad_CV.sub_(p_CV, alpha=w)
            grad_CV = grad_CV.div_(N).to(compute_dtype)
            assert grad_x_ND is not None and grad_w_VD is not None
            grad_x_ND[start:end] = grad_CV @ w_VD
            if compute_dtype == loss_dtype:
                grad_w_VD.addmm_(grad_CV.t(), x_CD)
            else:
                grad_w_VD += (grad_CV.t() @ x_CD).to(loss_dtype)
        ce = ce_sum / N
        loss = (1.0 - w) * ce + w * distill_sums[0] / N if w else ce.clone()
        if z_loss:
            loss = loss + z_loss * z_sum / N
        if needs_grad:
            assert grad_w_VD is not None
            ctx.save_for_backward(grad_x_ND, grad_w_VD.to(weight_VD.dtype))
        if teacher is None:
            ctx.mark_non_differentiable(ce)
            return loss, ce
        figures = torch.stack([distill_sums[0], distill_sums[0] - distill_sums[1]]) / N
        ctx.mark_non_differentiable(ce, figures)
        return loss, ce, figures

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor, *grad_figures: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        grad_x_ND, grad_w_VD = ctx.saved_tensors  # type: ignore[attr-defined]
        return (
            grad_x_ND * grad_loss.to(grad_x_ND.dtype),
            grad_w_VD * grad_loss.to(grad_w_VD.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    x_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    z_loss: float = 0.0,
    loss_dtype: torch.dtype = torch.float32,
    teacher: SoftTargets | None = None,
    token_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """(total loss to optimise, mean cross-entropy in nats/token) of logits `x_ND @ weight_VD.T`.

    When the logits fit in one chunk (N * V <= CHUNK_ELEMENTS: every CPU-sized model) this is the linear
    layer and `lm_loss`, op for op (measured on a CPU, faster than chunking: 256 against 265-287 ms for
    2048 tokens x 8192 classes). Above that, `_LinearCrossEntropy` computes it in chunks, never holding
    the (N, V) logits, equal to `lm_loss` up to rounding (gpt2-d12's micro-batch of 32 x 1024 tokens over
    32768 classes: 2 GB of bf16 logits, plus their fp32 copy and log-softmax, become 16 chunks). Under
    autocast the matmuls run in the autocast dtype, as a linear layer's would.

    With a `teacher` (distillation, weight w = teacher.weight): the loss is (1 - w) * CE + w * H(teacher,
    student) (+ the z-loss, unweighted), and a third output holds, without gradient, [mean H(teacher,
    student), mean KL(teacher || student)] in nats/token. With w = 0 the loss and its gradient are those
    without a teacher, bit for bit. `token_dtype`: `lm_loss`'s, on the unchunked path (the chunked one
    keeps its arithmetic in `loss_dtype`)."""
    device_type = x_ND.device.type
    compute_dtype = x_ND.dtype
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    N = x_ND.shape[0]
    if N * weight_VD.shape[0] <= CHUNK_ELEMENTS:
        logits_NV = F.linear(x_ND, weight_VD)
        loss, ce = lm_loss(logits_NV[None], targets_N[None], z_loss, loss_dtype, token_dtype)
        if teacher is None:
            return loss, ce
        w = teacher.weight
        logq_NV = torch.log_softmax((logits_NV if w else logits_NV.detach()).to(loss_dtype), dim=-1)
        _, cross, entropy = soft_cross_entropy_sums(
            teacher.cast(compute_dtype).log_probs(0, N, loss_dtype), logq_NV
        )
        if w:  # (1 - w) * CE + w * H, from lm_loss's CE (+ z-loss)
            loss = loss + w * (cross / N - ce)
        return loss, ce, torch.stack([cross, cross - entropy]).detach() / N
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(  # type: ignore[no-any-return]
            x_ND, weight_VD, targets_N, z_loss, loss_dtype, compute_dtype, teacher
        )
