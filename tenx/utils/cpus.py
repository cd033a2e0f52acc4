"""How many CPUs this process may use, how many of them other programs keep busy right now, and so how many
torch threads a command takes: the one place of thread choice (`choose_threads`, `set_torch_threads`, the
`--threads` flag).

`os.cpu_count()` is the machine's count. A process may be allowed fewer: an affinity mask (taskset, a
container's cpuset, Slurm's binding), a CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`), or a Slurm
allocation (SLURM_CPUS_PER_TASK, SLURM_CPUS_ON_NODE). `usable_cpu_count` is the least of them: worker and
thread counts start from it. `busy_cpus` measures, over a tenth of a second, how much of those CPUs other
processes use; `choose_threads` leaves them alone (two torch threads on two cores, one of them busy, ran a
training step 20 times slower than one thread). torch is imported only inside the functions that read or
set its thread count: data preparation counts its workers, and the CLI builds its `--threads` flags,
without importing it.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup hierarchy is mounted (v2: one tree; v1: a tree per controller, e.g. cpu,cpuacct/)."""
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
"""This process's cgroup path in each hierarchy."""
PROC_STAT = Path("/proc/stat")
"""Time each CPU spent busy and idle since boot, in clock ticks."""


def affinity_cpus() -> set[int] | None:
    """The CPUs this process may run on (its affinity mask), or None where the OS does not say (macOS)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return None
    try:
        return set(getaffinity(0))
    except OSError:
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _quota(quota: str | None, period: str | None) -> float | None:
    """CPUs a quota of `quota` per `period` microseconds allows; None for no quota (max, -1) or bad text."""
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _cgroup_dirs(root: Path, self_cgroup: Path) -> list[tuple[str, Path]]:
    """(version, directory) of this process's cgroup and each ancestor up to `root`, in each hierarchy.

    A limit set on an ancestor binds its children too. Inside a container the cgroup namespace usually
    makes the process's own cgroup the mount's root; where /proc/self/cgroup names a path the mount does
    not hold, only the root is read."""
    dirs: list[tuple[str, Path]] = []
    for line in (_read(self_cgroup) or "").splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and not controllers:
            version, base = "v2", root
        elif "cpu" in controllers.split(","):
            version, base = "v1", root / controllers
            if not base.is_dir():
                base = root / "cpu"
        else:
            continue
        here = base / path.lstrip("/")
        while True:
            if here.is_dir():
                dirs.append((version, here))
            if here == base or base not in here.parents:
                break
            here = here.parent
    dirs += [("v2", root), ("v1", root / "cpu,cpuacct"), ("v1", root / "cpu")]
    return dirs


def cgroup_cpu_limit(root: Path | None = None, self_cgroup: Path | None = None) -> float | None:
    """The CPU quota of this process's cgroups, in CPUs (1.5: 150 ms per 100 ms), the least of those set on
    it and its ancestors; None when there is none (or no cgroup filesystem). `root` (default CGROUP_ROOT)
    and `self_cgroup` (default PROC_SELF_CGROUP) are parameters so that tests can point them at a fake tree."""
    limits = []
    for version, d in _cgroup_dirs(root or CGROUP_ROOT, self_cgroup or PROC_SELF_CGROUP):
        if version == "v2":
            quota, _, period = (_read(d / "cpu.max") or "").partition(" ")
            limit = _quota(quota, period)
        else:
            limit = _quota(_read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us"))
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def slurm_cpu_limit(environ: Mapping[str, str] | None = None) -> int | None:
    """CPUs Slurm gave this task: SLURM_CPUS_PER_TASK, else SLURM_CPUS_ON_NODE; None outside a job."""
    environ = os.environ if environ is None else environ
    for name in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        text = environ.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return None


def usable_cpu_count(
    root: Path | None = None, self_cgroup: Path | None = None, environ: Mapping[str, str] | None = None
) -> int:
    """CPUs this process may use: the least of the machine's count, its affinity mask, its cgroup quota
    (rounded up: 1.5 CPUs still run two workers' worth of work in bursts) and its Slurm allocation. At
    least 1."""
    counts = [os.cpu_count() or 1]
    affinity = affinity_cpus()
    if affinity:
        counts.append(len(affinity))
    quota = cgroup_cpu_limit(root, self_cgroup)
    if quota is not None:
        counts.append(math.ceil(quota))
    slurm = slurm_cpu_limit(environ)
    if slurm is not None:
        counts.append(slurm)
    return max(1, min(counts))


def read_cpu_times(proc_stat: Path | None = None) -> dict[int, tuple[int, int]] | None:
    """(busy, total) clock ticks since boot of each CPU, from /proc/stat; None where there is none."""
    text = _read(proc_stat or PROC_STAT)
    if text is None:
        return None
    times = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        try:
            ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        except ValueError:
            return None
        idle = sum(ticks[3:5])
        times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return times or None


def others_busy(
    before: dict[int, tuple[int, int]],
    after: dict[int, tuple[int, int]],
    own_cpu_s: float,
    wall_s: float,
    cpus: set[int] | None = None,
) -> float:
    """CPUs' worth of time that other processes used between two `read_cpu_times` readings: each CPU's
    busy fraction (of those in `cpus`; all when None) summed, less this process's own `own_cpu_s` of CPU
    time over `wall_s` seconds. Steal time (a hypervisor running another guest) counts as busy."""
    busy = 0.0
    for cpu, (busy_after, total_after) in after.items():
        if (cpus is not None and cpu not in cpus) or cpu not in before:
            continue
        busy_before, total_before = before[cpu]
        if total_after > total_before:
            busy += (busy_after - busy_before) / (total_after - total_before)
    return max(0.0, busy - own_cpu_s / wall_s) if wall_s > 0 else busy


def busy_cpus(interval: float = 0.1, proc_stat: Path | None = None) -> float:
    """CPUs' worth of this process's usable CPUs that other processes keep busy, measured over `interval`
    seconds (/proc/stat); where there is no /proc/stat, the 1-minute load average (which counts this
    process too), else 0."""
    before = read_cpu_times(proc_stat)
    if before is None:
        try:
            return os.getloadavg()[0]
        except (AttributeError, OSError):
            return 0.0
    wall0, own0 = time.perf_counter(), time.process_time()
    time.sleep(interval)
    after = read_cpu_times(proc_stat) or {}
    wall, own = time.perf_counter() - wall0, time.process_time() - own0
    return others_busy(before, after, own, wall, affinity_cpus())


def parse_threads(text: str) -> int | None:
    """A `--threads` value: `auto` (None: choose_threads decides) or a count >= 1."""
    if text.strip().lower() == "auto":
        return None
    if not text.strip().isdigit() or not 1 <= int(text) <= MAX_THREADS:
        raise argparse.ArgumentTypeError(
            f"expected auto or a thread count from 1 to {MAX_THREADS}, got {text!r}"
        )
    return int(text)


MAX_THREADS = 4096
"""The most torch threads a flag may ask for (more than any machine has cores; torch's own count is a C int)."""


def add_threads_argument(p: argparse.ArgumentParser, help: str | None = None, default: str = "auto") -> None:
    """Add `--threads auto|N` (None for auto: choose_threads decides) to `p`."""
    p.add_argument(
        "--threads",
        type=parse_threads,
        default=default,
        metavar="auto|N",
        help=help
        or "torch CPU threads; auto: the usable CPUs less those other programs keep busy, said when fewer",
    )


def threads_override(threads: int | None) -> list[str]:
    """The `--set` override that gives every run of a command a `--threads` count (none for auto: each run
    chooses its own, choose_threads)."""
    return [] if threads is None else [f"train.threads={threads}"]


BUSY_SHARE = 0.3
"""A CPU counts as taken when other programs use at least this share of it. Too many threads cost far more
than too few: with one other process on one of two cores, two torch threads made a training step 20 times
slower (1.2 s against 0.06 s) and `tenx eval` 5 times (129 s against 24 s), where one thread costs at most
half the speed of two on an idle machine."""


@functools.cache
def torch_default_threads() -> int:
    """torch's own intra-op thread count, read once before tenx sets any: the physical cores, or
    OMP_NUM_THREADS (tenx.hardware reads it when it is imported, as every command that sets threads does
    first)."""
    import torch

    return torch.get_num_threads()


def env_threads() -> int | None:
    """The thread count OMP_NUM_THREADS (else MKL_NUM_THREADS) sets, or None when neither holds a count."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        text = os.environ.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return None


def choose_threads(
    requested: int | None = None, flag: str = "--threads N", share: int = 1, *, quiet: bool = False
) -> int:
    """torch's CPU thread count for a command: `requested` when given (a `--threads` flag, train.threads);
    else OMP_NUM_THREADS when set; else the usable CPUs (usable_cpu_count: affinity, cgroup quota, Slurm;
    at most torch's own default, the physical cores) less those other programs keep busy (busy_cpus, a
    tenth of a second), divided among the `share` processes of this job on this machine. A choice cut by
    busy CPUs is said in one line on stderr, naming `flag` to override (`quiet`: not said; a training run
    that re-checks says it in an event).
    """
    if requested is not None:
        return requested
    from_env = env_threads()
    if from_env is not None:
        return from_env
    cpus = max(1, min(usable_cpu_count(), torch_default_threads()))
    if cpus // share <= 1:
        return 1
    busy = busy_cpus()
    taken = min(cpus, int(busy + 1 - BUSY_SHARE))
    threads = max(1, (cpus - taken) // share)
    if threads < cpus // share and not quiet:
        print(
            f"tenx: other programs keep {busy:.1f} of {cpus} CPUs busy: torch uses {threads} thread"
            f"{'s' if threads > 1 else ''}, not {cpus // share} (threads sharing a core wait on each "
            f"other); {flag} to choose",
            file=sys.stderr,
        )
    return threads


def set_torch_threads(requested: int | None = None, flag: str = "--threads N", share: int = 1) -> int:
    """Set torch's CPU threads to `choose_threads(requested, flag, share)`; the count set."""
    import torch

    threads = choose_threads(requested, flag, share)
    torch.set_num_threads(threads)
    return threads
