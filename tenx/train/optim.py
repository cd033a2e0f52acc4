"""AdamW and learning-rate schedules (warmup + cosine, warmup-stable-decay)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from tenx.config import field


@dataclass
class OptimConfig:
    """AdamW hyper-parameters and the learning-rate schedule."""

    lr: float = field(3e-3, gt=0, help="peak learning rate")
    min_lr_ratio: float = field(0.1, ge=0, le=1, help="final learning rate as a fraction of the peak")
    weight_decay: float = field(0.1, ge=0, help="decoupled weight decay on matrices (not on norms, biases)")
    beta1: float = field(0.9, ge=0, lt=1, help="AdamW beta1")
    beta2: float = field(0.95, ge=0, lt=1, help="AdamW beta2")
    eps: float = field(1e-8, ge=0, help="AdamW epsilon")
    grad_clip: float = field(1.0, ge=0, help="clip the global gradient norm to this value (0 disables)")
    schedule: Literal["cosine", "wsd", "constant"] = field(
        "cosine", help="learning-rate schedule after warmup"
    )
    warmup_steps: int = field(50, ge=0, help="linear warmup steps from 0 to the peak")
    decay_fraction: float = field(
        0.2, gt=0, le=1, help="wsd only: fraction of the run spent decaying at the end"
    )
    fused: bool | None = field(None, help="fused AdamW kernel; default: use it when the device supports it")


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of a run of `total_steps` steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        decay_start = max(cfg.warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return cfg.lr
        progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
        return cfg.lr - (cfg.lr - floor) * progress
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def replanned_warmup(step: int, total_steps: int, warmup_steps: int) -> int:
    """The warmup of a run re-planned to `total_steps` steps after `step` steps (tenx.train.callbacks.budget),
    its warmup so far `warmup_steps`.

    A warmup that is over stays as it was (changing it would move the decay already under way). One still
    under way may only shorten, to a tenth of the run, as `tenx quickstart` plans a short run, and never to
    before `step`: the learning rate goes on up from where it is (a longer warmup would lower it).
    """
    if step >= warmup_steps:
        return warmup_steps
    return max(step, min(warmup_steps, max(1, total_steps // 10)))


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; fused when the device supports it."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = cfg.fused if cfg.fused is not None else device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )
