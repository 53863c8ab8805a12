"""Push acknowledgements through the weight group's own store: the replicas' short way back to the trainer.

A replica acknowledges a push twice: first into the TCPStore that trainer rank 0 hosts for the epoch (the
weight group's, `StatelessGroup.store`), then to the hub, which keeps membership and versions. The trainer waits
on the store, one round trip after the last replica's key is set, where the hub's answer costs two Ray actor
calls more (replica -> hub -> trainer: about 2 ms on a 2-core machine, `bench/hub_roundtrip.py`).

The hub stays the authority: the trainer waits on the store in short slices and, between them, takes the hub's
answer as soon as there is one (a replica dropped because its engine died is not waited for there), and at the
deadline the hub's answer decides. A replica that cannot reach the store acknowledges to the hub alone.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from app.weights.records import Ack

log = logging.getLogger("app.sync")

SLICE_S = 2.0  # how long one wait on the store lasts before the hub is asked whether it already answered


def ack_key(epoch: int, version: int, replica_id: str) -> str:
    return f"relay-acks/{epoch}/{version}/{replica_id}"


class AckPoster:
    """A replica's client of the epoch's store (host, port of `GroupInfo`); `post` writes one push's answer."""

    def __init__(self, host: str, port: int, epoch: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self.epoch = epoch
        self.store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )

    def post(self, version: int, replica_id: str, ack: Ack) -> None:
        self.store.set(ack_key(self.epoch, version, replica_id), pickle.dumps(ack))


def collect(
    store: Any,
    epoch: int,
    version: int,
    replicas: list[str],
    deadline: float,
    hub_answered: Callable[[], bool],
) -> dict[str, Ack] | None:
    """Every replica's answer to push `version` of `epoch` from `store`, or None where the hub answered first
    or `deadline` (time.monotonic) passed without every answer: then the caller takes the hub's.

    Waits in slices of `SLICE_S` (no polling: each slice returns as soon as the last key is set) and asks
    `hub_answered()` between them."""
    keys = [ack_key(epoch, version, rid) for rid in replicas]
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            store.wait(keys, timedelta(seconds=min(SLICE_S, left)))
            break
        except Exception as e:  # a slice ran out (DistStoreError "wait timeout"), or the store is gone
            if "timeout" not in str(e).lower():
                log.warning(
                    "weight group store: acknowledgements of v%d unreadable (%s); asking the hub", version, e
                )
                return None
        if hub_answered():  # asked only after a slice ran out: the common case pays nothing for it
            return None
    got = {}
    for rid, key in zip(replicas, keys, strict=True):
        got[rid] = pickle.loads(store.get(key))
        store.delete_key(key)
    return got
