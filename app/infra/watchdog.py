"""The trainer's watchdog: no silent hang, ever.

Every wait in Relay has its own deadline; this is the backstop for whatever still does not return (a
collective on a wedged peer, a stuck driver call). Trainer rank 0 marks each phase it enters ("waiting for
8 finished groups for step 12", "pushing version 12", ...) and each completed step. If no step completes
within `train.stall_timeout_s`, the watchdog builds a report of what every role was doing (the trainer's
phase and for how long; the rollouter's stream: generating, queued, admission limit, replica version; every
replica's version and liveness; the last push), writes it to `stall_report.json`, logs it, and ends the
worker process: Ray Train then restarts the workers from the last checkpoint (`train.max_failures`) or
fails the run, and the driver raises `StallError` with the report.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

REPORT = "stall_report.json"
STALL_EXIT_CODE = 86


class StallError(RuntimeError):
    """The run made no progress within train.stall_timeout_s; the message holds the report."""


class Watchdog:
    def __init__(
        self,
        timeout_s: float,
        report: Callable[[], dict[str, Any]],
        report_path: Path,
        on_stall: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.report = report
        self.report_path = report_path
        self.on_stall = on_stall or (lambda _rep: os._exit(STALL_EXIT_CODE))
        self.poll_s = poll_s or min(5.0, timeout_s / 10)
        self.phase_name, self.phase_since = "starting", time.monotonic()
        self.last_step, self.last_step_at = 0, time.monotonic()
        self.fired: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.last_step_at = time.monotonic()
        self._thread.start()
        return self

    def phase(self, what: str) -> None:
        self.phase_name, self.phase_since = what, time.monotonic()

    def step_done(self, step: int) -> None:
        self.last_step, self.last_step_at = step, time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> dict[str, Any] | None:
        """Build and save the report if the deadline passed (the thread calls this every poll)."""
        now = time.monotonic()
        idle = now - self.last_step_at
        if idle <= self.timeout_s:
            return None
        rep: dict[str, Any] = {
            "error": f"no training step completed for {idle:.0f}s (train.stall_timeout_s={self.timeout_s:g})",
            "last_step": self.last_step,
            "trainer": {"phase": self.phase_name, "for_s": round(now - self.phase_since, 1)},
        }
        try:
            rep.update(self.report())
        except Exception as e:  # the report itself must not hang or fail the watchdog
            rep["report_error"] = repr(e)
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        self.report_path.write_text(json.dumps(rep, indent=1, default=str))
        log.error("STALL: %s", json.dumps(rep, default=str))
        self.fired = rep
        return rep

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            rep = self.check()
            if rep is not None:
                self.on_stall(rep)
                return


def summarize(rep: dict[str, Any]) -> str:
    """One paragraph from a stall report, for the error the driver raises."""
    parts = [rep.get("error", "stalled"), f"trainer: {rep.get('trainer')}"]
    for k in ("rollouter", "replicas", "last_push"):
        if k in rep:
            parts.append(f"{k}: {rep[k]}")
    return "; ".join(parts)
