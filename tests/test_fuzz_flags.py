"""Every numeric flag of every subcommand, found by walking the `tenx` parser (a flag added tomorrow is fuzzed
too), given negative, zero, nan, inf and huge values: each ends in one clear `tenx: error:` line (exit 2) or a
correct run, never a traceback, a hang, or exit 0 on nonsense.

Nonsense is refused: nan, infinities and negative numbers always (no flag of tenx means anything by them);
zero unless the flag is in ZERO_MEANS (each with what 0 means there). A huge value is refused or accepted,
but must not run away: the command either refuses it or gets as far as its real work (commands that train,
prepare or serve stop there: WORK names the function each reaches once its flags are checked) within
LIMIT_S. The sweep of all flags with all values is slow (`-m slow`); the default run tries every flag
once, with the values in turn.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import signal
import sys
from collections.abc import Iterator

import pytest

from tenx.cli import build_parser, main

VALUES = ("nan", "inf", "-inf", "-1", "-5000", "0", "1e300", "99999999999999999999")
LIMIT_S = 60
"""The longest one invocation may take (a hang fails the test with the flag and value)."""

ZERO_MEANS = {
    ("data prepare", "--val-ratio"): "no validation split",
    ("data prepare", "--heldout-ratio"): "no held-out split",
    ("data prepare", "--seed"): "seed 0",
    ("data prepare", "--ngram-index"): "no n-gram index",
    ("data prepare", "--near-dup-threshold"): "every pair counts as near-duplicate: allowed as a bound",
    ("data prepare", "--contamination-threshold"): "any shared n-gram contaminates",
    ("train", "--max-restarts"): "never restart",
    ("train", "--backoff"): "restart at once",
    ("train", "--heartbeat-timeout"): "no hang watchdog",
    ("train", "--fault-seed"): "seed 0",
    ("train", "--gpus-per-node"): "with --emit slurm: no GPUs asked for (a CPU partition)",
    ("status", "--events"): "no recent events listed",
    ("ladder", "--min-tokens-per-param"): "no lower bound",
    ("ladder", "--eval-bytes"): "the whole split",
    ("ladder", "--evals-per-run"): "no evaluation during a run",
    ("fit", "--bootstrap"): "no bootstrap band",
    ("fit", "--seed"): "seed 0",
    ("fit", "--min-tokens-per-param"): "no lower bound",
    ("fit", "--max-residual"): "keep every run",
    ("predict", "--bootstrap"): "no band",
    ("decompress", "--max-bytes"): "only an empty original",
    ("eval", "--threshold"): "any shared n-gram contaminates",
    ("eval", "--max-file-bytes"): "no size limit",
    ("sample", "--temperature"): "greedy decoding",
    ("sample", "--max-new-tokens"): "the prompt alone",
    ("sample", "--top-k"): "no top-k cut",
    ("sample", "--seed"): "seed 0",
    ("plan", "--diloco-every"): "no DiLoCo",
    ("plan failures", "--restart-s"): "an instant restart",
    ("plan failures", "--detect-s"): "instant detection",
    ("plan failures", "--seed"): "seed 0",
}
"""Flags where 0 is meaningful, and what it means (the test then only asks for a clean end)."""


def numeric_flags() -> list[tuple[str, str]]:
    """(subcommand, flag) for every option of every subcommand that takes a number."""
    found: list[tuple[str, str]] = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        complete = getattr(parser, "_complete", None)
        if complete is not None:
            complete()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.option_strings and action.nargs != 0 and _numeric(action):
                found.append((" ".join(path), action.option_strings[-1]))

    walk(build_parser(), [])
    return found


def _numeric(action: argparse.Action) -> bool:
    if action.type in (int, float):
        return True
    default = action.default
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return True
    return action.type not in (None, str) and not isinstance(action.type, argparse.FileType)


class _Reached(Exception):
    """The command got past its checks to its real work (which the fuzz does not run)."""


@pytest.fixture(scope="module")
def world(tiny_config, tiny_data, corpus_dir, tmp_path_factory):
    """What the subcommands need: a trained tiny run, its data, a ladder's results, a compressed file."""
    from tenx.compress.files import compress_file
    from tenx.train.run import train

    root = tmp_path_factory.mktemp("fuzz")
    run = root / "run"
    train(tiny_config(tiny_data, "train.steps=4", "checkpoint.every=2", "train.eval_every=0"), run)
    (root / "doc.py").write_bytes(b"import json\nprint(json.dumps({'a': 1}))\n" * 3)
    compress_file(run, root / "doc.py", root / "doc.py.tenx")
    ladder = root / "ladder"
    ladder.mkdir()
    rows = [
        {
            "name": f"r{i}",
            "params": n,
            "tokens": d,
            "flops": 6 * n * d,
            "heldout_loss": 1.7 + 400 / n**0.34 + 410 / d**0.28,
        }
        for i, (n, d) in enumerate((n, 20 * n * k) for n in (1e5, 3e5, 1e6, 3e6) for k in (0.5, 1, 2))
    ]
    (ladder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "run": run, "data": tiny_data, "corpus": corpus_dir, "ladder": ladder}


def _base(command: str, w: dict, n: int) -> list[str]:
    """A command line of `command` that works, into fresh outputs numbered `n`."""
    root, run = w["root"], str(w["run"])
    out = str(root / f"out{n}")
    data = f'data.dir="{w["data"]}"'
    return {
        "data prepare": ["data", "prepare", "--source", str(w["corpus"]), "--out", out, "--tokenizer", "bytes"],
        "data index": ["data", "index", str(w["data"])],
        "train": ["train", "--config", "tiny", "--run-dir", out, "--set", data, "--supervise"],
        "quickstart": ["quickstart", "--out", out],
        "status": ["status", run],
        "dashboard": ["dashboard", run],
        "replay": ["replay", run, "--step", "2"],
        "triage": ["triage", run],
        "lighthouse": ["lighthouse", "--bind", "127.0.0.1:0"],
        "ladder": ["ladder", "--config", "tiny", "--set", data, "--budgets", "1e11", "--grid", "ratio",
                   "--max-depth", "1", "--out", out, "--dry-run"],
        "derisk": ["derisk", "--base", "tiny", "--set", data, "--budgets", "1e11,2e11", "--out", out, "--dry-run",
                   "--change", "wide:model.aspect_ratio=64"],
        "fit": ["fit", str(w["ladder"]), "--no-plot", "--out", out, "--bootstrap", "4"],
        "predict": ["predict", "--run", run, "-o", f"{out}.json"],
        "curves convert": ["curves", "convert", "--from-run", run, "--out", f"{out}.jsonl"],
        "eval": ["eval", run, "--split", "val", "--out", f"{out}.json"],
        "sample": ["sample", run, "--max-new-tokens", "4"],
        "export": ["export", run, "-o", out],
        "compress": ["compress", run, str(root / "doc.py"), "-o", f"{out}.tenx"],
        "decompress": ["decompress", run, str(root / "doc.py.tenx"), "-o", f"{out}.py"],
        "plan": ["plan", "--config", "tiny", "--cluster", "cpu", "--vocab", "257"],
        "plan shapes": ["plan", "shapes", "--config", "tiny", "--vocab", "257", "--repeat", "2"],
        "plan failures": ["plan", "failures", "--no-sim"],
        "plan choose": ["plan", "choose", "--config", "tiny", "--cluster", "cpu", "--fit", str(w["ladder"]),
                        "--budget", "1e15", "--vocab", "257"],
    }[command]  # fmt: skip


@contextlib.contextmanager
def _stopped_at_work(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The functions where training, preparing and serving begin raise _Reached: the fuzz checks the flags,
    not the work. Where the work has its own validation (PrepareConfig, SupervisorConfig, the child's run
    config), a value counts as reached only once that accepts it too."""

    def reached(*args, **kwargs):
        raise _Reached

    def prepare_reached(cfg, *args, **kwargs):
        cfg.validate()  # the work's own check: a value it would refuse is not "reached"
        raise _Reached

    def supervise_reached(train_args, run_dir, cfg, *args, **kwargs):
        from tenx.train.config import load_run_config, resolve_config_path

        cfg.validate()  # the supervisor's settings, and the run config its child would load
        child = build_parser().parse_args(train_args)
        load_run_config(resolve_config_path(child.config), child.set)
        raise _Reached

    import tenx.data.prepare.pipeline as pipeline
    import tenx.launch.supervise as supervise
    import tenx.monitor.dashboard.server as dashboard
    import tenx.parallel.lighthouse as lighthouse
    import tenx.quickstart as quickstart

    monkeypatch.setattr(pipeline, "_prepare", prepare_reached)
    monkeypatch.setattr(supervise, "_supervise", supervise_reached)
    monkeypatch.setattr(quickstart, "prepare", prepare_reached)
    monkeypatch.setattr(quickstart, "is_prepared", lambda cfg: False)
    monkeypatch.setattr(dashboard.DashboardServer, "serve_forever", reached)
    monkeypatch.setattr(lighthouse, "start_lighthouse", _checked_lighthouse(lighthouse.start_lighthouse))
    yield


def _checked_lighthouse(start):
    def checked(bind, **options):
        server, address = start(bind, **options)
        server.shutdown()
        raise _Reached

    return checked


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang


def run_flag(command: str, flag: str, value: str, w: dict, n: int) -> tuple[str, str]:
    """How `tenx COMMAND ... FLAG VALUE` ended: 'refused', 'accepted' or 'reached' (its work), and what it
    printed on stderr; a traceback, a hang or another exit status fails the test."""
    argv = [*_base(command, w, n), flag, value]
    err = io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(LIMIT_S)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's refusal of a value its type rejects
                code = e.code
            except _Reached:
                return "reached", err.getvalue()
    except _Hang:
        pytest.fail(f"tenx {' '.join(argv)} did not end within {LIMIT_S} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    text = err.getvalue()
    assert code in (0, 2), f"tenx {' '.join(argv)} exited {code}: {text[-2000:]}"
    if code == 2:
        lines = [line for line in text.splitlines() if "error:" in line]
        assert lines and "Traceback" not in text, f"tenx {' '.join(argv)}: {text[-2000:]}"
    return ("refused" if code == 2 else "accepted"), text


def _nonsense(command: str, flag: str, value: str) -> bool:
    number = float(value)
    if math.isnan(number) or math.isinf(number) or number < 0:
        return True
    return number == 0 and (command, flag) not in ZERO_MEANS


def check(command: str, flag: str, value: str, w: dict, n: int) -> str:
    outcome, text = run_flag(command, flag, value, w, n)
    if _nonsense(command, flag, value):
        assert outcome == "refused", f"tenx {command} {flag} {value}: {outcome} (nonsense must be refused)"
    return outcome


FLAGS = numeric_flags()


def test_the_walk_finds_the_numeric_flags():
    assert len(FLAGS) >= 80
    for expected in [("eval", "--batch-size"), ("plan failures", "--days"), ("decompress", "--max-bytes")]:
        assert expected in FLAGS


def test_every_flag_once_with_the_values_in_turn(world, monkeypatch):
    """The default run tries every numeric flag the walk finds (a flag added tomorrow too), each with one
    value taken in turn from VALUES, so that across the flags every value is tried; `-m slow` tries every
    pair. (A hypothesis sample of 120 pairs left 37 of 106 flags untried.)"""
    outcomes: dict[tuple[str, str], str] = {}
    with _stopped_at_work(monkeypatch):
        for n, (command, flag) in enumerate(FLAGS):
            outcomes[(command, flag)] = check(command, flag, VALUES[n % len(VALUES)], world, n)
    assert set(outcomes) == set(FLAGS)
    assert {VALUES[n % len(VALUES)] for n in range(len(FLAGS))} == set(VALUES)
    reached = {command for (command, _), outcome in outcomes.items() if outcome == "reached"}
    assert "quickstart" in reached  # through prepare_reached: the work's own validation ran on it


@pytest.mark.slow
def test_every_flag_with_every_value(world, monkeypatch):
    counts: dict[str, int] = {}
    n = 0
    with _stopped_at_work(monkeypatch):
        for command, flag in FLAGS:
            for value in VALUES:
                n += 1
                outcome = check(command, flag, value, world, n)
                counts[outcome] = counts.get(outcome, 0) + 1
    print(json.dumps({"flags": len(FLAGS), "invocations": n, **counts}), file=sys.stderr)
