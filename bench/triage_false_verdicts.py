"""False verdicts of `tenx triage`, both ways: runs whose only fault is the optimisation, and planted op bugs.

Each divergent run trains a tiny model with the learning rate at 1x, 10x, 100x and 1000x the default
(`optim.lr` 3e-3), no warmup, no clipping and no weight decay, over several seeds, two model shapes (gpt2: learned
positions, LayerNorm, GELU; llama: RoPE, RMSNorm, SwiGLU) and two precisions (fp32, bf16 autocast), with a
guard that judges spikes after 5 steps, plus one clean run per shape (the config's own
warmup and clipping). Triage reads what the runs recorded and must never answer `library-op` or
`hardware` for them: nothing but the math is at fault.

The other column is the false negatives: runs with a planted library fault, whose incidents triage must
all blame on the planted op. Per shape and precision:
- `op-bug@step=1,run=24`: the cross-entropy's reduction breaks on runs of identical targets (a spike, a NaN
  or a crash, at the config's own learning rate);
- `op=layer_norm_backward` (gpt2), `op=sdpa_backward`, `op=mm_backward`: a backward kernel returns its
  gradients negated on the fast path, at a learning rate of 5e-2 with no clipping and a tight guard (window
  12, 2 sigma), where the negated LayerNorm gradient drives the loss to 2x its start: the case a loss-ratio
  rule called `ml`.
A planted run counts as named when it raised at least one incident and every incident's verdict is
`library-op` with the planted op as its cause (a run that raised nothing is a miss too).

    python bench/triage_false_verdicts.py [--seeds 3] [--steps 150] [--precisions fp32,bf16]
        [--shapes gpt2,llama] [--planted-steps 60] [--out runs/triage_false_verdicts]

Ends with one JSON line: runs, incidents, verdicts {verdict: count}, false_library_op, false_hardware,
planted_named, planted (named and total), false_negatives, planted_rows, per-run rows and wall_s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

from tenx.data.manifest import MANIFEST_NAME
from tenx.data.prepare.pipeline import PrepareConfig, prepare
from tenx.data.prepare.sources import copy_stdlib_packages
from tenx.errors import TenxError
from tenx.rundir import RunDir
from tenx.train.config import CONFIG_DIR, load_run_config
from tenx.train.optim import OptimConfig
from tenx.train.run import train
from tenx.triage.classify import triage

SHAPES = {
    "gpt2": ["model.family='gpt2'", "model.depth=2", "model.d_model=64", "model.head_dim=32"],
    "llama": ["model.family='llama'", "model.depth=3", "model.d_model=96", "model.head_dim=32"],
}
MULTIPLIERS = (1, 10, 100, 1000)
"""Learning rates as multiples of OptimConfig's default."""
PLANTED_OP = "aten.nll_loss_forward"
BACKWARD_FAULTS = {  # op= of the fault -> the aten op triage must name, and the shapes that have it
    "layer_norm_backward": ("aten.native_layer_norm_backward", ("gpt2",)),
    "sdpa_backward": ("aten._scaled_dot_product_flash_attention_for_cpu_backward", ("gpt2", "llama")),
    "mm_backward": ("aten.mm", ("gpt2", "llama")),
}
DIVERGING = [  # where the negated LayerNorm gradient drives the loss to 2x its start
    "optim.lr=5e-2",
    "optim.grad_clip=0",
    "guard.window=12",
    "guard.min_history=5",
    "guard.loss_sigma=2",
]
FORBIDDEN = ("library-op", "hardware")


def prepare_data(out: Path) -> Path:
    """The json and email packages of the standard library, byte-level (as the tests' tiny corpus)."""
    data = out / "data"
    if (data / MANIFEST_NAME).is_file():
        return data
    copy_stdlib_packages(("json", "email"), out / "corpus")
    prepare(
        PrepareConfig(
            source=str(out / "corpus"), out=str(data), tokenizer="bytes", val_ratio=0.1, heldout_ratio=0.1
        ),
        progress=False,
    )
    return data


def run_and_triage(run_dir: Path, data: Path, settings: list[str]) -> dict:
    """Train (the run may stop on its own: the guard giving up), then triage every incident."""
    if run_dir.exists():
        if not RunDir(run_dir).config.is_file():
            raise SystemExit(f"{run_dir} exists and is not a run this benchmark wrote; choose another --out")
        shutil.rmtree(run_dir)
    cfg = load_run_config(
        CONFIG_DIR / "tiny.toml",
        [f"data.dir={json.dumps(str(data))}", "log.progress=false", "train.threads=1", *settings],
    )
    t0 = time.perf_counter()
    stopped = None
    try:
        train(cfg, run_dir)
    except (TenxError, RuntimeError) as e:
        stopped = f"{type(e).__name__}: {str(e)[:120]}"
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    incidents, causes, _ = triage([run_dir])
    return {
        "run": run_dir.name,
        "stopped": stopped,
        "train_s": round(train_s, 1),
        "triage_s": round(time.perf_counter() - t0, 1),
        "incidents": len(incidents),
        "verdicts": dict(Counter(i.verdict or "unknown" for i in incidents)),
        "causes": [c.summary() for c in causes],
        "false": [
            {
                "id": i.id,
                "kind": i.kind,
                "step": i.step,
                "verdict": i.verdict,
                "why": i.evidence.get("summary"),
            }
            for i in incidents
            if i.verdict in FORBIDDEN
        ],
    }


def named_only(row: dict, op: str) -> bool:
    """Whether a planted run raised incidents and every one is a library-op whose only cause is `op`."""
    causes = [(c["kind"], c["op"]) for c in row["causes"]]
    return row["incidents"] > 0 and causes == [("library-op", op)]


def brief(row: dict) -> dict:
    return {k: row[k] for k in ("run", "incidents", "verdicts", "train_s", "triage_s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated train.precision values")
    p.add_argument("--planted-steps", type=int, default=60, help="steps of each planted backward-fault run")
    p.add_argument("--out", default="runs/triage_false_verdicts")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_start = time.perf_counter()
    out = Path(args.out)
    data = prepare_data(out)
    base_lr = OptimConfig().lr
    # a guard that judges spikes after 5 steps (the default waits for 20): more incidents to triage
    common = [
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "checkpoint.every=10",
        "guard.min_history=5",
        "guard.window=20",
    ]
    rows, planted, planted_rows = [], {}, []
    for shape, precision in [(s, p) for s in args.shapes.split(",") for p in args.precisions.split(",")]:
        common_here = [*common, f"train.precision='{precision}'"]
        tag = f"{shape}-{precision}"
        # the baseline: a planted library fault triage must still name
        row = run_and_triage(
            out / f"{tag}-opbug",
            data,
            [
                *SHAPES[shape],
                *common_here,
                "faults.inject=['op-bug@step=1,run=24']",
                "guard.max_rollbacks=100",
            ],
        )
        planted[tag] = named_only(row, PLANTED_OP)
        print(
            f"{tag} planted op-bug: {row['incidents']} incidents {row['verdicts']} -> named: {planted[tag]}"
        )
        planted_rows.append({"shape": tag, "fault": "nll_loss", "named": planted[tag], **brief(row)})
        for fault, (op, shapes) in BACKWARD_FAULTS.items():
            if shape not in shapes:
                continue
            row = run_and_triage(
                out / f"{tag}-{fault}",
                data,
                [
                    *SHAPES[shape],
                    *common_here,
                    f"train.steps={args.planted_steps}",
                    *DIVERGING,
                    f"faults.inject=['op-bug@step=1,op={fault}']",
                ],
            )
            named = named_only(row, op)
            planted_rows.append({"shape": tag, "fault": fault, "named": named, **brief(row)})
            print(
                f"{tag:<11} planted {fault:<20} {row['incidents']:>3} incidents {json.dumps(row['verdicts'])} "
                f"-> named: {named}  (train {row['train_s']:.1f} s, triage {row['triage_s']:.1f} s)",
                flush=True,
            )
        cases = [("clean", [])]
        for seed in range(args.seeds):
            for m in MULTIPLIERS:
                lr = base_lr * m
                cases.append(
                    (
                        f"lr{m}x-seed{seed}",
                        [
                            f"train.seed={seed}",
                            f"optim.lr={lr!r}",
                            "optim.warmup_steps=0",
                            "optim.grad_clip=0",
                            "optim.weight_decay=0",
                        ],
                    )
                )
        for name, settings in cases:
            row = run_and_triage(out / f"{tag}-{name}", data, [*SHAPES[shape], *common_here, *settings])
            row["shape"] = tag
            rows.append(row)
            flag = f"  {len(row['false'])} FALSE, e.g. {row['false'][0]}" if row["false"] else ""
            print(
                f"{tag:<11} {name:<16} {row['incidents']:>3} incidents {json.dumps(row['verdicts']):<40} "
                f"train {row['train_s']:>5.1f} s, triage {row['triage_s']:>5.1f} s{flag}",
                flush=True,
            )
    verdicts: Counter[str] = Counter()
    for row in rows:
        verdicts.update(row["verdicts"])
    false_library = sum(row["verdicts"].get("library-op", 0) for row in rows)
    false_hardware = sum(row["verdicts"].get("hardware", 0) for row in rows)
    named = sum(r["named"] for r in planted_rows)
    print(
        f"\n{len(rows)} optimisation-only runs, {sum(r['incidents'] for r in rows)} incidents: "
        f"{dict(verdicts)}; false library-op {false_library}, false hardware {false_hardware}; "
        f"planted ops named {named}/{len(planted_rows)} (false negatives {len(planted_rows) - named})"
    )
    print(
        json.dumps(
            {
                "runs": len(rows),
                "incidents": sum(r["incidents"] for r in rows),
                "verdicts": dict(verdicts),
                "false_library_op": false_library,
                "false_hardware": false_hardware,
                "planted_named": planted,
                "planted": {"named": named, "total": len(planted_rows)},
                "false_negatives": len(planted_rows) - named,
                "planted_rows": planted_rows,
                "rows": [{k: r[k] for k in ("run", "incidents", "verdicts")} for r in rows],
                "wall_s": round(time.perf_counter() - t_start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
