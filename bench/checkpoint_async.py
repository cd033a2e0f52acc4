"""How long a checkpoint save blocks training: synchronous against asynchronous, same state, same process.

Builds a GPT-2-shaped tenx Transformer (depth 8 with the GPT-2 vocabulary: ~51M parameters, ~0.6 GB of
parameters and AdamW moments), trains a few steps on random tokens so the optimizer state exists, then
saves N times with `AsyncCheckpointer(async_save=False)` and N times with the background writer, with a
few training steps between saves. Printed: the synchronous save time, the time an asynchronous save
blocks the loop (goal: <= 25% of a synchronous save), the background write time, and how much slower
the training steps that overlap a background write are than those that do not.

    python bench/checkpoint_async.py [--depth 8] [--saves 3] [--steps-between 3] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from tenx.checkpoint import AsyncCheckpointer
from tenx.model.config import ModelConfig
from tenx.model.transformer import Transformer, lm_loss

VOCAB, SEQ_LEN, MICRO_BATCH = 50257, 128, 4


def train_step(model: Transformer, opt: torch.optim.Optimizer, vocab: int) -> float:
    """One AdamW step on random tokens; returns its seconds."""
    t0 = time.perf_counter()
    tokens = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN + 1))
    loss, _ = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def state_tensors(model: Transformer, opt: torch.optim.Optimizer) -> dict:
    """The tensors a tenx checkpoint holds (as Trainer._state_tensors builds them)."""
    optim = get_optimizer_state_dict(model, opt)
    return {
        "model": get_model_state_dict(model),
        "optim": {"state": optim["state"]},
        "rng": {"torch": torch.get_rng_state()},
    }


def state_bytes(tree: dict) -> int:
    seen: dict[int, int] = {}

    def walk(node: object) -> None:
        if isinstance(node, torch.Tensor):
            seen[node.untyped_storage().data_ptr()] = node.untyped_storage().nbytes()
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)

    walk(tree)
    return sum(seen.values())


def describe(values: list[float]) -> str:
    return f"mean {statistics.mean(values):6.3f} s, median {statistics.median(values):6.3f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=8, help="model depth (width follows: 64 per layer)")
    ap.add_argument("--saves", type=int, default=3, help="timed saves of each kind")
    ap.add_argument("--steps-between", type=int, default=3, help="training steps between two saves")
    ap.add_argument("--keep-last", type=int, default=2, help="retention while saving")
    ap.add_argument("--out-dir", default=None, help="where to save (default: a temporary directory, removed)")
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = ModelConfig(family="gpt2", depth=args.depth, seq_len=SEQ_LEN, vocab_size=VOCAB).resolved()
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        train_step(model, opt, VOCAB)
    n_params = sum(p.numel() for p in model.parameters())
    size = state_bytes(state_tensors(model, opt))
    print(
        f"model: gpt2 depth {args.depth}, d_model {cfg.d_model}, {n_params / 1e6:.1f}M parameters; "
        f"checkpointed state {size / 2**20:,.0f} MiB; batch {MICRO_BATCH}x{SEQ_LEN}; "
        f"threads {torch.get_num_threads()}"
    )

    out = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="tenx-ckpt-bench-"))
    step = 0
    quiet_steps: list[float] = []  # no background write running
    overlapped_steps: list[float] = []  # a background write was in flight when the step began

    def meta() -> dict:
        return {"optim_param_groups": get_optimizer_state_dict(model, opt)["param_groups"], "step": step}

    try:
        sync = AsyncCheckpointer(out / "sync", keep_last=args.keep_last, async_save=False)
        sync.save(step, state_tensors(model, opt), meta())  # warm-up: DCP's first save plans and imports
        sync_times, sync_cpu = [], []
        for _ in range(args.saves):
            for _ in range(args.steps_between):
                quiet_steps.append(train_step(model, opt, VOCAB))
                step += 1
            tensors, cpu0 = state_tensors(model, opt), time.process_time()
            sync_times.append(sync.save(step, tensors, meta()))
            sync_cpu.append(time.process_time() - cpu0)
        sync.close()

        blocking, waited, write_times = [], 0, []
        with AsyncCheckpointer(out / "async", keep_last=args.keep_last) as cp:
            for i in range(args.saves):
                for _ in range(args.steps_between):
                    busy = cp.in_flight
                    (overlapped_steps if busy else quiet_steps).append(train_step(model, opt, VOCAB))
                    step += 1
                waited += cp.in_flight
                blocking.append(cp.save(step, state_tensors(model, opt), meta()))
                if i > 0:
                    write_times.append(cp.last_write_s)  # the previous job, which save() waited for
            for _ in range(args.steps_between):
                busy = cp.in_flight
                (overlapped_steps if busy else quiet_steps).append(train_step(model, opt, VOCAB))
            cp.wait()
            write_times.append(cp.last_write_s)
    finally:
        if not args.out_dir:
            shutil.rmtree(out, ignore_errors=True)

    print(f"\nsynchronous save (write, fsync, hash, publish, prune): {describe(sync_times)}")
    print(f"  of which CPU time, which a background write takes from training: {describe(sync_cpu)}")
    print(f"asynchronous save, time the loop was blocked:         {describe(blocking)}")
    print(f"asynchronous save, background write (same work):     {describe(write_times)}")
    if waited:
        print(f"  ({waited} of {args.saves} saves found the previous write still running and waited for it)")
    ratio = statistics.median(blocking) / statistics.median(sync_times)
    print(
        f"blocking / synchronous (medians): {ratio:.3f}  (goal <= 0.25: {'met' if ratio <= 0.25 else 'NOT met'})"
    )
    figures = {
        "bench": "checkpoint_async",
        "baseline": "synchronous save",
        "blocking_over_sync": ratio,
        "sync_median_s": statistics.median(sync_times),
        "async_blocking_median_s": statistics.median(blocking),
        "async_write_median_s": statistics.median(write_times),
    }
    if overlapped_steps and quiet_steps:
        q, o = statistics.median(quiet_steps), statistics.median(overlapped_steps)
        figures["step_slowdown_while_writing"] = o / q
        print(
            f"training step: {q:.3f} s median with no write running ({len(quiet_steps)} steps), "
            f"{o:.3f} s while a background write runs ({len(overlapped_steps)} steps): {o / q:.2f}x"
        )
        saved = statistics.mean(sync_times) - statistics.mean(blocking)
        lost = sum(overlapped_steps) / len(overlapped_steps) - statistics.mean(quiet_steps)
        print(
            f"per save: {saved:.3f} s of blocking saved, "
            f"{lost * len(overlapped_steps) / args.saves:.3f} s of step slowdown while writing"
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
