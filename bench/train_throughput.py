"""Training throughput of tenx against a plain PyTorch reference loop of the same shape, same process.

The reference is what nanoGPT does on a CPU: one GPT module (fused c_attn, GELU MLP, LayerNorm with
bias, tied embeddings, scaled_dot_product_attention), eager, fp32, torch.optim.AdamW with its default
(non-fused on CPU) implementation. Both train the same ~14M-parameter GPT-2 shape on the same batches of
the same prepared data with the same schedule, one after the other. Printed per run: tokens/s, MFU
against this machine's measured matmul peak for the dtype in use, peak memory, and the mean loss over the
last steps; then the ratios against the reference.

    python bench/train_throughput.py [--data DIR] [--steps 40] [--compile]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tenx import config as cfglib
from tenx.data.loader import TokenLoader, TokenStream
from tenx.data.prepare.pipeline import PrepareConfig, is_prepared, prepare
from tenx.hardware import peak_flops
from tenx.model.config import ModelConfig
from tenx.model.flops import flops_per_token
from tenx.train.config import RunConfig
from tenx.train.optim import OptimConfig, lr_at
from tenx.train.trainer import Trainer, resolve_precision, seed_everything

DEPTH, SEQ_LEN, MICRO_BATCH = 6, 256, 8


# ----- the reference: a nanoGPT-style single-module GPT and loop --------------------------------------
class RefBlock(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, d: int, n_head: int, depth: int, seq_len: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.h = nn.ModuleList(RefBlock(d, n_head) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * depth)
                    if name.endswith(("c_proj.weight", "mlp_proj.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def run_reference(
    loader: TokenLoader, model_cfg: ModelConfig, optim_cfg: OptimConfig, steps: int
) -> tuple[list[float], list[float]]:
    """Train the reference for `steps`; returns per-step seconds and losses."""
    assert model_cfg.vocab_size and model_cfg.d_model and model_cfg.n_heads
    model = RefGPT(model_cfg.vocab_size, model_cfg.d_model, model_cfg.n_heads, model_cfg.depth, SEQ_LEN)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": optim_cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
    )
    times, losses = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, optim_cfg)
        x, y = loader.next_batch()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return times, losses


# ----- measurement helpers -----------------------------------------------------------------------------
def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark for this process (Linux), so each run's peak is its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def summarize(name: str, times: list[float], losses: list[float], fpt: int, peak: float, skip: int) -> dict:
    tokens_per_step = MICRO_BATCH * SEQ_LEN
    timed = times[skip:]
    tps = tokens_per_step * len(timed) / sum(timed)
    tail = losses[-10:]
    return {
        "name": name,
        "tokens_per_s": tps,
        "mfu": fpt * tps / peak,
        "peak_mib": peak_rss_mib(),
        "final_loss": sum(tail) / len(tail),
    }


def ensure_data(data: Path) -> Path:
    cfg = PrepareConfig(source="stdlib", out=str(data))
    if not is_prepared(cfg):
        print(f"preparing the stdlib corpus into {data} ...", file=sys.stderr)
        prepare(cfg)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data", default="runs/data/stdlib", help="prepared stdlib data, BPE 8192 (made if missing)"
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the timing")
    ap.add_argument("--compile", action="store_true", help="also time tenx with torch.compile")
    args = ap.parse_args()
    data = ensure_data(Path(args.data))

    run_cfg = cfglib.from_dict(
        RunConfig,
        {
            "model": {"family": "gpt2", "depth": DEPTH, "seq_len": SEQ_LEN},
            "data": {"dir": str(data)},
            "optim": {"lr": 2e-3, "warmup_steps": 10, "fused": None},
            "train": {"steps": args.steps, "micro_batch": MICRO_BATCH, "eval_every": 0},
        },
    )
    stream = TokenStream(data, "train")
    model_cfg = run_cfg.model.resolved(int(stream.manifest["tokenizer"]["vocab_size"]))
    fpt = flops_per_token(model_cfg)
    print(
        f"model: gpt2 depth {DEPTH}, d_model {model_cfg.d_model}, seq {SEQ_LEN}, batch {MICRO_BATCH}; "
        f"{fpt / 1e6:.1f} MFLOP/token; threads {torch.get_num_threads()}"
    )
    print(
        f"measured matmul peak: fp32 {peak_flops(torch.device('cpu'), torch.float32) / 1e9:.0f} GFLOP/s, "
        f"bf16 {peak_flops(torch.device('cpu'), torch.bfloat16) / 1e9:.0f} GFLOP/s"
    )

    fp32_peak = peak_flops(torch.device("cpu"), torch.float32)

    def time_reference(label: str) -> dict:
        gc.collect()
        reset_peak_rss()
        seed_everything(0)
        loader = TokenLoader(stream, SEQ_LEN, MICRO_BATCH, seed=0)
        times, losses = run_reference(loader, model_cfg, run_cfg.optim, args.steps)
        return summarize(label, times, losses, fpt, fp32_peak, args.skip)

    results = [time_reference("reference (nanoGPT-style, fp32)")]

    variants = [("tenx fp32", "fp32", False), ("tenx default (auto)", "auto", False)]
    if args.compile:
        variants.append(("tenx default + compile", "auto", True))
    for name, precision, compile_ in variants:
        gc.collect()
        reset_peak_rss()
        cfg = cfglib.from_dict(
            RunConfig,
            {
                **cfglib.to_dict(run_cfg),
                "train": {**cfglib.to_dict(run_cfg.train), "precision": precision, "compile": compile_},
            },
        )
        trainer = Trainer(cfg, Path("/tmp/tenx-bench-run"))
        times, losses = [], []
        for _ in range(args.steps):
            m = trainer.train_step()
            times.append(m["step_time_s"])
            losses.append(m["loss"])
        dtype = resolve_precision(precision, trainer.device)
        label = f"{name} [{str(dtype).replace('torch.', '')}]"
        results.append(
            summarize(
                label,
                times,
                losses,
                fpt,
                peak_flops(trainer.device, dtype),
                max(args.skip, 3 if compile_ else 0),
            )
        )
        del trainer

    # The reference once more, now that tenx has tuned the process's allocator: shows how much of the ratio
    # is the allocator and how much the training step itself.
    results.append(time_reference("reference after tenx's allocator tuning"))

    ref = results[0]
    print(f"\n{'run':44} {'tokens/s':>9} {'MFU':>6} {'peak MiB':>9} {'loss@end':>9} {'ratio':>6}")
    for r in results:
        print(
            f"{r['name']:44} {r['tokens_per_s']:9,.0f} {100 * r['mfu']:5.1f}% {r['peak_mib']:9,.0f} "
            f"{r['final_loss']:9.4f} {r['tokens_per_s'] / ref['tokens_per_s']:6.2f}"
        )
    print(
        f"\nratio vs reference at equal precision (fp32): {results[1]['tokens_per_s'] / ref['tokens_per_s']:.2f}x"
    )
    print(
        "ratio vs the reference run with the same allocator tuning (fp32): "
        f"{results[1]['tokens_per_s'] / results[-1]['tokens_per_s']:.2f}x"
    )
    print(
        f"ratio vs reference with tenx's default CPU precision: "
        f"{results[2]['tokens_per_s'] / ref['tokens_per_s']:.2f}x, loss {results[2]['final_loss']:.4f} "
        f"vs {ref['final_loss']:.4f} after {args.steps * MICRO_BATCH * SEQ_LEN:,} tokens"
    )
    print(
        json.dumps(
            {
                "bench": "train_throughput",
                "baseline": ref["name"],
                "ratio_fp32": results[1]["tokens_per_s"] / ref["tokens_per_s"],
                "ratio_fp32_same_allocator": results[1]["tokens_per_s"] / results[-1]["tokens_per_s"],
                "ratio_default_precision": results[2]["tokens_per_s"] / ref["tokens_per_s"],
                "tokens_per_s": {r["name"]: r["tokens_per_s"] for r in results},
                "final_loss": {r["name"]: r["final_loss"] for r in results},
            }
        )
    )


if __name__ == "__main__":
    main()
