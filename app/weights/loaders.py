"""How a replica loads a push into its engine's workers (app/sync.py `ReplicaSync` picks one at its start).

    PausedLoad   pause generation, the workers receive and load the whole push, set the version, resume
    StagedLoad   `sync.staged_receive`: the workers receive into staging buffers while the engine generates
                 (app/weights/staging.py), then generation pauses only while they copy them into the model

The third, LoRA (an adapter added beside the older ones, never paused), is app/weights/adapters.py. Each loader
answers `load(plan, phases, ack_epoch=, timeout_s=)` with the workers' results and fills in the seconds of its
phases. With `rollout.partial=off` a paused load first drains the replica (`GenerationGate`). The engine is
reached only through app/vllm/engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from app.rollout.partial import PartialPolicy
from app.vllm import engine as vla
from app.weights.records import PushPlan, plan_to_json

log = logging.getLogger("app.sync")


class GenerationGate:
    """Generate requests enter through `admit()`. `drained()` closes the gate (new requests wait at it), waits
    until every request inside finished (up to a deadline), and opens it again when its block ends.

    vLLM's own `wait` pause lets only the running sequences finish: the samples of a request that its
    scheduler still queues (behind `max_num_seqs`) would start after the load, under the new weights, and a
    group would then hold samples of two versions."""

    def __init__(self) -> None:
        self.inside = 0
        self._open = asyncio.Event()
        self._open.set()
        self._empty = asyncio.Event()
        self._empty.set()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        while not self._open.is_set():  # re-checked: a drain may have closed it again before we resumed
            await self._open.wait()
        self.inside += 1
        self._empty.clear()
        try:
            yield
        finally:
            self.inside -= 1
            if self.inside == 0:
                self._empty.set()

    @contextlib.asynccontextmanager
    async def drained(self, timeout_s: float, what: str) -> AsyncIterator[None]:
        self._open.clear()
        try:
            try:
                await asyncio.wait_for(self._empty.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:  # load anyway: the stragglers' later samples start after it
                log.warning(
                    "%s: %d requests still generating after %gs; loading anyway",
                    what,
                    self.inside,
                    timeout_s,
                )
            yield
        finally:
            self._open.set()


class PausedLoad:
    """The paused receive: the workers receive and load the whole push while generation is paused.

    `label(version)` records the version this replica holds from then on (its own record and metric); it is
    called just before the engine's version is set, so whatever is sampled after the resume carries it."""

    def __init__(
        self,
        engine: Any,
        replica_id: str,
        *,
        partial: PartialPolicy,
        recompute_kv: bool,
        gate: GenerationGate,
        drain_timeout_s: float,
        label: Callable[[int], None],
    ) -> None:
        self.engine, self.replica_id = engine, replica_id
        self.partial, self.recompute_kv = partial, recompute_kv
        self.gate, self.drain_timeout_s = gate, drain_timeout_s
        self.label = label

    async def load(
        self, plan: PushPlan, ph: dict[str, float], *, ack_epoch: int | None, timeout_s: float
    ) -> list[dict[str, Any]]:
        """Receive and load push `plan` while paused; `ack_epoch` is the epoch whose store the workers answer
        into themselves (None: the replica does)."""
        return await self._paused(
            plan, ph, "relay_receive", plan_json=plan_to_json(plan), ack_epoch=ack_epoch
        )

    def _drained(self, version: int) -> contextlib.AbstractAsyncContextManager:
        if not self.partial.drains:
            return contextlib.nullcontext()
        return self.gate.drained(self.drain_timeout_s, f"replica {self.replica_id}, push of v{version}")

    async def _paused(
        self, plan: PushPlan, ph: dict[str, float], method: str, **kw: Any
    ) -> list[dict[str, Any]]:
        """Pause, run `method` in every worker (receive and load the push, or load the staged one), set the
        version, resume. The pause and the call go out together where the pause stops every step at once
        (`vla.paused_call`). Phases: drain, pause and receive (each from the pause's start to its answer; they
        overlap where sent together; the workers' transfer and load are inside receive), version, resume, and
        held (generation paused)."""
        t0 = time.perf_counter()
        async with self._drained(plan.version):
            t1 = time.perf_counter()
            try:
                res, ph["pause_s"], ph["receive_s"] = await vla.paused_call(
                    self.engine, self.partial, self.recompute_kv, method, timeout=None, **kw
                )
            except vla.PauseFailed:
                raise  # nothing went to the workers: the engine keeps its weights and its version
            except BaseException:
                await self._unpause(plan.version)  # the load went out and may have changed the weights
                raise
            ph["version_s"], ph["resume_s"] = await self._unpause(plan.version)
            ph.update(drain_s=t1 - t0, held_s=time.perf_counter() - t1)
        return res

    async def _unpause(self, version: int) -> tuple[float, float]:
        """After a load: label what is sampled from now on with `version`, resume; the two phases' seconds."""
        t0 = time.perf_counter()
        self.label(version)
        await vla.set_version(self.engine, version)
        t1 = time.perf_counter()
        await vla.resume(self.engine)
        return t1 - t0, time.perf_counter() - t1


class StagedLoad(PausedLoad):
    """`sync.staged_receive`: the workers (`workers` of them) receive into staging buffers while the engine
    generates, then generation pauses only while they copy the staged tensors into the model."""

    def __init__(self, engine: Any, replica_id: str, *, workers: int, **kw: Any) -> None:
        super().__init__(engine, replica_id, **kw)
        self.workers = workers

    async def load(
        self, plan: PushPlan, ph: dict[str, float], *, ack_epoch: int | None, timeout_s: float
    ) -> list[dict[str, Any]]:
        """Stage, then copy in under the pause (`relay_swap`). Phases: stage (from the announcement's arrival
        to every worker's notice, within the epoch's `timeout_s`), then as `PausedLoad`."""
        from app.weights.staging import stage_notices

        what = f"replica {self.replica_id}, push of v{plan.version}"
        t0 = time.perf_counter()
        async with stage_notices(self.workers) as notices:
            await vla.rpc(
                self.engine, "relay_stage", timeout=30, plan_json=plan_to_json(plan), notify=notices.path
            )
            await notices.wait(timeout_s + 5, what)
        ph["stage_s"] = time.perf_counter() - t0
        return await self._paused(plan, ph, "relay_swap", timeout_s=timeout_s, ack_epoch=ack_epoch)
