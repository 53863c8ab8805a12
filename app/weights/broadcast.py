"""The bucketed broadcast transport: each flat bucket is one broadcast from rank 0 over a `StatelessGroup`.

Rank 0 checksums a bucket while it is in flight; receivers checksum and load bucket k while bucket k+1 is in
flight. Neither end's host waits for a bucket on NCCL: each end orders its stream after the broadcasts
(`StatelessGroup.follow`) and waits, under the deadline, only for the last one, so the next broadcast is always
posted on both ends and the link never idles for a host's reaction between buckets. `send_buckets` (rank 0's
`_BroadcastSender` on the shared walk, `buckets.walk_buckets`) and `receive_buckets` are the two ends; `start`
(one broadcast per bucket here) is the only part a variant of this transport needs to change.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from app.weights.buckets import (
    _checksum_sums,
    _ck_strings,
    _dtype,
    load_bucket,
    pack_into,
    queues_on_device,
    walk_buckets,
)
from app.weights.group import StatelessGroup
from app.weights.records import Bucket, GroupInfo, PushPlan, PushStats, SyncError
from app.weights.transport import Gather, Load, register_transport

if TYPE_CHECKING:
    from app.config.weights import SyncConfig

Start = Callable[[torch.Tensor], list[Any]]


def _broadcast_one(group: StatelessGroup | None) -> Start:
    return lambda flat: [group.broadcast_async(flat)]  # type: ignore[union-attr]


class _BroadcastSender:
    """Rank 0's end of the broadcast walk, double-buffered: bucket k+1 is gathered, packed and checksummed
    while bucket k is in flight; at most two buckets are staged at once (the wait for bucket k comes after
    bucket k+1 started)."""

    def __init__(self, group: StatelessGroup, device: torch.device | str, start: Start) -> None:
        self.group, self.device, self.start = group, device, start
        self.inflight: tuple[torch.Tensor, list[Any]] | None = None  # the bucket on the wire: buffer, works

    def send(self, bucket: Bucket, tensors: list[torch.Tensor], stats: PushStats) -> torch.Tensor:
        t1 = time.perf_counter()
        flat = torch.empty(bucket.numel, dtype=_dtype(bucket.dtype), device=self.device)
        pack_into(bucket, tensors, flat)
        t2 = time.perf_counter()
        stats.pack_s += t2 - t1
        works = self.start(flat)  # a failure leaves the previous bucket in flight, for `finish`
        # checksummed while the bytes are in flight; formatted after the walk (no device sync per bucket)
        sums = _checksum_sums(flat)
        stats.transfer_s += time.perf_counter() - t2
        previous, self.inflight = self.inflight, (flat, works)
        # its buffer is reused only after it left (on NCCL the stream waits for it, not the host)
        self._settle(previous, stats, self.group.follow)
        return sums

    def finish(self, stats: PushStats) -> None:
        last, self.inflight = self.inflight, None
        try:
            self._settle(last, stats, self.group.wait)  # the last one, under the deadline, covers them all
        finally:
            if self.group.device.type == "cuda":
                torch.cuda.synchronize(self.group.device)

    def _settle(
        self, inflight: tuple[torch.Tensor, list[Any]] | None, stats: PushStats, wait: Callable[[Any], None]
    ) -> None:
        if inflight is None:
            return
        t = time.perf_counter()
        try:
            for work in inflight[1]:
                wait(work)
        finally:
            stats.transfer_s += time.perf_counter() - t


def send_buckets(
    plan: PushPlan,
    gather: Gather,
    group: StatelessGroup | None,
    device: torch.device | str = "cpu",
    start: Start | None = None,
) -> PushStats:
    """Walk the plan's buckets on every trainer rank (`walk_buckets`); rank 0 (the one holding `group`)
    broadcasts each, double-buffered (`_BroadcastSender`). `start(flat)` starts sending one packed bucket and
    returns the works to wait for (default: one broadcast)."""
    sender = None if group is None else _BroadcastSender(group, device, start or _broadcast_one(group))
    return walk_buckets(plan, gather, sender, "broadcast")


def receive_buckets(
    plan: PushPlan,
    group: StatelessGroup,
    load: Load,
    device: torch.device | str = "cpu",
    start: Start | None = None,
) -> tuple[list[str], dict[str, float]]:
    """Receive every bucket of `plan`, checksum it, and hand its tensors to `load`. Returns checksums, timings.

    Each bucket is checksummed and loaded while the next one is in flight; `load` sees the buckets in order.
    `start(flat)` starts receiving into one bucket's buffer and returns the works to wait for; it must
    mirror the sender's. On NCCL, where `load` only queues device work (`buckets.device_ordered`), the host
    queues every bucket's receive, checksum and load behind the one before (`StatelessGroup.follow`) and waits
    under the deadline only for the last bucket; any other `load` is handed a bucket once it arrived.
    """
    start = start or _broadcast_one(group)
    follow = group.follow if queues_on_device(load) else group.wait
    sums: list[torch.Tensor] = []
    timing = {"transfer_s": 0.0, "load_s": 0.0}
    t_start = time.perf_counter()
    received: tuple[Bucket, torch.Tensor] | None = None
    last = len(plan.buckets) - 1

    def finish(bucket: Bucket, flat: torch.Tensor) -> None:
        t1 = time.perf_counter()
        sums.append(_checksum_sums(flat))  # formatted after the walk: no device sync per bucket
        load_bucket(load, bucket, flat)
        timing["load_s"] += time.perf_counter() - t1

    for i, bucket in enumerate(plan.buckets):
        flat = torch.empty(bucket.numel, dtype=_dtype(bucket.dtype), device=device)
        works = start(flat)
        if received is not None:
            finish(*received)
        # the last bucket's under the deadline, on the host: NCCL ran every earlier one before it
        settle = group.wait if i == last else follow
        for work in works:
            settle(work)
        received = (bucket, flat)
    if received is not None:
        finish(*received)
    timing["transfer_s"] = time.perf_counter() - t_start - timing["load_s"]
    return _ck_strings(sums), timing


@register_transport("broadcast")
class BroadcastTransport:
    """Today's transport: a `StatelessGroup` per epoch (gloo or NCCL, `GroupInfo.backend`), one broadcast
    per bucket. Subclasses change how a bucket travels by overriding `start` on both ends."""

    @staticmethod
    def bucket_mb(sync: SyncConfig) -> float:
        """`sync.broadcast.bucket_mb`: the most MiB one broadcast carries."""
        return float(sync.broadcast.bucket_mb)

    @staticmethod
    def high_priority(sync: SyncConfig) -> bool:
        """`sync.broadcast.nccl_high_priority`: the broadcasts on a high-priority stream (NCCL only)."""
        return bool(sync.broadcast.nccl_high_priority)

    def __init__(self) -> None:
        self.group: StatelessGroup | None = None

    def start(self, flat: torch.Tensor) -> list[Any]:
        """Start moving one bucket's flat buffer (rank 0 sends it, receivers fill it); return the works."""
        return [self.group.broadcast_async(flat)]  # type: ignore[union-attr]

    def open(self, info: GroupInfo, device: torch.device | str) -> None:
        self._connect(info, 0, device)

    def join(self, info: GroupInfo, rank: int, device: torch.device | str) -> None:
        self._connect(info, rank, device)

    def _connect(self, info: GroupInfo, rank: int, device: torch.device | str) -> None:
        self.close()
        self.group = StatelessGroup(
            info.host,
            info.port,
            rank,
            info.world,
            info.backend,
            info.timeout_s,
            info.epoch,
            device,
            high_priority=info.high_priority,
        )

    def send(self, plan: PushPlan, gather: Gather, device: torch.device | str) -> PushStats:
        return send_buckets(plan, gather, self.group, device, start=self.start if self.group else None)

    def receive(
        self, plan: PushPlan, load: Load, device: torch.device | str
    ) -> tuple[list[str], dict[str, float]]:
        return receive_buckets(plan, self._joined(plan), load, device, start=self.start)

    def _joined(self, plan: PushPlan) -> StatelessGroup:
        """This receiver's group; SyncError where `plan` came before a join."""
        if self.group is None:
            raise SyncError(
                f"receive of v{plan.version} before a join: this worker is not in the weight group"
            )
        return self.group

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
