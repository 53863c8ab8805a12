"""Trainer side of the weight push (app/sync's protocol): rank 0 owns the epoch, every rank gathers."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from app.sync.buckets import plan_buckets
from app.sync.group import free_port, resolve_backend
from app.sync.hub import check_acks
from app.sync.records import Acks, GroupInfo, PushStats, SyncError
from app.sync.transport import WeightTransport, make_transport

if TYPE_CHECKING:
    from app.train_loop import Learner

log = logging.getLogger("app.train")


def _bcast(obj: Any) -> Any:
    """Rank 0's `obj` on every trainer rank (the default group), or `obj` itself without one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TrainerSync:
    """Pushes the learner's weights to every replica. Rank 0 owns the transport's epoch; every rank gathers.

    `hub` is the `WeightHub` actor handle; `cfg.sync.transport` names the transport (app/sync/transport.py)
    and `cfg.sync.backend` its process group's backend.
    """

    def __init__(self, cfg: Any, learner: Learner, hub: Any, device: torch.device) -> None:
        self.cfg, self.learner, self.hub, self.device = cfg, learner, hub, device
        self.rank = learner.rank
        self.transport_name = str(getattr(cfg.sync, "transport", "broadcast"))
        if self.transport_name == "auto":  # the driver resolves it from placement (app/resources.py)
            self.transport_name = "broadcast"  # a bare TrainerSync (tests, benches) knows none
        # an unknown name fails here, before any push; an unopened transport only walks the gathers
        self.walker = make_transport(self.transport_name)
        self.transport: WeightTransport | None = None  # rank 0's end of the current epoch
        self.epoch: int | None = None  # that epoch's number
        self.backend = resolve_backend(cfg.sync.backend, device)
        self.last: PushStats | None = None

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
        while not _bcast(self.rank == 0 and bool(ray.get(self.hub.alive_count.remote(), timeout=30))):
            waited = time.monotonic() - t0
            if _bcast(waited > timeout_s):
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

    def _ensure_group(self, deadline: float) -> None:
        """Rank 0: (re)form the epoch when there is none or the membership changed; drop who fails to join.
        Tries again until `deadline` (members that failed to join register again and are retried)."""
        import ray

        self._close()
        host = ray.util.get_node_ip_address()
        tries, last = 0, "no replica"
        while True:
            self._wait_for_a_replica(deadline)
            tries += 1
            info: GroupInfo = ray.get(
                self.hub.open_epoch.remote(
                    host, free_port(), self.backend, self.cfg.sync.timeout_s, self.transport_name
                )
            )
            if info.world > 1:  # else the last replica left between the check and the epoch
                err = self._form(info)
                if err is None:
                    return
                last = err
            if time.monotonic() > deadline:
                raise SyncError(
                    f"could not form the weight group within {self._budget_s():.0f}s ({tries} tries; "
                    f"replicas keep failing to join): {last}"
                )
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))

    def _form(self, info: GroupInfo) -> str | None:
        """Open the transport of epoch `info`; None when every member joined, else why not (the members
        that did not join are dropped: they register again for the next try)."""
        import ray

        s = self.cfg.sync
        t0 = time.perf_counter()
        transport = make_transport(self.transport_name)
        try:
            transport.open(info, self.device)
        except Exception as e:  # someone did not join: find out who, drop them, form again
            transport.close()
            acks: Acks = ray.get(self.hub.wait_acks.remote("join", info.epoch, 1.0))
            log.warning("epoch %d did not form (%s); dropping %s", info.epoch, e, acks.missing)
            ray.get(self.hub.drop.remote(acks.missing))
            return f"epoch {info.epoch}: {e}"
        acks = ray.get(self.hub.wait_acks.remote("join", info.epoch, s.timeout_s))
        try:
            check_acks(acks, None, s.timeout_s)
        except SyncError:
            transport.close()
            raise
        self.transport, self.epoch = transport, info.epoch
        log.info(
            "weight group epoch %d formed (%s): %d receivers in %.2fs",
            info.epoch,
            self.transport_name,
            info.world - 1,
            time.perf_counter() - t0,
        )
        return None

    def _announce(self, plan: Any, deadline: float) -> tuple[float, float]:
        """Rank 0: announce `plan` to the current epoch, forming a new one first where there is none or the
        hub refuses (the membership changed). Returns the seconds spent forming and announcing."""
        import ray

        group_s = announce_s = 0.0
        for _ in range(2):  # at most: refused once (membership changed), formed, announced
            if self.transport is None:
                t0 = time.perf_counter()
                self._ensure_group(deadline)
                group_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            ok = ray.get(self.hub.announce.remote(plan, self.epoch))
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
        try:
            # every other rank takes part in the gathers (FSDP2 collectives) and sends nothing
            sender = self.transport if self.rank == 0 and self.transport is not None else self.walker
            stats = sender.send(plan, self.learner.gather, self.device)
        except SyncError as e:
            err = str(e)
        if self.rank != 0:
            return stats, err
        t0 = time.perf_counter()
        # after a transport failure (a receiver died mid-push) only collect who answered
        ack_wait = s.timeout_s if err is None else min(5.0, s.timeout_s)
        acks: Acks = ray.get(self.hub.wait_acks.remote("push", plan.version, ack_wait))
        stats.ack_s = time.perf_counter() - t0
        try:
            check_acks(acks, stats.checksums if s.verify and not err else None, s.timeout_s)
            stats.extra = {rid: a.as_dict() for rid, a in acks.got.items()}
        except SyncError as e:
            err = f"{err + '; ' if err else ''}{e}"
            ray.get(self.hub.drop.remote(acks.missing + acks.failed))
        return stats, err

    def push(self, version: int) -> PushStats:
        """Push `version` to every replica; collective over the trainer ranks. After a failure (a replica
        died mid-push) the group re-forms without it and the push is tried again until the push's deadline
        (`_budget_s`); every try ends in a collective, so all ranks agree on when to stop."""

        s = self.cfg.sync
        mb = float(getattr(s, getattr(self.walker, "bucket_setting", "bucket_mb"), s.bucket_mb))
        plan = plan_buckets(self.learner.push_specs(), int(mb * 2**20), version)
        t_start = time.perf_counter()
        deadline = time.monotonic() + self._budget_s()
        tries = 0
        failures: list[str] = []
        while True:
            tries += 1
            err: str | None = None
            stats = PushStats(version=version)
            group_s = announce_s = 0.0
            if self.rank == 0:
                try:
                    group_s, announce_s = self._announce(plan, deadline)
                except Exception as e:
                    err = f"{e}"
            if _bcast(err is None):
                stats, err = self._send(plan)
            err = _bcast(err)
            if err is None:
                stats.group_s, stats.announce_s, stats.failures = group_s, announce_s, failures
                stats.wall_s = time.perf_counter() - t_start
                self.last = stats
                if self.rank == 0:
                    log.info("%s", stats.summary())
                return stats
            log.warning("push of version %d failed (try %d): %s", version, tries, err)
            failures.append(err)
            if self.rank == 0:
                self._close()
            if _bcast(time.monotonic() > deadline):  # rank 0's clock decides for every rank
                raise SyncError(
                    f"push of version {version} failed for {self._budget_s():.0f}s ({tries} tries): {err}"
                )
