"""DiLoCo's outer optimiser by default: SGD with Nesterov momentum, its lr and momentum set by the run's
number of outer steps.

The rule (`outer_rule`), for a run of S = train steps // sync_every outer steps:

    momentum = clamp(1 - 10 / S, 0.5, 0.9)
    lr       = clamp(0.7 + 0.75 * (0.9 - momentum), 0.7, 1.0)

- Long runs (S >= 100) get the published setting: Nesterov momentum 0.9, outer lr 0.7 (Douillard et al.
  2023, "DiLoCo", with H = 500 inner steps; reproduced by OpenDiLoCo, Jaghouar et al. 2024).
- A short run gets less momentum: the momentum's memory 1/(1 - momentum) is held to a tenth of the run's
  outer steps, since momentum 0.9 averages over ~10 outer steps and pays off only over hundreds. The lr
  rises to 1.0 as the momentum falls to 0.5 (plain averaging, FedAvg, is lr 1.0 without momentum). Local
  measurement behind the short end (docs/multi-cluster.md, bench/diloco_vs_sync.py, 2 groups, 20 outer
  steps): lr 1.0 / momentum 0.5 left a +6.4% held-out loss gap to sync, lr 0.7 / momentum 0.9 +12.6%; the
  rule gives 1.0 / 0.5 there.
- The number of groups M is not an input. Charles et al. 2025 ("Scaling Laws for DiLoCo") find the best
  outer lr roughly independent of model size but growing with M; they give no formula, and tenx has no
  measurement across M, so a run with many groups should sweep `outer_lr` upwards from the rule's value.
  They also find DiLoCo's best H (sync_every) grows with model size; sync_every stays an explicit choice
  because it sets the bandwidth.

An explicit `outer_lr` or `outer_momentum` is used as given; with only the momentum given, the lr follows
it by the same line. Without the run length (S unknown) the rule gives the long-run setting.
"""

from __future__ import annotations

LONG_RUN_LR, LONG_RUN_MOMENTUM = 0.7, 0.9  # Douillard et al. 2023
SHORT_RUN_LR, SHORT_RUN_MOMENTUM = 1.0, 0.5  # the local 20-outer-step measurement
MEMORY_FRACTION = 10  # the momentum's memory is at most S / MEMORY_FRACTION outer steps


def outer_lr_for(momentum: float) -> float:
    """The outer lr that goes with an outer momentum: 0.7 at 0.9, rising linearly to 1.0 at 0.5 and below."""
    slope = (SHORT_RUN_LR - LONG_RUN_LR) / (LONG_RUN_MOMENTUM - SHORT_RUN_MOMENTUM)
    return min(SHORT_RUN_LR, max(LONG_RUN_LR, LONG_RUN_LR + slope * (LONG_RUN_MOMENTUM - momentum)))


def outer_rule(outer_steps: int | None) -> tuple[float, float]:
    """(lr, momentum) of the outer Nesterov SGD for a run of `outer_steps` outer steps (None: unknown)."""
    if outer_steps is None:
        return LONG_RUN_LR, LONG_RUN_MOMENTUM
    momentum = 1.0 - MEMORY_FRACTION / max(1, outer_steps)
    momentum = min(LONG_RUN_MOMENTUM, max(SHORT_RUN_MOMENTUM, momentum))
    return outer_lr_for(momentum), momentum


def resolve_outer(
    lr: float | str, momentum: float | str, total_steps: int | None, sync_every: int
) -> tuple[float, float]:
    """The outer (lr, momentum) of a run: explicit values as given, 'auto' ones by `outer_rule`."""
    outer_steps = total_steps // sync_every if total_steps is not None else None
    rule_lr, rule_momentum = outer_rule(outer_steps)
    resolved_momentum = rule_momentum if momentum == "auto" else float(momentum)
    if lr != "auto":
        return float(lr), resolved_momentum
    return (rule_lr if momentum == "auto" else outer_lr_for(resolved_momentum)), resolved_momentum
