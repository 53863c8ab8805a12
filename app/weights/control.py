"""Run control: a clean stop, the trainer's heartbeat, and aborting every in-flight generation.

Kept apart from the weight plane (app/weights/hub.py): a stop or an abort must reach the roles even while a
push is stuck. Run as an async Ray actor named `control_name(prefix)`; replicas long-poll `next_control`
(app/weights/aborts.py `ReplicaControl`) and acknowledge each abort request with `ack`.

A replica is expected to answer an abort when it polled within `stale_s` seconds and has not detached (a
replica handling a push still polls: its abort waits for the push to finish, then answers).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from app.weights.records import Abort, Ack, Acks, ControlInstruction, Idle
from app.weights.shared import Changes

log = logging.getLogger("app.sync")


class RunControl:
    """Stop requests, the trainer's heartbeat, and abort requests with their acknowledgements."""

    def __init__(self, stale_s: float = 30.0) -> None:
        self.stop: str | None = None  # a clean stop was requested (signal, `ray job stop`): the reason
        self.heartbeat: dict[str, Any] = {}  # the trainer's last reported phase (watchdog reports)
        self.abort_seq = 0  # `abort_inflight` calls
        self.acks: dict[int, dict[str, Ack]] = {}
        self.polled: dict[str, float] = {}  # replica id -> last poll (monotonic)
        self.stale_s = stale_s
        self.changed = Changes()

    async def request_stop(self, reason: str) -> None:
        """Ask the trainer to stop cleanly after the step in progress (it saves and reports as usual)."""
        if self.stop is None:
            self.stop = reason
            log.warning("clean stop requested: %s", reason)

    async def stop_reason(self) -> str | None:
        return self.stop

    async def beat(self, info: dict[str, Any]) -> None:
        """The trainer's rank 0 reports what it is doing (phase, step, since when): read by stall reports."""
        self.heartbeat = {**info, "at": time.time()}

    async def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "stop": self.stop,
            "trainer": self.heartbeat,
            "abort_seq": self.abort_seq,
            "replicas_polled_s_ago": {rid: round(now - t, 1) for rid, t in self.polled.items()},
        }

    async def abort_count(self) -> int:
        return self.abort_seq

    def _live(self) -> set[str]:
        now = time.monotonic()
        return {rid for rid, t in self.polled.items() if now - t <= self.stale_s}

    async def abort_inflight(self, timeout_s: float) -> dict[str, Any]:
        """Every live replica ends its in-flight generations now (vLLM's abort pause): each request returns
        what it generated so far, finish reason 'abort', so the rollouter can save the partial rollouts.
        Returns `Acks.as_dict()`: {"kind", "key", "acks": {replica: answer}, "missing": [replica, ...]}."""
        self.abort_seq += 1
        seq, expected = self.abort_seq, self._live()
        await self.changed.notify()
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.acks.get(seq, {})
            missing = sorted((expected & self._live()) - set(got))  # one that detached is not waited for
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                break
            await self.changed.wait(min(left, 1.0))
        return Acks(kind="abort", key=seq, got=dict(self.acks.get(seq, {})), missing=missing).as_dict()

    async def next_control(self, replica_id: str, abort_seen: int, wait_s: float) -> ControlInstruction:
        """Long-poll of a replica that handled abort requests up to `abort_seen`: `Abort` or `Idle`."""
        deadline = time.monotonic() + wait_s
        try:
            while True:
                self.polled[replica_id] = time.monotonic()
                if 0 <= abort_seen < self.abort_seq:
                    return Abort(seq=self.abort_seq)
                left = deadline - time.monotonic()
                if left <= 0:
                    return Idle()
                await self.changed.wait(left)
        finally:
            self.polled[replica_id] = time.monotonic()

    async def ack(self, replica_id: str, seq: int, ack: Ack) -> None:
        self.acks.setdefault(seq, {})[replica_id] = ack
        await self.changed.notify()

    async def detach(self, replica_id: str) -> None:
        """A replica is going away: no later abort waits for it."""
        self.polled.pop(replica_id, None)
        await self.changed.notify()
