"""`tenx plan shapes`: the shapes of a run's matmuls, measured, and the nearby shapes that run faster.

Every GEMM of one forward micro-batch (fused QKV, the two attention batched matmuls, out_proj, MLP up and
down, lm_head) is timed with torch on the device in the run's dtype. Nearby candidate configs (d_ff on
coarser multiples, vocabulary padded to 128/256, the other head width, d_model +- 64/128) reuse the same
measurements where their shapes coincide. Timing rounds interleave every shape, so a candidate is compared
with the baseline round by round, on the GEMMs the change touches (time per FLOP; plain time for vocabulary
padding, whose extra columns are wasted work): a change counts only when every round agrees on its sign and
its median gain exceeds the spread (max - min) of the paired ratios. Faster per FLOP is not a faster step: a
wider model is often faster per FLOP and several times slower per step. The recommendation (`best`) is the
nearest candidate faster on its GEMMs whose whole step is measurably faster too (by the same rule) with at
least the baseline's parameters; the nearest faster per FLOP only (`best_per_flop`) is reported as what it is,
with its step time and parameters.

Shapes are (batch, M, K, N): `batch` independent (M, K) @ (K, N) products, 2*batch*M*K*N FLOPs each.
On a CPU the micro-batch is capped (`max_tokens`) and times are scaled up linearly to the full one.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tenx.errors import ConfigError
from tenx.model.config import ModelConfig, round_up
from tenx.model.flops import count_params
from tenx.plan.estimate import DEFAULT_VOCAB

CPU_MAX_TOKENS = 2048
"""Rows per GEMM benchmarked on a CPU; a full micro-batch of a large config would take minutes."""
MIN_SAMPLE_S = 0.02
"""Each timing sample repeats a GEMM until it lasts about this long, so timer resolution does not matter."""


@dataclass(frozen=True)
class Gemm:
    """One matmul of a forward pass, `count` times per micro-batch (once per layer, or once)."""

    name: str
    batch: int
    m: int
    k: int
    n: int
    count: int
    weight: tuple[int, int] | None = None
    """The nn.Linear weight shape (out, in) this GEMM multiplies by; None for attention's activations."""

    @property
    def flops(self) -> int:
        """FLOPs of one call: 2*M*K*N per batch entry."""
        return 2 * self.batch * self.m * self.k * self.n

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.batch, self.m, self.k, self.n)


def gemm_shapes(cfg: ModelConfig, micro_batch: int) -> list[Gemm]:
    """The forward GEMMs of one micro-batch of the resolved model `cfg`."""
    assert cfg.d_model and cfg.n_heads and cfg.n_kv_heads and cfg.d_ff and cfg.vocab_size
    d, t, layers = cfg.d_model, cfg.seq_len, cfg.depth
    e = d // cfg.n_heads
    rows = micro_batch * t
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * e
    up = (2 if cfg.mlp == "swiglu" else 1) * cfg.d_ff
    heads = micro_batch * cfg.n_heads
    return [
        Gemm("qkv_proj", 1, rows, d, qkv, layers, (qkv, d)),
        Gemm("attn_scores", heads, t, e, t, layers),
        Gemm("attn_values", heads, t, t, e, layers),
        Gemm("out_proj", 1, rows, cfg.n_heads * e, d, layers, (d, cfg.n_heads * e)),
        Gemm("up_proj", 1, rows, d, up, layers, (up, d)),
        Gemm("down_proj", 1, rows, cfg.d_ff, d, layers, (d, cfg.d_ff)),
        Gemm("lm_head", 1, rows, d, cfg.vocab_size, 1, (cfg.vocab_size, d)),
    ]


def _replace(cfg: ModelConfig, **changes: Any) -> ModelConfig | None:
    """A valid copy of raw config `cfg` with `changes`, or None when the change makes it invalid."""
    try:
        out = dataclasses.replace(cfg, **changes)
        out.validate()
    except (ConfigError, TypeError, ValueError):
        return None
    return out


def candidates(raw: ModelConfig, vocab: int) -> list[tuple[str, ModelConfig]]:
    """Nearby valid configs of raw config `raw`: (description, raw config) pairs, baseline excluded."""
    base = raw.resolved(vocab)
    assert base.d_model and base.d_ff and base.vocab_size and base.n_heads and base.n_kv_heads
    out: list[tuple[str, ModelConfig]] = []

    def add(what: str, cfg: ModelConfig | None) -> None:
        if cfg is not None and all(what != seen for seen, _ in out):
            out.append((what, cfg))

    d_ffs = {base.d_ff + 64, base.d_ff - 64}
    for multiple in (64, 128, 256):
        d_ffs |= {round_up(base.d_ff, multiple), base.d_ff // multiple * multiple}
    for d_ff in sorted(x for x in d_ffs if x > 0 and x != base.d_ff):
        add(f"d_ff {base.d_ff} -> {d_ff}", _replace(raw, d_ff=d_ff))
    raw_vocab = raw.vocab_size or vocab
    for multiple in (128, 256):
        padded = round_up(raw_vocab, multiple)
        if padded != base.vocab_size:
            add(f"vocab {base.vocab_size} -> {padded}", _replace(raw, vocab_size=padded))
    for head_dim in (64, 128):
        if head_dim != base.d_model // base.n_heads and base.d_model % head_dim == 0:
            n_heads = base.d_model // head_dim
            group = base.n_heads // base.n_kv_heads
            kv = n_heads // group if n_heads % group == 0 else n_heads
            cfg = _replace(raw, d_model=base.d_model, head_dim=head_dim, n_heads=n_heads, n_kv_heads=kv)
            add(f"head_dim {base.d_model // base.n_heads} -> {head_dim}", cfg)
    for delta in (-128, -64, 64, 128):
        d_model = base.d_model + delta
        if d_model > 0:
            head_dim = base.d_model // base.n_heads
            n_heads = max(1, d_model // head_dim) if raw.n_heads is None else raw.n_heads
            cfg = _replace(raw, d_model=d_model, n_heads=n_heads, head_dim=head_dim)
            add(f"d_model {base.d_model} -> {d_model}", cfg)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    """Operands and a calibrated repeat count for one GEMM shape."""

    def __init__(self, key: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype) -> None:
        batch, m, k, n = key
        self.device = device
        if batch == 1:
            x, w = (
                torch.randn(m, k, device=device, dtype=dtype),
                torch.randn(n, k, device=device, dtype=dtype),
            )
            self.call = lambda: F.linear(x, w)
        else:
            a = torch.randn(batch, m, k, device=device, dtype=dtype)
            b = torch.randn(batch, k, n, device=device, dtype=dtype)
            self.call = lambda: torch.bmm(a, b)
        self.call()
        first = self.sample(1)
        self.iters = max(1, min(1000, round(MIN_SAMPLE_S / max(first, 1e-7))))

    def sample(self, iters: int | None = None) -> float:
        """Seconds per call, averaged over `iters` calls."""
        iters = iters or self.iters
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(iters):
            self.call()
        _sync(self.device)
        return (time.perf_counter() - t0) / iters


def _step_times(gemms: list[Gemm], times: dict[tuple[int, int, int, int], list[float]], r: int) -> float:
    return sum(g.count * times[g.key][r] for g in gemms)


def _verdict(ratios: list[float]) -> tuple[bool, bool]:
    """(faster, slower) from paired ratios candidate/baseline: every round agrees on the sign and the
    median gain exceeds their spread (max - min)."""
    gain = 1 - statistics.median(ratios)
    spread = max(ratios) - min(ratios)
    consistent = all(x < 1 for x in ratios) or all(x > 1 for x in ratios)
    return gain > spread and consistent and gain > 0, -gain > spread and consistent and gain < 0


def benchmark_shapes(
    model_cfg: ModelConfig,
    micro_batch: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    repeat: int = 5,
    *,
    vocab: int = DEFAULT_VOCAB,
    max_tokens: int | None = None,
    with_candidates: bool = True,
    sampler: Callable[[tuple[int, int, int, int]], Callable[[], float]] | None = None,
) -> dict[str, Any]:
    """Time the forward GEMMs of raw config `model_cfg` and of its nearby candidates; a JSON-ready report.

    Times are per full micro-batch (scaled from at most `max_tokens` rows per GEMM; default: no cap on a
    GPU, CPU_MAX_TOKENS on a CPU) and per forward pass; backward is two more GEMMs of each shape.
    `sampler(key)` gives, for one GEMM shape (batch, M, K, N), a function returning one sample's seconds per
    call (default: a `_Timer` on `device`; tests give known times).
    """
    device = torch.device(device)
    if repeat < 2:
        raise ConfigError(f"repeat: need at least 2 measurements to report a spread, got {repeat}")
    base = model_cfg.resolved(vocab)
    if max_tokens is None:
        max_tokens = CPU_MAX_TOKENS if device.type == "cpu" else micro_batch * base.seq_len
    bench_batch = max(1, min(micro_batch, max_tokens // base.seq_len))
    scale = micro_batch / bench_batch
    configs = [("baseline", model_cfg)] + (candidates(model_cfg, vocab) if with_candidates else [])
    plans = [
        (what, cfg.resolved(vocab), gemm_shapes(cfg.resolved(vocab), bench_batch)) for what, cfg in configs
    ]
    keys = list(dict.fromkeys(g.key for _, _, gemms in plans for g in gemms))
    samples = {key: sampler(key) if sampler else _Timer(key, device, dtype).sample for key in keys}
    times: dict[tuple[int, int, int, int], list[float]] = {key: [] for key in keys}
    for _ in range(repeat):  # interleaved: every shape once per round, so drift hits all alike
        for key in keys:
            times[key].append(samples[key]() * scale)

    base_gemms = plans[0][2]
    base_rounds = [_step_times(base_gemms, times, r) for r in range(repeat)]
    base_time = statistics.median(base_rounds)
    full = {g.name: g for g in gemm_shapes(base, micro_batch)}
    rows: list[dict[str, Any]] = []
    for g in base_gemms:
        t = statistics.median(times[g.key])
        flops = full[g.name].flops
        rows.append(
            {
                "name": g.name,
                "count": g.count,
                "batch": full[g.name].batch,
                "m": full[g.name].m,
                "k": g.k,
                "n": g.n,
                "flops": flops,
                "time_s": t,
                "spread": (max(times[g.key]) - min(times[g.key])) / t,
                "flops_per_s": flops / t,
                "share": g.count * t / base_time,
            }
        )
    base_flops = sum(g.count * g.flops for g in full.values())
    base_params = count_params(base).total
    result: dict[str, Any] = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "micro_batch": micro_batch,
        "bench_micro_batch": bench_batch,
        "repeat": repeat,
        "model": dataclasses.asdict(base),
        "gemms": rows,
        "step_gemm_flops": base_flops,
        "step_gemm_time_s": base_time,
        "step_spread": (max(base_rounds) - min(base_rounds)) / base_time,
        "flops_per_s": base_flops / base_time,
        "params": base_params,
        "candidates": [],
    }
    base_keys = {g.name: g.key for g in base_gemms}
    for what, cfg, gemms in plans[1:]:
        rounds = [_step_times(gemms, times, r) for r in range(repeat)]
        full_cand = gemm_shapes(cfg, micro_batch)
        flops = sum(g.count * g.flops for g in full_cand)
        params = count_params(cfg).total
        # judged on the GEMMs the change touches, so the rest of the step does not dilute it
        changed = [g.name for g in gemms if base_keys[g.name] != g.key]
        local_c = [_step_times([g for g in gemms if g.name in changed], times, r) for r in range(repeat)]
        local_b = [_step_times([g for g in base_gemms if g.name in changed], times, r) for r in range(repeat)]
        flops_c = sum(g.count * g.flops for g in full_cand if g.name in changed)
        flops_b = sum(g.count * g.flops for g in full.values() if g.name in changed)
        # the vocabulary is the data's either way: padding only adds work, so compare plain time
        unit = 1.0 if what.startswith("vocab") else flops_c / flops_b
        local = [c / b / unit for c, b in zip(local_c, local_b)]
        step = [c / b for c, b in zip(rounds, base_rounds)]
        faster, slower = _verdict(local)
        result["candidates"].append(
            {
                "change": what,
                "gemms": changed,
                "metric": "time" if what.startswith("vocab") else "time per FLOP",
                "ratio": statistics.median(local),
                "spread": max(local) - min(local),
                "faster": faster,
                "slower": slower,
                "step_faster": _verdict(step)[0],
                "params": params,
                "step_gemm_flops": flops,
                "step_gemm_time_s": statistics.median(rounds),
                "flops_per_s": flops / statistics.median(rounds),
                "step_time_ratio": statistics.median(step),
                "time_per_flop_ratio": statistics.median(step) * base_flops / flops,
                "time_per_param_ratio": statistics.median(step) * base_params / params,
            }
        )
    result.update(pick_best(result["candidates"], base_params))
    return result


def pick_best(candidates: list[dict[str, Any]], base_params: int) -> dict[str, str | None]:
    """`best`: the nearest candidate (in parameters) faster on its GEMMs whose whole step is measurably
    faster too, with at least `base_params` parameters (a smaller model is trivially faster); `best_per_flop`:
    the nearest faster on its GEMMs, whatever its step time (None when there is none)."""

    def nearest(pool: list[dict[str, Any]]) -> str | None:
        found = min(pool, key=lambda c: abs(c["params"] / base_params - 1), default=None)
        return found["change"] if found else None

    faster = [c for c in candidates if c["faster"]]
    better = [c for c in faster if c["step_faster"] and c["params"] >= base_params]
    return {"best": nearest(better), "best_per_flop": nearest(faster)}


def format_shapes(result: dict[str, Any]) -> str:
    """The report as text: one line per GEMM, then one per candidate with its verdict."""
    lines = [
        f"GEMMs of one forward micro-batch ({result['micro_batch']} x {result['model']['seq_len']} tokens; "
        f"measured at {result['bench_micro_batch']} sequences, scaled) on {result['device']}, "
        f"{result['dtype']}, median of {result['repeat']}:",
        f"  {'gemm':<12} {'count':>5} {'batch x M x K x N':>26} {'GFLOP/s':>9} {'share':>6} {'spread':>7}",
    ]
    for r in result["gemms"]:
        shape = f"{r['batch']} x {r['m']} x {r['k']} x {r['n']}"
        lines.append(
            f"  {r['name']:<12} {r['count']:>5} {shape:>26} {r['flops_per_s'] / 1e9:>9.1f} "
            f"{r['share']:>6.1%} {r['spread']:>7.1%}"
        )
    lines.append(
        f"  step: {result['step_gemm_time_s'] * 1e3:.1f} ms, {result['flops_per_s'] / 1e9:.1f} GFLOP/s, "
        f"spread {result['step_spread']:.1%}, {result['params'] / 1e6:.2f}M params"
    )
    if result["candidates"]:
        lines.append(
            "Nearby shapes, on the GEMMs each changes (counts only beyond the spread of paired rounds):"
        )
    for c in result["candidates"]:
        verdict = "faster" if c["faster"] else "slower" if c["slower"] else "within noise"
        change = 1 - c["ratio"]
        touched = "all GEMMs" if len(c["gemms"]) == len(result["gemms"]) else "+".join(c["gemms"])
        per = " per FLOP" if c["metric"] == "time per FLOP" else ""
        lines.append(
            f"  {c['change']:<22} {abs(change):5.1%} {'faster' if change > 0 else 'slower'}{per} "
            f"on {touched} (spread {c['spread']:.1%}): "
            f"{verdict}; whole step x{c['step_time_ratio']:.3f} time, x{c['time_per_flop_ratio']:.3f} "
            f"per FLOP, x{c['time_per_param_ratio']:.3f} per param"
        )
    by_change = {c["change"]: c for c in result["candidates"]}
    best, per_flop = result.get("best"), result.get("best_per_flop")
    if best:
        c = by_change[best]
        lines.append(
            f"Faster step, no fewer parameters: {best} (whole step x{c['step_time_ratio']:.3f} the time, "
            f"x{c['params'] / result['params']:.3f} the parameters)"
        )
    else:
        lines.append("No nearby shape makes the whole step measurably faster without losing parameters.")
    if per_flop and per_flop != best:
        c = by_change[per_flop]
        slower = c["step_time_ratio"] > 1
        lines.append(
            f"Faster per FLOP only: {per_flop}: its whole step takes x{c['step_time_ratio']:.3f} the time"
            f"{' (SLOWER)' if slower else ''} for x{c['step_gemm_flops'] / result['step_gemm_flops']:.3f} "
            f"the FLOPs and x{c['params'] / result['params']:.3f} the parameters"
        )
    return "\n".join(lines)
