"""Model FLOPs utilization against a peak that may be wrong: re-measured when a step beats it, and reported
as unknown (never clamped to 100%) when a step still runs faster than the device can."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RECHECK_S = 60.0
"""The peak is measured again at most this often (a matmul benchmark takes a fraction of a second)."""


@dataclass
class MfuMeter:
    """MFU of each step: achieved FLOP/s over the peak; a step above the peak makes it measure the peak
    again (`measure`: the run's dtype on its device, all ranks together). A higher peak is adopted
    (`peak-flops-raised`); a step still faster than the peak means the FLOP count or the peak is wrong: MFU
    is None, and `mfu-unknown` is said once."""

    measure: Callable[[], float]
    emit: Callable[..., Any]
    """emit(kind, **fields): the run's event log at this step (rank 0), or a no-op"""
    checked: float = -math.inf
    unknown_said: bool = False

    def __call__(self, achieved: float, peak: float) -> tuple[float | None, float]:
        """(MFU or None when unknown, the peak to take from now on)."""
        if achieved <= peak:
            return achieved / peak, peak
        now = time.perf_counter()
        if now - self.checked >= RECHECK_S:
            self.checked = now
            measured = self.measure()
            if measured > peak:
                if measured > 1.01 * peak:
                    self.emit("peak-flops-raised", before=peak, achieved=achieved, peak=measured)
                peak = measured
        if achieved <= peak:
            return achieved / peak, peak
        if not self.unknown_said:
            self.unknown_said = True
            self.emit(
                "mfu-unknown",
                achieved=achieved,
                peak=peak,
                message=f"a step ran at {achieved:.4g} FLOP/s, above the measured peak {peak:.4g}: the FLOP "
                "count or the peak is wrong, so MFU is unknown",
            )
        return None, peak
