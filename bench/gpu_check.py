"""GPU check: every tenx command on one device, training throughput against a reference loop, and the
planner's predictions against the measurements; one JSON line at the end.

Each command runs as a user runs it, `python -m tenx ...` in a fresh process (this checkout first on
PYTHONPATH), on a tiny byte-level corpus (the `json` and `email` packages of the standard library) that the
check prepares in its work directory. A command's entry is "pass" only when it exits as expected and what
it wrote holds up (files, verdicts, bitwise equality); otherwise it is the error's first line:

  prepare            tenx data prepare (bytes, 10% validation, 10% held out)
  train              12 steps of configs/tiny.toml, 2 micro-batches per step, statistics every 4
  resume             the same run crashed at step 7, then --resume auto: bitwise equal to train's model
  supervise-sigkill  the same run under --supervise, SIGKILLed at step 7: bitwise equal to train's model
  eval, sample       bits per byte on the held-out split; a continuation that starts with the prompt
  replay             tenx replay of step 10: "reproduces", bit for bit
  triage, bisect     an injected op-bug crash; tenx triage names aten.nll_loss_forward (library-op), and
                     the bisection's repro.py still shows the fault
  compress           tenx compress / decompress round trip, byte for byte
  export, export-load  the Hugging Face export, read back by tenx's importer to tenx's logits; transformers'
                     logits equal tenx's (export-load: skipped without transformers)
  plan-measure       tenx plan --measure on tiny (calibration kept in the work directory, not ~/.cache)
  ladder, derisk     the shipped configs at their tiniest budgets (derisk: its first change on a CPU)
  stats, dashboard   train's statistics in metrics.jsonl; tenx report writes the runs' HTML dashboard
  ddp, fsdp          torchrun with 2 processes (gloo on a CPU, one GPU each on CUDA): the same losses as
                     train within 1e-4 (bf16 on CUDA: 1e-2); on a single GPU "skipped: needs 2 GPUs"

`throughput`: bench/train_throughput.py's compare() on gpt2-d12, llama-1b and llama-1b with float8 linears
(`llama-1b-fp8`: its `over_bf16` is its tenx tokens/s over tenx's bf16 llama-1b, `loss_over_bf16` the same
for the final loss; skipped, saying why, without fp8 tensor cores), one fresh process per shape
(`--shape` runs one), after the commands on CUDA and beside them on a CPU (`--device cpu` shrinks both
shapes: `tiny`). `plan`: tenx.plan's estimate of that run's step time and peak memory over the measured
ones, on a cluster of one such device (the shipped cpu or h100-node factors, this device's peak FLOP/s
and memory); on a CPU the measured peak is the process's resident memory, Python and torch included.

    python bench/gpu_check.py [--device cuda|cpu] [--out DIR] [--workers N] [--shape SHAPE] [--budget-s S]

The throughput runs first (after prepare), alone on the device, then the commands. Each entry is appended
to WORK/fragments.jsonl the moment it is known (a shape's with its throughput and plan figures), so a check
cut short still yields every figure so far (`--out DIR` keeps them). The summary counts passed, skipped
(only where the machine gives the reason: SKIPPABLE), failed and dropped commands, never a skip as a pass:
"17 passed, 2 skipped, 0 failed of 19 commands"; the JSON line has `counts`. `--budget-s S` fits the whole
check into S seconds: a command that would end past it (by its seconds the last time it passed on this
device, kept in tenx's cache, else EXPECTED_S) is dropped, and named in the summary and under `dropped`.
Derisk, export, eval and plan-measure pass only on checked contents: finite positive multipliers; the
exported weights, read back by tenx's own importer, give tenx's logits; bits per byte recomputed from the
report's own totals; predicted and measured step time and memory both present, their ratio as reported.

It is sized to finish within 8 minutes on one H100; `--device cpu` runs the matrix in about 2 minutes on 2
cores (tests/test_gpu_check.py). It exits with 1 when an entry fails, and then keeps its work directory
(each command's log is in logs/); --out DIR keeps it always.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tenx.data.manifest import MANIFEST_NAME
from tenx.data.prepare.sources import copy_stdlib_packages
from tenx.hardware import device_name, peak_flops, pick_device, resolve_precision
from tenx.rundir import RunDir, step_dir_name
from tenx.utils.io import read_jsonl

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("json", "email")
SHAPES = ("gpt2-d12", "llama-1b", "llama-1b-fp8")
"""Throughput entries: a shipped shape, optionally with `-fp8` (train.precision = fp8: tenx's float8 linears,
timed against the same bf16 reference; skipped with the reason where the device has no fp8 tensor cores)."""
SKIPPABLE = {"ddp", "fsdp", "export-load"}  # entries that may read "skipped: REASON" on some machines
MARKER = "GPU_CHECK_SHAPE "
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Fault)\b(:|$)")

IMPORT_EXPORT = """
import json, sys, torch
from tenx.checkpoint.models import load_model
from tenx.export.hf_import import import_hf
run, out = sys.argv[1:3]
model = load_model(run, "cpu").model.float().eval()
back = import_hf(out)
ids = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    print(json.dumps({"max_abs_diff": (back(ids) - model(ids)).abs().max().item()}))
"""
LOAD_EXPORT = """
import json, sys, torch, transformers
from tenx.checkpoint.models import load_model
run, out, device = sys.argv[1:4]
model = load_model(run, device).model.float().eval()
hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval().to(device)
ids = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ids = ids.to(device)
    print(json.dumps({"max_abs_diff": (hf(input_ids=ids).logits - model(ids)).abs().max().item()}))
"""


def exited(pid: int, timeout: float) -> bool:
    """Whether child `pid` exited within `timeout` seconds; it is left unreaped (os.waitid's WNOWAIT)."""
    deadline = time.monotonic() + timeout
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


class CheckFailed(Exception):
    """An entry's one-line reason."""


def first_error(stderr: str, stdout: str, returncode: int | None) -> str:
    """The line that says what went wrong: tenx's own error line, else the exception's line (not torchrun's
    ChildFailedError, which only says a rank failed; without the `[rankN]: ` torchrun puts before a rank's
    lines), else the last line printed."""
    lines = [RANK_PREFIX.sub("", s.strip()) for s in (stderr + "\n" + stdout).splitlines() if s.strip()]
    for want in (lambda s: s.startswith("tenx: error"), lambda s: bool(EXCEPTION_LINE.match(s))):
        found = [s for s in lines if want(s) and "ChildFailedError" not in s]
        if found:
            return found[-1][:300]
    return (lines[-1][:300] if lines else "") or f"exit code {returncode}"


@dataclass
class Check:
    name: str
    run: Callable[[Context], str | None]  # None: "pass"; a string: the entry (a skip); raises CheckFailed
    needs: tuple[str, ...] = ()  # checks that must pass first
    after: tuple[str, ...] = ()  # checks that must end first, passed or not
    slots: int = 1  # processes it keeps busy


@dataclass
class Context:
    """Where the check works and how it starts processes."""

    work: Path
    device: torch.device
    timeout: float
    env: dict[str, str] = field(default_factory=dict)
    throughput: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    """each check's wall seconds, as recorded"""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def data(self) -> Path:
        return self.work / "data"

    def run_dir(self, name: str) -> Path:
        return self.work / "runs" / name

    def process(
        self, log: str, cmd: list[str], *, returncode: int | None = 0, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd`, its output kept in logs/LOG.log; CheckFailed (its first error line) unless it exits
        with `returncode` (None: any non-zero code, a failure the check injected)."""
        limit = timeout or self.timeout
        logs = self.work / "logs"
        logs.mkdir(exist_ok=True)
        # a session of its own: a timeout ends the whole tree (torchrun's ranks, a supervisor's child). The
        # output goes to files, not pipes, and the command is done when its own process exits: a descendant
        # that outlives it (a compile worker holding an inherited stderr) cannot keep the check waiting for
        # the pipes' end; what is left of its session is ended then.
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(
                cmd, env=self.env, stdout=out, stderr=err, text=True, start_new_session=True
            )
            timed_out = not exited(proc.pid, limit)
            with contextlib.suppress(ProcessLookupError):  # before reaping it: its group id is still its own
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.seek(0)
            err.seek(0)
            done = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
        (logs / f"{log}.log").write_text(f"$ {' '.join(cmd)}\n{done.stdout}\n--- stderr ---\n{done.stderr}")
        if timed_out:
            raise CheckFailed(f"{log}: timed out after {limit:.0f} s")
        ok = done.returncode == returncode if returncode is not None else done.returncode != 0
        if not ok:
            if done.returncode == 0:
                raise CheckFailed(f"{' '.join(cmd[2:4])} exited 0 where it should have failed")
            raise CheckFailed(first_error(done.stderr, done.stdout, done.returncode))
        return done

    def tenx(self, log: str, *args: str, returncode: int | None = 0) -> subprocess.CompletedProcess[str]:
        return self.process(log, [sys.executable, "-m", "tenx", *args], returncode=returncode)

    def train_args(self, run: str, *extra: str, device: str | None = None) -> list[str]:
        """`tenx train` of the shared 12-step run into runs/RUN (its model is the bitwise reference)."""
        settings = [
            f"data.dir='{self.data}'",
            f"train.device='{device or self.device}'",
            "train.steps=12",
            "train.global_batch=16",  # 2 micro-batches of 8: the 2-process runs match it
            "checkpoint.every=4",
            "monitor.stats_every=4",
            "train.eval_every=0",
            "train.threads=1",
            "log.progress=false",
        ]
        if self.cuda:
            settings.append("train.precision='bf16'")
        sets = [x for s in settings for x in ("--set", s)]
        return ["train", "--config", "tiny", *sets, "--run-dir", str(self.run_dir(run)), *extra]

    def run_sets(self) -> list[str]:
        """--set flags of the ladder and derisk runs: this data, this device, one thread, quiet."""
        settings = [f"data.dir='{self.data}'", f"train.device='{self.device}'", "train.threads=1"]
        return [x for s in [*settings, "log.progress=false"] for x in ("--set", s)]


def same_model(a: Path, b: Path) -> None:
    """CheckFailed unless the newest checkpoints of runs a and b hold the same model, bit for bit."""
    from tenx.checkpoint.models import load_model

    first, second = load_model(a, "cpu"), load_model(b, "cpu")
    if first.checkpoint.name != second.checkpoint.name:
        raise CheckFailed(f"{b.name} ends at {second.checkpoint.name}, {a.name} at {first.checkpoint.name}")
    x, y = first.model.state_dict(), second.model.state_dict()
    differ = [k for k in x if k not in y or not torch.equal(x[k], y[k])]
    if differ or x.keys() != y.keys():
        raise CheckFailed(
            f"{b.name}'s final model differs from {a.name}'s (first: {(differ or ['keys'])[0]})"
        )


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(RunDir(run).metrics) if "loss" in r}


# ----- the commands ----------------------------------------------------------------------------------
def check_prepare(ctx: Context) -> None:
    corpus = copy_stdlib_packages(PACKAGES, ctx.work / "corpus")
    args = ["--tokenizer", "bytes", "--val-ratio", "0.1", "--heldout-ratio", "0.1", "--quiet"]
    ctx.tenx("prepare", "data", "prepare", "--source", str(corpus), "--out", str(ctx.data), *args)
    manifest = json.loads((ctx.data / MANIFEST_NAME).read_text())
    if manifest["tokenizer"]["vocab_size"] != 257:
        raise CheckFailed(f"prepared vocabulary {manifest['tokenizer']['vocab_size']}, expected 257 (bytes)")


def check_train(ctx: Context) -> None:
    ctx.tenx("train", *ctx.train_args("train"))
    run = RunDir(ctx.run_dir("train"))
    if sorted(losses(run.root)) != list(range(1, 13)):
        raise CheckFailed(f"{run.metrics} does not hold a loss for each of steps 1..12")
    if not all(math.isfinite(v) for v in losses(run.root).values()):
        raise CheckFailed(f"{run.metrics}: a loss is not finite")
    if not (run.root / "checkpoints" / step_dir_name(12)).is_dir():
        raise CheckFailed("no checkpoint of step 12")


def check_resume(ctx: Context) -> None:
    ctx.tenx("resume-crash", *ctx.train_args("resume", "--fault", "crash@step=7"), returncode=None)
    done = ctx.tenx("resume", *ctx.train_args("resume", "--resume", "auto"))
    if "resumed from" not in done.stdout + done.stderr:
        raise CheckFailed("tenx train --resume auto did not say where it resumed from")
    same_model(ctx.run_dir("train"), ctx.run_dir("resume"))


def check_sigkill(ctx: Context) -> None:
    from tenx.monitor.events import read_events

    run = ctx.run_dir("sigkill")
    ctx.tenx(
        "supervise-sigkill",
        *ctx.train_args("sigkill", "--supervise", "--backoff", "0", "--fault", "sigkill@step=7"),
    )
    kinds = [(e["kind"], e.get("fault_kind")) for e in read_events(run)]
    if ("fault", "sigkill") not in kinds or ("restart", None) not in kinds:
        raise CheckFailed(f"no SIGKILL and restart in {RunDir(run).events}: {kinds}")
    same_model(ctx.run_dir("train"), run)


def check_eval(ctx: Context) -> None:
    out = ctx.work / "eval.json"
    ctx.tenx(
        "eval",
        "eval",
        str(ctx.run_dir("train")),
        "--split",
        "heldout",
        "--device",
        str(ctx.device),
        "--out",
        str(out),
    )
    held = json.loads(out.read_text())["datasets"]["heldout"]
    bpb = held["bits_per_byte"]
    if not (isinstance(bpb, (int, float)) and math.isfinite(bpb) and 0 < bpb < 9):
        raise CheckFailed(f"held-out bits per byte {bpb}")
    again = held["nll_nats"] / math.log(2) / held["bytes"]  # from its own totals: the figure adds up
    if not (held["bytes"] > 0 and held["tokens"] > 0 and math.isclose(bpb, again, rel_tol=1e-9)):
        raise CheckFailed(f"bits per byte {bpb} is not its nll {held['nll_nats']} over {held['bytes']} bytes")
    if not math.isclose(held["loss"], held["nll_nats"] / held["tokens"], rel_tol=1e-9):
        raise CheckFailed(f"loss {held['loss']} is not its nll over its {held['tokens']} tokens")


def check_sample(ctx: Context) -> None:
    args = ["--prompt", "def ", "--max-new-tokens", "20", "--seed", "0", "--device", str(ctx.device)]
    text = ctx.tenx("sample", "sample", str(ctx.run_dir("train")), *args).stdout
    if not text.startswith("def ") or len(text.strip()) <= 4:
        raise CheckFailed(f"the sample does not continue the prompt: {text[:60]!r}")


def check_replay(ctx: Context) -> None:
    done = ctx.tenx("replay", "replay", str(ctx.run_dir("train")), "--step", "10", "--json")
    report = json.loads(done.stdout)
    if report["verdict"] != "reproduces" or not report.get("bitwise"):
        raise CheckFailed(f"replay of step 10: {report['verdict']}, bitwise {report.get('bitwise')}")


def check_triage(ctx: Context) -> None:
    run = ctx.run_dir("opbug")
    faults = ["--fault", "op-bug@step=1,run=24", "--set", "guard.max_rollbacks=100"]
    ctx.tenx("triage-run", *ctx.train_args("opbug", *faults), returncode=None)
    found = json.loads(ctx.tenx("triage", "triage", str(run), "--all", "--json").stdout)
    causes = [(c["verdict"], c.get("op")) for c in found["root_causes"]]
    if causes != [("library-op", "aten.nll_loss_forward")]:
        raise CheckFailed(f"root causes {causes}, expected one library-op in aten.nll_loss_forward")
    (ctx.work / "triage.json").write_text(json.dumps(found))


def check_bisect(ctx: Context) -> None:
    found = json.loads((ctx.work / "triage.json").read_text())
    evidence = found["incidents"][0]["evidence"]
    if evidence.get("op") != "aten.nll_loss_forward" or not evidence.get("repro"):
        raise CheckFailed(f"the bisection named {evidence.get('op')!r} and no repro.py")
    repro = Path(evidence["repro"])
    repro = repro if repro.is_absolute() else ctx.work / repro
    done = ctx.process("bisect", [sys.executable, str(repro)], returncode=1)  # 1: still misbehaves
    if "aten.nll_loss_forward" not in done.stdout:
        raise CheckFailed(f"{repro} did not report the operator: {done.stdout.strip()[:100]!r}")


def check_compress(ctx: Context) -> None:
    original = ctx.work / "sample.py"
    original.write_bytes((ctx.work / "corpus" / "json" / "decoder.py").read_bytes()[:4096])
    packed, back, run = ctx.work / "sample.py.tenx", ctx.work / "sample.back.py", str(ctx.run_dir("train"))
    ctx.tenx("compress", "compress", run, str(original), "-o", str(packed), "--device", ctx.device.type)
    ctx.tenx("decompress", "decompress", run, str(packed), "-o", str(back))
    if back.read_bytes() != original.read_bytes():
        raise CheckFailed("decompressed bytes differ from the original")
    if packed.stat().st_size >= original.stat().st_size:
        raise CheckFailed(f"{packed.stat().st_size} compressed bytes for {original.stat().st_size}")
    # several files decoded together on the device, each as the CPU encoder wrote it
    sources = {ctx.work / f"many{i}.py": original.read_bytes()[: 300 + 1500 * i] for i in range(3)}
    for path, data in sources.items():
        path.write_bytes(data)
    ctx.tenx("compress", "compress", run, *map(str, sources))
    for path in sources:
        path.unlink()
    ctx.tenx("decompress", "decompress", run, *(f"{p}.tenx" for p in sources), "--device", ctx.device.type)
    if any(path.read_bytes() != data for path, data in sources.items()):
        raise CheckFailed("files decompressed together differ from their originals")


def check_export(ctx: Context) -> None:
    out = ctx.work / "hf"
    ctx.tenx("export", "export", str(ctx.run_dir("train")), "--format", "hf", "-o", str(out))
    missing = [n for n in ("config.json", "model.safetensors") if not (out / n).is_file()]
    if missing:
        raise CheckFailed(f"the export has no {', '.join(missing)}")
    # the exported weights read back (tenx's own importer, no transformers needed) give tenx's logits
    cmd = [sys.executable, "-c", IMPORT_EXPORT, str(ctx.run_dir("train")), str(out)]
    diff = json.loads(ctx.process("export-import", cmd).stdout.strip().splitlines()[-1])["max_abs_diff"]
    if not diff <= 1e-4:
        raise CheckFailed(f"the exported weights' logits differ from tenx's by up to {diff:.3g}")


def check_export_load(ctx: Context) -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "skipped: transformers is not installed (pip install transformers)"
    cmd = [
        sys.executable,
        "-c",
        LOAD_EXPORT,
        str(ctx.run_dir("train")),
        str(ctx.work / "hf"),
        str(ctx.device),
    ]
    diff = json.loads(ctx.process("export-load", cmd).stdout.strip().splitlines()[-1])["max_abs_diff"]
    if not diff <= (5e-3 if ctx.cuda else 1e-4):
        raise CheckFailed(f"transformers' logits differ from tenx's by up to {diff:.3g}")
    return None


def check_plan_measure(ctx: Context) -> None:
    out = ctx.work / "plan.json"
    sets = ["--set", f"data.dir='{ctx.data}'", "--set", f"train.device='{ctx.device}'"]
    cluster = "h100-node" if ctx.cuda else "cpu"
    args = ["--cluster", cluster, "--ranks", "1", "--measure", "--steps", "4", "--json", str(out)]
    ctx.tenx("plan-measure", "plan", "--config", "tiny", *sets, *args)
    after = json.loads(out.read_text())["calibration"]["after"]
    ratios = [r[k] for r in after.values() for k in ("step_time_ratio", "memory_ratio")]
    if len(after) < 2 or not all(math.isfinite(r) and r > 0 for r in ratios):
        raise CheckFailed(f"calibrated predicted/measured ratios {ratios}")
    keys = ("predicted_step_s", "measured_step_s", "predicted_memory_gb", "measured_memory_gb")
    for case, r in after.items():
        bad = [
            k for k in keys if not (isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) and r[k] > 0)
        ]
        if bad:
            raise CheckFailed(
                f"plan --measure case {case}: {', '.join(bad)} missing or not a positive number"
            )
        if not math.isclose(r["step_time_ratio"], r["predicted_step_s"] / r["measured_step_s"], rel_tol=1e-6):
            raise CheckFailed(
                f"plan --measure case {case}: its step-time ratio is not predicted over measured"
            )


def check_ladder(ctx: Context) -> None:
    out = ctx.work / "ladder"
    budget = ["--budgets", "2e10", "--grid", "ratio", "--max-depth", "1", "--eval-bytes", "10000"]
    ctx.tenx(
        "ladder",
        "ladder",
        "--config",
        "ladder",
        *ctx.run_sets(),
        *budget,
        "--evals-per-run",
        "0",
        "--out",
        str(out),
    )
    rows = read_jsonl(out / "results.jsonl")
    if len(rows) != 1 or not math.isfinite(rows[0]["heldout_loss"]):
        raise CheckFailed(f"{out / 'results.jsonl'}: {len(rows)} rows, expected 1 with a held-out loss")
    if not RunDir(out / "runs" / rows[0]["name"]).loss_curve.is_file():
        raise CheckFailed("the ladder run has no loss-curve PNG")


def check_derisk(ctx: Context) -> None:
    out = ctx.work / "derisk"
    study = REPO / "configs" / "derisk" / "gpt2_to_llama.toml"
    args = [
        "--config",
        str(study),
        *ctx.run_sets(),
        "--budgets",
        "1e10,2e10",
        "--seeds",
        "1",
        # half the ladder's peak lr: at 127 steps the tiny rope run diverged at step 31 on an Intel Xeon
        # (AVX-512, AMX; loss 2.8 -> 10.3), before its first checkpoint, so the guard could not roll back;
        # this checks the command, not the learning rate
        "--set",
        "optim.lr=1.5e-3",
        "--out",
        str(out),
    ]
    if not ctx.cuda:  # on a CPU its first change only (4 runs, not 10)
        args += ["--change", "rope:model.pos='rope'"]
    ctx.tenx("derisk", "derisk", *args)
    missing = [n for n in ("report.md", "report.png", "derisk.json") if not (out / n).is_file()]
    if missing:
        raise CheckFailed(f"derisk wrote no {', '.join(missing)}")
    found = []
    for change in json.loads((out / "derisk.json").read_text())["changes"]:
        for ref in ("marginal", "cumulative"):
            m = change.get(ref) or {}
            found += [m.get("multipliers")]
    values = [x for ms in found if ms for x in ms]
    if not values or not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in values):
        raise CheckFailed(f"derisk.json: multipliers {values[:6]} (expected finite positive numbers)")


def check_stats(ctx: Context) -> None:
    records = read_jsonl(RunDir(ctx.run_dir("train")).metrics)
    at = {r["step"]: {k: v for k, v in r.items() if k.startswith("stats/")} for r in records if "step" in r}
    steps = sorted(s for s, stats in at.items() if stats)
    if steps != [4, 8, 12]:
        raise CheckFailed(f"statistics at steps {steps}, expected 4, 8, 12 (monitor.stats_every=4)")
    values = [v for s in steps for k, v in at[s].items() if k.startswith("stats/grad_norm/")]
    if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
        raise CheckFailed(f"per-layer gradient norms {values[:4]}")


def check_dashboard(ctx: Context) -> None:
    out = ctx.work / "report.html"
    ctx.tenx("dashboard", "report", str(ctx.run_dir("train")), str(ctx.run_dir("sigkill")), "-o", str(out))
    html = out.read_text()
    wanted = ['"name":"train"', '"name":"sigkill"', '"grad_norm"', "plotly"]
    if not html.lstrip().lower().startswith("<!doctype html") or any(w not in html for w in wanted):
        raise CheckFailed(f"{out} lacks {[w for w in wanted if w not in html]}")


def check_parallel(strategy: str) -> Callable[[Context], str | None]:
    def run(ctx: Context) -> str | None:
        if ctx.cuda and torch.cuda.device_count() < 2:
            return "skipped: needs 2 GPUs"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        # on CUDA each rank takes cuda:LOCAL_RANK
        args = ctx.train_args(strategy, "--set", f"parallel.strategy={strategy}", device=ctx.device.type)
        ctx.process(strategy, [*launcher, "-m", "tenx", *args])
        meta = json.loads(RunDir(ctx.run_dir(strategy)).provenance.read_text())
        if (meta.get("world_size"), meta.get("strategy")) != (2, strategy):
            raise CheckFailed(f"run.json says world_size {meta.get('world_size')}, {meta.get('strategy')}")
        one, two = losses(ctx.run_dir("train")), losses(ctx.run_dir(strategy))
        if sorted(one) != sorted(two):
            raise CheckFailed(f"steps {sorted(two)} where the 1-process run has {sorted(one)}")
        worst = max(abs(one[s] - two[s]) / abs(one[s]) for s in one)
        if not worst <= (1e-2 if ctx.cuda else 1e-4):
            raise CheckFailed(f"losses differ from the 1-process run by up to {worst:.2e} relative")
        return None

    return run


COMMANDS = [  # in the order they start: the critical path (train, then the kill) and the longest first
    Check("prepare", check_prepare),
    Check("train", check_train, ("prepare",)),
    Check("supervise-sigkill", check_sigkill, ("train",)),
    Check("derisk", check_derisk, ("prepare",)),
    Check("ddp", check_parallel("ddp"), ("train",), slots=2),
    Check("fsdp", check_parallel("fsdp"), ("train",), slots=2),
    Check("triage", check_triage, ("prepare",)),
    Check("plan-measure", check_plan_measure, ("prepare",)),
    Check("resume", check_resume, ("train",)),
    Check("ladder", check_ladder, ("prepare",)),
    Check("export", check_export, ("train",)),
    Check("export-load", check_export_load, ("export",)),
    Check("compress", check_compress, ("train",)),
    Check("replay", check_replay, ("train",)),
    Check("eval", check_eval, ("train",)),
    Check("sample", check_sample, ("train",)),
    Check("bisect", check_bisect, ("triage",)),
    Check("stats", check_stats, ("train",)),
    Check("dashboard", check_dashboard, ("train", "supervise-sigkill")),
]


# ----- throughput and plan ---------------------------------------------------------------------------
def load_throughput_bench() -> Any:
    """bench/train_throughput.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("train_throughput", REPO / "bench" / "train_throughput.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def device_cluster(device: torch.device, dtype: torch.dtype) -> Any:
    """One accelerator with this device's peak and memory, and the shipped factors of its kind."""
    from tenx.plan.estimate import load_cluster

    cluster = load_cluster("h100-node" if device.type == "cuda" else "cpu")
    cluster.name, cluster.node.accelerators, cluster.cluster.nodes = f"this {device.type}", 1, 1
    peak = peak_flops(device, dtype) / 1e12
    if dtype == torch.bfloat16:
        cluster.node.peak_tflops_bf16 = peak
    else:
        cluster.node.peak_tflops_fp32 = peak
    if device.type == "cuda":
        cluster.node.memory_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    else:
        cluster.node.memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return cluster


def measure_shape(shape: str, device: torch.device, steps: int, skip: int, tiny: bool, data: Path) -> dict:
    """compare() of bench/train_throughput.py on `shape`, and the plan's predictions of that run."""
    from tenx.plan.estimate import estimate, vocab_of

    bench = load_throughput_bench()
    shape, fp8, precision = shape.removesuffix("-fp8"), shape.endswith("-fp8"), None
    extra: dict[str, Any] = {"data": data} if "data" in inspect.signature(bench.compare).parameters else {}
    if fp8:
        extra["precision"] = precision = "fp8"
    result = bench.compare(shape, device, steps, skip, tiny=tiny, **extra)
    try:
        run = bench.run_config(shape, device, data, steps, tiny, precision)
    except AttributeError as e:
        return {"throughput": result, "plan": {"error": f"bench/train_throughput.py: {e}"}}
    dtype = resolve_precision(run.train.precision, device)
    plan = estimate(
        run,
        device_cluster(device, dtype),
        vocab=vocab_of(run),
        ranks=1,
        dtype="bf16" if dtype == torch.bfloat16 else "fp32",
    )
    model = run.model.resolved(vocab_of(run))
    tokens_per_step = run.train.micro_batch * max(1, run.train.grad_accum) * model.seq_len
    measured_step_s = tokens_per_step / result["tenx"]["tokens_per_s"]
    predicted_mib = plan.memory_per_rank["total"] / 2**20
    return {
        "throughput": result,
        "plan": {
            "step_time_ratio": plan.step_s / measured_step_s,
            "memory_ratio": predicted_mib / result["tenx"]["peak_mib"],
            "predicted_step_s": plan.step_s,
            "measured_step_s": measured_step_s,
            "predicted_peak_mib": predicted_mib,
            "measured_peak_mib": result["tenx"]["peak_mib"],
        },
    }


def check_shape(shape: str) -> Callable[[Context], str | None]:
    """The throughput of one shape, in a fresh process (its own memory accounting)."""

    def run(ctx: Context) -> str | None:
        if shape.endswith("-fp8"):
            from tenx.errors import ConfigError
            from tenx.train.float8 import check_float8_support

            try:
                check_float8_support(ctx.device)
            except ConfigError as e:
                ctx.throughput[shape] = ctx.plan[shape] = {"skipped": str(e)}
                return f"skipped: {e}"  # a skip is said as one, never as a pass
        data = ctx.work / "throughput-data"  # a copy: compare() may prepare into the directory it is given
        if not data.exists():
            shutil.copytree(ctx.data, data)
        steps, skip = ("12", "4") if ctx.cuda else ("8", "2")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--shape", shape, "--device", str(ctx.device)]
        cmd += ["--steps", steps, "--skip", skip, "--data", str(data)]
        done = ctx.process(f"throughput-{shape}", cmd, timeout=300 if ctx.cuda else 150)
        line = next((s for s in reversed(done.stdout.splitlines()) if s.startswith(MARKER)), None)
        if line is None:
            raise CheckFailed(f"--shape {shape} printed no result")
        record = json.loads(line[len(MARKER) :])
        ctx.throughput[shape], ctx.plan[shape] = record["throughput"], record["plan"]
        return None

    return run


# ----- running them ----------------------------------------------------------------------------------
EXPECTED_S = {"cuda": 60.0, "cpu": 30.0}
"""Seconds a check is expected to take when this machine has not run it before (then: its last time,
GPU_CHECK_SECONDS in tenx's cache). --budget-s starts no check that would end past the budget."""
GPU_CHECK_SECONDS = "gpu-check-seconds.json"


def expected_seconds(device: torch.device) -> dict[str, float]:
    """Each check's seconds the last time it ran on this device (by name), from tenx's cache."""
    from tenx.utils.io import cache_dir

    try:
        known = json.loads((cache_dir() / GPU_CHECK_SECONDS).read_text())
    except (OSError, ValueError):
        return {}
    mine = known.get(device_name(device), {}) if isinstance(known, dict) else {}
    return {k: float(v) for k, v in mine.items() if isinstance(v, (int, float))}


def remember_seconds(device: torch.device, seconds: dict[str, float]) -> None:
    """Keep each check's seconds on this device for the next --budget-s (best effort: a cache)."""
    from tenx.utils.io import atomic_write_json, cache_dir

    path = cache_dir() / GPU_CHECK_SECONDS
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    known[device_name(device)] = {**known.get(device_name(device), {}), **seconds}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, known)


@dataclass
class Budget:
    """--budget-s: the whole check's wall time; a check that would end past it is dropped, and named."""

    seconds: float | None
    expected: dict[str, float]
    default: float

    def refuses(self, name: str, elapsed: float) -> str | None:
        if self.seconds is None:
            return None
        need = self.expected.get(name, self.default)
        if elapsed + need <= self.seconds:
            return None
        return f"dropped: would not fit in --budget-s {self.seconds:g} (about {need:.0f} s, {elapsed:.0f} s gone)"


def run_checks(
    ctx: Context,
    checks: list[Check],
    workers: int,
    t0: float,
    earlier: dict[str, str] | None = None,
    budget: Budget | None = None,
) -> dict[str, str]:
    """Each check once its needs passed (here or in `earlier`), `workers` processes busy at most; the entries
    of these checks and the earlier ones, by name. Each entry is written to WORK/fragments.jsonl the moment
    it is known (with the throughput and plan figures of a shape), so a check cut short keeps what it had."""
    results: dict[str, str] = dict(earlier or {})
    pending, running = list(checks), {}
    free = workers

    def attempt(check: Check) -> tuple[str, float]:
        start = time.perf_counter()
        try:
            entry = check.run(ctx) or "pass"
        except CheckFailed as e:
            entry = str(e) or "failed"
        except Exception as e:  # a bug of the check itself, or a file a command should have written
            entry = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return entry, time.perf_counter() - start

    def record(name: str, entry: str, seconds: float = 0.0) -> None:
        results[name] = entry
        ctx.seconds[name] = seconds
        print(f"[{time.perf_counter() - t0:6.1f} s] {name}: {entry} ({seconds:.1f} s)", flush=True)
        fragment: dict[str, Any] = {"name": name, "entry": entry, "seconds": round(seconds, 1)}
        shape = name.removeprefix("throughput ")
        if shape != name:
            fragment |= {"throughput": ctx.throughput.get(shape), "plan": ctx.plan.get(shape)}
        with open(ctx.work / "fragments.jsonl", "a") as f:
            f.write(json.dumps(fragment, default=str) + "\n")

    with ThreadPoolExecutor(max_workers=workers) as pool:
        while pending or running:
            for check in list(pending):
                if not all(n in results for n in (*check.needs, *check.after)):
                    continue
                failed = [n for n in check.needs if results[n] != "pass"]
                if failed:
                    pending.remove(check)
                    dropped = results[failed[0]].startswith("dropped")
                    record(check.name, f"{'dropped' if dropped else 'not run'}: {failed[0]} did not pass")
                    continue
                take = min(check.slots, workers)
                refused = budget.refuses(check.name, time.perf_counter() - t0) if budget else None
                if refused and take <= free:
                    pending.remove(check)
                    record(check.name, refused)
                    continue
                if take <= free:
                    pending.remove(check)
                    free -= take
                    running[pool.submit(attempt, check)] = (check, take)
            if not running:
                continue
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                check, take = running.pop(future)
                free += take
                record(check.name, *future.result())
    return results


def outcome(name: str, entry: str) -> str:
    """passed, skipped (a reason the machine gives: SKIPPABLE entries only), dropped (--budget-s) or failed.
    A skip is never a pass, and a skip of a command that must run here is a failure."""
    if entry == "pass":
        return "passed"
    if entry.startswith("skipped") and name in SKIPPABLE:
        return "skipped"
    if entry.startswith("dropped"):
        return "dropped"
    return "failed"


def command_counts(commands: dict[str, str]) -> dict[str, int]:
    """{passed, skipped, failed, dropped}: how many commands ended each way."""
    counts = dict.fromkeys(("passed", "skipped", "failed", "dropped"), 0)
    for name, entry in commands.items():
        counts[outcome(name, entry)] += 1
    return counts


def subprocess_env(work: Path) -> dict[str, str]:
    """This checkout first on PYTHONPATH, one thread per process, caches inside the work directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return {
        **env,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TENX_CACHE_DIR": str(work / "cache"),  # tenx plan --measure keeps its factors here, not in ~/.cache
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: CUDA when available)")
    ap.add_argument("--out", help="work directory, kept (default: a temporary one, kept only on a failure)")
    ap.add_argument("--workers", type=int, help="commands at once (default: 4 on CUDA, 2 on a CPU)")
    ap.add_argument("--timeout", type=float, help="seconds per command (default: 300 on CUDA, 120 on a CPU)")
    ap.add_argument(
        "--budget-s",
        type=float,
        help="fit the whole check into this many seconds: a command that would end past it (by its time on "
        "this device last run, else 60 s on CUDA, 30 s on a CPU) is dropped and named",
    )
    ap.add_argument("--shape", choices=SHAPES, help="only the throughput and plan of this shape, as JSON")
    ap.add_argument("--steps", type=int, default=12, help="--shape: steps of each run")
    ap.add_argument("--skip", type=int, default=4, help="--shape: warm-up steps left out of the timing")
    ap.add_argument("--data", help="--shape: prepared data (default: runs/data/stdlib)")
    args = ap.parse_args()
    device = pick_device(args.device, "--device")

    if args.shape:
        data = Path(args.data or "runs/data/stdlib")
        start = time.perf_counter()
        record = measure_shape(args.shape, device, args.steps, args.skip, device.type == "cpu", data)
        # the measuring's seconds, not the process's start or exit
        record["throughput"]["seconds"] = round(time.perf_counter() - start, 1)
        print(MARKER + json.dumps(record))
        return

    t0 = time.perf_counter()
    if args.out and Path(args.out).exists() and any(Path(args.out).iterdir()):
        raise SystemExit(f"--out {args.out}: not empty; give a new or empty directory (nothing was written)")
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tenx-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    cuda = device.type == "cuda"
    ctx = Context(
        work.resolve(), device, args.timeout or (300 if cuda else 120), subprocess_env(work.resolve())
    )
    print(f"gpu check on {device_name(device)} ({device}); work directory {ctx.work}", flush=True)
    shapes = [  # one after the other (they share a data directory)
        Check(f"throughput {s}", check_shape(s), ("prepare",), tuple(f"throughput {p}" for p in SHAPES[:i]))
        for i, s in enumerate(SHAPES)
    ]
    budget = Budget(args.budget_s, expected_seconds(device), EXPECTED_S["cuda" if cuda else "cpu"])
    # the throughput first, alone on the device, one shape after the other (they share a data directory):
    # its figures are what a short or cut-short check most needs; then the commands
    results = run_checks(ctx, COMMANDS[:1], 1, t0, budget=budget)
    results = run_checks(ctx, shapes, 1, t0, results, budget)
    results = run_checks(ctx, COMMANDS[1:], args.workers or (4 if cuda else 2), t0, results, budget)
    remember_seconds(device, {n: s for n, s in ctx.seconds.items() if results.get(n) == "pass"})
    for shape, check in zip(SHAPES, shapes, strict=True):
        if shape not in ctx.throughput:
            ctx.throughput[shape] = {"error": results[check.name]}
            ctx.plan[shape] = {"error": results[check.name]}
    commands = {c.name: results[c.name] for c in COMMANDS}
    counts = command_counts(commands)
    dropped = [n for n, e in commands.items() if e.startswith("dropped")]
    dropped += [s for s in SHAPES if str(ctx.throughput[s].get("error", "")).startswith("dropped")]
    failed = [n for n, e in commands.items() if outcome(n, e) == "failed"]
    failed += [s for s in SHAPES if "error" in ctx.throughput[s] and s not in dropped]
    fp8, bf16 = ctx.throughput.get("llama-1b-fp8", {}), ctx.throughput.get("llama-1b", {})
    if "tenx" in fp8 and "tenx" in bf16:  # the acceptance: fp8 against tenx's own bf16
        fp8["over_bf16"] = fp8["tenx"]["tokens_per_s"] / bf16["tenx"]["tokens_per_s"]
        fp8["loss_over_bf16"] = fp8["tenx"]["final_loss"] / bf16["tenx"]["final_loss"]
    seconds = time.perf_counter() - t0
    if args.out or failed:
        print(f"work directory kept: {ctx.work} (logs/ holds each command's output)")
    else:
        shutil.rmtree(ctx.work, ignore_errors=True)
    said = f"{counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed"
    if dropped:
        said += f", {len(dropped)} dropped to fit --budget-s {args.budget_s:g} ({', '.join(dropped)})"
    print(f"{said} of {len(commands)} commands in {seconds:.0f} s", flush=True)
    summary = {
        "bench": "gpu_check",
        "device": device_name(device),
        "torch": torch.__version__,
        "seconds": round(seconds, 1),
        "counts": counts,
        "dropped": dropped,
        "commands": commands,
        "throughput": ctx.throughput,
        "plan": ctx.plan,
    }
    print(json.dumps(summary, default=str))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
