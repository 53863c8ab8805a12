"""The weight push protocol, both ends: a versioned, bucketed push from the trainer to every rollout replica.

Protocol (one trainer, N receivers; a receiver is one vLLM worker process of one replica):

  join   Membership changes only between pushes. When a replica registers (start, autoscaling) or leaves,
         trainer rank 0 opens a new *epoch*: it hosts a TCPStore on a fresh port and announces
         (epoch, address, world, rank of each receiver) through the hub. Every member builds the same
         stateless process group (gloo on CPU, NCCL on GPU) from that store, next to, never inside, the
         trainer's default group, and acknowledges the epoch. A member that does not acknowledge within
         the deadline is dropped and the epoch is formed again without it.
  push   1. Rank 0 announces (version v, bucket plan) through the hub: names, shapes, dtypes and offsets
            of every tensor in every flat bucket of at most `sync.bucket_mb` MiB.
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

What both stand on (records, buckets, process groups, transports, the hub and the run control) is
app/weights/.

Replica side. `ReplicaSync.start` registers the replica with the hub and runs two loops in the replica's event loop:

  weights  long-polls `WeightHub.next_instruction`: `Join` (build the epoch's transport in every vLLM worker),
           `Push` (pause generation, receive and load in the workers, set the engine's weight version,
           resume, acknowledge with checksums), `Leave`, `Unknown` (register again), `Idle`.
  control  long-polls `RunControl.next_control`: `Abort` ends every in-flight generation (its tokens so far
           return with finish reason 'abort') and acknowledges.

A weight load and an abort never overlap (one lock). Version-gated join: a replica registered while a run is
under way is admitted (its `start` returns) only after it received and verified the current weights.
With `rollout.partial=off` a push drains the replica first (`GenerationGate`): requests already inside finish
under the old weights, samples of theirs that vLLM queued behind `max_num_seqs` included, and new ones wait.

LoRA (`model.lora_rank > 0`, `rollout.partial=finish_on_old`): the trainer pushes the adapter tensors alone
(`Learner.push_specs`), with the same plan, version and checksums. A replica never pauses: its workers receive
the adapter and write it as a PEFT folder, the engine adds it as the adapter of version v beside the older
ones (vLLM `add_lora`, id v + 1), new requests take it, requests in flight finish on the adapter they were
admitted under (so every token of a sample carries one version), and an older adapter is removed once no
request uses it (app/vllm/adapters.py). The acknowledgement carries the adapter tensors' checksums.
The engine is reached only through app/vllm/engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from app.infra.ray_compat import current_actor
from app.trainer.comm import bcast, first_error
from app.vllm import engine as vla
from app.vllm.adapters import Adapter, AdapterBook
from app.weights.ack_board import (
    AckPoster,
    agreed_checksums,
    collect,
    collect_keys,
    replica_acks,
    slowest_worker,
    worker_key,
)
from app.weights.buckets import plan_buckets
from app.weights.group import free_port, resolve_backend
from app.weights.hub import check_acks
from app.weights.records import (
    Abort,
    Ack,
    Acks,
    GroupInfo,
    Join,
    Leave,
    Push,
    PushPlan,
    PushStats,
    SyncError,
    Unknown,
    group_to_json,
    plan_to_json,
)
from app.weights.transport import WeightTransport, make_transport

if TYPE_CHECKING:
    import torch

    from app.trainer.learner import Learner

log = logging.getLogger("app.sync")  # the replica's end
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
        self.transport: WeightTransport | None = None  # rank 0's end of the current epoch
        self.epoch: int | None = None  # that epoch's number
        self.replicas: list[str] = []  # that epoch's replicas, whose acknowledgements a push waits for
        self.store_acks = False  # whether every one of them reached the epoch's store at its join
        # replica id -> the weight-group ranks of its workers, where every worker answers into the store itself
        self.worker_ranks: dict[str, list[int]] = {}
        # the last push the workers acknowledged: its stats and the hub's answer still to come, which holds
        # each replica's own phases (`settle`)
        self._late: tuple[PushStats, Any] | None = None
        self.backend = resolve_backend(cfg.sync.backend, device)
        # the trainer ranks that send: rank 0 alone, or every rank where the transport sends from each rank to
        # the replicas on its own GPU (CUDA IPC with a trainer rank and a replica on every GPU)
        world = int(getattr(learner, "world", 1) or 1)
        self.senders = world if getattr(self.walker, "every_rank_sends", False) else 1
        self.last: PushStats | None = None
        self._last_plan: tuple[Any, PushPlan] | None = None  # (pushed tensors and bucket size, their plan)

    def _wait_for_a_replica(self, deadline: float) -> None:
        """Every replica gone (died, being restarted by Serve): wait for one to register, until `deadline`."""
        import ray

        while not ray.get(self.hub.alive_count.remote()):
            if time.monotonic() > deadline:
                raise SyncError(
                    "no rollout replica registered with the weight hub within the push's deadline "
                    f"({self._budget_s():.0f}s: see push_budget_s); the Serve deployment has no running replica "
                    "(see the Serve view of the dashboard)"
                )
            time.sleep(1.0)

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

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport, self.epoch = None, None

    def _together(self, value: Any) -> Any:
        """Rank 0's `value` on every rank where every rank sends (they form each epoch together), else as is:
        with one sender only rank 0 forms and announces."""
        return bcast(value) if self.senders > 1 else value

    def _open_epoch(self, deadline: float) -> GroupInfo:
        """Rank 0 asks the hub for a new epoch (after a replica registered); every sender learns it. Raises the
        same SyncError on every sender."""
        import ray

        info, err = None, None
        if self.rank == 0:
            try:
                self._wait_for_a_replica(deadline)
                info = ray.get(
                    self.hub.open_epoch.remote(
                        ray.util.get_node_ip_address(),
                        free_port(),
                        self.backend,
                        self.cfg.sync.timeout_s,
                        self.transport_name,
                        self.senders,
                        bool(getattr(self.cfg.sync, "nccl_high_priority", False)),
                    ),
                    timeout=self.cfg.sync.timeout_s,
                )
            except Exception as e:
                err = f"{e}"
        info, err = self._together((info, err))
        if err is not None:
            raise SyncError(err)
        return info

    def _ensure_group(self, deadline: float) -> None:
        """Rank 0 (every sender, together): (re)form the epoch when there is none or the membership changed;
        drop who fails to join. Tries again until `deadline` (members that failed to join register again)."""
        self._close()
        tries, last = 0, "no replica"
        while True:
            tries += 1
            info = self._open_epoch(deadline)
            if info.world > info.senders:  # else the last replica left between the check and the epoch
                err = self._form(info)
                if err is None:
                    return
                last = err
            if self._together(time.monotonic() > deadline):
                raise SyncError(
                    f"could not form the weight group within {self._budget_s():.0f}s ({tries} tries; "
                    f"replicas keep failing to join): {last}"
                )
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))

    def _form(self, info: GroupInfo) -> str | None:
        """Open this rank's end of epoch `info`; None when every member joined, else why not (rank 0 drops
        the members that did not join: they register again for the next try)."""
        t0 = time.perf_counter()
        transport = make_transport(self.transport_name)
        err: str | None = None
        try:
            if self.rank == 0:
                transport.open(info, self.device)
            else:  # another sender: its rank in the group is its trainer rank
                transport.join(info, self.rank, self.device)
        except Exception as e:
            err = f"epoch {info.epoch}: {e}"
        if self.senders > 1:
            err = first_error(err)
        failed = None  # a member joined but acknowledged a failure: this try of the push fails
        if self.rank == 0:
            try:
                err, failed = self._check_joined(info, err)
            except Exception as e:  # the hub did not answer: every sender must leave alike
                failed = f"epoch {info.epoch}: the weight hub did not answer: {e}"
        err, failed = self._together((err, failed))
        if err is not None or failed is not None:
            transport.close()
        if failed is not None:
            raise SyncError(failed)
        if err is not None:
            return err
        self.transport, self.epoch, self.replicas = transport, info.epoch, sorted(info.ranks)
        train_log.info(
            "weight group epoch %d formed (%s): %d receivers, %d sender(s) in %.2fs",
            info.epoch,
            self.transport_name,
            info.world - info.senders,
            info.senders,
            time.perf_counter() - t0,
        )
        return None

    def _check_joined(self, info: GroupInfo, err: str | None) -> tuple[str | None, str | None]:
        """Rank 0: after a failed open, drop who did not join and return (why, None); after a good one, check
        every member's join acknowledgement: (None, None), or (None, why) where one failed."""
        import ray

        s = self.cfg.sync
        self.store_acks, self.worker_ranks = False, {}
        if err is not None:  # someone did not join: find out who, drop them, form again
            acks: Acks = ray.get(self.hub.wait_acks.remote("join", info.epoch, 1.0))
            train_log.warning("epoch %d did not form (%s); dropping %s", info.epoch, err, acks.missing)
            ray.get(self.hub.drop.remote(acks.missing))
            return err, None
        acks = ray.get(self.hub.wait_acks.remote("join", info.epoch, s.timeout_s))
        try:
            check_acks(acks, None, s.timeout_s)
        except SyncError as e:
            return None, f"{e}"
        # a replica that could not reach the store acknowledges through the hub alone: then wait there
        self.store_acks = all(bool(a.detail.get("store")) for a in acks.got.values())
        if self.store_acks and all(a.detail.get("worker_acks") for a in acks.got.values()):
            self.worker_ranks = {
                rid: [int(w["rank"]) for w in a.detail["workers"]] for rid, a in acks.got.items()
            }
        return None, None

    def _announce(self, plan: Any, deadline: float) -> tuple[float, float]:
        """Rank 0 (every sender, together): announce `plan` to the current epoch, forming a new one first where
        there is none or the hub refuses (the membership changed). Returns the seconds spent forming and
        announcing."""
        import ray

        group_s = announce_s = 0.0
        for _ in range(2):  # at most: refused once (membership changed), formed, announced
            if self._together(self.transport is None):
                t0 = time.perf_counter()
                self._ensure_group(deadline)
                group_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            ok, err = True, None
            if self.rank == 0:
                try:
                    ok = ray.get(self.hub.announce.remote(plan, self.epoch), timeout=self.cfg.sync.timeout_s)
                except Exception as e:  # every sender must leave this loop alike
                    ok, err = False, f"the weight hub did not take the announcement of v{plan.version}: {e}"
            ok, err = self._together((ok, err))
            if err is not None:
                raise SyncError(err)
            announce_s += time.perf_counter() - t0
            if ok:
                return group_s, announce_s
            self._close()
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
            sender = self.transport if self.transport is not None else self.walker
            # gathered as the trainer holds them: the pack casts to the pushed dtype while it copies
            stats = sender.send(plan, functools.partial(self.learner.gather, cast=False), self.device)
        except SyncError as e:
            err = str(e)
        if self.rank != 0:
            return stats, err
        t0 = time.perf_counter()
        if err is not None:  # a transport failure (a receiver died mid-push): only collect who answered
            pending = self.hub.wait_acks.remote("push", plan.version, min(5.0, s.timeout_s))
        acks, stats.acked_via = self._acks(plan.version, pending, err)
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

    def _acks(self, version: int, pending: Any, err: str | None) -> tuple[Acks, str]:
        """Rank 0: every replica's answer to push `version`. After a walk without failure they come through
        the weight group's store (app/weights/ack_board.py: no Ray call on the way), from each worker where
        every worker answers there ("workers"), else from each replica ("store"); the hub's answer (`pending`)
        where the store has not every answer by the deadline, where the hub answers first (a replica dropped),
        or after a failed walk. Returns them and where they came from."""
        import ray

        s = self.cfg.sync
        store = getattr(getattr(self.transport, "group", None), "store", None)
        if err is None and store is not None and self.store_acks and self.replicas and self.epoch is not None:
            deadline = time.monotonic() + s.timeout_s
            hub_answered = lambda: bool(ray.wait([pending], timeout=0)[0])  # noqa: E731
            if self.worker_ranks:
                keys = {
                    r: worker_key(self.epoch, version, r) for rs in self.worker_ranks.values() for r in rs
                }
                answers = collect_keys(store, keys, version, deadline, hub_answered)
                if answers is not None:
                    got = replica_acks(self.worker_ranks, answers, version)
                    return Acks(kind="push", key=version, got=got), "workers"
            else:
                got = collect(store, self.epoch, version, self.replicas, deadline, hub_answered)
                if got is not None:
                    return Acks(kind="push", key=version, got=got), "store"
        return ray.get(pending, timeout=s.timeout_s + 30), "hub"

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
            train_log.info("%s", stats.summary())
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
        train_log.info("%s", stats.summary())

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
        mb = float(getattr(s, getattr(self.walker, "bucket_setting", "bucket_mb"), s.bucket_mb))
        plan = self._plan(version, int(mb * 2**20))
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
                    train_log.info("%s", stats.summary())
                return stats
            train_log.warning("push of version %d failed (try %d): %s", version, tries, err)
            failures.append(err)
            if self.rank == 0 or self.senders > 1:
                self._close()
            if bcast(time.monotonic() > deadline):  # rank 0's clock decides for every rank
                raise SyncError(
                    f"push of version {version} failed for {self._budget_s():.0f}s ({tries} tries): {err}"
                )


# ---------------------------------------------------------------------------------------------- replica end


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


POSTER_CONNECT_S = 2.0  # a replica's connection to the epoch's store for its acknowledgements, at most


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
        lora: dict[str, Any] | None = None,
        workers: int = 1,
        staged: bool = False,
    ) -> None:
        self.engine, self.replica_id, self.hub = engine, replica_id, hub
        self.group_timeout_s = 60.0  # the current epoch's deadline (`GroupInfo.timeout_s`), set at each join
        # LoRA (rollout.partial=finish_on_old): the LoraSpec of the pushed adapters, as a dict, and the adapters
        # this replica holds (app/vllm/adapters.py), each a PEFT folder under adapter_root
        self.lora = lora
        self.adapters = AdapterBook()
        self.adapter_root = tempfile.mkdtemp(prefix="relay-lora-") if lora else ""
        self.pushes = 0
        self.control_name, self.control = control, None
        self.partial, self.recompute_kv = partial, recompute_kv
        self.gate = GenerationGate()  # partial=off: a push drains the replica first
        self.drain_timeout_s = drain_timeout_s
        self.poll_s, self.metrics = poll_s, metrics
        self.started = started or time.time()
        self.workers = workers  # tensor parallel size; each worker is one receiver rank
        self.version = -1  # weights from disk, not yet verified against the trainer's
        self.epoch = -1
        self.abort_seen = -1  # run control's abort requests handled (set at start)
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
        if lora:
            self._load = self._load_adapter
        elif staged:
            self._load = self._load_staged
        else:
            self._load = self._load_weights

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
        from app.weights.actors import get_actor

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
        if self.adapter_root:
            shutil.rmtree(self.adapter_root, ignore_errors=True)

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
            self.epoch, self.group_timeout_s = g.epoch, g.timeout_s
            self.poster = await self._poster(g)
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

    async def _poster(self, g: GroupInfo) -> AckPoster | None:
        """A client of epoch `g`'s store for this replica's acknowledgements; None (the hub alone) where the
        trainer's store cannot be reached from here within `POSTER_CONNECT_S` (the workers have just joined
        through it, so a healthy connection takes milliseconds; the weights loop must not wait longer)."""
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(AckPoster, g.host, g.port, g.epoch, g.timeout_s), timeout=POSTER_CONNECT_S
            )
        except Exception as e:
            log.warning(
                "replica %s: the weight group's store at %s:%d is unreachable (%s); acknowledging through the hub "
                "alone",
                self.replica_id,
                g.host,
                g.port,
                f"no connection within {POSTER_CONNECT_S:.0f}s"
                if isinstance(e, asyncio.TimeoutError)
                else repr(e),
            )
            return None

    async def _post(self, version: int, ack: Ack, res: list[dict[str, Any]] | None) -> None:
        """Acknowledge into the trainer's store (app/weights/ack_board.py) before the hub: where the workers
        answer there themselves, only what they did not post (every worker's failure where the load failed
        before their answers, a post that failed); a failure is logged and leaves the hub alone for the rest
        of the epoch."""
        poster = self.poster
        if poster is None or poster.epoch != self.epoch:
            return
        post: Any = functools.partial(poster.post, version, self.replica_id, ack)
        if self.worker_ranks:
            if res is not None and all(r.get("posted") for r in res):
                return  # the trainer has every answer already
            post = functools.partial(poster.post_workers, version, self.worker_ranks, ack, res)
        try:
            await asyncio.wait_for(asyncio.to_thread(post), timeout=self.group_timeout_s)
        except Exception as e:
            self.poster = None
            log.warning(
                "replica %s: acknowledging v%d into the store failed: %r", self.replica_id, version, e
            )

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
        """Receive and load the push (`self._load`: `_load_weights`, `_load_staged`, or `_load_adapter` with
        LoRA), acknowledge with the checksums and each phase's seconds (see those)."""
        ph: dict[str, float] = {"wake_s": max(0.0, time.time() - announced_at) if announced_at else 0.0}
        res = None
        try:
            res = await self._load(plan, ph)
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

    async def _load_adapter(self, plan: PushPlan, ph: dict[str, float]) -> list[dict[str, Any]]:
        """LoRA, `finish_on_old`: no pause at all. The workers receive the adapter and write it as a PEFT folder;
        the engine adds it beside the older ones as version v, new requests take it, requests in flight finish
        on theirs, and older adapters no request uses are removed. Phases: receive (the workers' RPC), add
        (vLLM loads the folder), held 0 (generation never paused)."""
        self.pushes += 1
        path = os.path.join(self.adapter_root, f"v{plan.version}-{self.pushes}")
        t0 = time.perf_counter()
        res = await vla.rpc(
            self.engine,
            "relay_receive",
            timeout=None,
            plan_json=plan_to_json(plan),
            adapter_dir=path,
            adapter_json=json.dumps(self.lora),
        )
        t1 = time.perf_counter()
        adapter = Adapter(plan.version, path)
        await vla.add_adapter(self.engine, adapter)
        t2 = time.perf_counter()
        unused = self.adapters.publish(adapter)
        self.version = plan.version
        if self.metrics is not None:
            self.metrics.set("relay_replica_weight_version", plan.version, {"replica": self.replica_id})
        await self._retire(unused)
        on_old = sum(n for v, n in self.adapters.users.items() if v != plan.version)
        ph.update(receive_s=t1 - t0, add_s=t2 - t1, pause_s=0.0, held_s=0.0, on_old=float(on_old))
        return res

    @contextlib.asynccontextmanager
    async def adapter(self, version: int | None = None) -> AsyncIterator[Adapter | None]:
        """The LoRA adapter a generation request uses from admission to its end (None without LoRA, and before
        the first push); old adapters it was the last user of are removed after it."""
        if not self.lora:
            yield None
            return
        unused: list[Adapter] = []
        try:
            with self.adapters.using(version) as (held, unused):
                yield held
        finally:
            await self._retire(unused)

    async def _retire(self, adapters: list[Adapter]) -> None:
        """Remove adapters no request uses from the engine and their folders from disk (a failure is logged:
        the engine's adapter cache then evicts it)."""
        for a in adapters:
            try:
                await vla.remove_adapter(self.engine, a)
            except Exception as e:
                log.warning("replica %s: removing adapter %s failed: %r", self.replica_id, a.name, e)
            shutil.rmtree(a.path, ignore_errors=True)

    async def _load_staged(self, plan: PushPlan, ph: dict[str, float]) -> list[dict[str, Any]]:
        """`sync.staged_receive`: the workers receive into staging buffers while the engine generates (stage),
        then generation pauses only while they copy the staged tensors into the model (`relay_swap`). Phases:
        stage (from the announcement's arrival to every worker's notice), then as `_load_weights`."""
        from app.weights.staging import stage_notices

        what = f"replica {self.replica_id}, push of v{plan.version}"
        t0 = time.perf_counter()
        async with stage_notices(self.workers) as notices:
            await vla.rpc(
                self.engine, "relay_stage", timeout=30, plan_json=plan_to_json(plan), notify=notices.path
            )
            await notices.wait(self.group_timeout_s + 5, what)
        ph["stage_s"] = time.perf_counter() - t0
        return await self._paused(
            plan, ph, "relay_swap", timeout_s=self.group_timeout_s, ack_epoch=self._ack_epoch()
        )

    async def _load_weights(self, plan: PushPlan, ph: dict[str, float]) -> list[dict[str, Any]]:
        """The paused receive: the workers receive and load the whole push while generation is paused."""
        return await self._paused(
            plan, ph, "relay_receive", plan_json=plan_to_json(plan), ack_epoch=self._ack_epoch()
        )

    def _ack_epoch(self) -> int | None:
        """The epoch whose store the workers answer a push into themselves (None: this replica does)."""
        return self.epoch if self.worker_ranks and self.poster is not None else None

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
        await self._set_version(version)
        t1 = time.perf_counter()
        await vla.resume(self.engine)
        return t1 - t0, time.perf_counter() - t1
