"""A teacher's next-token distribution on the student's tokens, for distillation (pure math).

The teacher is held as the inputs of its output layer, not as its probabilities: per member, its final
hidden states (N, D_k) and its output weight (V, D_k). A chunk of rows [start, end) of its log-probabilities
is made when the student's loss reaches it (tenx.model.transformer.linear_cross_entropy), so neither model's
(N, V) logits of a large vocabulary exist at once. A teacher of several members (an ensemble) is the mixture
of their probabilities, as tenx.model.ensemble computes it: log((1/K) sum_k softmax(logits_k)).

Shape suffixes as in tenx/model/transformer.py; N tokens, C a chunk of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class SoftTargets:
    """The teacher's output-layer inputs for N tokens, and the weight w of its term in the student's loss:
    (1 - w) * CE(data targets) + w * H(teacher probabilities, student)."""

    hidden: list[torch.Tensor]
    """Per member: its final (normalised) hidden states, (N, D_k), computed without gradients."""
    heads: list[torch.Tensor]
    """Per member: its output weight (V, D_k); every member's V is the student's."""
    weight: float

    def cast(self, dtype: torch.dtype) -> SoftTargets:
        """The teacher with its hidden states and output weights in `dtype`, the dtype its output layers'
        matmuls are to run in (the autocast dtype, as the student's do), converted once for all chunks."""
        return SoftTargets([h.to(dtype) for h in self.hidden], [w.to(dtype) for w in self.heads], self.weight)

    def log_probs(self, start: int, end: int, loss_dtype: torch.dtype) -> torch.Tensor:
        """The teacher's log-probabilities of rows [start, end), (C, V) in `loss_dtype`."""
        total_CV: torch.Tensor | None = None  # a running log-sum, as Ensemble.forward computes it
        for h_ND, w_VD in zip(self.hidden, self.heads, strict=True):
            logits_CV = (h_ND[start:end] @ w_VD.t()).to(loss_dtype)
            logp_CV = torch.log_softmax(logits_CV, dim=-1)
            total_CV = logp_CV if total_CV is None else torch.logaddexp(total_CV, logp_CV)
        assert total_CV is not None
        return total_CV - math.log(len(self.heads)) if len(self.heads) > 1 else total_CV


def soft_cross_entropy_sums(
    teacher_logp_CV: torch.Tensor, student_logq_CV: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the teacher's probabilities (C, V), the sum over the rows of H(teacher, student), the sum of the
    teacher's entropy H(teacher)): the rows' KL(teacher || student) is the difference of the two sums."""
    p_CV = teacher_logp_CV.exp()
    return p_CV, -(p_CV * student_logq_CV).sum(), -(p_CV * teacher_logp_CV).sum()
