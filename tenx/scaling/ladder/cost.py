"""How long a ladder's runs will take on this machine (`tenx ladder --dry-run`): each model shape's training
steps timed here, then each run's tokens, evaluations and overhead added up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tenx.errors import TenxError
from tenx.scaling.ladder.rungs import LadderConfig, PlannedRun, vocab_size_of
from tenx.train.config import RunConfig

PROBE_SECONDS = 1.5
"""The dry run times each shape's training steps for at least this long (and at least PROBE_STEPS steps)."""
PROBE_STEPS = 5
PROBE_MAX_STEPS = 40
RUN_OVERHEAD_S = 2.0
"""Seconds each run spends outside its steps and evaluations: building the model and data, its checkpoint
saves, the loss plot and loading its final checkpoint for evaluation (1 to 3 s per run of the default ladder
on 2 CPU cores)."""


def steady_step_seconds(step_seconds: list[float]) -> float:
    """A shape's step time from the timed steps of a probe: their median, so that a burst of other work on
    the machine during a step or two (or a slow first step) does not set the estimate of a whole run."""
    if not step_seconds:
        raise TenxError("steady_step_seconds: no timed steps")
    return float(statistics.median(step_seconds))


def measure_tokens_per_s(
    cfg: RunConfig,
    micro_batch: int,
    steps: int = PROBE_STEPS,
    *,
    min_seconds: float = PROBE_SECONDS,
    max_steps: int = PROBE_MAX_STEPS,
    progress: Callable[[str], None] | None = None,
) -> float:
    """Training tokens per second of cfg's model on this machine: two warm-up steps on random tokens, then
    steps timed one by one until there are `steps` of them and `min_seconds` have passed (at most
    `max_steps`); the rate of their median step (steady_step_seconds). Runs on cfg's train.threads when set
    (the threads its training will use). `progress` gets one line when the timing is done."""
    import torch

    from tenx.hardware import pick_device, resolve_precision, tune_cpu_allocator
    from tenx.model.transformer import Transformer
    from tenx.train.float8 import convert_linears_to_float8
    from tenx.train.optim import build_optimizer

    device = pick_device(cfg.train.device, "train.device")
    if device.type == "cpu":
        tune_cpu_allocator()
        if cfg.train.threads is not None:  # training sets these threads (tenx.train.parts); time on them
            torch.set_num_threads(cfg.train.threads)
    model_cfg = cfg.model.resolved(vocab_size_of(cfg))
    torch.manual_seed(0)
    model = Transformer(model_cfg).to(device)
    if cfg.train.precision == "fp8":  # the linears training converts, converted here too
        convert_linears_to_float8(model, device)
    opt = build_optimizer(model, cfg.optim, device)
    amp = resolve_precision(cfg.train.precision, device)
    assert model_cfg.vocab_size is not None
    x = torch.randint(0, model_cfg.vocab_size, (micro_batch, model_cfg.seq_len + 1), device=device)

    def step() -> float:
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
            loss, _ = model(x[:, :-1], x[:, 1:])  # the training step's own forward and loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # `device`'s queue: on `cuda:1` the current GPU is another one
        return time.perf_counter() - t0

    step(), step()  # the first steps allocate and pick kernels
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < max_steps and (len(times) < steps or time.perf_counter() - began < min_seconds):
        times.append(step())
    seconds = steady_step_seconds(times)
    if progress is not None:
        progress(
            f"  timed depth {model_cfg.depth} ({micro_batch} x {model_cfg.seq_len} tokens a step): "
            f"{seconds:.3g} s a step (median of {len(times)}), {micro_batch * model_cfg.seq_len / seconds:,.0f} "
            "tokens/s"
        )
    return micro_batch * model_cfg.seq_len / seconds


def run_seconds(run: PlannedRun, lc: LadderConfig, tokens_per_s: float) -> float:
    """Estimated wall seconds of one run that trains at `tokens_per_s`: its training tokens, the validation
    losses it logs and the final evaluation of val and held-out (forward only: a third of a training step's
    cost per token), and RUN_OVERHEAD_S."""
    # at least eval_bytes of each of the val and held-out splits, in tokens
    eval_tokens = 2 * lc.eval_bytes / _bytes_per_token(run.config) if lc.eval_bytes else 0.0
    tc = run.config.train
    if tc.eval_every:  # the validation losses logged during the run
        eval_tokens += -(-tc.steps // tc.eval_every) * tc.eval_batches * tc.micro_batch * run.seq_len
    return run.tokens / tokens_per_s + eval_tokens / (3 * tokens_per_s) + RUN_OVERHEAD_S


def estimate_seconds(
    plan: list[PlannedRun],
    lc: LadderConfig,
    *,
    tokens_per_s: Callable[[RunConfig, int], float] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Estimated wall seconds of each run on this machine (run_seconds), from the training speed of each
    shape (depth, micro-batch): `tokens_per_s(config, micro_batch)`, by default measured here
    (measure_tokens_per_s, once per shape, saying each to `progress`)."""
    speed: dict[tuple[int, int], float] = {}
    out = {}
    for run in plan:
        shape = (run.depth, run.config.train.micro_batch)
        if shape not in speed:
            if tokens_per_s is not None:
                speed[shape] = tokens_per_s(run.config, shape[1])
            else:
                speed[shape] = measure_tokens_per_s(run.config, shape[1], progress=progress)
        out[run.name] = run_seconds(run, lc, speed[shape])
    return out


def _bytes_per_token(cfg: RunConfig) -> float:
    """From the data's manifest; before the data is prepared (a dry run), 1 for bytes (a vocabulary of
    257) and a typical 3 for a BPE vocabulary."""
    from tenx.data.manifest import read_manifest
    from tenx.data.tokenizer import ByteTokenizer

    if not (Path(cfg.data.dir) / "manifest.json").exists():
        return 1.0 if cfg.model.vocab_size == ByteTokenizer.vocab_size else 3.0
    split = read_manifest(cfg.data.dir)["splits"][cfg.data.train_split]
    return max(1e-9, split["bytes"] / max(1, split["tokens"]))


def contention_note() -> str:
    """A line for the estimate when other programs keep this machine's CPUs busy (its steps were timed
    beside them), else ''."""
    from tenx.utils.cpus import BUSY_SHARE, busy_cpus, usable_cpu_count

    busy = busy_cpus()
    if busy < BUSY_SHARE:
        return ""
    return (
        f"\nnote: other programs kept {busy:.1f} of {usable_cpu_count()} CPUs busy while the steps were timed; "
        "the estimate holds while they go on doing so (alone, this machine trains faster)"
    )


def start_order(plan: list[PlannedRun]) -> list[int]:
    """The order in which several workers start `plan`'s runs (indices): the costliest (most FLOPs) first,
    so that the short runs fill the gaps at the end rather than a long one running alone."""
    return sorted(range(len(plan)), key=lambda i: -plan[i].flops)


def workers_seconds(plan: list[PlannedRun], seconds: dict[str, float], workers: int) -> float:
    """Wall seconds of `plan` trained `workers` at a time as tenx.scaling.ladder.runner.run_planned schedules it
    (start_order, each run to the first worker free), from each run's `seconds` on its worker's slot."""
    free = [0.0] * workers
    for i in start_order(plan):
        start = min(free)
        free[free.index(start)] = start + seconds[plan[i].name]
    return max(free)
