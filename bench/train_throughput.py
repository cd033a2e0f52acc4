"""Training throughput of tenx against a nanoGPT-style reference loop of the same shape, same process.

The reference is what nanoGPT does: one GPT module (fused c_attn, scaled_dot_product_attention, the loss
inside the module), AdamW (fused on CUDA, torch's default on a CPU, as nanoGPT chooses), bf16 autocast and
torch.compile where the shape asks for them, batches copied from pinned memory without blocking. For a
llama-family shape the reference swaps in what that family needs (RMSNorm, RoPE, SwiGLU, grouped KV heads,
QK-norm, untied output), written the same plain way. tenx trains through `tenx.train.run`'s default
callbacks (validation, step record, prequential code length, statistics, watch, metrics, TensorBoard,
checkpointing), and a step's time is one whole turn of its loop, from one step's end to the next's: every
callback is paid for. Both read the same batches of the same prepared data, with the same schedule.

Shapes:
  cpu       gpt2 depth 6 (d_model 384), seq 256, micro-batch 8, fp32, eager: the CPU figure (default on a CPU)
  gpt2-d12  configs/gpt2-d12.toml: depth 12, vocab 32768, seq 1024, micro-batch 32 x 4, bf16, compile
  llama-1b  configs/llama-1b.toml: depth 28, d_model 1792, GQA 28/4, vocab 32768, seq 2048, 8 x 8, bf16, compile
`--tiny` shrinks gpt2-d12 and llama-1b to a few seconds a step on a CPU (the GPU check's CPU matrix). The
vocabulary is set explicitly (model.vocab_size), so any prepared data directory serves every shape.

Printed per run: tokens/s, MFU (against the vendor's peak on a known GPU, the measured matmul peak on a CPU),
peak memory (CUDA: max allocated; CPU: the process's peak RSS, reset before each run), the mean loss of the
last steps; then tenx/reference ratios and what each callback costs per step. On a CPU the runs alternate
(reference, tenx, reference, tenx, ...; `--rounds`) after the allocator is tuned once for the whole process,
so the machine's drift and the allocator fall on both alike.

    python bench/train_throughput.py [--device cpu|cuda] [--shape cpu|gpt2-d12|llama-1b] [--steps N]
                                     [--rounds R] [--tiny] [--precision fp32|bf16|fp8] [--data DIR]

`--precision fp8` (a GPU with fp8 tensor cores) trains tenx with float8 linears against the bf16 reference;
run the same shape with `--precision bf16` beside it for tenx's own bf16 figure.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tenx.data.loader import TokenLoader, TokenStream
from tenx.data.manifest import read_manifest
from tenx.data.prepare.pipeline import PrepareConfig, is_prepared, prepare
from tenx.errors import DataError
from tenx.hardware import device_name, peak_flops, pick_device, resolve_precision, tune_cpu_allocator
from tenx.model.config import ModelConfig
from tenx.model.flops import flops_per_token
from tenx.train.config import RunConfig, load_run_config, resolve_config_path
from tenx.train.hooks import Callback
from tenx.train.optim import OptimConfig, lr_at
from tenx.train.rng import seed_everything
from tenx.train.run import default_callbacks
from tenx.train.trainer import Trainer

SHAPES = ("cpu", "gpt2-d12", "llama-1b")
HOOKS = ("on_step_start", "pre_optim_step", "on_step_end")


# ----- the reference: a nanoGPT-style single-module GPT (and its llama-family twin) --------------------
class RefNorm(nn.Module):
    def __init__(self, d: int, rms: bool, bias: bool, eps: float) -> None:
        super().__init__()
        self.rms, self.eps = rms, eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias and not rms else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class RefBlock(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.d_model and c.n_heads and c.n_kv_heads and c.d_ff
        d, rms, bias = c.d_model, c.norm == "rmsnorm", bool(c.bias)
        self.n_head, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, c.d_model // c.n_heads
        self.swiglu = c.mlp == "swiglu"
        self.ln_1, self.ln_2 = RefNorm(d, rms, bias, c.norm_eps), RefNorm(d, rms, bias, c.norm_eps)
        self.c_attn = nn.Linear(d, (self.n_head + 2 * self.n_kv) * self.hd, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        self.q_norm = RefNorm(self.hd, rms, bias, c.norm_eps) if c.qk_norm else None
        self.k_norm = RefNorm(self.hd, rms, bias, c.norm_eps) if c.qk_norm else None
        self.c_fc = nn.Linear(d, (2 if self.swiglu else 1) * c.d_ff, bias=bias)
        self.mlp_proj = nn.Linear(c.d_ff, d, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(self.ln_1(x)).view(B, T, -1, self.hd)
        q, k, v = qkv.split([self.n_head, self.n_kv, self.n_kv], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None and sin is not None:
            q, k = rope(q, cos[:T], sin[:T]), rope(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_head)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        h = self.c_fc(self.ln_2(x))
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return x + self.mlp_proj(h)


class RefGPT(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.vocab_size and c.d_model and c.n_heads
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.seq_len, c.d_model) if c.pos == "learned" else None
        self.h = nn.ModuleList(RefBlock(c) for _ in range(c.depth))
        self.ln_f = RefNorm(c.d_model, c.norm == "rmsnorm", bool(c.bias), c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.wte.weight = self.lm_head.weight
        if c.pos == "rope":
            hd = c.d_model // c.n_heads
            freqs = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
            angles = torch.outer(torch.arange(c.seq_len).float(), freqs)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
        else:
            self.cos = self.sin = None
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scaled = name.endswith(("c_proj.weight", "mlp_proj.weight"))
                nn.init.normal_(p, 0.0, c.init_std / math.sqrt(2 * c.depth) if scaled else c.init_std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe.weight[: idx.shape[1]]
        for block in self.h:
            x = block(x, self.cos, self.sin)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


# ----- shapes and measurement --------------------------------------------------------------------------
def run_config(
    shape: str, device: torch.device, data: Path, steps: int, tiny: bool, precision: str | None = None
) -> RunConfig:
    """The tenx run config of `shape` (both runs take their model, batch, schedule and precision from it;
    `precision` replaces the shape's: with fp8 the reference runs bf16, tenx converts its linears)."""
    common = [
        f"data.dir={data}",
        f"train.steps={steps}",
        f"train.device={device}",
        "train.eval_every=0",  # validation once, at the end (the last step is not timed)
        "train.eval_batches=2",
        "checkpoint.every=0",
        "checkpoint.at_end=false",
        "log.progress=false",
    ]
    if shape == "cpu":
        settings = [
            "model.family=gpt2",
            "model.depth=6",
            "model.seq_len=256",
            "optim.lr=2e-3",
            "optim.warmup_steps=10",
            "train.micro_batch=8",
            "train.precision=fp32",
        ]
        return load_run_config(
            None, common + settings + ([f"train.precision={precision}"] if precision else [])
        )
    settings = ["model.vocab_size=32768"]
    if tiny:  # a few seconds a step on a CPU, the shape's family and features kept; the data's vocabulary
        settings = [
            "model.depth=2",
            "model.seq_len=128",
            "train.micro_batch=4",
            "train.grad_accum=2",
            "train.compile=false",
            "train.precision=fp32",
            "optim.warmup_steps=5",
        ]
        if shape == "llama-1b":
            settings.append("model.n_kv_heads=1")
    if precision:
        settings.append(f"train.precision={precision}")
    return load_run_config(resolve_config_path(shape), common + settings)


def rss_peak_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def reset_peak_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return rss_peak_mib()


def run_reference(cfg: RunConfig, model_cfg: ModelConfig, loader: TokenLoader, device: torch.device) -> dict:
    """Train the reference for cfg.train.steps; per-step wall seconds and losses."""
    steps, accum = cfg.train.steps or 0, cfg.train.grad_accum
    amp = resolve_precision(cfg.train.precision, device)
    model = RefGPT(model_cfg).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim: OptimConfig = cfg.optim
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        fused=True if device.type == "cuda" else None,
    )
    forward = torch.compile(model) if cfg.train.compile else model
    pin = device.type == "cuda"
    times, losses = [], []
    t0 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, optim)
        for _ in range(accum):
            x, y = loader.next_batch()
            if pin:
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
                loss = forward(x, y) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item() * accum)  # nanoGPT logs the loss every step (a sync, as tenx's)
        now = time.perf_counter()
        times.append(now - t0)
        t0 = now
    return {"times": times, "losses": losses}


class StepClock(Callback):
    """Last of the callbacks: the wall time of every turn of the loop, and each callback's share of it.

    Each other callback's hooks are wrapped to add their time to that callback's tally per step."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.ends: list[float] = []
        self.losses: list[float] = []
        self.costs: dict[str, list[float]] = {}
        for cb in callbacks:
            name = type(cb).__name__
            tally = self.costs.setdefault(name, [])
            for hook in HOOKS:
                setattr(cb, hook, self._timed(getattr(cb, hook), tally))

    def _timed(self, method: Any, tally: list[float]) -> Any:
        def timed(trainer: Any, *args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return method(trainer, *args)
            finally:
                while len(tally) < trainer.step + 1:
                    tally.append(0.0)
                tally[trainer.step] += time.perf_counter() - t0  # during a step: attributed to it

        return timed

    def on_train_start(self, trainer: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        self.ends.append(time.perf_counter())
        self.losses.append(float(metrics["loss"]))


def run_tenx(cfg: RunConfig, run_dir: Path) -> dict:
    """Train tenx for cfg.train.steps through its default callbacks; per-turn wall seconds, losses, costs."""
    callbacks = default_callbacks(cfg)
    clock = StepClock(callbacks)
    trainer = Trainer(cfg, run_dir, [*callbacks, clock])
    trainer.fit()
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]
    return {"times": times, "losses": clock.losses, "costs": clock.costs, "trainer": trainer}


def summarize(run: dict, tokens_per_step: int, skip: int, fpt: int, peak: float, memory: float) -> dict:
    timed = run["times"][skip:-1]  # the warm-up (compile) and the last step (validation at the end) left out
    tps = tokens_per_step * len(timed) / sum(timed)
    tail = run["losses"][-10:]
    return {
        "tokens_per_s": tps,
        "mfu": fpt * tps / peak,
        "peak_mib": memory,
        "final_loss": sum(tail) / len(tail),
        "step_s": statistics.median(timed),
    }


def ensure_data(data: Path) -> Path:
    """`data` as it is when it holds a prepared directory (any corpus, any tokenizer: the shapes set their
    vocabulary), else the standard library prepared into it with BPE 8192."""
    try:
        read_manifest(data)
        return data
    except DataError:
        pass
    cfg = PrepareConfig(source="stdlib", out=str(data))
    if not is_prepared(cfg):
        print(f"preparing the stdlib corpus into {data} ...", file=sys.stderr)
        prepare(cfg)
    return data


def compare(
    shape: str,
    device: torch.device | str,
    steps: int = 30,
    skip: int = 5,
    tiny: bool = False,
    data: Path | str = "runs/data/stdlib",
    rounds: int = 1,
    precision: str | None = None,
) -> dict:
    """Time tenx and the reference on `shape`, alternating `rounds` times; the medians of each, as a dict.
    `precision` replaces the shape's train.precision (fp8: tenx's linears in float8, the reference bf16)."""
    device = pick_device(str(device), "--device")
    if shape not in SHAPES:
        raise SystemExit(f"--shape: one of {', '.join(SHAPES)}, got {shape!r}")
    data = ensure_data(Path(data))
    if device.type == "cpu":
        tune_cpu_allocator()  # once for the process: both runs get it
    skip = min(skip, max(0, steps - 3))
    cfg = run_config(shape, device, data, steps, tiny, precision)
    stream = TokenStream(data, "train")
    model_cfg = cfg.model.resolved(int(stream.manifest["tokenizer"]["vocab_size"]))
    fpt = flops_per_token(model_cfg)
    dtype = resolve_precision(cfg.train.precision, device)
    peak = peak_flops(device, dtype)
    tokens_per_step = cfg.train.micro_batch * cfg.train.grad_accum * model_cfg.seq_len
    runs: dict[str, list[dict]] = {"reference": [], "tenx": []}
    costs: dict[str, list[float]] = {}
    for _ in range(rounds):
        reset_peak_memory(device)
        seed_everything(cfg.train.seed)
        loader = TokenLoader(stream, model_cfg.seq_len, cfg.train.micro_batch, seed=cfg.train.seed)
        ref = run_reference(cfg, model_cfg, loader, device)
        runs["reference"].append(summarize(ref, tokens_per_step, skip, fpt, peak, peak_memory_mib(device)))
        del ref, loader
        reset_peak_memory(device)
        with tempfile.TemporaryDirectory(prefix="tenx-throughput-") as tmp:
            tenx = run_tenx(cfg, Path(tmp) / "run")
            runs["tenx"].append(summarize(tenx, tokens_per_step, skip, fpt, peak, peak_memory_mib(device)))
            timed_steps = range(skip + 1, steps)  # the same steps as the timing (1-based: skip+1 .. steps-1)
            for name, tally in tenx["costs"].items():
                per_step = [tally[s] if s < len(tally) else 0.0 for s in timed_steps]
                costs.setdefault(name, []).append(1000 * sum(per_step) / len(per_step))
            del tenx
    med = {who: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for who, rs in runs.items()}
    return {
        "shape": shape + (" (tiny)" if tiny else ""),
        "device": device_name(device),
        "precision": cfg.train.precision
        if cfg.train.precision == "fp8"
        else str(dtype).removeprefix("torch."),
        "compile": cfg.train.compile,
        "tokens_per_step": tokens_per_step,
        "tenx": med["tenx"],
        "reference": med["reference"],
        "ratio": med["tenx"]["tokens_per_s"] / med["reference"]["tokens_per_s"],
        "memory_ratio": med["tenx"]["peak_mib"] / med["reference"]["peak_mib"],
        "callbacks_ms_per_step": {name: statistics.median(v) for name, v in costs.items()},
        "rounds": rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    ap.add_argument("--shape", choices=SHAPES, default=None, help="default: cpu on a CPU, gpt2-d12 on a GPU")
    ap.add_argument(
        "--steps", type=int, default=None, help="steps per run (default 40 on a CPU, 30 on a GPU)"
    )
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the timing")
    ap.add_argument("--rounds", type=int, default=None, help="alternations (default 2 on a CPU, 1 on a GPU)")
    ap.add_argument("--tiny", action="store_true", help="shrink gpt2-d12 / llama-1b to CPU size")
    ap.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp8"),
        default=None,
        help="replace the shape's train.precision",
    )
    ap.add_argument(
        "--data",
        default="runs/data/stdlib",
        help="prepared data (default: the stdlib, BPE 8192, made if missing)",
    )
    args = ap.parse_args()
    device = pick_device(args.device, "--device")
    gpu = device.type == "cuda"
    shape = args.shape or ("gpt2-d12" if gpu else "cpu")
    result = compare(
        shape,
        device,
        steps=args.steps or (30 if gpu else 40),
        skip=args.skip,
        tiny=args.tiny,
        data=args.data,
        rounds=args.rounds or (1 if gpu else 2),
        precision=args.precision,
    )
    print(
        f"{result['shape']} on {result['device']}, {result['precision']}, compile {result['compile']}, "
        f"{result['tokens_per_step']:,} tokens/step, threads {torch.get_num_threads()}"
    )
    print(f"\n{'run':12} {'tokens/s':>10} {'MFU':>6} {'peak MiB':>9} {'loss@end':>9}")
    for who in ("reference", "tenx"):
        r = result[who]
        print(
            f"{who:12} {r['tokens_per_s']:10,.0f} {100 * r['mfu']:5.1f}% {r['peak_mib']:9,.0f} "
            f"{r['final_loss']:9.4f}"
        )
    print(
        f"\ntenx / reference: {result['ratio']:.2f}x tokens/s at {result['memory_ratio']:.2f}x peak memory "
        f"(median of {result['rounds']} alternating rounds)"
    )
    print("what each of tenx's callbacks costs per step (ms, in the timed steps):")
    for name, ms in sorted(result["callbacks_ms_per_step"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:18} {ms:8.2f}")
    print(json.dumps({"bench": "train_throughput", "baseline": "reference (nanoGPT-style)", **result}))


if __name__ == "__main__":
    main()
