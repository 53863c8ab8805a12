"""Control plane of the weight group: membership, epochs, push announcements and acknowledgements.

`WeightHub` handles weights only; run control (clean stop, the trainer's heartbeat, aborting in-flight
generations) is `RunControl`'s (app/weights/control.py): callers talk to the control actor directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from app.infra import ray_compat
from app.weights.control import RunControl
from app.weights.records import (
    Ack,
    Acks,
    GroupInfo,
    Idle,
    Instruction,
    Join,
    Leave,
    Push,
    PushPlan,
    SyncError,
    Unknown,
)
from app.weights.shared import Changes, call

log = logging.getLogger("app.sync")


@dataclass(kw_only=True)
class Member:
    replica_id: str
    workers: int
    registered_at: float
    started_at: float = 0.0  # when the replica's constructor began (for rollout/join_s)
    alive: bool = True  # False once it left or was dropped: not part of the next epoch
    leaving: bool = False  # it asked to leave (downscaling); it still finishes a push already announced
    version: int = -1
    epoch: int = -1
    push_epoch: int = -1  # the epoch of its last acknowledged push (a retried push comes in a new epoch)
    admitted_at: float | None = None  # first acknowledged push: from then on it serves rollout traffic
    join_s: float | None = None
    pushes: int = 0
    first_served: dict[str, int] | None = None  # versions when it served its first rollout request
    node_ip: str = ""  # the Ray node it runs on
    pid: int = 0  # its Serve replica actor's process on that node (for an operator, or a fault test)
    registered_version: int = -1  # the version current when it registered (what it must hold to serve)
    admitted_version: int | None = None  # the version of its first acknowledged push (it serves from then)
    left_at: float | None = None  # when it left, or was dropped
    dropped: str | None = None
    # the epoch of its last failed join or push: it is not sent to join that epoch again (its trainer may be
    # gone, killed mid-push; a live one drops it and forms the next epoch, which it joins)
    failed_epoch: int = -1


class WeightHub:
    """Membership, announcements and acknowledgements of the weight group.

    Run as an async Ray actor (the caller wraps it with `ray.remote`). Replicas long-poll `next_instruction`;
    the trainer calls `open_epoch`, `announce` and `wait_acks`. Every wait takes a deadline.
    `control` is the run's `RunControl` (an actor handle, or an object in this process; one is made here when
    none is given): `status` reports its stop reason and the trainer's heartbeat.
    """

    def __init__(self, control: Any = None) -> None:
        self.members: dict[str, Member] = {}
        self.actors: dict[str, Any] = {}  # replica id -> its Serve replica actor's handle (to see it die)
        self.group: GroupInfo | None = None
        self.plan: PushPlan | None = None
        self.version = -1  # last version acknowledged by every member
        self.acks: dict[tuple[str, int], dict[str, Ack]] = {}
        self.changed = Changes()
        self.last_push: dict[str, Any] = {}
        self.announced_at = 0.0
        self.control = control if control is not None else RunControl()

    # ------------------------------------------------------------ membership

    async def register(
        self,
        replica_id: str,
        workers: int = 1,
        started_at: float | None = None,
        node_ip: str = "",
        actor: Any = None,
        pid: int = 0,
    ) -> int:
        """A replica asks to join; it becomes a member at the next epoch (the next push re-forms the group).
        `actor`: its actor handle, so that a new epoch leaves it out at once once Ray says it died.

        Returns the version the replica must hold before it may serve: -1 when nothing was pushed yet (the
        run is starting and the trainer's first push comes before any rollout), else the latest version.
        """
        now, need = time.time(), self.current_version()
        first = self.members.get(replica_id)  # registered before (dropped since): it kept serving
        self.members[replica_id] = Member(
            replica_id=replica_id,
            workers=workers,
            registered_at=now,
            started_at=started_at or now,
            node_ip=node_ip,
            pid=pid,
            registered_version=first.registered_version if first else need,
            admitted_version=first.admitted_version if first else None,
        )
        self.actors[replica_id] = actor
        log.info("replica %s registered with %d worker(s) on node %s", replica_id, workers, node_ip or "?")
        await self.changed.notify()
        return need

    def current_version(self) -> int:
        return max(self.version, self.plan.version if self.plan is not None else -1)

    async def leave(self, replica_id: str) -> None:
        """A replica is going away (downscaling): it is left out of the next epoch; a push already announced
        to its epoch is still delivered to it before its loop receives `Leave`."""
        m = self.members.get(replica_id)
        if m is not None and m.alive:
            m.alive, m.leaving, m.left_at = False, True, time.time()
            log.info("replica %s leaves the weight group", replica_id)
        await self.changed.notify()

    async def served(self, replica_id: str, version: int) -> None:
        """A replica reports its first rollout request and the version it served it with."""
        m = self.members.get(replica_id)
        if m is not None and m.first_served is None:
            m.first_served = {"version": version, "hub_version": self.current_version()}

    def membership_changed(self) -> bool:
        if self.group is None:
            return bool(self.alive_ids())
        return set(self.group.ranks) != set(self.alive_ids())

    async def joiners(self) -> list[str]:
        """Live replicas outside the current epoch: they wait for a push to join (and, mid-run, to serve)."""
        ranks = self.group.ranks if self.group else {}
        return [rid for rid in self.alive_ids() if rid not in ranks]

    async def alive_count(self) -> int:
        return len(self.alive_ids())

    def alive_ids(self) -> list[str]:
        return sorted(m.replica_id for m in self.members.values() if m.alive)

    async def drop(self, replica_ids: list[str], reason: str = "failed a join or push") -> None:
        """Remove members that failed a join or a push (or whose engine died); they must register again to
        rejoin."""
        for rid in replica_ids:
            m = self.members.get(rid)
            if m is not None and m.alive:
                m.alive, m.dropped, m.left_at = False, reason, time.time()
                log.warning("replica %s dropped from the weight group: %s", rid, reason)
        await self.changed.notify()

    async def _drop_dead(self) -> None:
        """Drop the members whose replica actor Ray reports dead (its process killed or crashed): the new
        epoch leaves them out at once instead of waiting out its join deadline (`sync.timeout_s`)."""
        probed = [rid for rid in self.alive_ids() if self.actors.get(rid) is not None]
        died = await asyncio.gather(*[ray_compat.actor_died(self.actors[rid]) for rid in probed])
        gone = [rid for rid, d in zip(probed, died, strict=True) if d]
        if gone:
            await self.drop(gone, "its replica actor died")

    # ------------------------------------------------------------ epochs and pushes (the trainer)

    async def open_epoch(
        self,
        host: str,
        port: int,
        backend: str,
        timeout_s: float,
        transport: str = "broadcast",
        senders: int = 1,
        high_priority: bool = False,
    ) -> GroupInfo:
        """Assign ranks to the live members and announce a new epoch of the weight group (members whose
        actor died are dropped first). The trainer's `senders` ranks come first (0..senders-1)."""
        await self._drop_dead()
        ranks, nxt = {}, senders
        for rid in self.alive_ids():
            ranks[rid] = nxt
            nxt += self.members[rid].workers
        epoch = (self.group.epoch + 1) if self.group else 0
        self.group = GroupInfo(
            epoch=epoch,
            host=host,
            port=port,
            world=nxt,
            backend=backend,
            timeout_s=timeout_s,
            ranks=ranks,
            transport=transport,
            senders=senders,
            high_priority=high_priority,
        )
        self.plan = None
        await self.changed.notify()
        return self.group

    async def announce(self, plan: PushPlan, epoch: int | None = None) -> bool:
        """Announce `plan` to the members of the current epoch. With `epoch` (the trainer's group), refuse
        (False, nothing announced) when that is no longer the current epoch or the membership changed since:
        the trainer then forms a new epoch first. One round trip on the push's critical path."""
        if epoch is not None and (
            self.group is None or self.group.epoch != epoch or self.membership_changed()
        ):
            return False
        if plan.version < self.version:  # the trainer restored an earlier checkpoint: replicas roll back
            log.warning(
                "version %d announced after %d: rolling the replicas back (trainer restored from a checkpoint)",
                plan.version,
                self.version,
            )
        if plan.version <= self.version:  # (the same version again: a retry, or a restore at this version)
            self.version = plan.version - 1
        # a retry of this version starts clean: an answer to an earlier try (a failure from a replica whose
        # engine died since, say) must not fail this one
        self.acks.pop(("push", plan.version), None)
        self.plan = plan
        self.announced_at = time.time()
        self.last_push = {
            "version": plan.version,
            "announced_at": self.announced_at,
            "epoch": self.group.epoch if self.group else None,
        }
        await self.changed.notify()
        return True

    async def wait_acks(self, kind: str, key: int, timeout_s: float) -> Acks:
        """Wait until every member of the current epoch acknowledged (kind, key), or the deadline. A member
        dropped meanwhile (its engine died) is not waited for: it stays in `missing` and the trainer re-forms
        the group without it."""
        expected = set(self.group.ranks) if self.group else set()
        deadline = time.monotonic() + timeout_s
        while True:
            missing = sorted(expected - set(self.acks.get((kind, key), {})))
            waiting = [rid for rid in missing if rid in self.members and self.members[rid].dropped is None]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                break
            await self.changed.wait(min(left, 1.0))
        got = {rid: a for rid, a in self.acks.get((kind, key), {}).items() if rid in expected}
        acks = Acks(kind=kind, key=key, got=got, missing=missing)
        if kind == "push" and acks.complete:
            self.version = max(self.version, key)
        return acks

    # ------------------------------------------------------------ the replicas

    def _instruction(self, replica_id: str, epoch: int, version: int) -> Instruction | None:
        """What `replica_id` (at `epoch`, holding `version`) must do now; None: nothing yet."""
        m, g, plan = self.members.get(replica_id), self.group, self.plan
        in_epoch = g is not None and replica_id in g.ranks and g.epoch == epoch
        if m is not None and m.leaving:
            pending = in_epoch and plan is not None and plan.version > version
            return Push(plan=plan, announced_at=self.announced_at) if pending else Leave()  # type: ignore[arg-type]
        if m is None or not m.alive:
            return Unknown()
        if g is not None and replica_id in g.ranks and g.epoch != epoch:
            return Join(group=g, rank=g.ranks[replica_id]) if g.epoch != m.failed_epoch else None
        # another version (newer, or older after the trainer restored a checkpoint), or the same version
        # retried in a new epoch (the replica may have received it before a broadcast failed elsewhere:
        # every member must take part in the retry)
        if in_epoch and plan is not None and (plan.version != version or m.push_epoch != g.epoch):  # type: ignore[union-attr]
            return Push(plan=plan, announced_at=self.announced_at)
        return None

    async def next_instruction(self, replica_id: str, epoch: int, version: int, wait_s: float) -> Instruction:
        """Long-poll: what should this replica do next? `Idle` when nothing within `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            instr = self._instruction(replica_id, epoch, version)
            if instr is not None:
                return instr
            left = deadline - time.monotonic()
            if left <= 0:
                return Idle()
            await self.changed.wait(left)

    async def ack(self, replica_id: str, kind: str, key: int, ack: Ack) -> None:
        """A replica's answer to join `key` (an epoch) or push `key` (a version)."""
        m = self.members.get(replica_id)
        if m is not None and not ack.ok:
            m.failed_epoch = key if kind == "join" else m.epoch
        elif m is not None:
            if kind == "join":
                m.epoch = key
            elif kind == "push":
                m.version = key
                m.push_epoch = self.group.epoch if self.group else -1
                m.pushes += 1
                if m.admitted_version is None:
                    m.admitted_version = key
                if m.admitted_at is None:  # its first verified weights: admitted to serve
                    m.admitted_at = time.time()
                    m.join_s = m.admitted_at - m.started_at
                    ack = dataclasses.replace(ack, detail={**ack.detail, "join_s": m.join_s})
        self.acks.setdefault((kind, key), {})[replica_id] = ack
        await self.changed.notify()

    async def status(self) -> dict[str, Any]:
        """Version, epoch and every replica ever seen (liveness, version, admission, leave times), with the
        run control's stop reason and trainer heartbeat."""
        try:  # the membership picture must come back even when the control actor is gone
            ctl = await asyncio.wait_for(call(self.control, "status"), timeout=5)
        except Exception as e:
            ctl = {"stop": None, "trainer": {"error": f"run control did not answer: {e!r}"}}
        return {
            "version": self.version,
            "epoch": self.group.epoch if self.group else None,
            "group": sorted(self.group.ranks) if self.group else [],
            "host": self.group.host if self.group else None,  # the trainer's node: the weight group's address
            "members": {rid: asdict(m) for rid, m in self.members.items()},
            "membership_changed": self.membership_changed(),
            "stop": ctl.get("stop"),
            "last_push": self.last_push,
            "trainer": ctl.get("trainer", {}),
        }


def check_acks(acks: Acks, expected_checksums: list[str] | None, timeout_s: float) -> None:
    """Raise SyncError naming every replica that did not acknowledge, failed, or loaded other bytes."""
    kind, key = acks.kind, acks.key
    problems = [
        f"replica {rid} did not acknowledge {kind} {key} within {timeout_s:.0f}s (dead or stuck)"
        for rid in acks.missing
    ]
    for rid, a in acks.got.items():
        if not a.ok:
            problems.append(f"replica {rid} failed {kind} {key}: {a.error or 'unknown error'}")
        elif expected_checksums is not None and a.checksums != expected_checksums:
            problems.append(f"replica {rid} loaded different bytes for version {key} (checksum mismatch)")
    if problems:
        raise SyncError("; ".join(problems))
