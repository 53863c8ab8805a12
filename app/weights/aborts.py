"""A replica's end of run control (app/weights/control.py `RunControl`): its abort loop.

Started by app/sync.py `ReplicaSync` beside its weights loop. It long-polls `RunControl.next_control`; at an
`Abort` it ends every in-flight generation (vLLM's abort pause: each request returns its tokens so far with
finish reason 'abort', which the rollouter saves as partial rollouts) and acknowledges. An abort takes the
replica's lock, so a weight load and an abort never overlap. The engine is reached only through
app/vllm/engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from app.rollout.partial import partial_policy
from app.vllm import engine as vla
from app.weights.records import Abort, Ack


class ReplicaControl:
    """A replica's end of run control (`name`: the `RunControl` actor's name; None: no run control).

    Its loop (`run`) long-polls `RunControl.next_control`: at an `Abort` it ends every in-flight generation
    (its tokens so far return with finish reason 'abort') and acknowledges. An abort takes the replica's
    `lock`, so a weight load and an abort never overlap."""

    def __init__(self, engine: Any, replica_id: str, name: str | None, poll_s: float) -> None:
        self.engine, self.replica_id, self.name, self.poll_s = engine, replica_id, name, poll_s
        self.actor: Any = None  # the RunControl actor, once it exists
        self.seen = -1  # abort requests handled (set at `attach`)

    def find(self) -> Any:
        """The run-control actor, or None while it does not exist (then no one can ask for an abort)."""
        if self.name is None:
            return None
        from app.weights.actors import get_actor

        try:
            return get_actor(self.name)
        except ValueError:
            return None

    async def attach(self) -> None:
        """At the replica's start: find the actor; aborts asked for before are not this replica's."""
        self.actor = self.find()
        if self.actor is not None:
            self.seen = await self.actor.abort_count.remote()

    async def detach(self, timeout_s: float) -> None:
        """Tell the run control that this replica is going away (no later abort waits for it)."""
        if self.actor is not None:
            await asyncio.wait_for(self.actor.detach.remote(self.replica_id), timeout=timeout_s)

    async def run(self, lock: asyncio.Lock, running: Callable[[], bool], note: Callable[[str], None]) -> None:
        """The control loop, while `running()`; `note(why)` records a failure to reach the run control."""
        while running():
            if self.actor is None:
                await asyncio.sleep(self.poll_s)
                self.actor = self.find()
                continue
            try:
                instr = await self.actor.next_control.remote(self.replica_id, self.seen, self.poll_s)
            except Exception as e:  # the control actor is gone: the run is over
                note(f"run control unreachable: {e}")
                await asyncio.sleep(self.poll_s)
                continue
            if isinstance(instr, Abort):
                async with lock:
                    await self.abort(instr.seq)

    async def abort(self, seq: int) -> None:
        """End every in-flight generation now: each returns its tokens so far with finish reason 'abort'
        (the rollouter saves them as partial rollouts in a checkpoint)."""
        try:
            await vla.pause(self.engine, partial_policy("resubmit"))  # its pause aborts every request
            await vla.resume(self.engine)
            ack = Ack(ok=True)
        except Exception as e:
            ack = Ack(ok=False, error=str(e))
        self.seen = seq
        with contextlib.suppress(Exception):
            await self.actor.ack.remote(self.replica_id, seq, ack)
