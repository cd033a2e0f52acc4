"""An ensemble of independently trained members that predicts the average of their probabilities.

    p(x_t | x_<t) = (1/K) * sum_k softmax(logits_k)[x_t]

Averaging probabilities, not logits, is what makes an ensemble a mixture: its code length on a token is
-log of the mean probability, which is never worse than the members' mean code length (Jensen) and is what
prequential coding needs. `forward` returns log((1/K) sum_k softmax(logits_k)), computed as
a running logaddexp of the members' log_softmax, minus log K, in float32: normalised log-probabilities, so anything that reads
a model's output as logits (cross-entropy, softmax, sampling, arithmetic coding) reads the mixture.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tenx.model.transformer import Transformer


class Ensemble(nn.Module):
    """K members with one configuration shape and one vocabulary: token ids (B, T) -> log mean probability
    (B, T, V), float32."""

    def __init__(self, members: list[Transformer]) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one member")
        vocab = {m.cfg.vocab_size for m in members}
        seq = {m.cfg.seq_len for m in members}
        if len(vocab) != 1 or len(seq) != 1:
            raise ValueError(
                f"ensemble members must share vocab_size and seq_len (got {sorted(vocab)} and {sorted(seq)})"
            )
        self.members = nn.ModuleList(members)
        self.cfg = members[0].cfg
        """Member 0's config: the shape the callers read (seq_len, vocab_size)."""

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        total_BTV: torch.Tensor | None = None  # a running log-sum: one (B, T, V) tensor held, not K of them
        for m in self.members:
            logp_BTV = torch.log_softmax(m(tokens_BT).float(), dim=-1)
            total_BTV = logp_BTV if total_BTV is None else torch.logaddexp(total_BTV, logp_BTV)
        assert total_BTV is not None
        return total_BTV - math.log(len(self.members))
