"""Plan calibration: `tenx plan`'s predicted step time and peak memory against measurement on this CPU.

Each case trains a config for a few steps in a fresh process (one thread per process; several ranks under
torchrun over gloo) and measures the median step time and the peak resident memory the training added
(tenx/plan/calibrate.py). The cluster is configs/clusters/cpu.toml. First the predictions with the file's
default factors; then the factors are fitted (the single-process tiny and quickstart cases give the step
overhead, compute efficiency, runtime memory and activation factor; the 2-rank tiny DDP case gives the
per-collective latency and the communicator's memory) and every case is predicted again (fitted cases are marked *).

Baseline: the measurement itself, in the same process tree.

    python bench/plan_calibration.py [--out runs/plan_calibration] [--steps 6] [--save]

Ends with one JSON line: step_time_ratios and memory_ratios (predicted over measured, after calibration, one
per case), the same before calibration, and the fitted factors.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tenx.data.prepare.pipeline import PrepareConfig, is_prepared, prepare
from tenx.data.prepare.sources import copy_stdlib_packages
from tenx.hardware import device_name, pick_device
from tenx.plan.calibrate import fit_all, measure, predicted_over_measured, save_calibration
from tenx.plan.estimate import load_cluster
from tenx.train.config import load_run_config, resolve_config_path

PACKAGES = ("json", "email", "http", "xml", "unittest", "logging")
GPT2_SMALL_ON_CPU = ["model.seq_len=256", "train.micro_batch=2", "train.grad_accum=1", "train.compile=false"]
CASES = [  # (name, config, extra overrides, ranks, strategy, fitted on)
    ("tiny", "tiny", [], 1, "ddp", True),
    ("quickstart", "quickstart", ["train.micro_batch=8"], 1, "ddp", True),
    ("gpt2-d12", "gpt2-d12", GPT2_SMALL_ON_CPU, 1, "ddp", False),
    ("tiny ddp x2", "tiny", [], 2, "ddp", True),
    ("tiny fsdp x2", "tiny", [], 2, "fsdp", False),
    ("quickstart ddp x2", "quickstart", ["train.micro_batch=8"], 2, "ddp", False),
]


def prepare_data(out: Path) -> Path:
    corpus, data = out / "corpus", out / "data"
    copy_stdlib_packages(PACKAGES, corpus)
    cfg = PrepareConfig(source=str(corpus), out=str(data), tokenizer="bpe", vocab_size=4096)
    if not is_prepared(cfg):
        prepare(cfg, progress=False)
    return data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/plan_calibration")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--save", action="store_true", help="keep the fitted factors for `tenx plan --cluster cpu`"
    )
    args = p.parse_args()
    t0 = time.perf_counter()
    data = prepare_data(Path(args.out))
    vocab = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    common = [f"data.dir={json.dumps(str(data))}", "train.precision='fp32'"]
    measured = []
    for name, config, extra, ranks, strategy, fitted in CASES:
        overrides = [*common, *extra]
        run = load_run_config(resolve_config_path(config), overrides)
        m = measure(config, overrides, ranks=ranks, strategy=strategy, steps=args.steps)
        measured.append((name, run, m, fitted))
        print(f"measured {name}: {m['step_s']:.4f} s/step, {m['memory'] / 1e9:.3f} GB", flush=True)

    cluster = load_cluster("cpu")
    before = {name: predicted_over_measured(run, cluster, vocab, m) for name, run, m, _ in measured}
    factors = fit_all(
        [(run, vocab, m) for _, run, m, fitted in measured if fitted and m["ranks"] == 1],
        [(run, vocab, m) for _, run, m, fitted in measured if fitted and m["ranks"] > 1],
        cluster,
    )
    after = {name: predicted_over_measured(run, cluster, vocab, m) for name, run, m, _ in measured}
    print(f"\nfitted on {', '.join(n for n, *_, f in measured if f)}: {factors}")
    print(
        f"{'case':<20}{'step pred':>11}{'measured':>11}{'ratio':>8}{'mem pred GB':>13}{'measured':>10}{'ratio':>8}"
    )
    for name, *_, fitted in measured:
        r = after[name]
        print(
            f"{name + (' *' if fitted else ''):<20}{r['predicted_step_s']:>11.4f}{r['measured_step_s']:>11.4f}"
            f"{r['step_time_ratio']:>8.2f}{r['predicted_memory_gb']:>13.3f}{r['measured_memory_gb']:>10.3f}"
            f"{r['memory_ratio']:>8.2f}"
        )
    print("(* fitted on)")
    if args.save:
        measured_on = device_name(pick_device(measured[0][1].train.device, "train.device"))
        print(f"saved the factors to {save_calibration(cluster.name, factors, measured_on)}")
    print(
        json.dumps(
            {
                "cases": [n for n, *_ in measured],
                "step_time_ratios": [round(after[n]["step_time_ratio"], 3) for n, *_ in measured],
                "memory_ratios": [round(after[n]["memory_ratio"], 3) for n, *_ in measured],
                "step_time_ratios_before": [round(before[n]["step_time_ratio"], 3) for n, *_ in measured],
                "memory_ratios_before": [round(before[n]["memory_ratio"], 3) for n, *_ in measured],
                "factors": factors,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
