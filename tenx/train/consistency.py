"""Replica consistency checks against silent data corruption (stub: config only; the implementation follows)."""

from __future__ import annotations

from dataclasses import dataclass

from tenx.config import field
from tenx.errors import ConfigError


@dataclass
class ConsistencyConfig:
    """Compare data-parallel replicas' parameters (and reduced gradients) to catch silent corruption."""

    every: int = field(100, help="compare replicas every N steps (0: off)")
    gradients: bool = field(True, help="also compare the reduced gradients (where replicas hold full ones)")
    self_check: bool = field(
        True,
        help="each rank checks its parameters did not change between optimizer steps (names the rank "
        "when two replicas disagree and there is no majority); one checksum pass per step",
    )

    def validate(self) -> None:
        """Check ranges; names the offending field."""
        if self.every < 0:
            raise ConfigError(f"parallel.consistency.every: must be >= 0, got {self.every}")
