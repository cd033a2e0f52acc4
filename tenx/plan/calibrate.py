"""`tenx plan --measure`: predicted against measured on this machine, and the factors fitted from it.

A measurement trains the config for a few steps in a fresh process (under torchrun for several ranks, one
thread each) and reports the median step time after two warm-up steps and the peak resident memory the
training added (the process's peak RSS minus its RSS after importing torch and tenx); the last step takes
the model statistics, as every `monitor.stats_every`-th step of a run does, so their memory is in the peak
(the estimate counts them when `monitor.stats_every` > 0). The fit: the compute
efficiency that makes the predicted step time equal the measured one, and the activation factor that makes
the predicted memory equal the measured one (the part of it the formula attributes to activations). The
factors are kept per machine in plan-calibration.json in tenx's cache (tenx.utils.io.cache_dir: $TENX_CACHE_DIR
when set and not empty), with the device they were measured on, and applied by `tenx plan` to the cluster file
of that name only on that device; a damaged entry is an error naming the file and the field, never used.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tenx.errors import TenxError
from tenx.hardware import device_name, pick_device
from tenx.plan.estimate import GB, Cluster, estimate
from tenx.rundir import RunDir
from tenx.utils.io import cache_dir, read_jsonl


def _rss() -> int:
    """Current resident set size in bytes (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def _worker(config: str, overrides: list[str], run_dir: str) -> None:
    """Inside the measuring process: train, then print one JSON line with this rank's figures."""
    import tenx.train.run as run_module
    from tenx.train.config import load_run_config, resolve_config_path

    baseline = _rss()
    cfg = load_run_config(resolve_config_path(config), overrides)
    run_module.train(cfg, run_dir)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    rank = int(os.environ.get("RANK", "0"))
    metrics = read_jsonl(RunDir(run_dir).metrics) if rank == 0 else []
    times = [r["step_time_s"] for r in metrics if "step_time_s" in r]
    print(
        "TENX_MEASURE "
        + json.dumps({"rank": rank, "peak_rss": peak, "baseline_rss": baseline, "step_times": times})
    )


def measure(
    config: str, overrides: list[str], *, ranks: int = 1, strategy: str = "ddp", steps: int = 6
) -> dict[str, Any]:
    """Train `config` for `steps` steps in a fresh process (or `ranks` under torchrun); the measured figures."""
    from tenx.train.config import load_run_config, resolve_config_path

    run = load_run_config(resolve_config_path(config), overrides)
    length = (  # a config that sets train.tokens keeps it, for exactly `steps` steps
        f"train.tokens={steps * run.train.micro_batch * run.model.seq_len * run.train.grad_accum * ranks}"
        if run.train.tokens is not None
        else f"train.steps={steps}"
    )
    with tempfile.TemporaryDirectory(prefix="tenx-measure-") as tmp:
        settings = [
            *overrides,
            length,
            "train.eval_every=0",
            "checkpoint.every=0",
            "checkpoint.at_end=false",
            "log.progress=false",
            "log.tensorboard=false",
            "log.prequential_xz_mb=0",
            "train.threads=1",
            f"parallel.strategy={strategy}",
            f"monitor.stats_every={steps}",  # the last step takes the statistics (its memory; not in the median)
        ]
        code = "import sys, json; from tenx.plan.calibrate import _worker; _worker(*json.loads(sys.argv[1]))"
        payload = json.dumps([config, settings, str(Path(tmp) / "run")])
        if ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
            cmd += ["--no-python", sys.executable, "-c", code, payload]
        else:
            cmd = [sys.executable, "-c", code, payload]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if out.returncode != 0:  # the measured run's own last error line, not its traceback
            lines = [line.strip() for line in out.stderr.splitlines() if line.strip()]
            cause = next((line for line in reversed(lines) if "rror" in line), lines[-1] if lines else "")
            raise TenxError(
                f"--measure: the measured run of {config} failed (exit {out.returncode}): {cause[:500]}; "
                "run it with `tenx train` to see why"
            )
    decoder, marker, rows = json.JSONDecoder(), "TENX_MEASURE ", []
    at = out.stdout.find(marker)
    while at >= 0:  # ranks print at once: lines may interleave, so each record is decoded where it starts
        record, _ = decoder.raw_decode(out.stdout, at + len(marker))
        rows.append(record)
        at = out.stdout.find(marker, at + len(marker))
    times = next(r["step_times"] for r in rows if r["rank"] == 0)
    return {
        "step_s": statistics.median(times[2:] if len(times) > 3 else times),
        "memory": max(r["peak_rss"] - r["baseline_rss"] for r in rows),
        "ranks": ranks,
        "strategy": strategy,
    }


def predicted_over_measured(
    run: Any, cluster: Cluster, vocab: int, measured: dict[str, Any]
) -> dict[str, float]:
    """Predicted over measured step time and memory for one measured case."""
    plan = estimate(
        run, cluster, vocab=vocab, strategy=measured["strategy"], ranks=measured["ranks"], dtype="fp32"
    )
    return {
        "predicted_step_s": plan.step_s,
        "measured_step_s": measured["step_s"],
        "step_time_ratio": plan.step_s / measured["step_s"],
        "predicted_memory_gb": plan.memory_per_rank["total"] / GB,
        "measured_memory_gb": measured["memory"] / GB,
        "memory_ratio": plan.memory_per_rank["total"] / measured["memory"],
    }


def fit(cases: list[tuple[Any, int, dict[str, Any]]], cluster: Cluster) -> dict[str, float]:
    """Factors from measured single-rank cases (run config, vocab, measurement), each by least squares over
    the cases: the step overhead and compute efficiency (measured step = overhead + time at 100% of peak /
    efficiency), and the runtime memory and activation factor (measured = runtime + fixed + factor x formula)."""
    import numpy as np

    times, spent, rows, targets = [], [], [], []
    for run, vocab, measured in cases:
        plan = estimate(run, cluster, vocab=vocab, strategy="ddp", ranks=1, dtype="fp32")
        times.append([1.0, plan.compute_s * cluster.cluster.compute_efficiency])  # seconds at 100% of peak
        spent.append(measured["step_s"])
        m = plan.memory_per_rank
        transient = m["activations"] + m["logits"] + m["loss_backward"]
        fixed = m["total"] - m["runtime"] - transient
        if (
            fixed + transient
            > m["parameters"] + m["optimizer"] + m["gathered"] + m["gradients"] + m["update"]
        ):
            rows.append([1.0, transient / cluster.cluster.activation_factor])  # the peak is in the backward
        else:
            rows.append([1.0, 0.0])  # the peak is at the update: only the runtime memory is unknown
            fixed += transient
        targets.append(measured["memory"] - fixed)
    (runtime, factor), *_ = np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)
    (overhead, slowdown), *_ = np.linalg.lstsq(np.array(times), np.array(spent), rcond=None)
    return {
        "compute_efficiency": float(min(1.0, 1.0 / max(slowdown, 1.0))),
        "step_overhead_s": float(max(overhead, 0.0)),
        "activation_factor": float(max(factor, 0.05)),
        "runtime_gb": float(max(runtime, 0.0)) / GB,
    }


def fit_latency(cases: list[tuple[Any, int, dict[str, Any]]], cluster: Cluster) -> dict[str, float]:
    """From measured multi-rank cases: the per-collective latency that makes their step times exact on
    average (least squares), and the communicator's memory per rank (the mean of what the estimate lacks)."""
    excess, counts, memory = 0.0, 0.0, []
    for run, vocab, measured in cases:
        plan = estimate(
            run, cluster, vocab=vocab, strategy=measured["strategy"], ranks=measured["ranks"], dtype="fp32"
        )
        n = plan.communication["collectives"]
        excess += n * (measured["step_s"] - (plan.step_s - plan.communication["latency_s"]))
        counts += n * n
        without = plan.memory_per_rank["total"] / GB - cluster.cluster.communicator_gb
        memory.append(measured["memory"] / GB - without)
    return {
        "collective_latency_s": max(0.0, excess / counts) if counts else 0.0,
        "communicator_gb": max(0.0, sum(memory) / len(memory)) if memory else 0.0,
    }


def fit_all(
    single: list[tuple[Any, int, dict[str, Any]]],
    multi: list[tuple[Any, int, dict[str, Any]]],
    cluster: Cluster,
) -> dict[str, float]:
    """`fit` on the single-rank cases, then `fit_latency` on the multi-rank ones (if any), each set on
    `cluster` as it is fitted; the factors."""
    factors = fit(single, cluster)
    for key, value in factors.items():
        setattr(cluster.cluster, key, value)
    if multi:  # fitted with the single-rank factors in place
        factors.update(fit_latency(multi, cluster))
        for key, value in factors.items():
            setattr(cluster.cluster, key, value)
    return factors


def calibration_path() -> Path:
    """Where `--measure` keeps the factors: plan-calibration.json in tenx's cache (tenx.utils.io.cache_dir)."""
    return cache_dir() / "plan-calibration.json"


FACTOR_RANGES = {
    "compute_efficiency": (0.0, 1.0, False),
    "activation_factor": (0.0, 100.0, False),
    "runtime_gb": (0.0, 1e4, True),
    "step_overhead_s": (0.0, 1e3, True),
    "collective_latency_s": (0.0, 10.0, True),
    "communicator_gb": (0.0, 1e3, True),
}
"""Each kept factor's (low, high, whether low itself is allowed): a value outside is not a measurement (a
compute efficiency of 0 would divide the step time by zero)."""


def _bad_calibration(what: str) -> TenxError:
    return TenxError(
        f"{calibration_path()}: {what}; delete the file, or rerun `tenx plan --measure` to measure again"
    )


def _checked_factors(cluster_name: str, factors: Any) -> dict[str, Any]:
    """The saved entry of `cluster_name`, every factor in it a finite number in its range (a TenxError
    naming the file and the field otherwise)."""
    if not isinstance(factors, dict):
        raise _bad_calibration(f"the entry of {cluster_name!r} is not an object")
    for key, (low, high, low_allowed) in FACTOR_RANGES.items():
        if key not in factors:
            continue
        value = factors[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (
            number
            and math.isfinite(value)
            and value <= high
            and (value >= low if low_allowed else value > low)
        ):
            bound = f"{'[' if low_allowed else '('}{low:g}, {high:g}]"
            raise _bad_calibration(f"{cluster_name}.{key} = {value!r} is not a number in {bound}")
    return factors


def save_calibration(cluster_name: str, factors: dict[str, float], measured_on: str) -> Path:
    """Keep the factors fitted on the device named `measured_on` (tenx.hardware.device_name) for clusters
    named `cluster_name` (atomically, beside earlier ones)."""
    from tenx.utils.io import atomic_write_json

    path = calibration_path()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    known[cluster_name] = {**factors, "measured_on": measured_on}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, known)
    return path


def apply_calibration(cluster: Cluster, device: str) -> str | None:
    """Use the factors saved for this cluster's name when they were measured on `device` (this machine's,
    tenx.hardware.device_name): None when none were saved; "applied"; else why they were not (factors of
    another device would silently mis-predict this one: a CPU's for an H100 node)."""
    path = calibration_path()
    if not path.exists():
        return None
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise _bad_calibration(f"unreadable ({e})") from None
    if not isinstance(known, dict):
        raise _bad_calibration("not a JSON object of clusters' factors")
    if cluster.name not in known:
        return None
    factors = _checked_factors(cluster.name, known[cluster.name])
    measured_on = factors.get("measured_on")
    if measured_on != device:
        where = f"on {measured_on}" if isinstance(measured_on, str) else "without the device they came from"
        return (
            f"factors of {cluster.name!r} in {calibration_path()} were measured {where}, not on this machine's "
            f"{device}: not applied (measure here with --measure)"
        )
    for key in FACTOR_RANGES:
        if key in factors:
            setattr(cluster.cluster, key, float(factors[key]))
    return "applied"


def calibrate(
    config: str,
    overrides: list[str],
    cluster: Cluster,
    vocab: int,
    *,
    ranks: int = 1,
    strategy: str = "ddp",
    steps: int = 6,
    progress: Any = print,
) -> dict[str, Any]:
    """`tenx plan --measure`: measure `config` in one process at its micro-batch and at twice it (two points
    fit the overhead and efficiency of time, the runtime memory and activation factor), and under torchrun
    with `ranks` ranks when more than one (fits the per-collective latency); predicted over measured before
    and after the fit, and the fitted factors (set on `cluster`)."""
    from tenx.train.config import load_run_config, resolve_config_path

    overrides = [*overrides, "train.precision='fp32'"]  # the estimate's dtype on a CPU
    base = load_run_config(resolve_config_path(config), overrides)
    cases = []
    b = base.train.micro_batch
    for mb, n in [(b, 1), (2 * b, 1)] + ([(b, ranks)] if ranks > 1 else []):
        settings = [*overrides, f"train.micro_batch={mb}"]
        run = load_run_config(resolve_config_path(config), settings)
        measured = measure(config, settings, ranks=n, strategy=strategy if n > 1 else "ddp", steps=steps)
        progress(
            f"measured micro-batch {mb} on {n} rank{'s' * (n > 1)}: {measured['step_s']:.4f} s/step, "
            f"{measured['memory'] / GB:.3f} GB"
        )
        cases.append((f"micro-batch {mb} x{n}", run, measured))
    before = {name: predicted_over_measured(run, cluster, vocab, m) for name, run, m in cases}
    factors = fit_all(
        [(run, vocab, m) for _, run, m in cases if m["ranks"] == 1],
        [(run, vocab, m) for _, run, m in cases if m["ranks"] > 1],
        cluster,
    )
    after = {name: predicted_over_measured(run, cluster, vocab, m) for name, run, m in cases}
    measured_on = device_name(pick_device(base.train.device, "train.device"))
    return {
        "cases": [name for name, *_ in cases],
        "before": before,
        "after": after,
        "factors": factors,
        "measured_on": measured_on,
    }
