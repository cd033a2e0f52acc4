"""Version 1 of the `.tenx` numerics, kept to read its files: the model's float32 kernels one position at a
time. Its probabilities depend on the kernels (CPU instruction set, thread count, device), so such a file
decodes only where the same kernels run; version 2 (tenx/compress/fixed.py) decodes anywhere.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from tenx.model.transformer import Block, Transformer, apply_rope

FREQ_SCALE = float(1 << 24)


class FloatStepper:
    """The model one position at a time with a key/value cache: logits (R, V) of position `pos` of R rows.

    The same math as Transformer.forward (tests/test_codec.py compares them), restated for one position.
    """

    def __init__(self, model: Transformer, rows: int) -> None:
        self.model = model
        self.blocks = [cast(Block, block) for block in model.blocks]
        self.rope = (
            (cast(torch.Tensor, model.rope_cos), cast(torch.Tensor, model.rope_sin))
            if model.cfg.pos == "rope"
            else None
        )
        attn = self.blocks[0].attn
        shape = (rows, attn.n_kv_heads, model.cfg.seq_len, attn.head_dim)
        device = next(model.parameters()).device
        # Only positions already written are read, so the cache needs no initial values.
        self.keys = [torch.empty(shape, device=device) for _ in self.blocks]
        self.values = [torch.empty(shape, device=device) for _ in self.blocks]

    def __call__(self, tokens_R: torch.Tensor, pos: int) -> torch.Tensor:
        m, R = self.model, tokens_R.shape[0]
        x_R1D = m.tok_emb(tokens_R)[:, None]
        if m.pos_emb is not None:
            x_R1D = x_R1D + m.pos_emb.weight[pos]
        for i, block in enumerate(self.blocks):
            a = block.attn
            qkv = a.qkv_proj(block.attn_norm(x_R1D)).view(R, 1, a.n_heads + 2 * a.n_kv_heads, a.head_dim)
            q_R1HE, k_R1KE, v_R1KE = qkv.split([a.n_heads, a.n_kv_heads, a.n_kv_heads], dim=2)
            q_RH1E, k_RK1E, v_RK1E = q_R1HE.transpose(1, 2), k_R1KE.transpose(1, 2), v_R1KE.transpose(1, 2)
            if a.q_norm is not None and a.k_norm is not None:
                q_RH1E, k_RK1E = a.q_norm(q_RH1E), a.k_norm(k_RK1E)
            if self.rope is not None:
                cos, sin = self.rope[0][pos : pos + 1], self.rope[1][pos : pos + 1]
                q_RH1E, k_RK1E = apply_rope(q_RH1E, cos, sin), apply_rope(k_RK1E, cos, sin)
            self.keys[i][:, :, pos] = k_RK1E[:, :, 0]
            self.values[i][:, :, pos] = v_RK1E[:, :, 0]
            y_RH1E = F.scaled_dot_product_attention(
                q_RH1E,
                self.keys[i][:, :, : pos + 1],
                self.values[i][:, :, : pos + 1],
                enable_gqa=a.n_kv_heads != a.n_heads,
            )
            x_R1D = x_R1D + a.out_proj(y_RH1E.transpose(1, 2).reshape(R, 1, -1))
            x_R1D = x_R1D + block.mlp(block.mlp_norm(x_R1D))
        return m.lm_head(m.final_norm(x_R1D))[:, 0]


def float_frequencies(logits_RV: torch.Tensor, vocab: int, eot: int) -> np.ndarray:
    """Integer token frequencies (as float64, exact) from fp32 logits: what the range coder sees."""
    z_RV = logits_RV[:, :vocab].float().cpu().double()
    z_RV[:, eot] = -torch.inf  # never coded: the header holds the token count
    return (torch.floor(torch.softmax(z_RV, dim=-1) * FREQ_SCALE) + 1).numpy()
