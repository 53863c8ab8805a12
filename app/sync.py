"""The weight push protocol, both ends: a versioned, bucketed push from the trainer to every rollout replica.

Protocol (one trainer, N receivers; a receiver is one vLLM worker process of one replica):

  join   Membership changes only between pushes. When a replica registers (start, autoscaling) or leaves,
         trainer rank 0 opens a new *epoch*: it hosts a TCPStore on a fresh port and announces
         (epoch, address, world, rank of each receiver) through the hub. Every member builds the same
         stateless process group (gloo on CPU, NCCL on GPU) from that store, next to, never inside, the
         trainer's default group, and acknowledges the epoch. A member that does not acknowledge within
         the deadline is dropped and the epoch is formed again without it.
  push   1. Rank 0 announces (version v, bucket plan) through the hub: names, shapes, dtypes and offsets
            of every tensor in every flat bucket of at most the transport's bucket size
            (`sync.broadcast.bucket_mb`; the CUDA-IPC transport's `sync.ipc.bucket_mb`).
         2. Every trainer rank walks the buckets in the same order and gathers each bucket's full tensors
            (an FSDP2 collective) in lock-step; only rank 0 packs and broadcasts. Rank 0 keeps gathering
            even after a send failed, so the other ranks never wait in a gather rank 0 will not join.
         3. Each receiver receives bucket by bucket, checksums each flat buffer, and loads it into its
            model, then acknowledges (v, checksums) into the epoch's TCPStore, which rank 0 hosts (the
            trainer's short way back, app/weights/ack_board.py): each vLLM worker itself, the moment its
            last bucket is loaded. Its replica then sets its weight version to v before generation resumes
            (every token sampled afterwards carries v) and acknowledges to the hub (membership, versions,
            its phases: `TrainerSync.settle`). With LoRA the replica answers into the store itself, after
            the engine added the adapter.
         4. The push is complete only when every member acknowledged v with checksums equal to the
            trainer's, within `sync.timeout_s`; the hub's answer decides where the store has not every
            answer (a replica dropped, stuck or unable to reach the store). NCCL's own completion proves
            nothing (a broadcast to a dead peer can "succeed"); a missing or wrong acknowledgement fails the
            push naming the replica, and the next push forms a new epoch.

  Versions only increase, except that a trainer restored from a checkpoint announces its (older) version and
  the replicas roll back to it. Pushes do not overlap: one push is acknowledged (or failed) before the next is
  announced. Under FSDP2 every trainer rank gathers each bucket (a collective), only rank 0 sends.

On each replica a push is: pause generation -> flush (vLLM's pause returns once the engine is quiet; with
`rollout.partial=keep` requests freeze and continue after resume) -> receive every bucket -> load it ->
(each worker answers the trainer) -> set the weight version -> resume -> acknowledge to the hub. Where the pause stops every step at once
(keep, resubmit) the receive goes to the engine core right behind the pause, not after its answer
(app/vllm/engine.py `paused_call`: the core takes both in order and runs no step between them, and the loads
queue on the stream of any step still in flight). With `sync.staged_receive` the workers
first receive every bucket in a thread while generation goes on (app/weights/staging.py), and the pause covers
only their copy of the staged tensors into the model.

The two ends, here:

    TrainerSync   the trainer ranks' end: rank 0 owns the epoch (forms it, announces, checks the
                  acknowledgements), every rank gathers (torch, Ray; used by the learner's loop)
    ReplicaSync   a rollout replica's end (Ray, the engine through app/vllm)

What both stand on is app/weights/: records, buckets, process groups, transports, the hub and the run
control, and the parts each end runs: the trainer's epoch (`TrainerEpoch`, epoch.py: forming it, where its
acknowledgements come from), a replica's loads (`PausedLoad`, `StagedLoad`, `GenerationGate`: loaders.py),
its LoRA adapters (`ReplicaAdapters`, adapters.py) and its abort loop (`ReplicaControl`, aborts.py).

Replica side. `ReplicaSync.start` registers the replica with the hub and runs two loops in the replica's event loop:

  weights  long-polls `WeightHub.next_instruction`: `Join` (build the epoch's transport in every vLLM worker),
           `Push` (pause generation, receive and load in the workers, set the engine's weight version,
           resume, acknowledge with checksums), `Leave`, `Unknown` (register again), `Idle`.
  control  long-polls `RunControl.next_control` (`ReplicaControl`): `Abort` ends every in-flight generation
           (its tokens so far return with finish reason 'abort') and acknowledges.

A weight load and an abort never overlap (one lock). Version-gated join: a replica registered while a run is
under way is admitted (its `start` returns) only after it received and verified the current weights.
With `rollout.partial=off` a push drains the replica first (`GenerationGate`): requests already inside finish
under the old weights, samples of theirs that vLLM queued behind `max_num_seqs` included, and new ones wait.

LoRA (`model.lora.rank > 0`, `rollout.partial=finish_on_old`): the trainer pushes the adapter tensors alone
(`Learner.push_specs`), with the same plan, version and checksums. A replica never pauses: its workers receive
the adapter and write it as a PEFT folder, the engine adds it as the adapter of version v beside the older
ones (vLLM `add_lora`, id v + 1), new requests take it, requests in flight finish on the adapter they were
admitted under (so every token of a sample carries one version), and an older adapter is removed once no
request uses it (app/weights/adapters.py, app/vllm/adapters.py). The acknowledgement carries the adapter tensors' checksums.
The engine is reached only through app/vllm/engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from app.infra.ray_compat import current_actor
from app.rollout.partial import PartialPolicy, partial_policy
from app.trainer.comm import bcast
from app.vllm import engine as vla
from app.weights.aborts import ReplicaControl
from app.weights.ack_board import AckPoster, agreed_checksums, slowest_worker
from app.weights.adapters import ReplicaAdapters
from app.weights.buckets import plan_buckets
from app.weights.epoch import TrainerEpoch
from app.weights.group import resolve_backend
from app.weights.hub import check_acks
from app.weights.loaders import GenerationGate, PausedLoad, StagedLoad
from app.weights.records import (
    Ack,
    Acks,
    Join,
    Leave,
    Push,
    PushPlan,
    PushStats,
    SyncError,
    Unknown,
    group_to_json,
)
from app.weights.transport import make_transport

if TYPE_CHECKING:
    import torch

    from app.trainer.learner import Learner
    from app.vllm.adapters import Adapter

log = logging.getLogger("app.sync")  # the replica's end
ENGINE_DIED = "its vLLM engine died"  # the hub's drop reason of a replica whose engine died
train_log = logging.getLogger("app.train")  # the trainer's end


# ---------------------------------------------------------------------------------------------- trainer end


class TrainerSync:
    """Pushes the learner's weights to every replica. Rank 0 owns the transport's epoch; every rank gathers.

    `hub` is the `WeightHub` actor handle; `cfg.sync.transport` names the transport (app/weights/transport.py)
    and `cfg.sync.backend` its process group's backend.
    """

    def __init__(self, cfg: Any, learner: Learner, hub: Any, device: torch.device) -> None:
        self.cfg, self.learner, self.hub, self.device = cfg, learner, hub, device
        self.rank = learner.rank
        self.transport_name = str(getattr(cfg.sync, "transport", "broadcast"))
        if self.transport_name == "auto":  # the driver resolves it from placement (app/infra/resources.py)
            self.transport_name = "broadcast"  # a bare TrainerSync (tests, benches) knows none
        # an unknown name fails here, before any push; an unopened transport only walks the gathers
        self.walker = make_transport(self.transport_name)
        # the last push the workers acknowledged: its stats and the hub's answer still to come, which holds
        # each replica's own phases (`settle`)
        self._late: tuple[PushStats, Any] | None = None
        self.backend = resolve_backend(cfg.sync.backend, device)
        # the trainer ranks that send: rank 0 alone, or every rank where the transport sends from each rank to
        # the replicas on its own GPU (CUDA IPC with a trainer rank and a replica on every GPU)
        world = int(getattr(learner, "world", 1) or 1)
        self.senders = world if getattr(self.walker, "every_rank_sends", False) else 1
        # the current epoch (its transport, replicas and acknowledgement routes), formed with the hub
        self.group = TrainerEpoch(
            cfg.sync,
            hub,
            rank=self.rank,
            device=device,
            backend=self.backend,
            transport_name=self.transport_name,
            senders=self.senders,
            budget_s=self._budget_s(),
        )
        self.last: PushStats | None = None
        self._last_plan: tuple[Any, PushPlan] | None = None  # (pushed tensors and bucket size, their plan)

    def wait_for_rollout(self, timeout_s: float) -> float:
        """Before the first push: wait until a replica has registered (the rollout deployment starts beside
        the trainer, app/driver.py), at most `timeout_s` (`rollout.join_timeout_s`). Collective: every rank
        polls with rank 0 each second, so no rank sits in one long collective. Returns the seconds waited."""
        import ray

        t0 = time.monotonic()
        while not bcast(self.rank == 0 and bool(ray.get(self.hub.alive_count.remote(), timeout=30))):
            waited = time.monotonic() - t0
            if bcast(waited > timeout_s):
                raise SyncError(
                    f"no rollout replica registered with the weight hub within rollout.join_timeout_s="
                    f"{timeout_s:.0f}s; the Serve deployment has no running replica (see the Serve view of the "
                    "dashboard and the replica's log; a large model may need a longer rollout.join_timeout_s)"
                )
            time.sleep(1.0)
        return time.monotonic() - t0

    def _budget_s(self) -> float:
        """How long one push may keep retrying (forming the group, re-forming it after a failure).

        Recovery is bounded by time, not by a count of attempts: on a loaded machine a replica may need
        several tries to join. The budget is `train.timeout_s` less two `sync.timeout_s` (one last attempt:
        forming plus acknowledgements), so every trainer rank's wait for rank 0 stays within its collective
        timeout (`train.timeout_s + sync.timeout_s + 60`, app/driver.py)."""
        t, s = self.cfg.train.timeout_s, self.cfg.sync.timeout_s
        return max(s, t - 2 * s)

    def _announce(self, plan: Any, deadline: float) -> tuple[float, float]:
        """Rank 0 (every sender, together): announce `plan` to the current epoch, forming a new one first where
        there is none or the hub refuses (the membership changed). Returns the seconds spent forming and
        announcing."""
        import ray

        group_s = announce_s = 0.0
        for _ in range(2):  # at most: refused once (membership changed), formed, announced
            if self.group.together(self.group.transport is None):
                t0 = time.perf_counter()
                self.group.ensure(deadline)
                group_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            ok, err = True, None
            if self.rank == 0:
                try:
                    ok = ray.get(
                        self.hub.announce.remote(plan, self.group.epoch), timeout=self.cfg.sync.timeout_s
                    )
                except Exception as e:  # every sender must leave this loop alike
                    ok, err = False, f"the weight hub did not take the announcement of v{plan.version}: {e}"
            ok, err = self.group.together((ok, err))
            if err is not None:
                raise SyncError(err)
            announce_s += time.perf_counter() - t0
            if ok:
                return group_s, announce_s
            self.group.close()
        raise SyncError(
            f"the weight hub refused the announcement of v{plan.version} twice (membership churn)"
        )

    def _send(self, plan: Any) -> tuple[PushStats, str | None]:
        """Every rank walks the plan (rank 0 sends); rank 0 then waits for and checks the acknowledgements."""
        import ray

        s = self.cfg.sync
        err: str | None = None
        stats = PushStats(version=plan.version)
        # asked before the walk, so the answer leaves the hub as soon as the last replica acknowledged
        pending = self.hub.wait_acks.remote("push", plan.version, s.timeout_s) if self.rank == 0 else None
        try:
            # a rank that does not send takes part in the gathers (FSDP2 collectives) only
            sender = self.group.transport if self.group.transport is not None else self.walker
            # gathered as the trainer holds them: the pack casts to the pushed dtype while it copies
            stats = sender.send(plan, functools.partial(self.learner.gather, cast=False), self.device)
        except SyncError as e:
            err = str(e)
        if self.rank != 0:
            return stats, err
        t0 = time.perf_counter()
        if err is not None:  # a transport failure (a receiver died mid-push): only collect who answered
            pending = self.hub.wait_acks.remote("push", plan.version, min(5.0, s.timeout_s))
        acks, stats.acked_via = self.group.acks(plan.version, pending, err)
        stats.ack_s = time.perf_counter() - t0
        try:
            check_acks(acks, stats.checksums if s.verify and not err else None, s.timeout_s)
            stats.extra = {rid: a.as_dict() for rid, a in acks.got.items()}
            if stats.acked_via == "workers":  # each replica's own answer (its phases) comes after: `settle`
                self._late = (stats, pending)
        except SyncError as e:
            err = f"{err + '; ' if err else ''}{e}"
            ray.get(self.hub.drop.remote(acks.missing + acks.failed))
        return stats, err

    def settle(self, timeout_s: float = 5.0, last_call: bool = False) -> None:
        """Rank 0, after a push its replicas' workers acknowledged: each replica's own answer from the hub,
        which follows within milliseconds (the version set, generation resumed, every phase) into the push's
        stats (`sync/replica/*`), then its log line. A replica that failed after its workers' answers (its
        engine died before the resume) is dropped, so the next push forms the group again without it. Where
        the answer is not there within `timeout_s` it stays pending, unless `last_call` (the next push). A
        no-op where nothing is pending (always on the other ranks)."""
        if self._late is None:
            return
        import ray

        stats, pending = self._late
        if not ray.wait([pending], timeout=timeout_s)[0] and not last_call:
            return
        self._late = None
        try:
            acks: Acks = ray.get(pending, timeout=0.1)
        except Exception as e:
            train_log.warning("push v%d: the replicas' own answers did not come (%r)", stats.version, e)
            train_log.debug("%s", stats.summary())
            return
        for rid, a in acks.got.items():
            stats.extra[rid] = {**stats.extra.get(rid, {}), **a.as_dict()}
        bad = acks.missing + acks.failed
        if bad:
            train_log.warning(
                "push v%d: replica(s) %s failed after their workers acknowledged it (%s); dropping them",
                stats.version,
                bad,
                "; ".join(f"{r}: {acks.got[r].error}" for r in acks.failed) or "no answer",
            )
            ray.get(self.hub.drop.remote(bad), timeout=30)
        train_log.debug("%s", stats.summary())

    def _plan(self, version: int, bucket_bytes: int) -> PushPlan:
        """This push's plan: the last push's buckets with the new version while the pushed tensors and the
        bucket size stay the same (one layout, so every process on the way parses it once)."""
        key = (tuple((n, tuple(shape), str(dt)) for n, shape, dt in self.learner.push_specs()), bucket_bytes)
        if self._last_plan is None or self._last_plan[0] != key:
            self._last_plan = (key, plan_buckets(key[0], bucket_bytes, version))
        return dataclasses.replace(self._last_plan[1], version=version)

    def push(self, version: int) -> PushStats:
        """Push `version` to every replica; collective over the trainer ranks. After a failure (a replica
        died mid-push) the group re-forms without it and the push is tried again until the push's deadline
        (`_budget_s`); every try ends in a collective, so all ranks agree on when to stop."""

        s = self.cfg.sync
        self.settle(s.timeout_s, last_call=True)  # the previous push's replica answers, if still pending
        plan = self._plan(version, int(self.walker.bucket_mb(s) * 2**20))  # the transport's own section
        t_start = time.perf_counter()
        deadline = time.monotonic() + self._budget_s()
        tries = 0
        failures: list[str] = []
        while True:
            tries += 1
            err: str | None = None
            stats = PushStats(version=version)
            group_s = announce_s = 0.0
            if self.rank == 0 or self.senders > 1:
                try:
                    group_s, announce_s = self._announce(plan, deadline)
                except Exception as e:
                    err = f"{e}"
            if bcast(err is None):
                stats, err = self._send(plan)
            err = bcast(err)
            if err is None:
                stats.group_s, stats.announce_s, stats.failures = group_s, announce_s, failures
                stats.wall_s = time.perf_counter() - t_start
                self.last = stats
                if self.rank == 0 and self._late is None:  # else logged by `settle`, with the replica phases
                    train_log.debug("%s", stats.summary())
                return stats
            train_log.warning("push of version %d failed (try %d): %s", version, tries, err)
            failures.append(err)
            if self.rank == 0 or self.senders > 1:
                self.group.close()
            if bcast(time.monotonic() > deadline):  # rank 0's clock decides for every rank
                raise SyncError(
                    f"push of version {version} failed for {self._budget_s():.0f}s ({tries} tries): {err}"
                )


# ---------------------------------------------------------------------------------------------- replica end


def _node_ip() -> str:
    """The Ray node this replica runs on ('' outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else ""


class ReplicaSync:
    """The weight-group membership and run-control answers of one replica (`engine` is its AsyncLLM)."""

    def __init__(
        self,
        engine: Any,
        replica_id: str,
        *,
        hub: Any,
        control: str | None,
        partial: PartialPolicy = partial_policy("keep"),
        recompute_kv: bool = True,
        drain_timeout_s: float = 120.0,
        poll_s: float = 2.0,
        metrics: Any = None,
        started: float | None = None,
        lora: dict[str, Any] | None = None,
        workers: int = 1,
        staged: bool = False,
    ) -> None:
        self.engine, self.replica_id, self.hub = engine, replica_id, hub
        self.group_timeout_s = 60.0  # the current epoch's deadline (`GroupInfo.timeout_s`), set at each join
        # LoRA (rollout.partial=finish_on_old): the LoraSpec of the pushed adapters, as a dict
        self.lora = lora
        self.control = ReplicaControl(engine, replica_id, control, poll_s)  # run control's aborts
        self.gate = GenerationGate()  # where `partial.drains` (off): a push drains the replica first
        self.poll_s, self.metrics = poll_s, metrics
        self.started = started or time.time()
        self.workers = workers  # tensor parallel size; each worker is one receiver rank
        self.version = -1  # weights from disk, not yet verified against the trainer's
        self.epoch = -1
        self.leaving = False
        self.admitted = asyncio.Event()
        self.verified = False  # a push of the trainer's weights acknowledged (its first one carries join_s)
        self.poster: AckPoster | None = None  # this epoch's acknowledgements into the trainer's store
        self.worker_ranks: list[int] = []  # where the workers acknowledge into it themselves: their ranks
        self.last_error: str | None = None
        self.dead: str | None = None  # why this replica can never serve again (its engine died)
        self.lock = asyncio.Lock()  # a weight load and an abort never overlap
        self.tasks: list[asyncio.Task] = []
        # how a push loads: an adapter beside the older ones (never paused: nothing to stage), staged
        # (sync.staged_receive: received while generating, paused only to copy it in), or paused throughout
        self.adapters = ReplicaAdapters(engine, replica_id, lora, self._label) if lora else None
        paused: dict[str, Any] = dict(
            partial=partial,
            recompute_kv=recompute_kv,
            gate=self.gate,
            drain_timeout_s=drain_timeout_s,
            label=self._label,
        )
        self.loader: ReplicaAdapters | PausedLoad
        if self.adapters is not None:
            self.loader = self.adapters
        elif staged:
            self.loader = StagedLoad(engine, replica_id, workers=workers, **paused)
        else:
            self.loader = PausedLoad(engine, replica_id, **paused)

    async def start(self, join_timeout_s: float) -> None:
        """Register, start both loops, and return once this replica may serve (see the module docstring)."""
        await vla.set_version(self.engine, self.version)
        need = await self.hub.register.remote(
            self.replica_id, self.workers, self.started, _node_ip(), current_actor(), os.getpid()
        )
        await self.control.attach()
        loop = asyncio.get_running_loop()
        aborts = self.control.run(self.lock, lambda: not self.leaving and self.dead is None, self._note)
        self.tasks = [loop.create_task(self._weights_loop()), loop.create_task(aborts)]
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

    async def check_health(self) -> None:
        """Raise when the engine is dead or a sync loop ended (a crash): Serve then replaces this replica."""
        if not await self._engine_alive():
            raise RuntimeError(f"replica {self.replica_id}: {self.dead}")
        for t in self.tasks:
            if t.done() and not self.leaving:
                exc = t.exception() if not t.cancelled() else None
                raise RuntimeError(f"weight-sync loop of replica {self.replica_id} stopped: {exc!r}")

    async def stop(self) -> None:
        """Leave the weight group cleanly (finishing a push already announced to this replica). A replica
        whose engine died is dropped with that reason instead: Serve stopping it after its failed health
        check can come before its own drop reached the hub, and a clean leave would hide why it went."""
        self.leaving = True
        try:
            if not await self._engine_alive():
                await asyncio.wait_for(self.hub.drop.remote([self.replica_id], ENGINE_DIED), timeout=10)
            else:
                await self.control.detach(5)
                await asyncio.wait_for(self.hub.leave.remote(self.replica_id), timeout=5)
                await asyncio.wait_for(asyncio.shield(self.tasks[0]), timeout=20)
        except Exception as e:  # the hub is gone (end of run) or a push never finished
            log.info("replica %s: leaving without the hub's goodbye: %r", self.replica_id, e)
        for t in self.tasks:
            with contextlib.suppress(Exception):
                t.cancel()
        if self.adapters is not None:
            self.adapters.close()

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
                await asyncio.wait_for(self.hub.drop.remote([self.replica_id], ENGINE_DIED), timeout=10)
            with contextlib.suppress(Exception):
                await self.control.detach(10)
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

    # ------------------------------------------------------------ the handlers

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
            self.epoch, self.group_timeout_s = g.epoch, g.timeout_s
            self.poster = await AckPoster.connect(g, self.replica_id)
            # pushes are acknowledged into the store: by the workers themselves where each can (not LoRA: the
            # engine adds the adapter after them), else by this replica
            by_workers = self.poster is not None and not self.lora and all(w.get("store") for w in res)
            self.worker_ranks = [int(w["rank"]) for w in res] if by_workers else []
            detail = {"workers": res, "store": self.poster is not None, "worker_acks": by_workers}
            await self.hub.ack.remote(self.replica_id, "join", g.epoch, Ack(ok=True, detail=detail))
        except Exception as e:
            why = (
                f"the workers did not answer within {g.timeout_s + 5:g}s"
                if isinstance(e, (asyncio.TimeoutError, TimeoutError))
                else str(e) or repr(e)
            )
            self.last_error = f"join of epoch {g.epoch} failed: {why}"
            log.warning("replica %s: %s", self.replica_id, self.last_error)
            await self.hub.ack.remote(self.replica_id, "join", g.epoch, Ack(ok=False, error=why))

    async def _post(self, version: int, ack: Ack, res: list[dict[str, Any]] | None) -> None:
        """Acknowledge into the trainer's store (app/weights/ack_board.py) before the hub; a failure leaves the
        hub alone for the rest of the epoch."""
        poster = self.poster
        if poster is None or poster.epoch != self.epoch:
            return
        ok = await poster.answer(version, self.replica_id, ack, self.worker_ranks, res, self.group_timeout_s)
        if not ok:
            self.poster = None

    def _label(self, version: int) -> None:
        """This replica holds `version` from now on (its loader sets the engine's version where it pauses)."""
        self.version = version
        if self.metrics is not None:
            self.metrics.set("relay_replica_weight_version", version, {"replica": self.replica_id})

    def _note(self, why: str) -> None:
        """The run control could not be reached (shown by the replica's `info`)."""
        self.last_error = why

    async def _receive(self, plan: PushPlan, announced_at: float = 0.0) -> None:
        """Receive and load the push (`self.loader`: app/weights/loaders.py `PausedLoad` or `StagedLoad`, or
        with LoRA app/weights/adapters.py `ReplicaAdapters`), acknowledge with the checksums and each phase's
        seconds (see those)."""
        ph: dict[str, float] = {"wake_s": max(0.0, time.time() - announced_at) if announced_at else 0.0}
        res = None
        try:
            res = await self.loader.load(
                plan, ph, ack_epoch=self._ack_epoch(), timeout_s=self.group_timeout_s
            )
            self.admitted.set()
            ph.update(slowest_worker(res))
            if not self.verified:  # as the hub counts it: registration to the first verified weights
                ph["join_s"] = time.time() - self.started
            ack = Ack(
                ok=True,
                checksums=agreed_checksums(res, self.replica_id, plan.version),
                detail={**ph, "acked_at": time.time()},
            )
            self.verified = True
        except Exception as e:
            self.last_error = f"receive of version {plan.version} failed: {e}"
            log.warning("replica %s: %s", self.replica_id, self.last_error)
            ack = Ack(ok=False, error=str(e))
        await self._post(plan.version, ack, res)  # the trainer's short way (app/weights/ack_board.py)
        with contextlib.suppress(Exception):
            await self.hub.ack.remote(self.replica_id, "push", plan.version, ack)
        if not ack.ok:
            self.epoch = -1  # rejoin at the next epoch

    def _ack_epoch(self) -> int | None:
        """The epoch whose store the workers answer a push into themselves (None: this replica does)."""
        return self.epoch if self.worker_ranks and self.poster is not None else None

    def adapter(self, version: int | None = None) -> contextlib.AbstractAsyncContextManager[Adapter | None]:
        """The LoRA adapter a generation request uses from admission to its end (None without LoRA, and before
        the first push); old adapters it was the last user of are removed after it."""
        if self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.using(version)
