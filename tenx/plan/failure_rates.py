"""What fails in a cluster, and how often: the `[failures]` table of a cluster file (tenx/plan/estimate.py's
`Cluster.failures`), read by `tenx plan failures` (tenx/plan/failsim.py).

A cluster's failures are counts of unexpected interruptions by component over an exposure of `gpu_days`
(accelerators x days); a component's rate per accelerator is count / gpu_days, and rates add. The default is
Llama 3's published breakdown (The Llama 3 Herd of Models, 2024, §3.3.4, Table 5): 419 unexpected
interruptions in 54 days on 16,384 H100 GPUs (466 with 47 planned ones, left out). The counts sum to 419;
the paper's percentages do not all equal count/419 (faulty GPU: 148, printed as 30.1%), so counts are used.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenx.config import field
from tenx.errors import ConfigError

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54.0
# Llama 3 §3.3.4 Table 5: unexpected interruptions by root cause, 54 days on 16,384 H100s (sum 419).
LLAMA3_UNEXPECTED = {
    "faulty GPU": 148,
    "GPU HBM3 memory": 72,
    "software bug": 54,
    "network switch/cable": 35,
    "host maintenance": 32,
    "GPU SRAM memory": 19,
    "GPU system processor": 17,
    "NIC": 7,
    "NCCL watchdog timeouts": 7,
    "silent data corruption": 6,
    "GPU thermal interface + sensor": 6,
    "SSD": 3,
    "power supply": 3,
    "server chassis": 2,
    "IO expansion board": 2,
    "dependency": 2,
    "CPU": 2,
    "system memory": 2,
}
LLAMA3_SOURCE = "Llama 3 (arXiv 2407.21783) §3.3.4 Table 5, unexpected interruptions"
DAY_S = 86_400.0


@dataclass
class FailureComponent:
    """One cause of unexpected interruptions and how many it caused over the exposure (`gpu_days`)."""

    name: str = field("", help="the component or cause, for reports (unique within the file)")
    count: float | None = field(None, ge=0, help="interruptions it caused over `gpu_days`")


def _llama3_components() -> list[FailureComponent]:
    return [FailureComponent(name, float(n)) for name, n in LLAMA3_UNEXPECTED.items()]


@dataclass
class FailureRates:
    """A cluster's failure rates (the `[failures]` table of a cluster file): unexpected interruptions by
    component, counted over an exposure of `gpu_days`; a component's per-accelerator rate is count / gpu_days.
    The default is Llama 3's breakdown (419 interruptions over 16,384 H100 × 54 days)."""

    source: str = field(LLAMA3_SOURCE, help="where the counts come from, for reports")
    gpu_days: float = field(
        LLAMA3_GPUS * LLAMA3_DAYS,
        gt=0,
        help="the exposure the counts were observed over: accelerators x days",
    )
    components: list[FailureComponent] = field(
        default_factory=_llama3_components, help="the causes ([[failures.components]]: name, count)"
    )

    def validate(self) -> None:
        """Each component is named once and counted; together they interrupt at a positive rate."""
        seen: set[str] = set()
        for i, c in enumerate(self.components):
            where = f"components[{i}]"
            if not c.name.strip():
                raise ConfigError(f"{where}.name: must name the component (e.g. 'faulty GPU')")
            if c.name in seen:
                raise ConfigError(f"{where}.name: {c.name!r} is listed twice; give each component once")
            seen.add(c.name)
            if c.count is None:
                raise ConfigError(f"{where}.count: missing; give the interruptions {c.name!r} caused")
        if not sum(c.count or 0.0 for c in self.components) > 0:
            raise ConfigError(
                "components: their counts sum to 0, so nothing ever fails; give at least one cause with a "
                "positive count (or drop [failures] for Llama 3's rates)"
            )

    def per_gpu_s(self) -> dict[str, float]:
        """Failures per accelerator-second of each component."""
        return {c.name: (c.count or 0.0) / (self.gpu_days * DAY_S) for c in self.components}

    def describe(self) -> str:
        """One line for reports: the source, the total count and the exposure."""
        total = sum(c.count or 0.0 for c in self.components)
        return f"{self.source}: {total:,.4g} interruptions / {self.gpu_days:,.6g} GPU-days"
