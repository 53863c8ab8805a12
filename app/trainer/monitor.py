"""Phase reporting: the watchdog (app/infra/watchdog.py) and the run control's heartbeat learn what the trainer
is doing; on a stall, `stall_report` says what the other roles were doing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.infra.watchdog import REPORT, Watchdog
from app.trainer.comm import Actors


def stall_report(actors: Actors) -> dict[str, Any]:
    """What the rollouter and the replicas are doing, for the watchdog (each answer within 10 s)."""
    import ray

    out: dict[str, Any] = {}
    try:
        out["rollouter"] = ray.get(actors.rollouter.progress.remote(), timeout=10)
    except Exception as e:
        out["rollouter"] = f"no answer within 10s ({e!r}): the rollouter itself is stuck or dead"
    try:
        st = ray.get(actors.hub.status.remote(), timeout=10)
        out["replicas"] = {
            rid: {k: m.get(k) for k in ("alive", "version", "epoch", "dropped", "leaving")}
            for rid, m in st.get("members", {}).items()
        }
        out["hub_version"], out["last_push"] = st.get("version"), st.get("last_push")
    except Exception as e:
        out["replicas"] = f"the weight hub did not answer within 10s ({e!r})"
    return out


class Monitor:
    """Rank 0 reports each phase and completed step; on the other ranks every call does nothing."""

    def __init__(self, actors: Actors | None, stall_timeout_s: float, run_dir: Path) -> None:
        self.actors, self.stall_timeout_s, self.run_dir = actors, stall_timeout_s, run_dir
        self.dog: Watchdog | None = None
        self.restored_step: int | None = None

    def start(self, restored_step: int | None) -> None:
        """Start the watchdog (rank 0): from now on a step must complete every `train.stall_timeout_s`."""
        self.restored_step = restored_step
        if self.actors is not None:
            actors = self.actors
            self.dog = Watchdog(self.stall_timeout_s, lambda: stall_report(actors), self.run_dir / REPORT)
            self.dog.start()

    def phase(self, what: str) -> None:
        if self.dog is None:
            return
        self.dog.phase(what)
        beat = {"phase": what, "step": self.dog.last_step, "restored_step": self.restored_step}
        self.actors.control.beat.remote(beat)

    def step_done(self, step: int) -> None:
        if self.dog is not None:
            self.dog.step_done(step)

    def stop(self) -> None:
        if self.dog is not None:
            self.dog.stop()
