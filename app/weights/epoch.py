"""The trainer's end of the protocol's join (app/sync.py): forming the weight group's epoch with the hub.

Trainer rank 0 (every sending rank, together, where every rank sends) asks the hub for a new epoch once a
replica registered, opens its end of the epoch's transport, and checks every member's join acknowledgement; a
member that did not join is dropped and the epoch is formed again without it, until the push's deadline.
`TrainerEpoch` holds the current epoch: its transport, its replicas, and where their push acknowledgements
come from (`acks`: the epoch's store, from each worker or each replica, or the hub alone).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from app.trainer.comm import bcast, first_error
from app.weights.ack_board import collect, collect_keys, replica_acks, worker_key
from app.weights.group import free_port
from app.weights.hub import check_acks
from app.weights.records import Acks, GroupInfo, SyncError
from app.weights.transport import WeightTransport, make_transport, transport_class

if TYPE_CHECKING:
    import torch

train_log = logging.getLogger("app.train")


class TrainerEpoch:
    """This trainer rank's end of the current epoch (rank 0's and, where every rank sends, every rank's).

    `sync` is the `sync` config section; `hub` the `WeightHub` actor handle; `senders` the trainer ranks that
    send (1: rank 0 alone); `budget_s` how long one push may keep forming the group (named in errors)."""

    def __init__(
        self,
        sync: Any,
        hub: Any,
        *,
        rank: int,
        device: torch.device,
        backend: str,
        transport_name: str,
        senders: int,
        budget_s: float,
    ) -> None:
        self.sync, self.hub, self.rank, self.device = sync, hub, rank, device
        self.backend, self.transport_name, self.senders, self.budget_s = (
            backend,
            transport_name,
            senders,
            budget_s,
        )
        self.transport: WeightTransport | None = None  # rank 0's end of the current epoch
        self.epoch: int | None = None  # that epoch's number
        self.replicas: list[str] = []  # that epoch's replicas, whose acknowledgements a push waits for
        self.store_acks = False  # whether every one of them reached the epoch's store at its join
        # replica id -> the weight-group ranks of its workers, where every worker answers into the store itself
        self.worker_ranks: dict[str, list[int]] = {}

    def _wait_for_a_replica(self, deadline: float) -> None:
        """Every replica gone (died, being restarted by Serve): wait for one to register, until `deadline`."""
        import ray

        while not ray.get(self.hub.alive_count.remote()):
            if time.monotonic() > deadline:
                raise SyncError(
                    "no rollout replica registered with the weight hub within the push's deadline "
                    f"({self.budget_s:.0f}s: see push_budget_s); the Serve deployment has no running replica "
                    "(see the Serve view of the dashboard)"
                )
            time.sleep(1.0)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport, self.epoch = None, None

    def together(self, value: Any) -> Any:
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
                        self.sync.timeout_s,
                        self.transport_name,
                        self.senders,
                        transport_class(self.transport_name).high_priority(self.sync),
                    ),
                    timeout=self.sync.timeout_s,
                )
            except Exception as e:
                err = f"{e}"
        info, err = self.together((info, err))
        if err is not None:
            raise SyncError(err)
        return info

    def ensure(self, deadline: float) -> None:
        """Rank 0 (every sender, together): (re)form the epoch when there is none or the membership changed;
        drop who fails to join. Tries again until `deadline` (members that failed to join register again)."""
        self.close()
        tries, last = 0, "no replica"
        while True:
            tries += 1
            info = self._open_epoch(deadline)
            if info.world > info.senders:  # else the last replica left between the check and the epoch
                err = self._form(info)
                if err is None:
                    return
                last = err
            if self.together(time.monotonic() > deadline):
                raise SyncError(
                    f"could not form the weight group within {self.budget_s:.0f}s ({tries} tries; "
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
        err, failed = self.together((err, failed))
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

        s = self.sync
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

    def acks(self, version: int, pending: Any, err: str | None) -> tuple[Acks, str]:
        """Rank 0: every replica's answer to push `version`. After a walk without failure they come through
        the weight group's store (app/weights/ack_board.py: no Ray call on the way), from each worker where
        every worker answers there ("workers"), else from each replica ("store"); the hub's answer (`pending`)
        where the store has not every answer by the deadline, where the hub answers first (a replica dropped),
        or after a failed walk. Returns them and where they came from."""
        import ray

        s = self.sync
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
