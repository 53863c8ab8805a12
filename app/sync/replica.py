"""Replica side of the weight push: one rollout replica's membership of the weight group.

`ReplicaSync.start` registers the replica with the hub and runs two loops in the replica's event loop:

  weights  long-polls `WeightHub.next_instruction`: `Join` (build the epoch's transport in every vLLM worker),
           `Push` (pause generation, receive and load in the workers, set the engine's weight version,
           resume, acknowledge with checksums), `Leave`, `Unknown` (register again), `Idle`.
  control  long-polls `RunControl.next_control`: `Abort` ends every in-flight generation (its tokens so far
           return with finish reason 'abort') and acknowledges.

A weight load and an abort never overlap (one lock). Version-gated join: a replica registered while a run is
under way is admitted (its `start` returns) only after it received and verified the current weights.
With `rollout.partial=off` a push drains the replica first (`GenerationGate`): requests already inside finish
under the old weights, samples of theirs that vLLM queued behind `max_num_seqs` included, and new ones wait.
The engine is reached only through app/vllm/engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from app.ray_compat import current_actor
from app.sync.records import Abort, Ack, Join, Leave, Push, PushPlan, Unknown, group_to_json, plan_to_json
from app.vllm import engine as vla

log = logging.getLogger("app.sync")


def _node_ip() -> str:
    """The Ray node this replica runs on ('' outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else ""


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


class ReplicaSync:
    """The weight-group membership and run-control answers of one replica (`engine` is its AsyncLLM)."""

    def __init__(
        self,
        engine: Any,
        replica_id: str,
        *,
        hub: Any,
        control: str | None,
        partial: str = "keep",
        recompute_kv: bool = True,
        drain_timeout_s: float = 120.0,
        poll_s: float = 2.0,
        metrics: Any = None,
        started: float | None = None,
    ) -> None:
        self.engine, self.replica_id, self.hub = engine, replica_id, hub
        self.control_name, self.control = control, None
        self.partial, self.recompute_kv = partial, recompute_kv
        self.gate = GenerationGate()  # partial=off: a push drains the replica first
        self.drain_timeout_s = drain_timeout_s
        self.poll_s, self.metrics = poll_s, metrics
        self.started = started or time.time()
        self.workers = 1  # tensor parallel size; each worker is one receiver rank
        self.version = -1  # weights from disk, not yet verified against the trainer's
        self.epoch = -1
        self.abort_seen = -1  # run control's abort requests handled (set at start)
        self.leaving = False
        self.admitted = asyncio.Event()
        self.last_error: str | None = None
        self.dead: str | None = None  # why this replica can never serve again (its engine died)
        self.lock = asyncio.Lock()  # a weight load and an abort never overlap
        self.tasks: list[asyncio.Task] = []

    async def start(self, join_timeout_s: float) -> None:
        """Register, start both loops, and return once this replica may serve (see the module docstring)."""
        await vla.set_version(self.engine, self.version)
        need = await self.hub.register.remote(
            self.replica_id, self.workers, self.started, _node_ip(), current_actor(), os.getpid()
        )
        self.control = self._find_control()
        if self.control is not None:
            self.abort_seen = await self.control.abort_count.remote()
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._weights_loop()), loop.create_task(self._control_loop())]
        if need < 0:  # the run is starting: the trainer's first push comes before any rollout
            self.admitted.set()
            return
        log.info("replica %s waits for the weights of version >= %d before serving", self.replica_id, need)
        try:
            await asyncio.wait_for(self.admitted.wait(), timeout=join_timeout_s)
        except asyncio.TimeoutError:
            for t in self.tasks:
                t.cancel()
            raise TimeoutError(
                f"replica {self.replica_id} did not receive the current weights (version >= {need}) within "
                f"rollout.join_timeout_s={join_timeout_s}s; last error: {self.last_error}; is the trainer "
                "still pushing?"
            ) from None
        log.info("replica %s admitted at version %d", self.replica_id, self.version)

    def _find_control(self) -> Any:
        """The run-control actor, or None while it does not exist (then no one can ask for an abort)."""
        if self.control_name is None:
            return None
        from app.sync.actors import get_actor

        try:
            return get_actor(self.control_name)
        except ValueError:
            return None

    async def check_health(self) -> None:
        """Raise when the engine is dead or a sync loop ended (a crash): Serve then replaces this replica."""
        if not await self._engine_alive():
            raise RuntimeError(f"replica {self.replica_id}: {self.dead}")
        for t in self.tasks:
            if t.done() and not self.leaving:
                exc = t.exception() if not t.cancelled() else None
                raise RuntimeError(f"weight-sync loop of replica {self.replica_id} stopped: {exc!r}")

    async def stop(self) -> None:
        """Leave the weight group cleanly (finishing a push already announced to this replica)."""
        self.leaving = True
        try:
            if self.control is not None:
                await asyncio.wait_for(self.control.detach.remote(self.replica_id), timeout=5)
            await asyncio.wait_for(self.hub.leave.remote(self.replica_id), timeout=5)
            await asyncio.wait_for(asyncio.shield(self.tasks[0]), timeout=20)
        except Exception as e:  # the hub is gone (end of run) or a push never finished
            log.info("replica %s: leaving without the hub's goodbye: %r", self.replica_id, e)
        for t in self.tasks:
            with contextlib.suppress(Exception):
                t.cancel()

    async def _engine_alive(self) -> bool:
        """False once the engine died (its EngineCore process killed by the OOM killer, or crashed). The
        replica then leaves the weight group and the run control at once, so no push or abort waits for it,
        and its health check fails, so Serve replaces it (the replacement joins version-gated)."""
        if not vla.engine_dead(self.engine):
            return True
        if self.dead is None:
            self.dead = self.last_error = "its vLLM engine died (EngineCore process gone)"
            log.error(
                "replica %s: %s; leaving the weight group for Serve to replace it", self.replica_id, self.dead
            )
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self.hub.drop.remote([self.replica_id], "its vLLM engine died"), timeout=10
                )
            if self.control is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.control.detach.remote(self.replica_id), timeout=10)
        return False

    # ------------------------------------------------------------ the loops

    async def _weights_loop(self) -> None:
        while True:
            if not await self._engine_alive():  # checked every poll (poll_s): a dead engine leaves at once
                raise RuntimeError(self.dead)
            try:
                instr = await self.hub.next_instruction.remote(
                    self.replica_id, self.epoch, self.version, self.poll_s
                )
            except Exception as e:  # the hub is gone: the run is over or restarting
                if self.leaving:
                    return
                self.last_error = f"hub unreachable: {e}"
                await asyncio.sleep(self.poll_s)
                continue
            if isinstance(instr, Leave):
                return
            if isinstance(instr, Unknown):
                await self.hub.register.remote(
                    self.replica_id, self.workers, self.started, _node_ip(), current_actor(), os.getpid()
                )
            elif isinstance(instr, Join):
                await self._join(instr)
            elif isinstance(instr, Push):
                async with self.lock:
                    await self._receive(instr.plan, instr.announced_at)

    async def _control_loop(self) -> None:
        while not self.leaving and self.dead is None:
            if self.control is None:
                await asyncio.sleep(self.poll_s)
                self.control = self._find_control()
                continue
            try:
                instr = await self.control.next_control.remote(self.replica_id, self.abort_seen, self.poll_s)
            except Exception as e:  # the control actor is gone: the run is over
                self.last_error = f"run control unreachable: {e}"
                await asyncio.sleep(self.poll_s)
                continue
            if isinstance(instr, Abort):
                async with self.lock:
                    await self._abort(instr.seq)

    # ------------------------------------------------------------ the handlers

    async def _abort(self, seq: int) -> None:
        """End every in-flight generation now: each returns its tokens so far with finish reason 'abort'
        (the rollouter saves them as partial rollouts in a checkpoint)."""
        try:
            await vla.pause(self.engine, "resubmit")
            await vla.resume(self.engine)
            ack = Ack(ok=True)
        except Exception as e:
            ack = Ack(ok=False, error=str(e))
        self.abort_seen = seq
        with contextlib.suppress(Exception):
            await self.control.ack.remote(self.replica_id, seq, ack)

    async def _join(self, instr: Join) -> None:
        g = instr.group
        try:
            res = await vla.rpc(
                self.engine,
                "relay_join",
                timeout=g.timeout_s + 5,
                group_json=group_to_json(g),
                first_rank=instr.rank,
            )
            self.epoch = g.epoch
            await self.hub.ack.remote(self.replica_id, "join", g.epoch, Ack(ok=True, detail={"workers": res}))
        except Exception as e:
            self.last_error = f"join of epoch {g.epoch} failed: {e}"
            log.warning("replica %s: %s", self.replica_id, self.last_error)
            await self.hub.ack.remote(self.replica_id, "join", g.epoch, Ack(ok=False, error=str(e)))

    async def _set_version(self, version: int) -> None:
        self.version = version
        await vla.set_version(self.engine, version)
        if self.metrics is not None:
            self.metrics.set("relay_replica_weight_version", version, {"replica": self.replica_id})

    def _drained(self, version: int) -> contextlib.AbstractAsyncContextManager:
        if self.partial != "off":
            return contextlib.nullcontext()
        return self.gate.drained(self.drain_timeout_s, f"replica {self.replica_id}, push of v{version}")

    async def _receive(self, plan: PushPlan, announced_at: float = 0.0) -> None:
        """Pause, receive and load in every worker, set the version, resume, acknowledge. The acknowledgement
        carries each phase's seconds (`phases`): wake (announcement to here), drain, pause, receive (the
        workers' RPC: transfer and load inside it), version, resume, and held (generation paused)."""
        t0 = time.perf_counter()
        ph: dict[str, float] = {"wake_s": max(0.0, time.time() - announced_at) if announced_at else 0.0}
        try:
            async with self._drained(plan.version):
                t1 = time.perf_counter()
                await vla.pause(self.engine, self.partial, self.recompute_kv)
                t2 = time.perf_counter()
                try:
                    res = await vla.rpc(
                        self.engine, "relay_receive", timeout=None, plan_json=plan_to_json(plan)
                    )
                finally:
                    t3 = time.perf_counter()
                    await self._set_version(plan.version)
                    t4 = time.perf_counter()
                    await vla.resume(self.engine)
                    t5 = time.perf_counter()
            self.admitted.set()
            ph.update(
                drain_s=t1 - t0,
                pause_s=t2 - t1,
                receive_s=t3 - t2,
                version_s=t4 - t3,
                resume_s=t5 - t4,
                held_s=t5 - t1,
                transfer_s=max(r["transfer_s"] for r in res),
                load_s=max(r["load_s"] for r in res),
                worker_s=max(r["receive_s"] for r in res),
            )
            ack = Ack(
                ok=True,
                checksums=res[0]["checksums"],
                detail={**ph, "acked_at": time.time()},
            )
            await self.hub.ack.remote(self.replica_id, "push", plan.version, ack)
        except Exception as e:
            self.last_error = f"receive of version {plan.version} failed: {e}"
            log.warning("replica %s: %s", self.replica_id, self.last_error)
            with contextlib.suppress(Exception):
                await self.hub.ack.remote(self.replica_id, "push", plan.version, Ack(ok=False, error=str(e)))
            self.epoch = -1  # rejoin at the next epoch
