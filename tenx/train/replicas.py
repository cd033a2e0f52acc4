"""Replica groups across clusters with torchft (stub: config only; the implementation follows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tenx.config import field
from tenx.errors import ConfigError


@dataclass
class ReplicaConfig:
    """Fault-tolerant replica groups (one per cluster) coordinated by a torchft lighthouse."""

    mode: Literal["off", "sync", "diloco", "streaming-diloco"] = field(
        "off",
        help="'off': one group; 'sync': fault-tolerant data parallel across groups every step; 'diloco': "
        "inner AdamW steps, an outer Nesterov step on averaged pseudo-gradients every sync_every steps; "
        "'streaming-diloco': DiLoCo with the model in fragments synced at staggered steps",
    )
    groups: int = field(1, help="replica groups the data is split across (each reads its own share)")
    group_id: int = field(0, help="this group's index in [0, groups); env TENX_REPLICA_GROUP overrides it")
    lighthouse: str = field(
        "", help="lighthouse address http://HOST:PORT (`tenx lighthouse`); env TORCHFT_LIGHTHOUSE if empty"
    )
    min_groups: int = field(1, help="fewest groups that may take a step (the others heal and rejoin)")
    sync_every: int = field(50, help="diloco: inner steps between outer steps (H)")
    outer_lr: float = field(0.7, help="diloco: outer SGD learning rate")
    outer_momentum: float = field(0.9, help="diloco: outer Nesterov momentum")
    fragments: int = field(2, help="streaming-diloco: model fragments synced at staggered steps")
    fragment_sync_delay: int = field(
        0, help="streaming-diloco: inner steps a fragment's all-reduce may overlap before it is applied"
    )
    timeout_s: float = field(60.0, help="collectives and quorum timeout (a dead peer is dropped after it)")

    def validate(self) -> None:
        """Check ranges; names the offending field."""
        if self.groups < 1:
            raise ConfigError(f"parallel.replicas.groups: must be >= 1, got {self.groups}")
        if not 0 <= self.group_id < self.groups:
            raise ConfigError(
                f"parallel.replicas.group_id: must be in [0, {self.groups}), got {self.group_id}"
            )
        if not 1 <= self.min_groups <= self.groups:
            raise ConfigError(
                f"parallel.replicas.min_groups: must be in [1, groups={self.groups}], got {self.min_groups}"
            )
        if self.sync_every < 1:
            raise ConfigError(f"parallel.replicas.sync_every: must be >= 1, got {self.sync_every}")
        if self.mode == "streaming-diloco":
            if self.fragments < 1 or self.sync_every % self.fragments:
                raise ConfigError(
                    f"parallel.replicas.fragments: must be >= 1 and divide sync_every={self.sync_every}, "
                    f"got {self.fragments}"
                )
            if self.fragment_sync_delay >= self.sync_every // self.fragments:
                raise ConfigError(
                    "parallel.replicas.fragment_sync_delay: must be < sync_every / fragments, got "
                    f"{self.fragment_sync_delay}"
                )
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.replicas.timeout_s: must be > 0, got {self.timeout_s}")
