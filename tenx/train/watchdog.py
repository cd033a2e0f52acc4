"""Hang detection: a thread that notices when no training step completes in time.

The training loop calls `beat()` after every step. If the next beat is late by more than `timeout_s`
(`first_step_timeout_s` before the first step, which may compile or verify data), the watchdog writes
every thread's stack (faulthandler) to RUN_DIR/hang-step<N>-pid<P>.txt (RunDir.hang_report), records a `hang` event and ends
the process with exit status 3, so a supervisor restarts it from the newest checkpoint. A Python-level
thread cannot fire while C code holds the GIL forever; the supervisor's heartbeat check covers that case.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tenx.config import field
from tenx.rundir import RunDir

if TYPE_CHECKING:
    from tenx.monitor.events import EventLog

EXIT_HANG = 3
"""Exit status of a process the watchdog ended."""


@dataclass
class WatchdogConfig:
    """How long a step may take before the run counts as hung."""

    timeout_s: float = field(
        600.0, ge=0, help="seconds without a completed step before the run is declared hung (0: off)"
    )
    first_step_timeout_s: float = field(
        1800.0, ge=0, help="the same limit before the first step (startup, compilation, data verification)"
    )


class Watchdog:
    """Dumps all stacks and exits when `beat()` is not called within the limit."""

    def __init__(self, cfg: WatchdogConfig, run: RunDir, events: EventLog | None = None) -> None:
        self.cfg = cfg
        self.run = run
        self.events = events
        self.step = 0
        self._last = time.monotonic()
        self._first = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, step: int = 0) -> None:
        """Begin watching (no-op when timeout_s is 0)."""
        if self.cfg.timeout_s <= 0 or self._thread is not None:
            return
        self.step, self._last, self._first = step, time.monotonic(), True
        self._thread = threading.Thread(target=self._run, name="tenx-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        """A step completed."""
        self.step, self._last, self._first = step, time.monotonic(), False

    def stop(self) -> None:
        """Stop watching (training ended or failed normally)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _limit(self) -> float:
        return self.cfg.first_step_timeout_s if self._first else self.cfg.timeout_s

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, max(0.05, self.cfg.timeout_s / 20))):
            waited = time.monotonic() - self._last
            if waited > self._limit():
                self._fire(waited)

    def _fire(self, waited: float) -> None:
        self.run.root.mkdir(parents=True, exist_ok=True)
        path = self.run.hang_report(self.step + 1, os.getpid())
        with open(path, "w") as f:
            f.write(f"tenx watchdog: no step completed for {waited:.1f} s after step {self.step}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        if self.events is not None:
            self.events.emit("hang", self.step + 1, waited_s=round(waited, 3), stacks=str(path))
        print(
            f"tenx: watchdog: no step completed for {waited:.0f} s; stacks written to {path}; exiting",
            flush=True,
        )
        os._exit(EXIT_HANG)
