"""Watching the rollout application start while the run goes on: a Serve deployment that fails to start (a
replica's constructor raising: a bad model folder, too little memory) ends the run with Serve's own reason
instead of leaving the trainer to wait out `rollout.join_timeout_s` for a replica."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class RolloutStartWatch:
    """Polled while training runs, until the rollout application first runs: a deployment that fails to
    start (a replica's constructor raising: a bad model folder, too little memory) raises Serve's message
    instead of leaving the trainer to wait out `rollout.join_timeout_s` for a replica."""

    def __init__(self, app: str, every_s: float = 2.0) -> None:
        self.app, self.every_s = app, every_s
        self.running = False
        self.next_check = 0.0
        self.pending: dict[Any, str] = {}  # other starts whose failure ends the run: ref -> what it is

    def expect(self, ref: Any, what: str) -> None:
        """Also watch `ref` (an actor's first call, answered once its constructor ran): its error ends the run."""
        self.pending[ref] = what

    def _check_pending(self) -> None:
        import ray

        if not self.pending:
            return
        done, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
        for ref in done:
            what = self.pending.pop(ref)
            ray.get(ref)  # raises the constructor's error (a UserError inside stays visible: app/errors.py)
            log.info("%s: done", what)

    def wait(self, timeout_s: float) -> None:
        """Until the application runs (raises where it failed, or after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not self.running:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the rollout deployment {self.app!r} did not start within rollout.join_timeout_s="
                    f"{timeout_s:.0f}s (see the Serve view of the dashboard, and the replica's log)"
                )
            self()
            time.sleep(0.5)

    def __call__(self) -> None:
        self._check_pending()
        if self.running or time.monotonic() < self.next_check:
            return
        from ray import serve

        self.next_check = time.monotonic() + self.every_s
        st = serve.status().applications.get(self.app)
        if st is None:
            return
        if st.status == "RUNNING":
            self.running = True
            log.info("rollout application %s running", self.app)
        elif st.status == "DEPLOY_FAILED":
            raise RuntimeError(
                f"the rollout deployment {self.app!r} failed to start: {failure_reason(st)} (see the Serve "
                "view of the dashboard, and the replica's log)"
            )


def failure_reason(app_status: Any) -> str:
    """Why a Serve application failed to deploy, with the replica's own reason where Serve has it: the app's
    message says only "Failed to update the deployments"; each deployment's message carries the constructor's
    traceback, whose last exception line (vLLM's refusal of a `max_model_len`, an out-of-memory) is the news."""
    reasons = []
    for name, dep in (getattr(app_status, "deployments", None) or {}).items():
        lines = [ln.strip() for ln in str(getattr(dep, "message", "") or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception", "Exit"))]
        if errors or lines:
            reasons.append(f"{name}: {(errors or lines)[-1][:600]}")
    return "; ".join([str(app_status.message), *reasons]) if reasons else str(app_status.message)
