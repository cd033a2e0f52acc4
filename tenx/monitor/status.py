"""`tenx status RUN_DIR`: a run's progress, newest verified checkpoint, last metrics, prediction and
prequential figures, goodput (tenx/monitor/goodput.py's report) and the count of each event kind with the
last events, read from the run directory's files alone."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tenx import rundir
from tenx.errors import TenxError
from tenx.monitor.events import read_events_counted
from tenx.monitor.goodput import compute_goodput, format_goodput
from tenx.utils.text import counted


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _event_line(event: dict[str, Any]) -> str:
    try:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(event.get("time") or 0)))
    except (OverflowError, OSError, ValueError, TypeError):  # a finite time past what the platform dates
        when = f"time {event.get('time')!r}"
    step = f" step {event['step']}" if event.get("step") is not None else ""
    extra = " ".join(
        f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
        for k, v in event.items()
        if k not in ("time", "kind", "step", "pid")
    )
    text = f"  {when}  {event.get('kind')}{step}  {extra}".rstrip()
    return text if len(text) <= 160 else text[:157] + "..."


def _prequential_lines(run_dir: Path, metrics: list[dict[str, Any]]) -> list[str]:
    """The training stream's prequential bits per byte: prequential.json at the end, else the running figure."""
    try:
        done = json.loads(rundir.RunDir(run_dir).prequential.read_text())
    except (OSError, ValueError):
        done = None
    if isinstance(done, dict) and isinstance(done.get("bits_per_byte"), (int, float)):
        text = f"prequential {_number(done['bits_per_byte'])} bits per byte of the training stream"
        same = done.get("same_bytes")
        if (
            isinstance(same, dict)
            and isinstance(same.get("xz_bits_per_byte"), (int, float))
            and isinstance(same.get("bytes", 0), int)
        ):
            text += (
                f"; on its first {same.get('bytes', 0):,} bytes {_number(same.get('model_bits_per_byte'))}"
                f" vs xz -9e {_number(same['xz_bits_per_byte'])}"
            )
        return [text]
    running = next((r for r in reversed(metrics) if "prequential_bpb" in r), None)
    if running is None:
        return []
    return [
        f"prequential {_number(running['prequential_bpb'])} bits per byte so far (step {running.get('step')})"
    ]


def format_status(run_dir: str | Path, events_shown: int | None = 5) -> str:
    """`tenx status RUN_DIR`: progress, newest verified checkpoint, last metrics, goodput, the count of each
    event kind and the last `events_shown` events (None: every one)."""
    run_dir = Path(run_dir)
    run = rundir.RunDir(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TenxError(f"{run_dir} is a file, not a run directory (pass a `tenx train` run's --run-dir)")
    if not run_dir.is_dir():
        raise TenxError(f"run directory {run_dir} does not exist (pass the --run-dir of a `tenx train` run)")
    from tenx.checkpoint import latest_verified, list_checkpoints

    report = compute_goodput(run_dir)
    metrics: list[dict[str, Any]] = []
    metrics_skipped = 0
    if run.metrics.exists():  # a directory in its place is an error naming it
        from tenx.monitor.metrics_file import read_metrics_counted

        metrics, metrics_skipped = read_metrics_counted(run.metrics)
    total = None
    try:
        total = json.loads(run.provenance.read_text()).get("total_steps")
    except (OSError, ValueError, AttributeError):
        pass

    lines = [f"run         {run_dir}"]
    known = ([report["steps"]] if report["records"] else []) + (
        [metrics[-1]["step"]] if metrics and isinstance(metrics[-1].get("step"), int) else []
    )
    if not known:
        progress = "no steps trained yet (no ledger.jsonl or metrics.jsonl)"
    else:
        step = max(known)
        progress = f"step {step}"
        if isinstance(total, int) and total > 0:
            progress += f" of {total} ({100 * step / total:.1f}%)"
        else:
            progress += " (total unknown: run.json has no total_steps)"
        if report["finished"]:
            progress += ", finished"
    lines.append(f"progress    {progress}")

    checkpoints = list_checkpoints(run.checkpoints)
    latest, skipped = latest_verified(run.checkpoints)
    if latest is not None:
        lines.append(f"checkpoint  {latest.name} verifies ({len(checkpoints)} on disk)")
    else:
        lines.append("checkpoint  none verifies" if checkpoints else "checkpoint  none saved yet")
    lines += [f"            not verifying: {note}" for note in skipped]

    if metrics:
        last = metrics[-1]
        text = f"step {last.get('step')} | loss {_number(last.get('loss'))}"
        validated = next((r for r in reversed(metrics) if "val_loss" in r), None)
        if validated is not None:
            text += f" | val_loss {_number(validated['val_loss'])} (step {validated.get('step')})"
        lines.append(f"metrics     {text}")
        watched = next((r for r in reversed(metrics) if isinstance(r.get("pred_dev"), (int, float))), None)
        if watched is not None:
            lines.append(
                f"prediction  step {watched.get('step')}: {_number(watched.get('pred_actual'))} vs predicted "
                f"{_number(watched.get('pred_loss'))} ({_number(watched.get('pred_lower'))} .. "
                f"{_number(watched.get('pred_upper'))}), {watched['pred_dev']:+.1f} band half-widths"
            )
        lines += _prequential_lines(run_dir, metrics)
        final = next((r for r in reversed(metrics) if "pred_final_self" in r), None)
        if final is not None:
            text = f"final loss {_number(final['pred_final_self'])} from its own curve (step {final.get('step')})"
            if "pred_final" in final:
                text += f", predicted {_number(final['pred_final'])}"
            lines.append(f"            {text}")
    else:
        lines.append("metrics     none yet (no metrics.jsonl)")
    if metrics_skipped:
        lines.append(
            f"            {counted(metrics_skipped, 'line')} of {run.metrics} passed over: not step records"
        )

    lines.append(format_goodput(report))

    events, events_skipped = read_events_counted(run_dir)
    if events:
        counts: dict[str, int] = {}
        for event in events:
            counts[str(event.get("kind"))] = counts.get(str(event.get("kind")), 0) + 1
        shown = events if events_shown is None else events[len(events) - min(events_shown, len(events)) :]
        text = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))
        if len(shown) < len(events):
            text += f" (the last {len(shown)} of {len(events)} below; --events all for every one)"
        lines.append("events      " + text)
        lines += [_event_line(event) for event in shown]
    else:
        lines.append("events      none")
    if events_skipped:
        lines.append(
            f"            {counted(events_skipped, 'event')} of {run.events} passed over: a field's type"
        )
    return "\n".join(lines)
