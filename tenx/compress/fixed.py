"""The model's next-token frequencies by arithmetic every machine rounds alike: `.tenx` files that decode on
any CPU kind, thread count or GPU.

A range decoder must see bit-identical probabilities to the encoder's. Floating-point results depend on the
kernel: a sum of 192 products comes out differently with AVX2, AVX-512, another thread count or a GPU's
order; exp and tanh differ between vector math libraries; one changed last bit of one probability and the
decoder reads garbage (a file compressed on an AMD EPYC was refused on an Intel Xeon). `FixedStepper`
computes the model's logits one position at a time, as codec's float `_Stepper` does, under rules that
leave no such freedom:

- **Every sum is a sum of integers below 2**53**, which float64 adds exactly in any order. Before each
  matmul the activations are rounded to integers of at most 2**15 on a power-of-two grid per row
  (`to_grid`), and each weight row once to integers of at most 2**15 (`FixedWeights`): a product is below
  2**30 and a dot product of up to 2**22 of them below 2**52, so any BLAS, blocking, thread count or GPU
  gives the same bits. Format version 4 puts the linear layers' activations and weights on a 7-bit grid
  clamped to 127 (INT8_LIMIT): products of int8s, summed exactly in int32 by `torch._int_mm` on a CPU and
  in float64 elsewhere, the same integers either way. Normalisation statistics are integer sums too (the
  row on a grid of 2**20). The
  attention's values go on one fixed grid per layer (products with the softmax's integer weights summed over
  positions), its exponent from a bound of |v| that the weights prove: |v_j| <= ||W_j|| * ||norm(x)|| + |b_j|
  with ||norm(x)|| <= sqrt(d) * max|gain| (+ ||bias||), computed from the integer weights.
- **Elementwise arithmetic is +, -, *, / and sqrt in float64**, which IEEE 754 rounds correctly on every
  CPU and GPU, one operation per torch call (so no kernel fuses a multiply-add), plus exact operations
  (round, floor, max, comparisons, scaling by powers of two built from their bits).
- **exp, tanh, sin and cos are polynomials** of those operations (`det_exp`, `det_tanh`, `det_sin_cos`,
  scalar `det_log`), evaluated in a fixed order; RoPE's tables come from them.

The softmax over the vocabulary becomes integer frequencies floor(exp(z - max z) * 2**24) + 1 exactly as on
the float path. The price is float64 arithmetic and ~15-bit activations (the figures: docs/eval.md).

This is a second forward pass beside `Transformer.forward`: it implements the components `COMPONENTS` names,
by ModelConfig's field names and values and tenx/model/'s module classes, and `check_components` refuses a
model with anything else (a field it does not know, a value or a module class it does not implement), naming
it, instead of coding a file with a model it would compute wrongly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NoReturn, cast

import numpy as np
import torch
from torch import nn

from tenx.errors import TenxError
from tenx.model.config import ModelConfig
from tenx.model.transformer import MLP, Attention, Block, RMSNorm, Transformer

GRID_BITS = 15
"""Magnitude bits of the integers a matmul multiplies (activations and weights)."""
INT8_LIMIT = 127
"""Format version 4's linear layers: activations and weights are integers of at most 127 in magnitude (the
7-bit grid, clamped), so products are int8 x int8 sums that int32 holds exactly (127 * 127 * 2**17 < 2**31)
and `torch._int_mm` computes 8-10x faster than float64 on a CPU core; 0.05% larger files (measured)."""
NORM_BITS = 20
"""Magnitude bits of a row's integers when its normalisation statistics are summed."""
WEIGHT_BITS = 20
"""Bits of the attention weights (integers of at most 2**20 per position)."""
EXACT_BITS = 52
"""What float64 sums exactly (2**53; one bit to spare)."""
FREQ_BITS = 24
"""Integer frequencies of the coder: floor(exp(z - max) * 2**24) + 1 (as the float path's)."""
WEIGHT_DEGREE = 7
"""det_exp's degree where its result becomes integers of at most 2**24 (attention weights, frequencies)."""
EXP_LIMIT = 700.0
"""det_exp's argument is clamped to +-700 (exp(-700) is still a normal float64)."""
FREQ_ROWS = 32
"""Rows whose frequencies are computed at once: det_exp's ~25 elementwise passes stay in the CPU's cache
(quickstart model, one thread, AMD EPYC: 27 us a row at 8-64 rows, 51 at 256, 66 at 1,024)."""
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_TWO_PI = 6.283185307179586


COMPONENTS: dict[str, tuple[object, ...]] = {
    "norm": ("layernorm", "rmsnorm"),
    "pos": ("learned", "rope"),
    "mlp": ("gelu", "swiglu"),
    "bias": (True, False),
    "qk_norm": (True, False),
    "tie_embeddings": (True, False),
    "ensemble": (1,),
}
"""ModelConfig's component fields (tenx/model/config.py) and the values of each this forward implements (one
model: an ensemble's members each record ensemble = 1; the ensemble itself is refused in compress/model.py)."""
READ_AS_GIVEN = frozenset(
    {"family", "depth", "aspect_ratio", "d_model", "head_dim", "n_heads", "n_kv_heads", "d_ff"}
    | {"vocab_size", "seq_len", "rope_theta", "norm_eps", "z_loss", "init_std", "dropout"}
)
"""ModelConfig's other fields, whose every value this forward handles: sizes (read from the weights),
constants it uses as they are, a family (its components are the fields above, resolved) and what acts only
in training (the z-loss, initialisation, dropout)."""
NORMS: dict[type[nn.Module], str] = {nn.LayerNorm: "layernorm", RMSNorm: "rmsnorm"}
"""The norm module classes this forward computes, by the `norm` value that builds each."""


def check_components(model: nn.Module) -> None:
    """Refuse (TenxError, naming it) a model with a component this forward does not implement: another model
    class than tenx/model/'s Transformer, a ModelConfig field in neither COMPONENTS nor READ_AS_GIVEN, a
    component value outside COMPONENTS, or a block, attention, MLP or norm module of another class than the
    config builds."""
    if type(model) is not Transformer:
        _refuse(f"model class {type(model).__name__}", "Transformer (tenx/model/transformer.py)")
    t = cast(Transformer, model)
    for f in dataclasses.fields(t.cfg):
        value = getattr(t.cfg, f.name)
        if f.name in READ_AS_GIVEN:
            continue
        if f.name not in COMPONENTS:
            _refuse(f"{ModelConfig.SECTION}.{f.name}={value!r}", f"the components {', '.join(COMPONENTS)}")
        implemented = COMPONENTS[f.name]
        if not any(type(value) is type(v) and value == v for v in implemented):
            _refuse(f"{ModelConfig.SECTION}.{f.name}={value!r}", ", ".join(repr(v) for v in implemented))
    norm = {kind: cls for cls, kind in NORMS.items()}[t.cfg.norm]
    expected: list[tuple[str, nn.Module | None, type[nn.Module]]] = [("final_norm", t.final_norm, norm)]
    for i, block in enumerate(t.blocks):
        expected.append((f"blocks.{i}", block, Block))
        if type(block) is Block:
            attn = block.attn
            expected += [(f"blocks.{i}.attn", attn, Attention), (f"blocks.{i}.mlp", block.mlp, MLP)]
            expected += [(f"blocks.{i}.{n}", getattr(block, n), norm) for n in ("attn_norm", "mlp_norm")]
            if type(attn) is Attention:
                expected += [(f"blocks.{i}.attn.{n}", getattr(attn, n), norm) for n in ("q_norm", "k_norm")]
    for name, module, cls in expected:
        if module is not None and type(module) is not cls:
            _refuse(f"module {name} of class {type(module).__name__}", cls.__name__)


def _refuse(what: str, implemented: str) -> NoReturn:
    raise TenxError(
        f"the model has {what}, which the fixed-point forward of portable .tenx files does not implement "
        f"(tenx/compress/fixed.py implements {implemented}): it would code with other probabilities than the "
        "model's, so this model cannot compress or decompress until fixed.py learns the component"
    )


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent (integer exponents in [-1022, 1023]) as float64, built from its bits: exact everywhere."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def det_exp(x: torch.Tensor, degree: int = 10) -> torch.Tensor:
    """exp(x) in float64, the same bits on every machine: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a
    Taylor polynomial of `degree` in Horner order, times 2**n. Relative error below 1e-12 at degree 10,
    5e-9 at 7 (what integer weights of 2**20 or 2**24 need: WEIGHT_DEGREE)."""
    x = x.clamp(-EXP_LIMIT, EXP_LIMIT)  # a new tensor: the operations below work in place (3x faster)
    t = x.mul_(_LOG2E)
    n = torch.round(t)
    r = t.sub_(n).mul_(_LN2)
    p = r * (1.0 / math.factorial(degree))
    for k in range(degree - 1, 0, -1):
        p.add_(1.0 / math.factorial(k)).mul_(r)
    p.add_(1.0)
    return p.mul_(pow2(n))


def det_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) = 1 - 2 / (exp(2x) + 1) by det_exp."""
    e = det_exp(x * 2.0).add_(1.0)
    return 1.0 - 2.0 / e


def det_sin_cos(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin a, cos a) in float64 by IEEE operations alone: a reduced to [-pi, pi], Taylor series of a / 8,
    three angle doublings."""
    r = a - torch.round(a / _TWO_PI) * _TWO_PI
    h = r * 0.125
    h2 = h * h
    s = torch.full_like(h, 0.0)
    c = torch.full_like(h, 0.0)
    for k in range(8, -1, -1):  # sin h = sum (-1)^k h^(2k+1)/(2k+1)!, cos h = sum (-1)^k h^(2k)/(2k)!
        s = s * h2
        s = s + (-1) ** k / math.factorial(2 * k + 1)
        c = c * h2
        c = c + (-1) ** k / math.factorial(2 * k)
    s = s * h
    for _ in range(3):
        s, c = (s * c) * 2.0, (c * c) - (s * s)
    return s, c


def det_log(x: float) -> float:
    """log(x) of a positive Python float by IEEE operations alone (libm's log may differ in its last bit
    between platforms): x = m 2**e, log m = 2 atanh((m - 1)/(m + 1)) by its series."""
    m, e = math.frexp(x)
    u = (m - 1.0) / (m + 1.0)
    u2, term, total = u * u, u, 0.0
    for k in range(40):
        total = total + term / (2 * k + 1)
        term = term * u2
    return e * _LN2 + 2.0 * total


def _int8_products(q_RI: torch.Tensor, q8_IO: torch.Tensor) -> torch.Tensor | None:
    """q_RI @ q8_IO as float64 by int8 products summed in int32 (exact: INT8_LIMIT), or None where this
    torch's `_int_mm` refuses the shapes (the caller's float64 product gives the same integers)."""
    flat = q_RI.reshape(-1, q_RI.shape[-1]).to(torch.int8)
    try:
        y = torch._int_mm(flat, q8_IO)
    except RuntimeError:
        return None
    return y.view(*q_RI.shape[:-1], -1).to(torch.float64)


@functools.cache
def _int_mm_works() -> bool:
    """Whether this torch computes int8 products with `torch._int_mm` on a CPU (the float64 path gives the
    same integers where it does not)."""
    try:
        one = torch.ones(1, 8, dtype=torch.int8)
        return int(torch._int_mm(one, one.t().contiguous())[0, 0]) == 8
    except (RuntimeError, AttributeError):
        return False


def to_grid(x: torch.Tensor, bits: int = GRID_BITS) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) as integers q of at most 2**bits in magnitude and a power of two per row: x ~ q * scale.
    Grids narrower than GRID_BITS are int8's: clamped to INT8_LIMIT (a row's peak can round to 2**7)."""
    peak = x.abs().amax(dim=-1, keepdim=True)
    _, exponent = torch.frexp(torch.where(peak > 0, peak, torch.ones_like(peak)))  # peak < 2**exponent
    exponent = exponent.to(torch.int64)
    q = (x * pow2(bits - exponent)).round_()
    if bits < GRID_BITS:
        q.clamp_(-INT8_LIMIT, INT8_LIMIT)
    return q, pow2(exponent - bits)  # both exact: powers of two


@dataclass
class GridLinear:
    """A linear layer on the grid: integer weights (out, in) transposed, their power-of-two row scales.
    `bits`: GRID_BITS, or 7 for format version 4's int8 products (both sides clamped to INT8_LIMIT)."""

    q_IO: torch.Tensor
    scale_O: torch.Tensor
    bias_O: torch.Tensor | None
    bits: int = GRID_BITS
    q8_IO: torch.Tensor | None = None
    """The weights as int8 where `torch._int_mm` runs (a CPU); elsewhere the same integers in float64."""

    @staticmethod
    def of(layer: nn.Linear, device: torch.device, bits: int = GRID_BITS) -> GridLinear:
        q_OI, scale_O1 = to_grid(layer.weight.detach().to(device, torch.float64), bits)
        bias = None if layer.bias is None else layer.bias.detach().to(device, torch.float64)
        q_IO = q_OI.t().contiguous()
        exact = layer.in_features <= 2**17  # int32 holds the sums (INT8_LIMIT docstring)
        int8 = bits < GRID_BITS and exact and device.type == "cpu" and _int_mm_works()
        return GridLinear(q_IO, scale_O1[:, 0], bias, bits, q_IO.to(torch.int8) if int8 else None)

    def __call__(self, x_RI: torch.Tensor) -> torch.Tensor:
        q_RI, scale_R1 = to_grid(x_RI, self.bits)
        y = None if self.q8_IO is None else _int8_products(q_RI, self.q8_IO)
        if y is None:
            y = q_RI @ self.q_IO  # an exact integer sum
        y.mul_(scale_R1)  # exact scaling by powers of two
        y.mul_(self.scale_O)
        return y if self.bias_O is None else y.add_(self.bias_O)

    def row_norms(self) -> torch.Tensor:
        """The Euclidean norm of each weight row (out,), from the integer weights: an exact sum, one sqrt."""
        return torch.sqrt((self.q_IO * self.q_IO).sum(dim=0)) * self.scale_O


@dataclass
class _Norm:
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    rms: bool

    @staticmethod
    def of(module: nn.Module, device: torch.device) -> _Norm:
        bias = getattr(module, "bias", None)
        return _Norm(
            module.weight.detach().to(device, torch.float64),
            None if bias is None else bias.detach().to(device, torch.float64),
            float(cast(float, module.eps)),
            NORMS[type(module)] == "rmsnorm",
        )

    def __call__(self, x_RD: torch.Tensor) -> torch.Tensor:
        q_RD, scale_R1 = to_grid(x_RD, NORM_BITS)
        d = float(x_RD.shape[-1])
        square_R1 = (q_RD * q_RD).sum(dim=-1, keepdim=True) / d
        if self.rms:
            centred, var = q_RD, square_R1
        else:
            mean_R1 = q_RD.sum(dim=-1, keepdim=True) / d
            centred, var = q_RD - mean_R1, square_R1 - mean_R1 * mean_R1
        var = var * scale_R1
        var = var * scale_R1
        y = (centred * scale_R1) / torch.sqrt(var + self.eps)
        y = y * self.weight
        return y if self.bias is None else y + self.bias

    def output_bound(self, d: int) -> float:
        """A bound of ||norm(x)||_2 for any x: sqrt(d) * max|gain| + ||bias||."""
        bound = math.sqrt(d) * float(self.weight.abs().max())
        if self.bias is not None:
            bound += math.sqrt(float((self.bias * self.bias).sum()))
        return bound


@dataclass
class _Layer:
    attn_norm: _Norm
    qkv: GridLinear
    out: GridLinear
    q_norm: _Norm | None
    k_norm: _Norm | None
    mlp_norm: _Norm
    up: GridLinear
    down: GridLinear
    value_exponent: int
    """The power of two of the layer's value grid."""
    value_scale: float = 1.0
    """2**value_exponent."""


class FixedWeights:
    """A model's weights on the grid, its RoPE tables and value grids: built once per codec and device."""

    def __init__(self, model: Transformer, device: torch.device, linear_bits: int = GRID_BITS) -> None:
        check_components(model)
        cfg = model.cfg
        self.linear_bits = linear_bits
        self.model = model
        self.device = device
        self.gated = cfg.mlp == "swiglu"
        blocks = [cast(Block, b) for b in model.blocks]
        attn = blocks[0].attn
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.seq_len = cfg.seq_len
        self.tok_emb = model.tok_emb.weight.detach().to(device, torch.float64)
        self.pos_emb = (
            None if model.pos_emb is None else model.pos_emb.weight.detach().to(device, torch.float64)
        )
        self.final_norm = _Norm.of(model.final_norm, device)
        self.head = GridLinear.of(model.lm_head, device, linear_bits)
        # the values' integers times the attention weights' (2**20), summed over seq_len positions
        self.value_bits = EXACT_BITS - WEIGHT_BITS - max(1, math.ceil(math.log2(cfg.seq_len)))
        self.layers = [self._layer(b, cfg.d_model or 0) for b in blocks]
        self.rope = self._rope_tables(cfg.rope_theta) if cfg.pos == "rope" else None

    def _layer(self, block: Block, d: int) -> _Layer:
        a, dev = block.attn, self.device
        layer = _Layer(
            attn_norm=_Norm.of(block.attn_norm, dev),
            qkv=GridLinear.of(a.qkv_proj, dev, self.linear_bits),
            out=GridLinear.of(a.out_proj, dev, self.linear_bits),
            q_norm=None if a.q_norm is None else _Norm.of(a.q_norm, dev),
            k_norm=None if a.k_norm is None else _Norm.of(a.k_norm, dev),
            mlp_norm=_Norm.of(block.mlp_norm, dev),
            up=GridLinear.of(block.mlp.up_proj, dev, self.linear_bits),
            down=GridLinear.of(block.mlp.down_proj, dev, self.linear_bits),
            value_exponent=0,
        )
        start = (a.n_heads + a.n_kv_heads) * a.head_dim  # the value rows of the fused projection
        norms = layer.qkv.row_norms()[start:]
        bias = 0.0 if layer.qkv.bias_O is None else float(layer.qkv.bias_O[start:].abs().max())
        bound = float(norms.max()) * layer.attn_norm.output_bound(d) + bias
        _, exponent = math.frexp(max(bound, 1e-30) * 1.01)  # margin for the grid rounding of x
        layer.value_exponent = exponent - self.value_bits
        layer.value_scale = math.ldexp(1.0, layer.value_exponent)  # exact
        return layer

    def _rope_tables(self, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.head_dim // 2
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=self.device) / self.head_dim
        inv_freq = det_exp(steps * -det_log(theta))
        angles = torch.arange(self.seq_len, dtype=torch.float64, device=self.device)[:, None] * inv_freq
        sin, cos = det_sin_cos(angles)
        assert sin.shape[-1] == half
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class FixedStepper:
    """Logits (R, V) of position `pos` of R rows, one position at a time with a key/value cache, under the
    rules of the module docstring. The same math as Transformer.forward (tests/test_codec.py compares).
    `hidden_all` runs every position of a chunk in one pass: by the same code, so the same bits (every sum
    is exact and every elementwise operation sees the same operands), which lets the encoder, who knows
    every token, skip the one-position-at-a-time loop the decoder needs."""

    def __init__(self, weights: FixedWeights, rows: int) -> None:
        w = self.w = weights
        shape = (rows, w.n_kv_heads, w.seq_len, w.head_dim)
        self.keys = [torch.zeros(shape, dtype=torch.float64, device=w.device) for _ in w.layers]
        self.key_scales = [torch.zeros(shape[:3], dtype=torch.float64, device=w.device) for _ in w.layers]
        self.values = [torch.zeros(shape, dtype=torch.float64, device=w.device) for _ in w.layers]

    def __call__(self, tokens_R: torch.Tensor, pos: int) -> torch.Tensor:
        return self.w.head(self.hidden(tokens_R, pos))

    def hidden(self, tokens_R: torch.Tensor, pos: int) -> torch.Tensor:
        """The final norm's outputs (R, D) at `pos`, which the output layer turns into logits."""
        return self._forward(tokens_R[:, None], pos)[:, 0]

    def hidden_all(self, tokens_RT: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """The final norm's outputs (R, T, D) at positions 0..T-1 of chunks starting with `tokens_RT`,
        `block` positions at a time (default: all): each block attends to the cache the blocks before it
        filled, so a block skips the scores of later positions that a single pass computes only to mask
        them (the same bits: a masked key weighs exactly 0 and every sum is exact)."""
        T = tokens_RT.shape[1]
        step = T if block is None else max(1, block)
        parts = [self._forward(tokens_RT[:, s : s + step], s) for s in range(0, T, step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _forward(self, tokens_RT: torch.Tensor, start: int) -> torch.Tensor:
        """Positions start..start+T-1 of R rows: their keys and values join the cache."""
        w = self.w
        (R, T), H, K, E = tokens_RT.shape, w.n_heads, w.n_kv_heads, w.head_dim
        end = start + T
        x = w.tok_emb[tokens_RT]
        if w.pos_emb is not None:
            x = x + w.pos_emb[start:end]
        for i, layer in enumerate(w.layers):
            qkv = layer.qkv(layer.attn_norm(x)).view(R, T, H + 2 * K, E)
            q, k, v = qkv[:, :, :H], qkv[:, :, H : H + K], qkv[:, :, H + K :]
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            if w.rope is not None:
                cos, sin = w.rope[0][start:end, None], w.rope[1][start:end, None]  # (T, 1, E)
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            k_int, k_scale = to_grid(k)  # (R, T, K, E), (R, T, K, 1)
            self.keys[i][:, :, start:end] = k_int.transpose(1, 2)
            self.key_scales[i][:, :, start:end] = k_scale[..., 0].transpose(1, 2)
            v_scale = layer.value_scale
            limit = float(2**w.value_bits)
            self.values[i][:, :, start:end] = torch.round(v / v_scale).clamp(-limit, limit).transpose(1, 2)
            x = x + layer.out(self._attend(i, q, start, v_scale))
            h = layer.up(layer.mlp_norm(x))
            if w.gated:
                gate, up = h.chunk(2, dim=-1)
                h = torch.div(gate, det_exp(-gate).add_(1.0)).mul_(up)
            else:
                inner = (h * h) * h
                inner = inner * 0.044715
                inner = (h + inner) * math.sqrt(2.0 / math.pi)
                h = (h * 0.5) * (det_tanh(inner) + 1.0)
            x = x + layer.down(h)
        return w.final_norm(x)

    def _attend(self, i: int, q_RTHE: torch.Tensor, start: int, v_scale: float) -> torch.Tensor:
        """Attention of the queries at start..start+T-1 over the cache up to each one's own position."""
        w = self.w
        (R, T), H, K, E = q_RTHE.shape[:2], w.n_heads, w.n_kv_heads, w.head_dim
        group = H // K  # query heads k*group .. (k+1)*group - 1 read key/value head k
        end = start + T
        q_int, q_scale = to_grid(q_RTHE)  # (R, T, H, E), (R, T, H, 1)
        q_int = q_int.view(R, T, K, group, E).permute(0, 2, 4, 1, 3).reshape(R, K, E, T * group)
        scores = self.keys[i][:, :, :end] @ q_int  # (R, K, L, T*G): exact integer dot products
        scores = scores * self.key_scales[i][:, :, :end, None]
        scores = scores.view(R, K, end, T, group).permute(0, 1, 3, 4, 2)  # (R, K, T, G, L)
        scores = scores * q_scale.view(R, T, K, group).permute(0, 2, 1, 3)[..., None]
        scores = scores * (1.0 / math.sqrt(E))
        if T > 1:  # position start+t sees keys 0..start+t: the others weigh exactly 0 (exp(-700) * 2**20 < 1)
            later = torch.arange(end, device=w.device) > torch.arange(start, end, device=w.device)[:, None]
            scores = scores.masked_fill(later[:, None, :], -math.inf)
        z = scores - scores.amax(dim=-1, keepdim=True)
        weights = det_exp(z, WEIGHT_DEGREE).mul_(float(2**WEIGHT_BITS)).floor_()  # integers of at most 2**20
        weights = weights.reshape(R, K, T * group, end)
        y = weights @ self.values[i][:, :, :end]  # (R, K, T*G, E): exact, below 2**52 by the value grid
        y = y / weights.sum(dim=-1, keepdim=True)
        y = (y * v_scale).view(R, K, T, group, E).permute(0, 2, 1, 3, 4)
        return y.reshape(R, T, H * E)


def fixed_frequencies(logits_RV: torch.Tensor, vocab: int, eot: int) -> np.ndarray:
    """Integer token frequencies floor(exp(z - max z) * 2**24) + 1 (end-of-document: 1) from the fixed
    stepper's logits, as float64 (exact), FREQ_ROWS rows at a time (elementwise: the same bits)."""
    parts = []
    for logits in logits_RV.split(FREQ_ROWS):
        z = logits[:, :vocab]
        z = z - z.amax(dim=-1, keepdim=True)
        freqs = det_exp(z, WEIGHT_DEGREE).mul_(float(2**FREQ_BITS)).floor_().add_(1.0)
        freqs[:, eot] = 1.0
        parts.append(freqs.cpu().numpy())
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
