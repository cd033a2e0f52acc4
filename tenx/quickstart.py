"""`tenx quickstart`: the whole loop on the embedded default corpus, the Python standard library.

prepare stdlib (BPE 4096) -> train configs/quickstart.toml on this machine -> bits per byte on the
held-out documents beside xz -9e on exactly the same bytes. Re-running reuses prepared data and a
finished run; an interrupted run resumes from its newest verified checkpoint.

The run fits a wall-clock budget (10 minutes by default) on any CPU: a few timed steps measure this
machine's training speed (bf16 where the CPU has native bf16, else fp32, ~3x slower) and give the first
step count, what the time left after preparation, evaluation and xz allows, capped at 1.5x the config's
steps (so that a fast machine still uses its budget; a `train.steps` the user sets is the cap itself);
a CPU that could train under 80% of them trains the next shallower model instead (about twice as fast).
That probe lasts seconds, and the machine's load may change after it, so training keeps to the budget by
itself: a `WallBudget` (tenx/train/callbacks/budget.py) re-plans the step count and the schedule's length
at every step from the speed observed, keeping the evaluation's share of the time at that speed too. The
plan is kept in OUT/plan.json, and the budget's state in every checkpoint, so that a resumed quickstart
continues the same schedule with the time that is left.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from tenx import checkpoint as ckpt
from tenx import rundir
from tenx.data.manifest import read_manifest, split_documents_text
from tenx.data.prepare.pipeline import PrepareConfig, format_prepare_summary, is_prepared, prepare
from tenx.data.tokenizer import load_tokenizer
from tenx.errors import ConfigError
from tenx.eval.evaluate import evaluate
from tenx.hardware import cpu_name, pick_device, resolve_precision
from tenx.monitor.loss_plot import plot_loss_curve
from tenx.scaling.ladder.runner import measure_tokens_per_s
from tenx.train.callbacks.budget import WallBudget, planned_steps
from tenx.train.config import RunConfig, load_run_config, resolve_config_path
from tenx.train.config import tokens_per_step as run_tokens_per_step
from tenx.train.run import train
from tenx.utils.io import atomic_write_json, read_json_object
from tenx.utils.xz import xz_bits_per_byte, xz_bits_per_byte_per_document

_RESERVE_S = 20.0  # xz -9e on the held-out bytes, the loss plot, the trainer's start-up (measured: 15 s)
_LOOP_EFFICIENCY = 0.95  # steps took 99% of a quickstart run's loop; the rest covers a probe that ran fast
_MIN_STEPS = 100
_END_STEPS = 2.0  # the final checkpoint's save, in steps' time (the budget keeps it at the end)
_clock = time.perf_counter  # the quickstart's seconds (tests simulate a machine with their own)
_BUDGET_FIELDS = ("budget_s", "reserve_steps", "max_steps")  # plan.json's settings of the budget
_SHAPE_KEYS = {"model.depth", "model.d_model"}  # a shape the user chose is kept
_SMALLER_BELOW = 0.8  # a budget for less than this share of the config's steps trains a shallower model
_SMALLER_BATCH = 2  # which takes this many times the config's sequences a step (learning rate x its root)
_PAST_CAP = 1.5  # a machine faster than the config's steps need trains up to this many times them, so the run
# still ends at its budget (measured on a 2-core Xeon: 2000 steps took 542 s of 600, -9.5%), unless the user
# set train.steps


def quickstart(
    out: str | Path = "runs/quickstart",
    steps: int | None = None,
    *,
    minutes: float = 10.0,
    source: str = "stdlib",
    tokenizer: str = "bpe",
    vocab_size: int = 4096,
    overrides: list[str] | None = None,
    started: float | None = None,
) -> dict[str, Any]:
    """Run the quickstart into `out` within about `minutes` of wall time; returns (and writes)
    summary.json. `steps` fixes the step count instead of fitting it to the budget.

    `source`, `tokenizer`, `vocab_size` and config `overrides` exist for tests and experiments; the defaults are the
    README's main job. `started`: the Unix time the budget counts from (default: this call; `tenx
    quickstart` gives its process's start, so that its imports count too).
    """
    if not (math.isfinite(minutes) and minutes > 0):
        raise ConfigError(f"--minutes must be a finite number > 0, got {minutes}")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    t0 = _clock() - (max(0.0, time.time() - started) if started is not None else 0.0)
    out = Path(out)
    data_dir, run_dir = out / "data", out / "run"
    run = rundir.RunDir(run_dir)

    prep = PrepareConfig(source=source, out=str(data_dir), tokenizer=tokenizer, vocab_size=vocab_size)
    if is_prepared(prep):
        print(f"[1/4] reusing prepared data in {data_dir}")
    else:
        print(f"[1/4] preparing the corpus '{source}' (tokenizer, shards, manifest)")
        print(format_prepare_summary(prepare(prep), data_dir))

    settings = [f'data.dir="{data_dir}"', *(overrides or [])]
    existing = ckpt.list_checkpoints(run.checkpoints)
    plan = _plan(out, data_dir, settings, steps, minutes, _clock() - t0, bool(existing))
    cfg = load_run_config(resolve_config_path("quickstart"), settings + plan["settings"])
    latest, _ = ckpt.latest_verified(run.checkpoints)
    meta = ckpt.read_checkpoint_meta(latest) if latest is not None else {}
    # a budgeted run ends where its budget's plan did; --steps N asks for N, whatever was planned before
    target = (cfg.train.steps or 0) if steps is not None else planned_steps(meta, cfg.train.steps or 0)
    if latest is not None and meta["step"] >= target:
        print(f"[2/4] reusing finished run in {run_dir}")
        trained = int(meta["step"])
    else:
        budget = _budget(plan, cfg)
        count = (
            f"about {cfg.train.steps} steps, as the budget allows," if budget else f"{cfg.train.steps} steps"
        )
        print(f"[2/4] training configs/quickstart.toml (depth {cfg.model.depth}) for {count} into {run_dir}")
        resume = "auto" if existing else None
        trainer, _ = train(cfg, run_dir, resume=resume, extra_callbacks=[budget] if budget else None)
        trained = trainer.step
        if budget:
            print(
                f"      trained {trained} steps in {budget.spent():.0f} s of the {budget.seconds:.0f} s "
                f"the budget left for training (the first plan: {plan['steps']})"
            )

    print("[3/4] evaluating on the held-out split")
    # windows that overlap by half: every scored token sees at least seq_len/2 tokens of context, as a
    # compressor coding the text in one pass would give it (twice the forward passes of disjoint windows)
    report = evaluate(run_dir, ["heldout"], stride=max(1, cfg.model.seq_len // 2))
    heldout = report["datasets"]["heldout"]

    print("[4/4] compressing the same held-out bytes with xz -9e")
    manifest = read_manifest(data_dir)
    tok = load_tokenizer(data_dir, manifest["tokenizer"])
    documents = [text.encode("utf-8") for text in split_documents_text(data_dir, manifest, "heldout", tok)]
    xz_bpb = xz_bits_per_byte(b"".join(documents))
    xz_doc_bpb = xz_bits_per_byte_per_document(documents)
    curve = plot_loss_curve(run.metrics, out / rundir.LOSS_CURVE, f"tenx quickstart ({source})")
    prequential = read_json_object(run.prequential)
    same = prequential.get("same_bytes") or {}

    summary = {
        "heldout_bits_per_byte": heldout["bits_per_byte"],
        "xz_bits_per_byte": xz_bpb,
        "xz_per_document_bits_per_byte": xz_doc_bpb,
        "heldout_loss_nats_per_token": heldout["loss"],
        "heldout_bytes": heldout["bytes"],
        "heldout_documents": manifest["splits"]["heldout"]["num_documents"],
        "beats_xz": heldout["bits_per_byte"] < xz_bpb,
        "prequential_bits_per_byte": prequential.get("bits_per_byte"),
        "prequential_same_bytes": same or None,
        "wall_seconds": _clock() - t0,
        "budget_minutes": plan.get("minutes"),
        "steps": trained,
        "planned_steps": plan.get("steps"),
        "depth": cfg.model.depth,
        "probe_tokens_per_s": plan.get("tokens_per_s"),
        "precision": plan.get("precision"),
        "cpu": cpu_name(),
        "run_dir": str(run_dir),
        "metrics": str(run.metrics),
        "loss_curve": str(curve),
        "eval": report["path"],
        "data_dir": str(data_dir),
    }
    atomic_write_json(out / "summary.json", summary)
    print(
        f"\nheld-out bits per byte: tenx {summary['heldout_bits_per_byte']:.4f} | xz -9e {xz_bpb:.4f} over the "
        f"concatenated files, {xz_doc_bpb:.4f} file by file\n"
        f"({heldout['bytes']:,} bytes in {summary['heldout_documents']} documents never trained on)\n"
        + _prequential_line(prequential, same)
        + f"run directory: {run_dir}\nmetrics: {summary['metrics']}\nloss curve: {curve}\n"
        f"summary: {out / 'summary.json'}\n"
        f"wall time: {summary['wall_seconds']:.0f} s ({summary['wall_seconds'] / 60:.1f} min) on {cpu_name()}"
    )
    return summary


def _budget(plan: dict[str, Any], cfg: RunConfig) -> WallBudget | None:
    """The wall-clock budget the plan asks for (none with --steps, or for a plan written before budgets)."""
    if "budget_s" not in plan:
        return None
    return WallBudget(
        max(1.0, float(plan["budget_s"])),
        reserve_steps=float(plan["reserve_steps"]),
        min_steps=_MIN_STEPS,
        max_steps=int(plan["max_steps"]),
        warmup_steps=cfg.optim.warmup_steps,
        clock=_clock,
    )


def _prequential_line(prequential: dict[str, Any], same: dict[str, Any]) -> str:
    """The training stream as compression: the model's prequential code length beside xz on the same bytes."""
    if not same.get("bytes"):
        return ""
    return (
        f"training stream, prequential: tenx {same['model_bits_per_byte']:.4f} | xz -9e "
        f"{same['xz_bits_per_byte']:.4f} bits per byte on the same {same['bytes']:,} bytes, in the order "
        "trained (each batch coded before the update that learns from it)\n"
    )


def _plan(
    out: Path,
    data_dir: Path,
    settings: list[str],
    steps: int | None,
    minutes: float,
    spent_s: float,
    resuming: bool,
) -> dict[str, Any]:
    """The schedule: config settings (steps, warmup, eval and checkpoint intervals) and how they were
    chosen. A resumed run keeps the plan it started with (OUT/plan.json)."""
    path = out / "plan.json"
    if steps is None and resuming and path.is_file():
        try:
            kept = json.loads(path.read_text())
            if (
                isinstance(kept.get("settings"), list)
                and all(isinstance(x, str) for x in kept["settings"])
                and all(isinstance(kept.get(k, 0), (int, float)) for k in _BUDGET_FIELDS)
            ):
                return kept
        except (OSError, ValueError):
            pass
    if steps is not None:
        plan: dict[str, Any] = {"settings": [f"train.steps={steps}"], "steps": steps}
        atomic_write_json(path, plan)
        return plan
    cfg = load_run_config(resolve_config_path("quickstart"), settings)
    device = pick_device(cfg.train.device, "train.device")
    precision = "bf16" if resolve_precision(cfg.train.precision, device) == torch.bfloat16 else "fp32"
    print(f"[2/4] measuring this machine's training speed ({cpu_name()}, {precision} matmuls)")
    manifest = read_manifest(data_dir)
    heldout_tokens = int(manifest["splits"]["heldout"]["tokens"])
    started = _clock() - spent_s  # when the quickstart began

    def fit(run_cfg: Any) -> tuple[int, float]:
        """(steps the budget allows, tokens/s) for run_cfg on this machine."""
        tokens_per_step = run_tokens_per_step(run_cfg.train, run_cfg.model.seq_len, 1)
        tokens_per_s = measure_tokens_per_s(run_cfg, run_cfg.train.micro_batch, steps=4)
        # evaluation is forward-only (about 3x a training step per token), each token scored in two
        # windows; xz -9e, the plot and start-up
        reserve_s = 2 * heldout_tokens / (3 * tokens_per_s) + _RESERVE_S
        train_s = minutes * 60 - (_clock() - started) - reserve_s
        # the loop's own work (validation, checkpoints, logging) takes about this share of a run's steps
        return int(_LOOP_EFFICIENCY * train_s * tokens_per_s / tokens_per_step), tokens_per_s

    fitted, tokens_per_s = fit(cfg)
    cap = cfg.train.steps or fitted
    shape_settings: list[str] = []
    user_keys = {s.split("=", 1)[0].strip() for s in settings}
    if fitted < _SMALLER_BELOW * cap and cfg.model.depth > 1 and not user_keys & _SHAPE_KEYS:
        # Too slow for the whole schedule (an fp32-only CPU, or one core busy): a shallower model at about
        # twice the speed learns more in the same minutes (measured: depth 3 for 5.3M tokens, 1.441 bits per
        # byte; depth 2 for 11.2M tokens in the same time, 1.372; depth 1 for 14M tokens, 1.487). It takes
        # those tokens in twice the sequences a step rather than twice the steps: at depth 2 on one thread,
        # 7.8M tokens as 950 steps of 32 sequences reached 1.4676 held-out bits per byte (1.4684 at a
        # learning rate of 4e-3), as 1,900 of 16 1.4732 and as 475 of 64 1.4833, 2% faster a token
        shape_settings = [f"model.depth={cfg.model.depth - 1}"]
        larger_batch = "train.micro_batch" not in user_keys  # else twice the steps of the user's batch
        if larger_batch:
            shape_settings.append(f"train.micro_batch={_SMALLER_BATCH * cfg.train.micro_batch}")
            if "optim.lr" not in user_keys:
                shape_settings.append(f"optim.lr={cfg.optim.lr * math.sqrt(_SMALLER_BATCH):.3g}")
        small_steps = cap if larger_batch else _SMALLER_BATCH * cap
        small = load_run_config(
            resolve_config_path("quickstart"), settings + shape_settings + [f"train.steps={small_steps}"]
        )
        print(
            f"      {tokens_per_s:,.0f} tokens/s at depth {cfg.model.depth} allows only {fitted} of its {cap} "
            f"steps: measuring depth {small.model.depth}, about twice as fast"
            + (f", {small.train.micro_batch} sequences a step" if larger_batch else "")
        )
        fitted, tokens_per_s = fit(small)
        cap, cfg = small.train.steps or cap, small
    tokens_per_step = run_tokens_per_step(cfg.train, cfg.model.seq_len, 1)
    past_cap = not any(s.split("=", 1)[0].strip() == "train.steps" for s in settings)
    ceiling = int(_PAST_CAP * cap) if past_cap else cap
    chosen = max(_MIN_STEPS, min(ceiling, fitted))
    # validation and checkpoints about every fifth of the run; a probe that ran slow must not make them
    # many, as the budget may then train many more steps than planned
    every = max(1, max(chosen, cap // 4) // 5)
    plan = {
        "settings": [
            *shape_settings,
            f"train.steps={chosen}",
            f"optim.warmup_steps={min(cfg.optim.warmup_steps, max(1, chosen // 10))}",
            f"train.eval_every={every}",
            f"checkpoint.every={every}",
        ],
        "steps": chosen,
        "minutes": minutes,
        "tokens_per_s": tokens_per_s,
        "precision": precision,
        "depth": cfg.model.depth,
        "cpu": cpu_name(),
        "train_seconds_planned": chosen * tokens_per_step / tokens_per_s,
        # for the budget that keeps training to the minutes whatever the speed does next
        "budget_s": minutes * 60 - (_clock() - started) - _RESERVE_S,
        "reserve_steps": _evaluation_steps(heldout_tokens, cfg, tokens_per_step) + _END_STEPS,
        "max_steps": max(ceiling, _MIN_STEPS),
    }
    atomic_write_json(path, plan)
    limit = "what the budget allows"
    if chosen == ceiling and fitted > ceiling:
        limit = f"{_PAST_CAP:g}x the config's steps, the most" if past_cap else "the config's"
    print(
        f"      {tokens_per_s:,.0f} tokens/s: training {chosen} steps ({limit}), about "
        f"{plan['train_seconds_planned'] / 60:.1f} min of a {minutes:g}-minute budget; the step count then "
        "follows the speed observed while training"
    )
    return plan


def _evaluation_steps(heldout_tokens: int, cfg: Any, tokens_per_step: int) -> float:
    """The evaluation after training (every held-out token scored in two windows) and the last step's
    validation, in training steps' time: a forward pass costs about a third of a training step per token."""
    validation_tokens = cfg.train.eval_batches * cfg.train.micro_batch * cfg.model.seq_len
    return (2 * heldout_tokens + validation_tokens) / (3 * tokens_per_step)
