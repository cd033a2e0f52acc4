"""A model that keeps learning as it codes (`tenx compress --adapt`): the output layer takes Adam steps on the
tokens just coded, by arithmetic every machine rounds alike, so the decoder repeats each update bit for bit.

Prequential coding: every token is coded with the model as it stands, then the model learns from it; the
decoder decodes the token with the same model and then makes the same update. `tenx eval --adapt`
(tenx/eval/adaptive.py) measures this with float32 backpropagation through every layer, whose bits differ
between kernels; a decoder needs updates that come out identical on any CPU kind, thread count or GPU.
Here the output layer (and a logit bias that starts at zero) adapts, under the rules of
tenx/compress/fixed.py:

- the gradient of the mean cross-entropy of the N tokens coded since the last update is H^T E / N, with H
  the final norm's outputs and E = p - onehot from the coder's own integer frequencies. E is rounded to
  integers of at most 2**20 (E_BITS) and H to integers of at most 2**15 on one power-of-two grid, so H^T E
  is a sum of N products below 2**35: exact in float64 for N below 2**17 (checked);
- Adam (betas 0.9 / 0.99, epsilon 1e-8, bias-corrected, no weight decay) is +, -, *, / and sqrt in float64,
  one operation per torch call; its scalar factors are products computed in Python's float64;
- the float64 master weights are put back on the 15-bit grid after each update for the next logits.

An update is made every `every` positions of the chunks stepping forward together (`every` x rows tokens)
and at the end of each group, so a file of 100 KB sees dozens of updates. Before the first update the
logits are those of plain `tenx compress`; the learning rate and `every` are recorded in the file's header.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tenx.compress.container import CodecAdaptation
from tenx.compress.fixed import EXACT_BITS, GRID_BITS, FixedWeights, GridLinear, to_grid
from tenx.errors import TenxError

E_BITS = 20
"""Magnitude bits of the rounded p - onehot."""
BETAS = (0.9, 0.99)
EPSILON = 1e-8


class AdaptiveHead:
    """The output layer and a logit bias of one coding pass, learning from the tokens coded (module
    docstring). `logits` of final-norm outputs; `record` what was coded; `update` when due."""

    def __init__(self, weights: FixedWeights, settings: CodecAdaptation) -> None:
        head = weights.head
        self.settings, self.device = settings, weights.device
        self.linear = head
        self.master_IO = head.q_IO * head.scale_O  # exact: the grid's own values
        self.bias_O = torch.zeros_like(self.master_IO[0])
        self.moments = [torch.zeros_like(self.master_IO), torch.zeros_like(self.master_IO)]
        self.bias_moments = [torch.zeros_like(self.bias_O), torch.zeros_like(self.bias_O)]
        self.decay = [1.0, 1.0]  # beta1**t and beta2**t by repeated multiplication (no libm pow)
        self._hidden: list[torch.Tensor] = []
        self._errors: list[np.ndarray] = []

    def logits(self, hidden_RD: torch.Tensor) -> torch.Tensor:
        """Logits (R, V) of final-norm outputs: the current head plus the learned bias."""
        return self.linear(hidden_RD) + self.bias_O

    def record(self, hidden_RD: torch.Tensor, freqs_RV: np.ndarray, tokens_R: np.ndarray) -> None:
        """Keep what the rows just coded: their final-norm outputs and p - onehot of the coded tokens under
        the coder's integer frequencies (a division per entry: correctly rounded everywhere)."""
        errors = np.zeros((len(tokens_R), self.master_IO.shape[1]))  # logits past the vocabulary: no gradient
        vocab = freqs_RV.shape[1]
        errors[:, :vocab] = freqs_RV / freqs_RV.sum(axis=1, keepdims=True)  # integer sums: exact in any order
        errors[np.arange(len(tokens_R)), tokens_R] -= 1.0
        self._hidden.append(hidden_RD)
        self._errors.append(errors)

    @property
    def pending(self) -> int:
        """Tokens recorded since the last update."""
        return sum(len(e) for e in self._errors)

    def update(self) -> None:
        """One Adam step on the mean cross-entropy of the tokens recorded since the last update."""
        n = self.pending
        if n == 0:
            return
        if n >= 2 ** (EXACT_BITS - GRID_BITS - E_BITS):
            raise TenxError(f"an adaptive update over {n:,} tokens would not be exact: lower --adapt-every")
        hidden, scale = to_grid(torch.cat(self._hidden).flatten()[None])  # one grid for every row
        hidden = hidden.view(n, -1)
        errors = torch.from_numpy(np.round(np.concatenate(self._errors) * float(2**E_BITS))).to(self.device)
        self._hidden, self._errors = [], []
        unit = float(scale) * 2.0**-E_BITS  # a power of two: exact
        grad_IO = (hidden.t() @ errors) * unit  # an exact integer sum, exactly scaled
        grad_IO = grad_IO / float(n)
        grad_O = errors.sum(dim=0) * unit  # exact integer sums
        grad_O = grad_O / float(n)
        self.decay = [self.decay[0] * BETAS[0], self.decay[1] * BETAS[1]]
        step_size = self.settings.lr * math.sqrt(1.0 - self.decay[1]) / (1.0 - self.decay[0])
        self.master_IO = self.master_IO - _adam_step(self.moments, grad_IO, step_size)
        self.bias_O = self.bias_O - _adam_step(self.bias_moments, grad_O, step_size)
        q_OI, scale_O1 = to_grid(self.master_IO.t())
        self.linear = GridLinear(q_OI.t().contiguous(), scale_O1[:, 0], self.linear.bias_O)


def _adam_step(moments: list[torch.Tensor], grad: torch.Tensor, step_size: float) -> torch.Tensor:
    """Update Adam's moments in place and return the step, one IEEE operation per torch call."""
    m, v = moments
    m.mul_(BETAS[0])
    m.add_(grad * (1.0 - BETAS[0]))
    v.mul_(BETAS[1])
    v.add_((grad * grad) * (1.0 - BETAS[1]))
    denominator = torch.sqrt(v) + EPSILON
    return (m / denominator) * step_size
